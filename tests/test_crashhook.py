"""The crash hook on real crashing scripts: the same traceback, stderr and exit code as without it, then the
handbook's note when it knows the error (and nothing when it does not, or when the handbook is broken);
under torchrun one note for the job, not one per rank; torchrun's own failure explained from the ranks'
torchelastic error files."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

CASES = {
    # a model on the CPU fed a tensor on another device (the meta device stands in for a GPU here)
    "device": """
        import torch
        model = torch.nn.Linear(2, 2)
        print("before the crash", flush=True)
        model(torch.ones(1, 2, device="meta"))
    """,
    # a DataLoader worker killed the way the OOM killer kills it
    "loader": """
        import os, signal, torch
        from torch.utils.data import DataLoader, Dataset

        class Data(Dataset):
            def __len__(self):
                return 4
            def __getitem__(self, i):
                os.kill(os.getpid(), signal.SIGKILL)

        for batch in DataLoader(Data(), num_workers=1):
            pass
    """,
    # a checkpoint written to a full disk (/dev/full answers every write with ENOSPC)
    "disk": """
        def save_checkpoint(path):
            with open(path, "wb") as f:
                f.write(b"weights" * 1000)
        save_checkpoint("/dev/full")
    """,
    # an error nobody knows
    "unknown": """
        def step():
            raise ValueError("the frobnicator is misaligned")
        step()
    """,
    # exit codes pass through
    "exit": """
        import sys
        print("bye")
        sys.exit(7)
    """,
}

MISMATCH = textwrap.dedent("""
    import datetime, torch, torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
    x = torch.ones(4)
    if dist.get_rank() == 0:
        dist.all_reduce(x)
    else:
        dist.all_gather([torch.empty(4) for _ in range(2)], x)
""")


def _env(home, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "MASTER_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_JOB_ID")}
    return dict(env, MLENG_HOME=str(home), PYTHONWARNINGS="ignore", **extra)


def _start(argv, cwd, env):
    return subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _same(text: str) -> str:
    """Pids and ports differ from run to run."""
    return re.sub(r"pid(?:\(s\))? \d+|pid: \d+|\d{4,}", "N", text)


def _pairs(tmp_path, home, names, wrapped):
    """Each case run plainly and with the hook (all at once: they are independent processes)."""
    procs = {}
    for name in names:
        script = tmp_path / f"{name}.py"
        script.write_text(textwrap.dedent(CASES[name]))
        procs[name] = (_start([sys.executable, str(script)], tmp_path, _env(home)),
                       _start(wrapped(script), tmp_path, _env(home)))
    out = {}
    for name, (plain, hooked) in procs.items():
        p_out, p_err = plain.communicate(timeout=120)
        h_out, h_err = hooked.communicate(timeout=120)
        out[name] = ((plain.returncode, p_out, p_err), (hooked.returncode, h_out, h_err))
    return out


def _note(plain_err: str, hooked_err: str) -> str:
    """The hooked stderr is the plain one, then the note: return the note."""
    plain, hooked = _same(plain_err), _same(hooked_err)
    assert hooked.startswith(plain), f"plain:\n{plain_err}\nhooked:\n{hooked_err}"
    return hooked[len(plain):]


def _without_notes(err: str) -> list[str]:
    """The ranks' own lines of a torchrun log, with the hook's notes taken out."""
    lines, in_note = [], False
    for line in err.splitlines():
        text = re.sub(r"^\[rank\d+\]: ", "", line)
        if text.startswith("mleng: the handbook knows this error"):
            in_note = True
            continue
        if in_note and text.startswith(("  ", "       ")):
            continue
        in_note = False
        if line.startswith("[rank"):
            lines.append(_same(line))
    return sorted(lines)


def test_known_errors_get_the_note_after_the_unchanged_traceback(tmp_path, index_home):
    results = _pairs(tmp_path, index_home, ["device", "loader", "disk", "unknown", "exit"],
                     lambda script: [sys.executable, "-m", "mleng.run", str(script)])
    for name, ((p_code, p_out, p_err), (h_code, h_out, h_err)) in results.items():
        assert h_code == p_code, name
        assert h_out == p_out, name
    (code, _, err), (_, _, hooked) = results["disk"]
    assert code == 1 and _note(err, hooked).startswith("mleng: the handbook knows this error: disk-full-checkpoint:")
    (code, out, err), (_, _, hooked) = results["device"]
    assert code == 1 and out == "before the crash\n" and "Traceback (most recent call last)" in err
    note = _note(err, hooked)
    assert note.startswith("mleng: the handbook knows this error: "), note
    assert "mleng handbook show " in note and "  fix: - " in note
    (code, _, err), (_, _, hooked) = results["loader"]
    assert code == 1 and "DataLoader worker" in err
    note = _note(err, hooked)
    assert note.startswith("mleng: the handbook knows this error: dataloader-worker-killed:"), note
    (code, _, err), (_, _, hooked) = results["unknown"]
    assert code == 1 and hooked == err  # nobody knows it: not a word more
    (code, out, err), (_, h_out, hooked) = results["exit"]
    assert code == 7 and hooked == err == "" and h_out == out == "bye\n"


def test_install_crash_hook_in_the_script_and_a_broken_handbook(tmp_path, index_home):
    scripts = {}
    for name, first in (("plain", "import mleng\nmleng.__version__\n"),
                        ("hooked", "import mleng\nmleng.install_crash_hook()\n")):
        (tmp_path / name).mkdir()
        scripts[name] = tmp_path / name / "disk.py"
        scripts[name].write_text(first + textwrap.dedent(CASES["disk"]))
    runs = [_start([sys.executable, str(scripts["plain"])], tmp_path, _env(index_home)),
            _start([sys.executable, str(scripts["hooked"])], tmp_path, _env(index_home)),
            # the handbook cannot be opened: the crash goes through exactly as without the hook
            _start([sys.executable, str(scripts["hooked"])], tmp_path,
                   _env(index_home, MLENG_HANDBOOK_DIR=str(tmp_path / "none")))]
    (p_out, p_err), (h_out, h_err), (b_out, b_err) = [p.communicate(timeout=120) for p in runs]
    assert [p.returncode for p in runs] == [1, 1, 1]
    assert h_out == p_out == b_out
    p_err = p_err.replace(str(tmp_path / "plain"), "DIR")
    h_err, b_err = (e.replace(str(tmp_path / "hooked"), "DIR") for e in (h_err, b_err))
    assert "OSError: [Errno 28] No space left on device" in p_err
    assert _note(p_err, h_err).startswith("mleng: the handbook knows this error: disk-full-checkpoint:")
    assert b_err == p_err


def test_under_torchrun_one_note_for_the_job_and_the_ranks_exit_as_without(tmp_path, index_home):
    script = tmp_path / "mismatch.py"
    script.write_text(MISMATCH)
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    plain = _start([*run, str(script)], tmp_path, _env(index_home))
    hooked = _start([*run, "-m", "mleng.run", str(script)], tmp_path, _env(index_home))
    p_out, p_err = plain.communicate(timeout=120)
    h_out, h_err = hooked.communicate(timeout=120)
    assert plain.returncode == hooked.returncode == 1
    assert h_out == p_out

    # Which rank times out first is a race of the job, not of the hook (on a loaded machine rank 1 can time
    # out first and rank 0 then see its peer gone), so rank 0's traceback is compared apart from gloo's own
    # last line, which is one of its two failure messages in either run.
    def rank0(err: str) -> list[str]:
        return [line for line in _without_notes(err) if line.startswith("[rank0]")]

    gloo = ("Timed out waiting", "Connection closed by peer")
    for lines in (rank0(h_err), rank0(p_err)):
        assert any(word in line for line in lines for word in gloo), lines
    assert [line for line in rank0(h_err) if "gloo/transport/tcp" not in line] == \
        [line for line in rank0(p_err) if "gloo/transport/tcp" not in line] and rank0(h_err)
    notes = [line for line in h_err.splitlines() if "mleng: the handbook knows this error" in line]
    assert any(" of 2): collective-mismatch" in n for n in notes), h_err  # whichever rank got there first
    explained = [n.split("): ", 1)[1] for n in notes]
    assert len(explained) == len(set(explained)), h_err  # no explanation twice
    assert "mleng:" not in p_err


def test_torchruns_own_failure_is_explained_from_the_ranks_error_files(tmp_path, index_home, capsys, monkeypatch):
    pytest.importorskip("torch")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from mleng import crashhook

    monkeypatch.setenv("MLENG_HOME", str(index_home))
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    failures = {}
    for rank, text in ((0, "RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms "
                           "for recv operation to complete"),
                       (1, "RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 3000ms "
                           "for send operation to complete")):
        path = tmp_path / f"error-{rank}.json"  # the format torchelastic's @record writes
        path.write_text(json.dumps({"message": {"message": text, "extraInfo": {"py_callstack": "...",
                                                                              "timestamp": "1"}}}))
        failures[rank] = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=1, error_file=str(path))
    note = crashhook.explain(ChildFailedError("train.py", failures))
    assert note is not None and note.count("mleng: the handbook knows this error") == 1
    assert note.startswith("mleng: the handbook knows this error (ranks 0, 1): collective-mismatch:")
    # no error file (the ranks had no @record): the agent's own error is what is looked up
    note = crashhook.explain(ChildFailedError("train.py", {0: ProcessFailure(0, 1, 1, str(tmp_path / "none"))}))
    assert note.startswith("mleng: the handbook knows this error: torchrun-child-failed-exitcode:")


def test_the_hook_is_free_until_a_crash_and_can_be_undone():
    code = ("import sys, mleng; before = sys.excepthook; mleng.install_crash_hook(); mleng.install_crash_hook(); "
            "hooked = sys.excepthook; from mleng.crashhook import uninstall_crash_hook; uninstall_crash_hook(); "
            "print(hooked is not before, sys.excepthook is before, 'torch' in sys.modules, "
            "'mleng.handbook.search' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["True", "True", "False", "False"], proc.stderr
