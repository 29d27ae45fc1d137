"""mleng slurm without a cluster: node lists, the generated sbatch script, merging job folders, stragglers."""

import json
import os
import subprocess

import pytest

from mleng.distributed.launch import expand_nodelist
from mleng.errors import UsageError
from mleng.slurm.merge import drain_line, find_stragglers, merge_job_dir
from mleng.slurm.script import ScriptSpec, inner_args, render


# --- node lists ---------------------------------------------------------------------------------

@pytest.mark.parametrize("nodelist, expected", [
    ("n1", ["n1"]),
    ("n[1-3,5]", ["n1", "n2", "n3", "n5"]),
    ("n[1-3,5],gpu-a[01-02]", ["n1", "n2", "n3", "n5", "gpu-a01", "gpu-a02"]),
    ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),
    ("login1,rack[1-2]-n[1-2]", ["login1", "rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
])
def test_expand_nodelist_in_pure_python(nodelist, expected):
    assert expand_nodelist(nodelist) == expected


@pytest.mark.parametrize("bad", ["n[1-3", "n[a-b]", ""])
def test_bad_nodelist_is_a_usage_error(bad):
    with pytest.raises(UsageError):
        expand_nodelist(bad)


# --- the sbatch script --------------------------------------------------------------------------

def test_gpu_script_has_one_torchrun_per_node_and_a_rendezvous(tmp_path):
    spec = ScriptSpec("comm", ["--op", "all_reduce"], nodes=4, gpus_per_node=8, partition="gpu",
                      time="00:20:00", account="proj1", output_dir=str(tmp_path), join_timeout_s=90,
                      env={"NCCL_NVLS_ENABLE": "0"})
    text = render(spec)
    for line in ["#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "#SBATCH --time=00:20:00", "#SBATCH --account=proj1",
                 f"#SBATCH --output={tmp_path}/slurm-%j.out", "#SBATCH --signal=B:USR1@120",
                 "export NCCL_NVLS_ENABLE=0", "trap on_time_limit USR1"]:
        assert line in text.splitlines(), line
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in text
    assert "--nproc-per-node=8" in text and "--nnodes=4" in text
    assert "--rdzv-backend=c10d" in text and "--rdzv-conf join_timeout=90" in text
    assert '--role="$node:"' in text and "--tee=2" in text
    assert "-m mleng.slurm.worker comm --op all_reduce --json" in text
    assert "--backend gloo" not in text  # GPUs: the command picks NCCL itself
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_cpu_script_uses_gloo_and_the_cpu_rank_count(tmp_path):
    spec = ScriptSpec("check", [], nodes=2, gpus_per_node=0, nproc_per_node=3, output_dir=str(tmp_path))
    text = render(spec)
    assert "--gpus-per-node" not in text
    assert "#SBATCH --cpus-per-task=3" in text
    assert "--nproc-per-node=3" in text
    assert inner_args(spec) == ["check", "--json", "--backend", "gloo"]
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_per_node_commands_run_once_per_node_without_torchrun(tmp_path):
    spec = ScriptSpec("mamf", ["--max-seconds", "30"], nodes=2, gpus_per_node=8, output_dir=str(tmp_path))
    text = render(spec)
    assert "torch.distributed.run" not in text
    assert inner_args(spec) == ["mamf", "--max-seconds", "30", "--json", "--no-store", "--all-devices"]
    assert '>"$MLENG_SLURM_RESULTS/nodes/$node.json"' in text


@pytest.mark.parametrize("changes, words", [
    ({"command": "ask"}, "cannot run 'ask'"),
    ({"nodes": 0}, "--nodes 0"),
    ({"gpus_per_node": -1}, "--gpus-per-node -1"),
    ({"gpus_per_node": 4, "nproc_per_node": 8}, "share a GPU"),
    ({"time": "1h"}, "not a SLURM time"),
    ({"partition": "a b"}, "--partition"),
    ({"mleng_args": ["--nproc", "2"]}, "--nproc after --"),
    ({"per_node": True}, "--per-node is for comm"),
    ({"per_node": True, "command": "comm"}, "at least 2 ranks per node"),
])
def test_bad_script_requests_are_refused(changes, words):
    fields = dict(command="check", mleng_args=[], nodes=2, gpus_per_node=0)
    fields.update(changes)
    with pytest.raises(UsageError, match=words):
        ScriptSpec(**fields).validate()


def test_cli_writes_the_script_and_refuses_bad_inner_args(run_mleng, tmp_path):
    done = run_mleng("slurm", "script", "check", "--nodes", "2", "--gpus-per-node", "0", "--output",
                     str(tmp_path), "--json", "--", "--timeout", "30", "--pairs")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["mode"] == "torchrun" and info["ranks_per_node"] == 1
    text = open(info["script"]).read()
    assert "check --timeout 30 --pairs --json --backend gloo" in text
    assert os.access(info["script"], os.X_OK)

    bad = run_mleng("slurm", "script", "check", "--nodes", "2", "--gpus-per-node", "0", "--output",
                    str(tmp_path), "--", "--no-such-flag")
    assert bad.returncode == 2
    assert "not valid for `mleng check`" in bad.stderr and "Traceback" not in bad.stderr


# --- merging a job's results folder -------------------------------------------------------------

def _record(kind, summary, rows=None, status="complete", rid="x"):
    return {"schema": "mleng.measurement/1", "id": rid, "kind": kind, "status": status, "started_at": "",
            "elapsed_s": 1.0, "machine": {"host": {"hostname": "h"}}, "params": {}, "rows": rows or [],
            "summary": summary, "error": None}


def _job_dir(tmp_path, mode, command, nodes):
    path = tmp_path / "job-42"
    (path / "nodes").mkdir(parents=True)
    (path / "job.json").write_text(json.dumps({"job_id": "42", "nodelist": "n[1-3]", "nodes": nodes,
                                               "command": command, "mode": mode, "ranks_per_node": 1,
                                               "gpus_per_node": 8, "rendezvous": "n1:20042"}))
    (path / "exit_code").write_text("0\n")
    return path


def test_per_node_mamf_records_merge_into_one_row_per_node_with_the_straggler(tmp_path):
    path = _job_dir(tmp_path, "per_node", "mamf", 3)
    for node, rates in (("n1", [700.0, 710.0]), ("n2", [705.0, 540.0]), ("n3", [712.0, 701.0])):
        per_device = [{"device": i, "tflops_median": r} for i, r in enumerate(rates)]
        record = _record("mamf", {"value": min(rates), "unit": "TFLOPS", "theoretical": 989.0,
                                  "per_device": per_device}, rid=f"mamf-{node}")
        (path / "nodes" / f"{node}.json").write_text("note printed first\n" + json.dumps(record, indent=2))
    merged = merge_job_dir(str(path))
    assert merged.kind == "mamf" and merged.status == "complete"
    assert [r["node"] for r in merged.rows] == ["n1", "n2", "n3"]
    assert merged.summary["value"] == 540.0 and merged.summary["slowest_node"] == "n2"
    assert [s["node"] for s in merged.summary["stragglers"]] == ["n2"]
    assert merged.summary["drain"] == [drain_line("n2", merged.summary["stragglers"][0]["reason"])]
    assert merged.summary["drain"][0].startswith('scontrol update nodename=n2 state=drain reason="mleng: mamf 540')
    n2 = next(r for r in merged.summary["per_node"] if r["node"] == "n2")
    assert n2["slowest_device"] == 1 and n2["devices"] == 2


def test_a_node_without_a_result_fails_the_merge_but_keeps_the_others(tmp_path):
    path = _job_dir(tmp_path, "per_node", "mamf", 2)
    (path / "nodes" / "n1.json").write_text(json.dumps(_record("mamf", {"value": 1.0, "unit": "TFLOPS"})))
    (path / "nodes" / "n2.json").write_text("Traceback (most recent call last):\n")
    merged = merge_job_dir(str(path))
    assert merged.status == "failed" and "n2" in merged.error
    assert [r["status"] for r in merged.rows] == ["complete", "failed"]


def test_check_pairs_per_node_value_uses_the_pairs_leaving_the_node(tmp_path):
    path = _job_dir(tmp_path, "torchrun", "check", 3)
    rows = [{"rank": r, "host": "h", "all_reduce_ok": True, "barrier_ms": 1.0} for r in range(3)]
    matrix = [[None, 10.0, 10.0], [10.0, None, 4.0], [10.0, 4.0, None]]  # rank 1 <-> rank 2 is slow
    summary = {"verdict": "ok", "world_size": 3, "problems": [],
               "pairs": {"mode": "ranks", "members": [0, 1, 2], "matrix_gbps": matrix, "slow": [], "suspects": []}}
    log = path / "torchrun" / "n1" / "42_abc" / "attempt_0" / "0"
    log.mkdir(parents=True)
    (log / "stdout.log").write_text(json.dumps(_record("connectivity", summary, rows, rid="connectivity-1")))
    (path / "ranks").mkdir()
    for rank, node in enumerate(["n1", "n2", "n3"]):
        (path / "ranks" / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "node": node}))
    merged = merge_job_dir(str(path), ratio=0.9)
    assert merged.id == "connectivity-1"  # rank 0's record, enriched, not a second one
    assert [r["node"] for r in merged.rows] == ["n1", "n2", "n3"]
    values = {r["node"]: r["pair_gbps"] for r in merged.summary["per_node"]}
    assert values == {"n1": 10.0, "n2": 7.0, "n3": 7.0}
    assert merged.summary["per_node_median"] == 7.0 and merged.summary["stragglers"] == []
    median, slow = find_stragglers(merged.summary["per_node"], "pair_gbps", 1.2)
    assert [r["node"] for r in slow] == ["n2", "n3"]


def test_merge_of_a_folder_that_is_not_a_job_is_a_usage_error(run_mleng, tmp_path):
    done = run_mleng("slurm", "merge", str(tmp_path))
    assert done.returncode == 2 and "no readable job.json" in done.stderr and "Traceback" not in done.stderr


def test_run_without_slurm_tools_says_so(run_mleng, tmp_path):
    done = run_mleng("slurm", "run", "check", "--nodes", "2", "--gpus-per-node", "0", "--output", str(tmp_path),
                     env={"PATH": "/nonexistent"})
    assert done.returncode == 2 and "sbatch is not on PATH" in done.stderr


# --- inside an allocation -----------------------------------------------------------------------

@pytest.mark.parametrize("env, nodes", [
    ({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "4"}, 4),                         # salloc shell, sbatch script
    ({"SLURM_JOB_ID": "7", "SLURM_NNODES": "2"}, 2),
    ({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "4", "SLURM_STEP_ID": "0"}, 0),   # already an srun step
    ({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "4", "RANK": "0"}, 0),            # torchrun placed it
    ({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "4", "MLENG_SLURM_RELAUNCH": "0"}, 0),
    ({"SLURM_JOB_NUM_NODES": "4"}, 0),                                              # no job
])
def test_allocation_nodes(env, nodes):
    from mleng.slurm.allocation import allocation_nodes

    assert allocation_nodes(env) == nodes


def test_comm_per_node_busbw_names_the_slow_node(tmp_path):
    path = _job_dir(tmp_path, "torchrun", "comm", 3)
    world = _record("collective", {"ops": {"all_reduce": {"peak_busbw_gbps": 40.0, "at_size_bytes": 1 << 30}}},
                    rows=[{"op": "all_reduce", "size_bytes": 1 << 30, "busbw_gbps": 40.0}], rid="collective-1")
    world["machine"]["ranks"] = [{"rank": r, "host": f"h{r}", "device": "cuda:0"} for r in range(3)]
    log = path / "torchrun" / "n1" / "42_abc" / "attempt_0" / "0"
    log.mkdir(parents=True)
    (log / "stdout.log").write_text(json.dumps(world))
    (path / "ranks").mkdir()
    for rank, node in enumerate(["n1", "n2", "n3"]):
        (path / "ranks" / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "node": node}))
    for node, busbw in (("n1", 360.0), ("n2", 361.0), ("n3", 250.0)):
        own = _record("collective", {"ops": {"all_reduce": {"peak_busbw_gbps": busbw, "at_size_bytes": 1 << 30}}})
        (path / "nodes" / f"{node}.json").write_text(json.dumps(own))
    merged = merge_job_dir(str(path))
    assert merged.id == "collective-1" and merged.status == "complete"
    assert [r["node"] for r in merged.machine["ranks"]] == ["n1", "n2", "n3"]
    per_node = {r["node"]: r for r in merged.summary["per_node"]}
    assert per_node["n3"]["busbw_gbps"] == 250.0 and per_node["n3"]["straggler"]
    assert not per_node["n1"]["straggler"] and not per_node["n2"]["straggler"]
    assert merged.summary["drain"] == [drain_line("n3", merged.summary["stragglers"][0]["reason"])]


def test_doctor_failure_on_one_node_gets_a_drain_line(tmp_path):
    path = _job_dir(tmp_path, "per_node", "doctor", 2)
    for node, verdict, rows in (("n1", "ok", []),
                                ("n2", "fail", [{"check": "gpu_count", "severity": "fail",
                                                 "summary": "7 GPUs visible, the job expects 8"}])):
        record = _record("doctor", {"verdict": verdict, "value": None, "unit": "",
                                    "counts": {"fail": len(rows), "warn": 0}}, rows=rows)
        (path / "nodes" / f"{node}.json").write_text(json.dumps(record))
    merged = merge_job_dir(str(path))
    assert [s["node"] for s in merged.summary["stragglers"]] == ["n2"]
    assert merged.summary["drain"] == [
        'scontrol update nodename=n2 state=drain reason="mleng: doctor: 7 GPUs visible, the job expects 8 (job 42)"']
