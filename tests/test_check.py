"""mleng check with real ranks (gloo on loopback): a healthy job, the missing-rank contract, --pairs, srun env."""

import json
import subprocess
import sys
import time

from mleng.distributed.launch import free_port
from mleng.results.store import Store
from test_comm import clean_env, mleng


def test_healthy_job_reports_every_rank(mleng_home):
    done = mleng("check", "--nproc", "2", "--alloc-gib", "0.01", "--timeout", "20", "--json", home=mleng_home)
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["kind"] == "check" and record["summary"]["verdict"] == "ok"
    assert record["summary"]["problems"] == [] and record["summary"]["world_size"] == 2
    rows = record["rows"]
    assert [r["rank"] for r in rows] == [0, 1] and [r["local_rank"] for r in rows] == [0, 1]
    for row in rows:
        assert row["all_reduce_ok"] and row["all_reduce_values"] == [2.0]
        assert row["alloc_ok"] is True and row["host"] and row["cpu_affinity"] and row["pid"] > 0
        assert row["device"] == "cpu" and row["launch"] == "spawned"
    assert len({r["pid"] for r in rows}) == 2
    with Store() as store:
        assert store.get(record["id"]).summary["verdict"] == "ok"


def test_no_store_measures_and_stores_nothing(mleng_home):
    for command in (["check", "--nproc", "2", "--timeout", "20"],
                    ["comm", "--nproc", "2", "-b", "64K", "-e", "64K", "--iters", "2", "--timeout", "20"]):
        done = mleng(*command, "--no-store", "--json", home=mleng_home)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["status"] == "complete"
    with Store() as store:
        assert store.list() == []


def test_missing_rank_contract_and_missing_master(mleng_home):
    # Contract (issue 4): rank 0 of a world of 2, rank 1 never started -> non-zero within 25 s, rank 1 named.
    # Alongside, the mirror case: rank 1 alone, nobody serving rank 0's store.
    # One after the other, so neither's clock includes the other's start-up on a 2-core CI machine.
    port_a, port_b = free_port(), free_port()
    env = dict(WORLD_SIZE=2, MASTER_ADDR="127.0.0.1")
    t0 = time.monotonic()
    alone0 = subprocess.Popen([sys.executable, "-m", "mleng", "check", "--timeout", "10"], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=clean_env(mleng_home, RANK=0, LOCAL_RANK=0, MASTER_PORT=port_a, **env))
    out0, err0 = alone0.communicate(timeout=60)
    elapsed0 = time.monotonic() - t0
    t1 = time.monotonic()
    alone1 = subprocess.Popen([sys.executable, "-m", "mleng", "check", "--timeout", "10"], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=clean_env(mleng_home, RANK=1, LOCAL_RANK=1, MASTER_PORT=port_b, **env))
    out1, err1 = alone1.communicate(timeout=60)
    elapsed1 = time.monotonic() - t1
    assert alone0.returncode != 0 and elapsed0 < 25, (elapsed0, err0)
    said = out0 + err0
    assert "rank 1 did not join within 10 s" in said and "1/2 ranks joined: rank 0 on" in said
    assert "Traceback" not in said
    assert alone1.returncode != 0 and elapsed1 < 25, (elapsed1, err1)
    assert f"rank 1 could not reach rank 0's store at 127.0.0.1:{port_b} within 10 s" in err1
    assert "Traceback" not in err1 and "frame #" not in err1
    with Store() as store:  # the failed run is on record too
        (listed,) = store.list(kind="check")
        assert listed["status"] == "failed"


def test_pairs_matrix_at_four_ranks(mleng_home):
    done = mleng("check", "--nproc", "4", "--pairs", "--pair-bytes", "256K", "--pair-iters", "2",
                 "--outlier-ratio", "0", "--timeout", "30", home=mleng_home)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("send bandwidth GB/s"))
    matrix = [line.split() for line in lines[header + 2: header + 6]]
    assert [row[0] for row in matrix] == ["0", "1", "2", "3"]
    for i, row in enumerate(matrix):
        for j, cell in enumerate(row[1:]):
            assert cell == "-" if i == j else float(cell.rstrip("*")) > 0
    with Store() as store:
        (listed,) = store.list(kind="check")
        pairs = store.get(listed["id"]).summary["pairs"]
    assert pairs["members"] == [0, 1, 2, 3] and len(pairs["matrix_gbps"]) == 4 and pairs["slow"] == []


def test_srun_environment_finds_rank0_from_the_node_list(mleng_home):
    # What srun gives each task; the node list's first host becomes MASTER_ADDR, the port comes from the job id.
    job_id = free_port() - 20000 if free_port() > 20000 else 4242
    procs = []
    for rank in (0, 1):
        env = clean_env(mleng_home, SLURM_PROCID=rank, SLURM_LOCALID=rank, SLURM_NTASKS=2, SLURM_STEP_NUM_TASKS=2,
                        SLURM_STEP_ID=0, SLURM_JOB_ID=job_id, SLURM_STEP_NODELIST="127.0.0.[1]")
        procs.append(subprocess.Popen([sys.executable, "-m", "mleng", "check", "--timeout", "20"], text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env))
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "2 ranks on 1 host(s)" in outs[0][0] and "launch srun" in outs[0][0]
    assert outs[1][0] == ""  # only rank 0 prints


def test_a_failed_allocation_names_every_rank(mleng_home):
    # 10^6 GiB is beyond any address space, so the allocation fails at once and touches nothing.
    done = mleng("check", "--nproc", "2", "--alloc-gib", "1000000", "--timeout", "20", home=mleng_home)
    assert done.returncode == 1, done.stderr
    assert "ranks 0, 1 (" in done.stdout and "could not allocate 1e+06 GiB on cpu" in done.stdout
    assert "can't allocate memory" in done.stdout
    assert "1 problem(s) found, listed above" in done.stderr and "Traceback" not in done.stderr


def test_srun_rank_that_never_starts_is_named_with_its_expected_host(mleng_home):
    env = clean_env(mleng_home, SLURM_PROCID=0, SLURM_LOCALID=0, SLURM_STEP_NUM_TASKS=2, SLURM_STEP_ID=0,
                    SLURM_JOB_ID=1, SLURM_STEP_NODELIST="127.0.0.[1-2]", SLURM_STEP_TASKS_PER_NODE="1(x2)",
                    MASTER_PORT=free_port())
    done = subprocess.run([sys.executable, "-m", "mleng", "check", "--timeout", "3"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert done.returncode == 1
    assert "rank 1 (expected on 127.0.0.2) did not join within 3 s (1/2 ranks joined: rank 0 on" in done.stderr


STUCK_SCRIPT = r"""
import sys, time
from mleng.distributed.launch import detect
from mleng.distributed.group import join, leave
from mleng.measure import connectivity
from mleng.errors import MlengError
launch = detect()
job = join(launch, "gloo", "cpu", 4.0)
if launch.rank == 1:
    time.sleep(8)   # joined, then stuck: never reaches the all-reduce
    sys.exit(0)
try:
    connectivity.verify_all_reduce(job)
except MlengError as exc:
    print(exc.message, flush=True)
    leave(job)  # as the CLI does: exiting with the timed-out op still queued in gloo aborts the process
    sys.exit(1)
"""


def test_a_stuck_rank_is_named_with_how_far_it_got(mleng_home, tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_SCRIPT)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=clean_env(mleng_home, RANK=r, WORLD_SIZE=2, LOCAL_RANK=r,
                                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for r in (0, 1)]
    t0 = time.monotonic()
    out0, _ = procs[0].communicate(timeout=60)
    assert time.monotonic() - t0 < 20 and procs[0].returncode == 1
    procs[1].communicate(timeout=60)
    assert out0.startswith("all_reduce of ones did not complete within 4 s on rank 0")
    assert "rank 1 (" in out0 and "last reached: joined, nothing after" in out0
