"""Shared fixtures: every test gets its own MLENG_HOME, so no test touches a user's results."""

import os
import subprocess
import sys

import pytest


@pytest.fixture(autouse=True)
def mleng_home(tmp_path, monkeypatch):
    home = tmp_path / "mleng-home"
    monkeypatch.setenv("MLENG_HOME", str(home))
    return home


@pytest.fixture
def run_mleng(mleng_home):
    """Run the real `mleng` CLI in a subprocess (python -m mleng) and return the CompletedProcess."""

    def _run(*args, timeout=120, env=None, input=None):
        full_env = dict(os.environ)
        full_env["MLENG_HOME"] = str(mleng_home)
        full_env.update(env or {})
        if isinstance(input, bytes):   # raw bytes on stdin (a compressed or binary log); text back
            proc = subprocess.run([sys.executable, "-m", "mleng", *args], capture_output=True,
                                  timeout=timeout, env=full_env, input=input)
            proc.stdout = proc.stdout.decode("utf-8", "replace")
            proc.stderr = proc.stderr.decode("utf-8", "replace")
            return proc
        return subprocess.run([sys.executable, "-m", "mleng", *args], capture_output=True, text=True,
                              timeout=timeout, env=full_env, input=input)

    return _run


@pytest.fixture(scope="module")
def index_home(tmp_path_factory):
    """One MLENG_HOME per test module with the handbook index already built (building it takes seconds)."""
    path = tmp_path_factory.mktemp("index-home")
    subprocess.run([sys.executable, "-c", "from mleng.handbook.index import open_index; open_index().close()"],
                   check=True, env=dict(os.environ, MLENG_HOME=str(path)), timeout=120)
    return path


@pytest.fixture(scope="session")
def dev_index(tmp_path_factory):
    """One fresh index of the checkout's entries for the dev-set tests (a rebuild takes seconds); they only read it."""
    from pathlib import Path

    from mleng.handbook.index import open_index

    entries = Path(__file__).resolve().parents[1] / "src" / "mleng" / "handbook" / "entries"
    index = open_index(entries, tmp_path_factory.mktemp("dev-index") / "idx.sqlite")
    yield index
    index.close()
