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
def entries_snapshot(tmp_path_factory):
    """The checkout's entries, copied once per session: the dev-set tests, the site and the MCP server all read
    this copy, so work that edits the checkout's entries meanwhile cannot make them disagree."""
    import shutil
    from pathlib import Path

    copy = tmp_path_factory.mktemp("entries") / "entries"
    shutil.copytree(Path(__file__).resolve().parents[1] / "src" / "mleng" / "handbook" / "entries", copy)
    return copy


@pytest.fixture(scope="session")
def dev_index(entries_snapshot, tmp_path_factory):
    """One fresh index of the entries for the dev-set tests (a rebuild takes seconds); they only read it."""
    from mleng.handbook.index import open_index

    index = open_index(entries_snapshot, tmp_path_factory.mktemp("dev-index") / "idx.sqlite")
    yield index
    index.close()


@pytest.fixture(scope="session")
def dev_search(dev_index):
    """search(dev_index, query, 5), each query searched once per session: the site's and the MCP server's
    parity tests compare their answers for the same dev-set queries with these (read-only) results."""
    from mleng.handbook.search import search

    answers: dict[str, dict] = {}

    def answer(query: str) -> dict:
        if query not in answers:
            answers[query] = search(dev_index, query, 5)
        return answers[query]

    return answer
