"""mleng comm with real ranks (gloo on loopback): every op's busbw factor and --check, 2 and 4 ranks, failures."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mleng.distributed.launch import free_port
from mleng.errors import UsageError
from mleng.measure.collectives import OPS, op_names, size_sweep, time_stats
from mleng.measure.sizes import parse_size
from mleng.results.store import Store

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_STEP_ID", "SLURM_NTASKS", "MLENG_SPAWNED")


def clean_env(home, **extra):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["MLENG_HOME"] = str(home)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def mleng(*args, home, timeout=120, **extra):
    return subprocess.run([sys.executable, "-m", "mleng", *args], capture_output=True, text=True,
                          timeout=timeout, env=clean_env(home, **extra))


def expected_factor(op, n):
    # nccl-tests' definitions, written out here independently of mleng.specs
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "all_to_all": (n - 1) / n, "broadcast": 1.0, "reduce": 1.0, "send_recv": 1.0}[op]


def test_sizes_ops_and_stats():
    # The one size rule: bare K/M/G binary (nccl-tests' -b 1G), IEC binary, SI decimal.
    assert parse_size("32K") == 32768 and parse_size("1M") == 1 << 20 and parse_size("4G") == 4 << 30
    assert parse_size("64MiB") == 64 << 20 and parse_size("1000") == 1000
    assert parse_size("1GB") == 10**9 and parse_size("1GiB") == parse_size("1G") == 1 << 30
    for bad in ("12X", "-1M", "0", "1.5", "1.3K"):
        with pytest.raises(UsageError):
            parse_size(bad)
    assert size_sweep(1 << 20, 8 << 20, 2) == [1 << 20, 2 << 20, 4 << 20, 8 << 20]
    assert size_sweep(1 << 20, 1 << 20, 2) == [1 << 20]
    with pytest.raises(UsageError):
        size_sweep(8 << 20, 1 << 20, 2)
    assert op_names("all") == list(OPS)
    assert op_names(["allreduce,broadcast", "all_reduce"]) == ["all_reduce", "broadcast"]
    with pytest.raises(UsageError, match="unknown op"):
        op_names("all_shuffle")
    stats = time_stats([1e-6, 2e-6, 3e-6, 4e-6, 5e-6])
    assert stats["time_us"] == pytest.approx(3) and stats["time_p99_us"] == pytest.approx(4.96)
    assert stats["time_cv"] == pytest.approx(2 ** 0.5 / 3)


def check_rows(rows, n):
    assert {r["op"] for r in rows} == set(OPS)
    for row in rows:
        assert row["wrong"] == 0, row
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * expected_factor(row["op"], n))
        assert row["algbw_gbps"] == pytest.approx(row["size_bytes"] / (row["time_us"] * 1e-6) / 1e9)
        assert row["time_min_us"] <= row["time_us"] <= row["time_max_us"] and row["time_us"] > 0
        assert row["samples"] == 2 and row["size_bytes"] == row["count"] * 4


@pytest.mark.parametrize("n", [2, 4])
def test_every_op_checks_correct_with_its_busbw_factor(n, mleng_home):
    done = mleng("comm", "--op", "all", "--check", "--nproc", str(n), "-b", "64K", "-e", "256K", "-f", "4",
                 "--iters", "3", "--warmup", "1", "--repeats", "2", "--json", home=mleng_home)
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["kind"] == "comm" and record["status"] == "complete"
    check_rows(record["rows"], n)
    assert len(record["rows"]) == 2 * len(OPS)
    assert record["params"]["world_size"] == n and record["params"]["launch"] == "spawned"
    assert [r["rank"] for r in record["machine"]["ranks"]] == list(range(n))
    assert record["summary"]["verdict"] == "inconclusive"
    assert record["summary"]["theoretical_source"] == "no reference rate for gloo over loopback"
    assert record["summary"]["wrong"] == 0
    with Store() as store:  # rank 0 alone stored exactly one record
        assert [r["id"] for r in store.list(kind="comm")] == [record["id"]]


def test_blocking_plot_and_min_busbw_failure(mleng_home, tmp_path):
    plot = tmp_path / "busbw.png"
    done = mleng("comm", "--op", "all_reduce", "--op", "send_recv", "--blocking", "--dtype", "bf16",
                 "-b", "32K", "-e", "128K", "--iters", "4", "--warmup", "1", "--plot", str(plot),
                 "--min-busbw", "100000", home=mleng_home)
    assert done.returncode == 1, done.stderr
    assert "peak busbw below --min-busbw 100000 GB/s" in done.stderr and "Traceback" not in done.stderr
    out = done.stdout
    assert "# all_reduce: busbw factor 1 at 2 ranks" in out and "# send_recv" in out
    assert "blocking: each of 4 iterations timed alone" in out and "bfloat16" in out
    assert "reference: no reference rate for gloo over loopback (inconclusive)" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Store() as store:
        (listed,) = store.list(kind="comm")
        record = store.get(listed["id"])
    assert record.summary["below_min_busbw"] == ["all_reduce", "send_recv"]
    assert len(record.rows) == 6 and all(r["samples"] == 4 for r in record.rows)


def test_bad_input_is_one_message_and_exit_2(mleng_home):
    for args, says in ((["-b", "12X"], "-b/--min-bytes '12X' is not a size"),
                       (["--op", "all_shuffle"], "unknown op 'all_shuffle'"),
                       (["--dtype", "fp7"], "unknown dtype 'fp7'"),
                       (["-b", "4M", "-e", "1M"], "is above --max-bytes")):
        done = mleng("comm", *args, home=mleng_home, timeout=30)
        assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr


def start_rank(rank, world, port, args, home):
    return subprocess.Popen([sys.executable, "-m", "mleng", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=clean_env(home, RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank,
                                          MASTER_ADDR="127.0.0.1", MASTER_PORT=port))


def test_ranks_started_with_different_ops_are_stopped_before_any_collective(mleng_home):
    port = free_port()
    common = ["comm", "-b", "64K", "-e", "64K", "--iters", "2", "--timeout", "15"]
    procs = [start_rank(0, 2, port, common + ["--op", "all_reduce"], mleng_home),
             start_rank(1, 2, port, common + ["--op", "broadcast"], mleng_home)]
    t0 = time.monotonic()
    outs = [p.communicate(timeout=60) for p in procs]
    assert time.monotonic() - t0 < 30
    assert procs[0].returncode == 2 and procs[1].returncode != 0
    assert "rank 1 started with different arguments than rank 0" in outs[0][1]
    assert "ops: rank 0 ['all_reduce'], rank 1 ['broadcast']" in outs[0][1]
    assert "rank 0 stopped the job" in outs[1][1]


MISMATCH_SCRIPT = r"""
import os, sys
from mleng.distributed.launch import detect
from mleng.distributed.group import join, leave, pick_device
from mleng.measure.collectives import OPS, Settings, sweep
from mleng.errors import MlengError
launch = detect()
job = join(launch, "gloo", pick_device(launch, "cpu"), 5.0)
op = "all_reduce" if launch.rank == 0 else "broadcast"   # the bug under test: ranks disagree
try:
    list(sweep(job, Settings(ops=[op], sizes=[1 << 20], iters=2, warmup=1, repeats=1)))
except MlengError as exc:
    print(exc.message, flush=True)
    leave(job)
    sys.exit(1)
"""


def test_a_rank_calling_a_different_collective_ends_within_the_timeout(mleng_home, tmp_path):
    script = tmp_path / "mismatch.py"
    script.write_text(MISMATCH_SCRIPT)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=clean_env(mleng_home, RANK=r, WORLD_SIZE=2, LOCAL_RANK=r,
                                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for r in (0, 1)]
    t0 = time.monotonic()
    outs = [p.communicate(timeout=60) for p in procs]
    elapsed = time.monotonic() - t0
    assert elapsed < 25, elapsed
    assert [p.returncode for p in procs] == [1, 1], outs
    # the rank whose timeout fires first says so; the other either times out too or sees it leave
    timed_out = [out for out, _ in outs if "did not complete within 5 s on rank" in out
                 and "another rank is missing, stuck, or running a different collective" in out]
    assert timed_out, outs
    assert outs[0][0].startswith("all_reduce at 1 MiB") and outs[1][0].startswith("broadcast at 1 MiB"), outs


def child_pids(parent):
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            pids.append(int(stat.parent.name))
    return pids


def rank_of(pid):
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(e for e in environ if e.startswith(b"RANK="))[5:])


def test_a_rank_that_dies_mid_run_is_named(mleng_home):
    proc = subprocess.Popen([sys.executable, "-m", "mleng", "comm", "--nproc", "2", "-b", "16M", "-e", "16M",
                             "--iters", "20", "--repeats", "50", "--timeout", "20"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(mleng_home))
    try:
        header = proc.stdout.readline()  # printed by rank 0 once every rank has joined
        assert header.startswith("# mleng comm: 2 ranks"), header + proc.stderr.read()
        time.sleep(1.0)
        (victim,) = [pid for pid in child_pids(proc.pid) if rank_of(pid) == 1]
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert time.monotonic() - t0 < 25
    assert proc.returncode == 1
    assert f"rank 1 (pid {victim}) was killed by SIGKILL" in err, err
    assert "a peer closed its connection" in err or "did not complete within" in err, err
    assert "Traceback" not in err
    with Store() as store:
        (listed,) = store.list(kind="comm")
        assert listed["status"] == "failed"


def test_two_node_torchrun_rendezvous_on_loopback(mleng_home):
    port = free_port()
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=mleng-test",
         "--rdzv-conf", "join_timeout=15", "-m", "mleng", "comm", "--op", "all_reduce,all_gather", "--check",
         "-b", "256K", "-e", "256K", "--iters", "3", "--repeats", "2", "--timeout", "20"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(mleng_home))
        for _ in range(2)]
    outs = [a.communicate(timeout=90) for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outs
    printed = [out for out, _ in outs if "# mleng comm" in out]
    assert len(printed) == 1  # rank 0 alone prints
    assert "2 ranks on 1 host" in printed[0] and "launch torchrun" in printed[0]
    assert "check: 0 wrong elements" in printed[0]


def test_ctrl_c_keeps_the_rows_measured_so_far(mleng_home):
    proc = subprocess.Popen([sys.executable, "-m", "mleng", "comm", "--nproc", "2", "-b", "64K", "-e", "64M",
                             "-f", "2", "--iters", "5", "--repeats", "3"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=clean_env(mleng_home), start_new_session=True)
    try:
        lines = []
        while len([line for line in lines if line.strip().startswith("65536")]) < 1:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            lines.append(line)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C: the whole process group
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "status: interrupted" in out and "Traceback" not in err
    with Store() as store:
        (listed,) = store.list(kind="comm")
        record = store.get(listed["id"])
    assert record.status == "interrupted" and len(record.rows) >= 1
