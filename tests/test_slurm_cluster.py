"""mleng slurm against a real SLURM: munged, slurmctld and two slurmd "nodes" (n1, n2) started on this host."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from mleng.distributed.launch import expand_nodelist

HERE = os.path.dirname(os.path.abspath(__file__))

pytestmark = pytest.mark.skipif(shutil.which("slurmctld") is None,
                                reason="slurmctld is not installed (CI installs slurm-wlm and munge)")


@pytest.fixture(scope="module")
def cluster():
    """The cluster's environment (SLURM_CONF); everything it started is stopped by pid files afterwards."""
    # Not under pytest's tmp_path: its parents are mode 700 and munged runs as the munge user.
    folder = tempfile.mkdtemp(prefix="mleng-slurm-")
    os.chmod(folder, 0o755)
    t0 = time.monotonic()
    up = subprocess.run(["bash", os.path.join(HERE, "slurm", "up.sh"), folder], capture_output=True, text=True,
                        timeout=90)
    try:
        assert up.returncode == 0, f"cluster did not come up:\n{up.stdout}\n{up.stderr}"
        env = dict(os.environ, SLURM_CONF=os.path.join(folder, "slurm.conf"))
        env.pop("SLURM_JOB_ID", None)
        print(f"\nslurm cluster up in {time.monotonic() - t0:.2f} s ({folder})")
        yield env
    finally:
        subprocess.run(["bash", os.path.join(HERE, "slurm", "down.sh"), folder], timeout=60)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def slurm_mleng(cluster, mleng_home):
    def _run(*args, timeout=120):
        env = dict(cluster, MLENG_HOME=str(mleng_home))
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "mleng", *args], capture_output=True, text=True,
                              timeout=timeout, env=env)
        done.wall_s = time.monotonic() - t0
        return done

    return _run


def test_both_nodes_are_up_and_scontrol_agrees_with_our_parser(cluster):
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True,
                           env=cluster, timeout=30).stdout.split("\n")
    assert sorted(line.split()[0] for line in nodes if line.strip()) == ["n1", "n2"]
    for nodelist in ("n[1-3,5],gpu-a[01-02]", "gpu[098-101]", "rack[1-2]-n[1-2]"):
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             env=cluster, timeout=30).stdout.split()
        assert out == expand_nodelist(nodelist)


def test_two_node_check_merges_into_one_record_with_a_row_per_node(slurm_mleng, tmp_path):
    done = slurm_mleng("slurm", "run", "check", "--nodes", "2", "--gpus-per-node", "0", "--output", str(tmp_path),
                       "--join-timeout", "30", "--json", "--", "--timeout", "30", "--pairs",
                       "--outlier-ratio", "0")  # two ranks on two shared cores: pair rates are too noisy to judge
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    print(f"check: submit to result {out['job']['submit_to_result_s']:.1f} s (CLI wall {done.wall_s:.1f} s)")
    assert out["job"]["state"] == "COMPLETED" and out["job"]["exit_code"] == 0
    record = out["record"]
    assert record["kind"] == "check" and record["status"] == "complete"
    assert record["summary"]["world_size"] == 2 and record["summary"]["verdict"] == "ok"
    assert sorted(r["rank"] for r in record["rows"]) == [0, 1]
    assert sorted(r["node"] for r in record["rows"]) == ["n1", "n2"]
    assert all(r["all_reduce_ok"] and r["launch"] == "torchrun" for r in record["rows"])
    per_node = record["summary"]["per_node"]
    assert sorted(n["node"] for n in per_node) == ["n1", "n2"]
    assert all(n["pair_gbps"] > 0 for n in per_node)  # the point-to-point rate between the two nodes
    assert record["params"]["slurm"]["nodelist"] == "n[1-2]"
    # the labelled log: rank 0 on its node said nothing on stderr, the batch shell its lines
    log = open(out["job"]["log"]).read()
    assert f"job {out['job']['job_id']} finished with exit code 0" in log
    # stored once, under rank 0's id, now with the nodes
    shown = slurm_mleng("results", "show", record["id"], "--json")
    assert json.loads(shown.stdout)["summary"]["per_node"] == per_node


def test_two_node_comm_with_gloo(slurm_mleng, tmp_path):
    done = slurm_mleng("slurm", "run", "comm", "--nodes", "2", "--gpus-per-node", "0", "--output", str(tmp_path),
                       "--join-timeout", "30", "--json", "--",
                       "--min-bytes", "1M", "--max-bytes", "2M", "--iters", "3", "--warmup", "1", "--repeats", "2")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    print(f"comm: submit to result {out['job']['submit_to_result_s']:.1f} s (CLI wall {done.wall_s:.1f} s)")
    record = out["record"]
    assert record["kind"] == "comm" and record["status"] == "complete"
    assert record["params"]["world_size"] == 2 and record["params"]["backend"] == "gloo"
    assert {r["size_bytes"] for r in record["rows"]} == {1 << 20, 2 << 20}
    assert all(r["busbw_gbps"] > 0 for r in record["rows"])
    ranks = record["machine"]["ranks"]
    assert sorted((r["rank"], r["node"]) for r in ranks)[0][0] == 0
    assert sorted(r["node"] for r in ranks) == ["n1", "n2"]
    assert sorted(n["node"] for n in record["summary"]["per_node"]) == ["n1", "n2"]


def test_per_node_command_merges_one_row_per_node(slurm_mleng, tmp_path):
    done = slurm_mleng("slurm", "run", "mamf", "--nodes", "2", "--gpus-per-node", "0", "--output", str(tmp_path),
                       "--json", "--straggler-ratio", "0", "--",
                       "--device", "cpu", "--dtype", "float32", "--m", "128", "--n", "128", "--k", "128", "--iters", "3")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    print(f"mamf per node: submit to result {out['job']['submit_to_result_s']:.1f} s")
    record = out["record"]
    assert record["kind"] == "mamf" and record["status"] == "complete"
    assert sorted(r["node"] for r in record["rows"]) == ["n1", "n2"]
    assert all(r["value"] > 0 and r["unit"] == "TFLOPS" for r in record["rows"])
    assert record["summary"]["value"] == min(r["value"] for r in record["rows"])
    log = open(out["job"]["log"]).read()
    assert "[n1] mleng mamf:" in log and "[n2] mleng mamf:" in log  # stderr labelled by node


def test_hand_submitted_script_merges_and_a_failed_rank_fails_the_job(cluster, slurm_mleng, tmp_path):
    # A bad value the parser accepts but the command refuses: every rank exits 2 inside the job.
    wrote = slurm_mleng("slurm", "script", "check", "--nodes", "2", "--gpus-per-node", "0", "--output",
                        str(tmp_path), "--json", "--", "--pair-iters", "0")
    assert wrote.returncode == 0, wrote.stderr
    script = json.loads(wrote.stdout)["script"]
    job_id = subprocess.run(["sbatch", "--parsable", script], capture_output=True, text=True, env=cluster,
                            timeout=30).stdout.strip()
    assert job_id.isdigit()
    deadline = time.monotonic() + 90
    while subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True, env=cluster,
                         timeout=30).stdout.strip() and time.monotonic() < deadline:
        time.sleep(0.2)
    merged = slurm_mleng("slurm", "merge", str(tmp_path / f"job-{job_id}"), "--json")
    assert merged.returncode == 1
    record = json.loads(merged.stdout)["record"]
    assert record["status"] == "failed" and "no rank wrote a result" in record["error"]
    assert record["params"]["slurm"]["exit_code"] != 0
    log = open(tmp_path / f"slurm-{job_id}.out").read()
    assert "[n1:0]:" in log and "--pair-iters must be at least 1" in log  # labelled by node and local rank


def test_sbatch_refusal_is_one_clear_message(slurm_mleng, tmp_path):
    done = slurm_mleng("slurm", "run", "check", "--nodes", "3", "--gpus-per-node", "0", "--output", str(tmp_path))
    assert done.returncode == 2
    assert "can never start" in done.stderr and "Traceback" not in done.stderr
    assert "cancelled job" in done.stderr


def _wait_gone(job_id, env, limit_s=90):
    deadline = time.monotonic() + limit_s
    while subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True, env=env,
                         timeout=30).stdout.strip():
        assert time.monotonic() < deadline, f"job {job_id} still queued after {limit_s} s"
        time.sleep(0.2)


def test_time_limit_signal_interrupts_the_ranks_and_keeps_the_rows(cluster, slurm_mleng, tmp_path):
    # What --signal=B:USR1@120 delivers before the time limit, sent by hand so the test need not wait for it.
    wrote = slurm_mleng("slurm", "script", "comm", "--nodes", "2", "--gpus-per-node", "0", "--output",
                        str(tmp_path), "--json", "--", "--min-bytes", "1M", "--max-bytes", "64M", "--iters", "20")
    script = json.loads(wrote.stdout)["script"]
    job_id = subprocess.run(["sbatch", "--parsable", script], capture_output=True, text=True, env=cluster,
                            timeout=30).stdout.strip()
    rank0_started = tmp_path / f"job-{job_id}" / "ranks" / "rank-0.json"
    deadline = time.monotonic() + 60
    while not rank0_started.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(6)  # into the sweep: torch imported (2-4 s here) and the first sizes measured
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=cluster, timeout=30, check=True)
    _wait_gone(job_id, cluster)
    merged = slurm_mleng("slurm", "merge", str(tmp_path / f"job-{job_id}"), "--json")
    record = json.loads(merged.stdout)["record"]
    assert record["status"] == "interrupted", record["error"]
    assert merged.returncode == 1
    log = open(tmp_path / f"slurm-{job_id}.out").read()
    assert "time limit near: interrupting the step" in log


def test_check_inside_salloc_runs_on_every_node(cluster, mleng_home):
    env = dict(cluster, MLENG_HOME=str(mleng_home))
    done = subprocess.run(["salloc", "-N2", sys.executable, "-m", "mleng", "check", "--timeout", "30", "--json"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "running 1 rank(s) on each with srun" in done.stderr
    record = json.loads(done.stdout)
    assert record["summary"]["world_size"] == 2 and record["params"]["launch"] == "srun"
    assert sorted(r.get("slurm_node") for r in record["rows"]) == ["n1", "n2"]
    shown = subprocess.run([sys.executable, "-m", "mleng", "slurm", "merge", record["id"], "--json"],
                           capture_output=True, text=True, env=env, timeout=60)
    per_node = json.loads(shown.stdout)["record"]["summary"]["per_node"]
    assert sorted(n["node"] for n in per_node) == ["n1", "n2"]


def test_relaunch_can_be_turned_off(cluster, mleng_home):
    env = dict(cluster, MLENG_HOME=str(mleng_home), MLENG_SLURM_RELAUNCH="0")
    done = subprocess.run(["salloc", "-N2", sys.executable, "-m", "mleng", "check", "--timeout", "30", "--json",
                           "--nproc", "1"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["summary"]["world_size"] == 1


def test_ctrl_c_while_following_interrupts_the_job_and_keeps_its_rows(cluster, mleng_home, tmp_path):
    import signal

    env = dict(cluster, MLENG_HOME=str(mleng_home))
    follower = subprocess.Popen([sys.executable, "-m", "mleng", "slurm", "run", "comm", "--nodes", "2",
                                 "--gpus-per-node", "0", "--output", str(tmp_path), "--json", "--quiet", "--",
                                 "--min-bytes", "1M", "--max-bytes", "64M", "--iters", "20"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("job-*/ranks/rank-0.json")) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(6)
        follower.send_signal(signal.SIGINT)
        stdout, stderr = follower.communicate(timeout=90)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.communicate()
    assert follower.returncode == 130, stderr
    assert "interrupting job" in stderr
    out = json.loads(stdout)
    assert out["record"]["status"] == "interrupted"
    assert out["stored_as"] == out["record"]["id"]
