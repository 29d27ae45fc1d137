"""One rank: an in-place collective (all_reduce, broadcast, reduce) moves nothing, so its row is an error, never a rate.

The CPU (gloo) half of what tests/gpu/test_gpu_comm.py checks with NCCL and CUDA graphs on a GPU.
"""

import json

from mleng.measure import collectives


def test_in_place_row_at_one_rank_is_rejected_even_below_every_ceiling():
    row = {"op": "broadcast", "size_bytes": 2**20, "busbw_gbps": 150.0, "algbw_gbps": 150.0,
           "one_rank_in_place": True}
    problem = collectives.physics_problem(row, None, 1800.0)
    assert problem and "one rank" in problem and "no data" in problem and "impossible" in problem
    assert collectives.physics_problem({**row, "one_rank_in_place": False}, None, 1800.0) is None


def test_one_rank_small_blocking_broadcast_is_an_error_row_with_a_one_rank_hint(run_mleng):
    result = run_mleng("comm", "--nproc", "1", "--backend", "gloo", "--op", "broadcast,all_gather", "-b", "1M",
                       "-e", "1M", "--blocking", "--iters", "3", "--warmup", "1", "--json")
    assert result.returncode == 1, result.stderr
    assert "one rank crosses no link" in result.stderr
    record = json.loads(result.stdout)
    broadcast, all_gather = record["rows"]
    assert broadcast["one_rank_in_place"] and "busbw_gbps" not in broadcast and "one rank" in broadcast["error"]
    # all_gather at one rank copies its input into a separate output: a real, local copy, and busbw 0.
    assert "error" not in all_gather and all_gather["busbw_gbps"] == 0.0 and all_gather["algbw_gbps"] > 0
    assert record["summary"]["verdict"] == "inconclusive"
