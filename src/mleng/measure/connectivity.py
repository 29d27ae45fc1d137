"""Every rank can talk: a verified all-reduce, a barrier that names absent ranks, an allocation test, pair bandwidth."""

from __future__ import annotations

import datetime
import re
import statistics
import time
from typing import Any

from mleng.errors import CheckFailed


def _dist():
    import torch.distributed as dist

    return dist


def _progress(job, step: str) -> None:
    """Leave a trail in the store, so rank 0 can say how far a rank got when a collective fails."""
    try:
        job.store.set(f"progress/{job.rank}", step)
    except Exception:
        pass


def where_ranks_are(job) -> str:
    """'rank 1 (vm) last reached: joined; ...' for the ranks that are not as far as rank 0."""
    mine = None
    trail = {}
    for rank in range(job.world_size):
        try:
            trail[rank] = job.store.get(f"progress/{rank}").decode() if job.store.check([f"progress/{rank}"]) \
                else "joined, nothing after"
        except Exception:
            trail[rank] = "unknown (store unreachable)"
        if rank == job.rank:
            mine = trail[rank]
    behind = [f"rank {r} ({job.ranks[r]['host']}) last reached: {step}"
              for r, step in trail.items() if step != mine]
    return "; ".join(behind)


def _wait(work, timeout_s: float) -> None:
    work.wait(timeout=datetime.timedelta(seconds=timeout_s))


def _fail(job, exc: BaseException, what: str) -> CheckFailed:
    from mleng.distributed.group import collective_error

    error = collective_error(exc, what, job.rank, job.timeout_s)
    if job.rank == 0:
        behind = where_ranks_are(job)
        if behind:
            error = CheckFailed(f"{error.message}; {behind}", hint=error.hint)
    return error


def verify_all_reduce(job) -> dict[str, Any]:
    """All-reduce of ones: every rank must see exactly the world size."""
    import torch

    _progress(job, "all_reduce")
    ones = torch.ones(1024, dtype=torch.float32, device=job.device)
    t0 = time.perf_counter()
    try:
        _wait(_dist().all_reduce(ones, async_op=True), job.timeout_s)
        if job.device.startswith("cuda"):
            torch.cuda.synchronize()
    except Exception as exc:
        raise _fail(job, exc, "all_reduce of ones") from None
    values = sorted(set(ones.cpu().tolist()))
    return {"all_reduce_ok": values == [float(job.world_size)], "all_reduce_values": values,
            "all_reduce_ms": (time.perf_counter() - t0) * 1e3}


def barrier(job) -> dict[str, Any]:
    """gloo's monitored_barrier names the ranks that do not arrive; on NCCL a device all-reduce with a wait timeout."""
    import torch

    _progress(job, "barrier")
    t0 = time.perf_counter()
    try:
        if job.backend == "gloo":
            _dist().monitored_barrier(timeout=datetime.timedelta(seconds=job.timeout_s), wait_all_ranks=True)
        else:
            flag = torch.ones(1, device=job.device)
            _wait(_dist().all_reduce(flag, async_op=True), job.timeout_s)
            torch.cuda.synchronize()
    except Exception as exc:
        raise _fail(job, exc, "barrier") from None
    return {"barrier_ms": (time.perf_counter() - t0) * 1e3}


def allocation(job, gib: float) -> dict[str, Any]:
    """Allocate and touch gib GiB on this rank's device: a GPU with too little free memory shows here."""
    import torch

    if gib <= 0:
        return {"alloc_gib": 0, "alloc_ok": None, "alloc_error": None}
    _progress(job, f"allocating {gib:g} GiB")
    t0 = time.perf_counter()
    try:
        block = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device=job.device)
        block.fill_(1)  # touch every page: an untouched allocation can succeed and fail later
        if job.device.startswith("cuda"):
            torch.cuda.synchronize()
        del block
        if job.device.startswith("cuda"):
            torch.cuda.empty_cache()
        return {"alloc_gib": gib, "alloc_ok": True, "alloc_error": None,
                "alloc_ms": (time.perf_counter() - t0) * 1e3}
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        from mleng.distributed.group import first_line

        text = re.sub(r"^(\[enforce fail at [^\]]*\]\s*)?(err == 0\.\s*)?", "", first_line(exc))
        return {"alloc_gib": gib, "alloc_ok": False, "alloc_error": text[:300]}


def pair_ranks(job, mode: str) -> list[int]:
    """Which ranks take part in --pairs: all of them, or the first rank of each host."""
    if mode == "nodes":
        first: dict[str, int] = {}
        for info in job.ranks:
            first.setdefault(info["host"], info["rank"])
        return sorted(first.values())
    return list(range(job.world_size))


def pair_bandwidth(job, members: list[int], size_bytes: int, iters: int, warmup: int) -> list[list[float | None]]:
    """GB/s of a one-way send for every ordered pair of members, one pair at a time; matrix[src][dst] by position.

    Each step lines every rank up with a tiny all-reduce, so only one pair moves data at a time;
    the time of a pair is the slower of its two ends.
    """
    import torch

    from mleng.measure.timing import Stopwatch

    dist = _dist()
    k = len(members)
    position = {rank: i for i, rank in enumerate(members)}
    count = max(1, size_bytes // 4)
    buf = torch.randn(count, dtype=torch.float32, device=job.device)
    times = torch.zeros(k * k, dtype=torch.float64, device=job.device)
    flag = torch.ones(1, device=job.device)
    timer = Stopwatch(job.device)
    _progress(job, "pairs")
    for src in members:
        for dst in members:
            if src == dst:
                continue
            try:
                _wait(dist.all_reduce(flag, async_op=True), job.timeout_s)
                if job.rank not in (src, dst):
                    continue
                peer = dst if job.rank == src else src
                for i in range(warmup + iters):
                    if i == warmup:
                        timer.sync()
                        timer.start()
                    if job.rank == src:
                        _wait(dist.isend(buf, peer), job.timeout_s)
                    else:
                        _wait(dist.irecv(buf, peer), job.timeout_s)
                times[position[src] * k + position[dst]] = timer.stop() / iters
            except Exception as exc:
                raise _fail(job, exc, f"send/recv between rank {src} and rank {dst}") from None
    try:
        _wait(dist.all_reduce(times, op=dist.ReduceOp.MAX, async_op=True), job.timeout_s)
    except Exception as exc:
        raise _fail(job, exc, "collecting the pair times") from None
    flat = times.cpu().tolist()
    matrix: list[list[float | None]] = []
    for i in range(k):
        matrix.append([None if i == j or flat[i * k + j] <= 0 else count * 4 / flat[i * k + j] / 1e9
                       for j in range(k)])
    return matrix


def flag_outliers(matrix: list[list[float | None]], ratio: float) -> tuple[float | None, list[tuple[int, int]]]:
    """The median pair rate and the (src, dst) positions below ratio x median: the links to suspect."""
    values = [v for row in matrix for v in row if v is not None]
    if not values:
        return None, []
    median = statistics.median(values)
    slow = [(i, j) for i, row in enumerate(matrix) for j, v in enumerate(row)
            if v is not None and v < ratio * median]
    return median, slow


def suspects(slow: list[tuple[int, int]], members: list[int], hosts: list[str]) -> list[str]:
    """Ranks that appear in most slow pairs: one bad NIC or node drags every pair it is part of."""
    counts: dict[int, int] = {}
    for i, j in slow:
        counts[members[i]] = counts.get(members[i], 0) + 1
        counts[members[j]] = counts.get(members[j], 0) + 1
    if not counts:
        return []
    top = max(counts.values())
    return [f"rank {r} ({hosts[r]}) is in {c} of the {len(slow)} slow pairs"
            for r, c in sorted(counts.items()) if c == top and c > 1]


def _ranks_on(rows: list[dict]) -> str:
    hosts = sorted({r["host"] for r in rows})
    ranks = ", ".join(str(r["rank"]) for r in rows)
    return f"rank{'s' if len(rows) > 1 else ''} {ranks} ({', '.join(hosts)})"


def problems(rows: list[dict], pairs: dict | None, world_size: int) -> list[str]:
    """One line per kind of failure, naming every rank and host that had it."""
    found = []
    by_answer: dict[str, list[dict]] = {}
    by_alloc_error: dict[str, list[dict]] = {}
    for row in rows:
        if not row.get("all_reduce_ok"):
            by_answer.setdefault(str(row.get("all_reduce_values")), []).append(row)
        if row.get("alloc_ok") is False:
            by_alloc_error.setdefault(f"{row['alloc_gib']:g} GiB on {row['device']}: {row['alloc_error']}",
                                      []).append(row)
    for answer, bad in by_answer.items():
        found.append(f"{_ranks_on(bad)} answered {answer} for an all-reduce of ones, expected {float(world_size)}")
    for what, bad in by_alloc_error.items():
        found.append(f"{_ranks_on(bad)} could not allocate {what}")
    if pairs and pairs.get("slow"):
        shown = ", ".join(f"{a}->{b}" for a, b in pairs["slow"][:8])
        found.append(f"{len(pairs['slow'])} slow pair(s) below {pairs.get('ratio', 0.7):g} x the median "
                     f"{pairs['median_gbps']:.3g} GB/s: {shown}"
                     + (f" ({'; '.join(pairs['suspects'])})" if pairs["suspects"] else ""))
    return found


def complete_record(record, job, rows: list[dict], pairs: dict | None, outlier_ratio: float, status: str,
                    error: str | None) -> None:
    """Rank 0's record of `mleng check`: a row per rank, the pairs matrix, and the verdict with its problems."""
    if pairs is not None:
        pairs["ratio"] = outlier_ratio
    world = job.world_size if job else None
    found = problems(rows, pairs, world or 0) if status == "complete" else [error]
    record.rows = rows
    record.summary = {
        "value": len(rows) if status == "complete" else None, "unit": "ranks ok" if not found else "ranks",
        "theoretical": world, "ratio": None,
        "verdict": "ok" if status == "complete" and not found else "problem",
        "world_size": world, "hosts": job.hosts if job else [], "problems": found,
    }
    if pairs is not None:
        record.summary["pairs"] = pairs
    record.params["launch"] = job.launch.mode if job else None


def pairs_matrix(job, mode: str, size_bytes: int, iters: int, outlier_ratio: float) -> dict[str, Any]:
    """`--pairs ranks|nodes`: the send bandwidth between every pair, the slow pairs and the suspect hosts."""
    members = pair_ranks(job, mode)
    if len(members) < 2:
        what = "host" if mode == "nodes" else "rank"
        return {"mode": mode, "members": members, "size_bytes": size_bytes,
                "skipped": f"--pairs {mode} needs at least 2 {what}s; this job has 1"}
    matrix = pair_bandwidth(job, members, size_bytes, iters, warmup=3)
    median, slow = flag_outliers(matrix, outlier_ratio)
    hosts = [r["host"] for r in job.ranks]
    return {"mode": mode, "members": members, "size_bytes": size_bytes, "matrix_gbps": matrix,
            "median_gbps": median, "slow": [[members[i], members[j]] for i, j in slow],
            "suspects": suspects(slow, members, hosts)}
