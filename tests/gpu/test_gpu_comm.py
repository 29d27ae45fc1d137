"""Collectives on one GPU with NCCL: CUDA-graph capture, and `mleng comm` printing no rate one rank cannot have.

One rank crosses no link. What it can honestly time is a local copy (all_gather, reduce_scatter and
all_to_all copy their input into a separate output); an in-place op (all_reduce, broadcast, reduce)
moves nothing, and NCCL enqueues nothing for it, so a CUDA graph of it is empty.
"""

import json
import types

import pytest

pytestmark = pytest.mark.gpu

IN_PLACE = ("all_reduce", "broadcast", "reduce")
COPIES = ("all_gather", "reduce_scatter", "all_to_all")


@pytest.fixture
def one_rank_nccl(torch_cuda, device):
    import torch.distributed as dist

    if not dist.is_nccl_available():
        pytest.skip("this torch build has no NCCL")
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    try:
        yield types.SimpleNamespace(world_size=1, rank=0, device="cuda:0", timeout_s=60.0)
    finally:
        dist.destroy_process_group()


def _hbm_gbps(torch):
    from mleng.measure.membw import hbm_theoretical_gbps

    return hbm_theoretical_gbps(torch.cuda.get_device_name(0))[0]


def test_graph_capture_of_a_copying_collective_replays_real_work(torch_cuda, one_rank_nccl):
    from mleng.measure import collectives

    torch = torch_cuda
    op = collectives.OPS["all_gather"]
    inp = torch.randn(2**20, device="cuda:0")
    out = torch.full((2**20,), float("nan"), device="cuda:0")
    graph, note = collectives._capture_graph(op, inp, out, 0, 1, iters=4)
    assert graph is not None and note is None, note
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, inp), "replaying the captured all_gather did not copy the input"


def test_graph_capture_of_an_in_place_op_at_one_rank_is_found_empty(torch_cuda, one_rank_nccl):
    from mleng.measure import collectives

    torch = torch_cuda
    buffer = torch.randn(2**20, device="cuda:0")
    graph, note = collectives._capture_graph(collectives.OPS["all_reduce"], buffer, buffer, 0, 1, iters=4)
    assert note == collectives.EMPTY_GRAPH, f"expected an empty graph, got {note!r}"


@pytest.mark.parametrize("cuda_graph,blocking", [(True, False), (False, False), (False, True)],
                         ids=["graph", "eager", "blocking"])
def test_one_rank_rows_are_error_rows_or_bounded_by_device_memory(torch_cuda, one_rank_nccl, cuda_graph, blocking):
    from mleng.measure import collectives

    torch = torch_cuda
    settings = collectives.Settings(ops=list(IN_PLACE + COPIES), sizes=[2**20, 64 * 2**20], iters=5, warmup=2,
                                    repeats=3, cuda_graph=cuda_graph, blocking=blocking, check=True)
    rows = list(collectives.sweep(one_rank_nccl, settings))
    assert len(rows) == len(settings.ops) * len(settings.sizes)
    collectives.reject_impossible(rows, None, collectives.fastest_link_gbps())
    hbm = _hbm_gbps(torch)
    for row in rows:
        what = f"{row['op']} at {row['size_bytes']} B ({'graph' if cuda_graph else 'blocking' if blocking else 'eager'})"
        assert row["wrong"] == 0, what
        if row["op"] in IN_PLACE:
            assert row.get("error") and "busbw_gbps" not in row and "algbw_gbps" not in row, what
        else:
            assert "error" not in row, f"{what}: {row.get('error')}"
            assert row["busbw_gbps"] == 0.0, what  # factor (n-1)/n is 0 at one rank
            assert 0 < row["algbw_gbps"], what
            if hbm:  # a local copy reads and writes every byte (algbw counts them once); twice that allows for L2
                assert row["algbw_gbps"] < hbm, f"{what}: algbw {row['algbw_gbps']:.0f} GB/s"
            if cuda_graph and not blocking:
                assert row["timing"] == "cuda_graph", what
    summary = collectives.summarize(rows, None, "one rank")
    assert summary["verdict"] == "inconclusive" and summary["value"] == 0.0
    assert len(summary["row_errors"]) == len(IN_PLACE) * len(settings.sizes)


def _check_rows(record, torch):
    hbm = _hbm_gbps(torch)
    ceiling = 2 * 1800.0
    for row in record["rows"]:
        if row.get("error"):
            assert "busbw_gbps" not in row and "algbw_gbps" not in row
            continue
        assert row["busbw_gbps"] == 0.0  # nothing crosses a link at one rank
        assert 0 < row["algbw_gbps"] < (hbm or ceiling)


def test_comm_cli_default_on_one_gpu_prints_an_error_row_not_a_rate(run_mleng, torch_cuda):
    result = run_mleng("comm", "--nproc", "1", "-b", "1M", "-e", "16M", "-f", "4", "--json", timeout=180)
    record = json.loads(result.stdout)
    assert record["params"]["world_size"] == 1 and record["params"]["backend"] == "nccl"
    rows = record["rows"]
    assert [r["op"] for r in rows] == ["all_reduce"] * 3
    assert all(r.get("error") and "busbw_gbps" not in r and "algbw_gbps" not in r for r in rows), rows
    assert result.returncode == 1 and "one rank crosses no link" in result.stderr, result.stderr
    s = record["summary"]
    assert s["value"] is None and s["verdict"] == "inconclusive" and "one rank" in s["theoretical_source"]
    assert record["machine"]["ranks"][0]["gpu_uuid"].startswith("GPU-")


def test_comm_cli_human_output_on_one_gpu_shows_no_impossible_number(run_mleng, torch_cuda):
    result = run_mleng("comm", "--nproc", "1", "--op", "all", "-b", "1M", "-e", "64M", "-f", "8",
                       "--no-cuda-graph", "--check", timeout=180)
    assert result.returncode == 1, result.stdout + result.stderr
    hbm = _hbm_gbps(torch_cuda) or 3600.0
    numbers = []
    for line in result.stdout.splitlines():
        cells = line.split()
        if cells and cells[0].isdigit() and "ERROR:" not in line:
            numbers.append((float(cells[4]), float(cells[5])))  # algbw_gbps, busbw_gbps columns
    assert numbers, result.stdout
    assert all(busbw == 0.0 and 0 < algbw < hbm for algbw, busbw in numbers), result.stdout
    assert result.stdout.count("ERROR: one rank") == 3 * 3  # all_reduce, broadcast, reduce at 1M, 8M, 64M


def test_comm_cli_copying_ops_on_one_gpu_are_bounded(run_mleng, torch_cuda):
    result = run_mleng("comm", "--nproc", "1", "--op", "all_gather,reduce_scatter,all_to_all", "-b", "1M",
                       "-e", "64M", "-f", "8", "--check", "--json", timeout=180)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert len(record["rows"]) == 3 * 3 and record["summary"]["wrong"] == 0
    assert all(r["timing"] == "cuda_graph" for r in record["rows"])
    _check_rows(record, torch_cuda)
    assert record["summary"]["value"] == 0.0 and record["summary"]["verdict"] == "inconclusive"
