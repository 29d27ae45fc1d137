"""mleng.preflight() inside real training scripts under torchrun (2 gloo ranks on loopback).

One torchrun job runs several preflights in a row, as a script could: healthy with its own group, a rank
whose contribution is wrong, a rank whose result is corrupted, then inside the job's own group (healthy,
a straggler made slow on purpose), and training's own collectives afterwards. A second job has a rank
that never calls preflight. Each rank writes what it saw to a JSON file the test reads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("torch")

SCRIPT = textwrap.dedent('''
    import json, os, subprocess, sys, time
    import mleng
    import torch, torch.distributed as dist

    rank = int(os.environ["RANK"])
    out = {"rank": rank, "calls": {}}

    def call(name, **kw):
        env_before, rng_before = dict(os.environ), torch.random.get_rng_state()
        t0 = time.monotonic()
        try:
            record = mleng.preflight(timeout=5, **kw)
            result = {"ok": True, "id": record.id if record else None,
                      "verdict": record.summary["verdict"] if record else None}
        except mleng.PreflightError as exc:
            result = {"ok": False, "error": exc.message}
        result["seconds"] = time.monotonic() - t0
        result["env_restored"] = dict(os.environ) == env_before
        result["rng_restored"] = bool(torch.equal(torch.random.get_rng_state(), rng_before))
        result["initialized_after"] = dist.is_initialized()
        out["calls"][name] = result

    os.sched_setaffinity(0, {rank % os.cpu_count()})
    call("healthy_own")

    import mleng.preflight as pf
    real_contribution = pf._contribution
    if rank == 1:
        pf._contribution = lambda r, n, device: real_contribution(r, n, device) * 3
    call("wrong_contribution")
    pf._contribution = real_contribution

    real_all_reduce = dist.all_reduce
    if rank == 1:
        state = {"first": True}
        def corrupting(tensor, *args, **kwargs):
            work = real_all_reduce(tensor, *args, **kwargs)
            if state["first"]:
                state["first"] = False
                if work is not None:
                    work.wait()
                tensor.add_(1)  # what rank 1 received is wrong; what it sent was right
            return work
        dist.all_reduce = corrupting
    call("corrupted_result")
    dist.all_reduce = real_all_reduce

    dist.init_process_group("gloo")  # the job's own group: preflight must use it, not make another
    group_before = dist.group.WORLD
    call("healthy_existing")
    out["same_group_after"] = dist.group.WORLD is group_before and dist.is_initialized()

    hogs = []
    if rank == 1:  # three busy loops on rank 1's core: it computes at about a quarter of its speed
        hog = "import os; os.sched_setaffinity(0, {%d})\\nwhile True: pass" % (rank % os.cpu_count())
        hogs = [subprocess.Popen([sys.executable, "-c", hog]) for _ in range(3)]
        time.sleep(0.5)
    try:
        call("straggler", max_seconds=6)
    finally:
        for h in hogs:
            h.kill()
            h.wait()

    x = torch.full((4,), float(rank + 1))
    dist.all_reduce(x)  # training goes on in the same group
    out["training_all_reduce"] = x.tolist()
    dist.destroy_process_group()
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
''')

ABSENT = textwrap.dedent('''
    import json, os, sys, time
    import mleng
    rank = int(os.environ["RANK"])
    if rank == 1:
        time.sleep(120)  # never calls preflight; torchrun stops it when rank 0 fails
    import torch.distributed  # a training script has torch loaded before it calls preflight: its import is not timed
    preflight = mleng.preflight
    t0 = time.monotonic()
    try:
        preflight(timeout=3)
        result = {"ok": True}
    except mleng.PreflightError as exc:
        result = {"ok": False, "error": exc.message}
    result["seconds"] = time.monotonic() - t0
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    sys.exit(0 if result["ok"] else 1)
''')


def _torchrun(script: str, tmp_path, mleng_home, timeout: float = 150, nproc: int = 2) -> subprocess.CompletedProcess:
    path = tmp_path / "train.py"
    path.write_text(script)
    env = dict(os.environ, MLENG_HOME=str(mleng_home), PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           str(path), str(tmp_path)], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=tmp_path)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("preflight")
    home = tmp_path / "home"
    proc = _torchrun(SCRIPT, tmp_path, home)
    ranks = {}
    for rank in (0, 1):
        path = tmp_path / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote nothing\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"
        ranks[rank] = json.loads(path.read_text())
    return proc, ranks, home


def test_healthy_job_passes_in_its_own_group_and_leaves_nothing_behind(job):
    proc, ranks, home = job
    for rank in (0, 1):
        call = ranks[rank]["calls"]["healthy_own"]
        assert call["ok"], call
        assert call["env_restored"] and call["rng_restored"]
        assert call["initialized_after"] is False  # its own group is gone
        assert call["seconds"] < 10  # the budget on a healthy node
    assert ranks[0]["calls"]["healthy_own"]["verdict"] == "ok"
    assert ranks[1]["calls"]["healthy_own"]["id"] is None  # rank 0 alone keeps the record
    # one summary, printed by rank 0
    assert proc.stderr.count("mleng preflight: 2 ranks on 1 host") == 5
    assert "[  ok] all_reduce  known values correct on all 2 ranks" in proc.stderr
    assert "[  ??] gpu" in proc.stderr and "run on the CPU" in proc.stderr
    from mleng.results.store import Store

    with Store(home / "results.sqlite", create=False) as store:
        record = store.get(ranks[0]["calls"]["healthy_own"]["id"])
    assert record.kind == "preflight" and record.summary["group"] == "own group"
    assert record.summary["world_size"] == 2 and record.summary["value"] > 0  # busbw GB/s
    checks = {r["check"]: r["severity"] for r in record.rows}
    assert checks["join"] == "ok" and checks["all_reduce"] == "ok" and checks["busbw"] == "inconclusive"


def test_a_wrong_contribution_fails_on_every_rank_and_names_the_sender(job):
    _, ranks, _ = job
    for rank in (0, 1):
        call = ranks[rank]["calls"]["wrong_contribution"]
        assert not call["ok"]
        assert "rank 1 (on " in call["error"] and "contributed wrong values" in call["error"], call["error"]
        assert call["env_restored"] and call["initialized_after"] is False


def test_a_corrupted_result_fails_on_every_rank_and_names_the_receiver(job):
    _, ranks, _ = job
    for rank in (0, 1):
        call = ranks[rank]["calls"]["corrupted_result"]
        assert not call["ok"]
        assert "rank 1 (on " in call["error"] and "received a wrong all-reduce result" in call["error"]
        assert "contributed" not in call["error"]


def test_the_jobs_own_group_is_used_and_still_works_after(job):
    proc, ranks, home = job
    for rank in (0, 1):
        call = ranks[rank]["calls"]["healthy_existing"]
        assert call["ok"], call
        assert call["initialized_after"] is True
        assert ranks[rank]["same_group_after"] is True
        assert ranks[rank]["training_all_reduce"] == [3.0] * 4
    assert "job's group, backend gloo" in proc.stderr


def test_a_rank_made_slow_on_purpose_is_named_as_the_straggler(job):
    _, ranks, _ = job
    for rank in (0, 1):
        call = ranks[rank]["calls"]["straggler"]
        assert not call["ok"], call
        assert "straggler rank(s): rank 1 (" in call["error"], call["error"]


def test_a_rank_that_never_joins_is_named_within_the_timeout(tmp_path, mleng_home):
    proc = _torchrun(ABSENT, tmp_path, mleng_home)
    assert proc.returncode != 0
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert not result["ok"]
    assert result["error"].startswith("rank 1 did not join within 3 s"), result["error"]
    assert result["seconds"] < 3 + 2
    assert not (tmp_path / "rank1.json").exists()


def test_bad_input_is_one_clear_error_before_anything_starts(monkeypatch):
    import mleng
    from mleng.errors import UsageError

    for kwargs, text in (({"timeout": 0}, "timeout=0"), ({"timeout": -1}, "timeout=-1"),
                         ({"max_seconds": 0}, "max_seconds=0"), ({"straggler_ratio": 1.5}, "straggler_ratio"),
                         ({"probe_bytes": "12Q"}, "12Q")):
        with pytest.raises(UsageError, match=text):
            mleng.preflight(**kwargs)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    t0 = time.monotonic()
    with pytest.raises(UsageError, match="RANK=3 is outside WORLD_SIZE=2"):
        mleng.preflight()
    monkeypatch.delenv("MASTER_PORT")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(UsageError, match="MASTER_ADDR or MASTER_PORT is not"):
        mleng.preflight()
    assert time.monotonic() - t0 < 10


def test_one_plain_process_is_checked_alone_and_a_missing_interface_is_one_error(mleng_home):
    code = textwrap.dedent("""
        import os, mleng
        r = mleng.preflight()
        print(r.summary["verdict"], r.summary["world_size"], sorted(x["check"] for x in r.rows))
        from mleng.distributed.launch import free_port
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                          GLOO_SOCKET_IFNAME="nosuchnic0")
        try:
            mleng.preflight()
        except mleng.PreflightError as exc:
            print("ERROR", exc.message, "|", exc.hint)
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=dict(env, MLENG_HOME=str(mleng_home)))
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.splitlines()
    assert first.split()[:2] == ["ok", "1"]
    assert "mleng preflight: 1 rank on 1 host" in proc.stderr
    assert second.startswith("ERROR process group initialization failed on rank 0: ") and "nosuchnic0" in second
    assert "GLOO_SOCKET_IFNAME=nosuchnic0 names a network interface this host does not have" in second


def test_stragglers_are_judged_against_the_median_of_the_others():
    from mleng.preflight import stragglers

    assert stragglers({0: 1.0, 1: 0.5}, 0.6) == [(1, 0.5, 1.0)]  # two ranks: each against the other
    assert stragglers({0: 1.0, 1: 0.9, 2: 1.1, 3: 0.3}, 0.6) == [(3, 0.3, 1.0)]
    assert stragglers({"a": 1.0, "b": 0.7}, 0.6) == []
    assert stragglers({0: 1.0, 1: 0.1}, 0) == []  # 0 names none
    assert stragglers({0: 1.0}, 0.6) == []


def test_a_group_made_without_naming_a_backend_is_probed_with_the_one_for_its_device(mleng_home):
    # Trainer/accelerate call init_process_group() with no backend: torch reports it as 'undefined'.
    script = textwrap.dedent('''
        import os, socket
        import torch.distributed as dist
        import mleng
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
        dist.init_process_group()
        print("torch says", dist.get_backend())
        mleng.preflight(max_seconds=5)
        dist.destroy_process_group()
    ''')
    env = dict(os.environ, MLENG_HOME=str(mleng_home), PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torch says undefined" in proc.stdout
    out = proc.stdout + proc.stderr
    assert "backend gloo" in out and "undefined" not in out.replace("torch says undefined", ""), out


FOUR = textwrap.dedent('''
    import json, os, sys
    import mleng
    rank = int(os.environ["RANK"])
    record = mleng.preflight(timeout=30)   # its own fail-fast group: no default group here
    rows = {r["check"]: r["severity"] for r in record.rows} if record else None
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump({"rows": rows}, f)
''')


def test_four_healthy_ranks_pass(tmp_path, mleng_home):
    proc = _torchrun(FOUR, tmp_path, mleng_home, nproc=4)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(r["rows"] is None for r in results[1:])       # rank 0 holds the record
    rows = results[0]["rows"]
    assert rows["join"] == "ok" and rows["all_reduce"] == "ok", rows
    assert "fail" not in rows.values() and "warn" not in rows.values(), rows
    assert "4/4 ranks" in proc.stderr
