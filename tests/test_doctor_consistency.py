"""Consistency across the nodes of a job (driver, CUDA, NCCL, torch, VBIOS, HCA firmware; the odd node named)
and within one node (VBIOS, HCA firmware): on modelled fingerprints, on a modelled job folder, and through
`mleng slurm run doctor` on a real throw-away SLURM (two nodes on this host)."""

import copy
import json
import shutil
from pathlib import Path

import pytest

from mleng.doctor.consistency import check_firmware_within_node, compare_nodes
from mleng.doctor.runner import run_doctor
from mleng.slurm.merge import merge_job_dir

FINGERPRINTS = Path(__file__).parent / "fixtures" / "fingerprints"


def fingerprint(name: str = "h200_healthy") -> dict:
    data = json.loads((FINGERPRINTS / f"{name}.json").read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


def cluster_of(n: int) -> dict[str, dict]:
    nodes = {}
    for i in range(n):
        fp = copy.deepcopy(fingerprint())
        fp["host"]["hostname"] = f"gpu-node-{17 + i:03d}"
        nodes[f"gpu-node-{17 + i:03d}"] = fp
    return nodes


def by_field(findings):
    return {f.subject: f for f in findings}


def test_identical_nodes_agree_on_everything():
    findings = compare_nodes(cluster_of(4))
    assert {f.severity for f in findings} == {"ok"}
    assert set(by_field(findings)) == {"driver", "cuda_driver", "torch", "cuda", "nccl", "gpu_model", "vbios",
                                       "hca_firmware", "os", "kernel"}
    assert by_field(findings)["vbios"].summary == "GPU VBIOS: 96.00.A5.00.1A on all 4 node(s)"


def test_the_odd_node_is_named_against_the_majority():
    nodes = cluster_of(4)
    nodes["gpu-node-019"]["software"]["nccl"] = "2.21.5"
    nodes["gpu-node-020"]["infiniband"]["devices"][3]["fw_ver"] = "28.36.1010"
    nodes["gpu-node-018"]["gpus"]["devices"][7]["vbios"] = "96.00.74.00.01"
    found = by_field(compare_nodes(nodes))
    nccl = found["nccl"]
    assert nccl.severity == "fail" and nccl.measured["odd_nodes"] == ["gpu-node-019"]
    assert nccl.summary == "NCCL: gpu-node-019 has 2.21.5, the other 3 node(s) 2.28.9"
    assert found["hca_firmware"].severity == "warn" and found["hca_firmware"].measured["odd_nodes"] == ["gpu-node-020"]
    assert "28.36.1010 x1" in found["hca_firmware"].summary
    assert found["vbios"].severity == "warn" and found["vbios"].measured["odd_nodes"] == ["gpu-node-018"]
    assert found["driver"].severity == "ok"


def test_two_nodes_that_differ_have_no_majority_and_nobody_is_drained():
    nodes = cluster_of(2)
    nodes["gpu-node-018"]["gpus"]["driver"] = "570.86.15"
    driver = by_field(compare_nodes(nodes))["driver"]
    assert driver.severity == "fail" and "no majority" in driver.summary and driver.measured["odd_nodes"] == []


def test_unknown_values_are_said_not_counted():
    nodes = cluster_of(3)
    nodes["gpu-node-019"]["software"]["torch"] = None
    torch = by_field(compare_nodes(nodes))["torch"]
    assert torch.severity == "ok" and "unknown on gpu-node-019" in torch.summary
    assert compare_nodes({"only": fingerprint()})[0].severity == "inconclusive"


def test_firmware_within_one_node():
    fp = fingerprint()
    assert {f.severity for f in check_firmware_within_node(fp)} == {"ok"}
    fp["gpus"]["devices"][6]["vbios"] = "96.00.74.00.01"
    fp["infiniband"]["devices"][2]["fw_ver"] = "28.36.1010"
    bad = {f.subject: f for f in check_firmware_within_node(fp) if f.severity != "ok"}
    assert set(bad) == {"vbios", "hca_firmware"}
    assert "gpu 6 96.00.74.00.01" in bad["vbios"].summary and "mlx5_2 28.36.1010" in bad["hca_firmware"].summary
    assert check_firmware_within_node(fingerprint("cpu_only")) == []


def _job_dir(tmp_path: Path, nodes: dict[str, dict]) -> Path:
    """A results folder as the sbatch script leaves it for a per-node command (modelled, see slurm/script.py)."""
    folder = tmp_path / "job-4242"
    (folder / "nodes").mkdir(parents=True)
    (folder / "job.json").write_text(json.dumps({"job_id": "4242", "nodelist": "gpu-node-[017-020]",
                                                 "nodes": len(nodes), "mode": "per_node", "command": "doctor"}))
    (folder / "exit_code").write_text("0\n")
    for node, fp in nodes.items():
        record = run_doctor(measure=False, fingerprint=fp, local=False, history=False)
        (folder / "nodes" / f"{node}.json").write_text("... progress lines\n" + json.dumps(record.to_dict()))
    return folder


def test_merged_doctor_job_names_the_odd_node_with_a_drain_line(tmp_path):
    nodes = cluster_of(4)
    nodes["gpu-node-019"]["gpus"]["driver"] = "570.86.15"
    nodes["gpu-node-019"]["gpus"]["cuda_driver"] = "12.8"
    record = merge_job_dir(str(_job_dir(tmp_path, nodes)))
    consistency = {row["subject"]: row for row in record.summary["consistency"]}
    assert consistency["driver"]["severity"] == "fail"
    assert [s["node"] for s in record.summary["stragglers"]] == ["gpu-node-019", "gpu-node-019"]
    assert any("scontrol update nodename=gpu-node-019 state=drain" in line and "570.86.15" in line
               for line in record.summary["drain"])
    from mleng.cli.slurm import render_merged

    text = render_merged(record)
    assert "same stack on every node:" in text and "[FAIL] NVIDIA driver: gpu-node-019 has 570.86.15" in text


def test_merged_consistent_job_has_no_straggler(tmp_path):
    record = merge_job_dir(str(_job_dir(tmp_path, cluster_of(3))))
    assert record.summary["stragglers"] == []
    assert {row["severity"] for row in record.summary["consistency"]} == {"ok"}


@pytest.mark.skipif(shutil.which("slurmctld") is None, reason="slurmctld is not installed")
def test_slurm_run_doctor_on_two_real_nodes_compares_their_stack(slurm_mleng, tmp_path):
    done = slurm_mleng("slurm", "run", "doctor", "--nodes", "2", "--gpus-per-node", "0", "--output", str(tmp_path),
                       "--json", "--", "--no-measure", timeout=180)
    out = json.loads(done.stdout)
    record = out["record"]
    assert record["kind"] == "doctor" and sorted(r["node"] for r in record["rows"]) == ["n1", "n2"]
    consistency = {row["subject"]: row for row in record["summary"]["consistency"]}
    # both "nodes" are this host: the same torch and kernel; no GPU, so no driver to compare
    assert consistency["torch"]["severity"] == "ok" and consistency["kernel"]["severity"] == "ok"
    assert consistency["driver"]["severity"] == "inconclusive"
    # the job's exit code follows the nodes' verdicts: 0 on a healthy host, 1 when this host fails a check of its own
    # (a nearly full disk under the tests failed both nodes' disk checks once, which is the job's answer, not a fault)
    failing = [row["node"] for row in record["rows"] if row.get("verdict") == "fail"]
    assert done.returncode == (1 if failing else 0), done.stderr


from tests.test_slurm_cluster import cluster, slurm_mleng  # noqa: E402,F401  (the real SLURM fixtures)
