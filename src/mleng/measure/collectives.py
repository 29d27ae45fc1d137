"""Collective bandwidth as nccl-tests measures it: one table entry per op, one shared timing and checking core."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

from mleng.errors import CheckFailed, UsageError
from mleng.measure.sizes import format_bytes, size_sweep  # noqa: F401 - size_sweep: comm's sizes, kept here too
from mleng.specs.formulas import busbw_factor  # nccl-tests' factors, kept with the other formulas


def dtype_name(text: str) -> str:
    from mleng.measure.dtypes import COLLECTIVE_DTYPES, canonical

    return canonical(text, COLLECTIVE_DTYPES)


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


# ---------------------------------------------------------------------------------------------
# --check input patterns: small integers, exact in every dtype of COLLECTIVE_DTYPES (bf16 holds integers up to 256
# exactly), so each expected result is known exactly without keeping copies of other ranks' data.
# Reductions use values in {-1, 0, 1}: any partial sum over up to 256 ranks stays exact in bf16.
# Data movement uses values in -120..120 that differ between ranks, so a chunk from the wrong rank shows.
# ---------------------------------------------------------------------------------------------

def reduce_pattern(rank: int, index):
    return ((index + 2 * rank) % 3) - 1


def move_pattern(rank: int, index):
    return ((index + 37 * rank) % 241) - 120


# ---------------------------------------------------------------------------------------------
# The op table
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Op:
    """One collective. `size` is the per-rank bytes of its larger buffer (nccl-tests' convention)."""

    name: str
    what: str
    min_ranks: int
    split: bool                              # count must divide by the world size (buffers are split n ways)
    buffers: Callable[..., tuple]            # (count, n, new) -> (input, output); new(numel) makes a tensor
    issue: Callable[..., list]               # (input, output, rank, n) -> works (async_op=True)
    fill: Callable[..., None]                # (input, output, rank, n, arange) puts the --check pattern in
    expected: Callable[..., Any]             # (count, n, rank, arange) -> expected output, or None: nothing to check

    def factor(self, n: int) -> float:
        return busbw_factor(self.name, n)


def _dist():
    import torch.distributed as dist

    return dist


def _sum_over_ranks(n: int, index) -> Any:
    total = reduce_pattern(0, index)
    for rank in range(1, n):
        total = total + reduce_pattern(rank, index)
    return total


def _concat_chunks(n: int, chunk: int, arange, pattern_of_source: Callable[[int, Any], Any]):
    import torch

    return torch.cat([pattern_of_source(j, arange(chunk)) for j in range(n)])


def _all_gather_issue(inp, out, rank, n):
    dist = _dist()
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return [gather(out, inp, async_op=True)]


def _reduce_scatter_issue(inp, out, rank, n):
    dist = _dist()
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return [scatter(out, inp, async_op=True)]


def _send_recv_issue(inp, out, rank, n):
    dist = _dist()
    ops = [dist.P2POp(dist.isend, inp, (rank + 1) % n), dist.P2POp(dist.irecv, out, (rank - 1) % n)]
    return dist.batch_isend_irecv(ops)


def _set(tensor, values) -> None:
    tensor.copy_(values.to(tensor.dtype))


OPS: dict[str, Op] = {op.name: op for op in [
    Op("all_reduce", "sum of every rank's buffer, on every rank", 1, False,
       buffers=lambda count, n, new: (lambda b: (b, b))(new(count)),
       issue=lambda inp, out, rank, n: [_dist().all_reduce(out, async_op=True)],
       fill=lambda inp, out, rank, n, arange: _set(out, reduce_pattern(rank, arange(out.numel()))),
       expected=lambda count, n, rank, arange: _sum_over_ranks(n, arange(count))),
    Op("all_gather", "every rank's chunk, concatenated, on every rank", 1, True,
       buffers=lambda count, n, new: (new(count // n), new(count)),
       issue=_all_gather_issue,
       fill=lambda inp, out, rank, n, arange: (_set(inp, move_pattern(rank, arange(inp.numel()))), out.fill_(-99)),
       expected=lambda count, n, rank, arange: _concat_chunks(n, count // n, arange, move_pattern)),
    Op("reduce_scatter", "the sum of every rank's buffer, each rank keeping its 1/n chunk", 1, True,
       buffers=lambda count, n, new: (new(count), new(count // n)),
       issue=_reduce_scatter_issue,
       fill=lambda inp, out, rank, n, arange: (_set(inp, reduce_pattern(rank, arange(inp.numel()))), out.fill_(-99)),
       expected=lambda count, n, rank, arange: _sum_over_ranks(n, arange(count // n) + rank * (count // n))),
    Op("all_to_all", "chunk j of rank i goes to rank j, as chunk i", 1, True,
       buffers=lambda count, n, new: (new(count), new(count)),
       issue=lambda inp, out, rank, n: [_dist().all_to_all_single(out, inp, async_op=True)],
       fill=lambda inp, out, rank, n, arange: (_set(inp, move_pattern(rank, arange(inp.numel()))), out.fill_(-99)),
       expected=lambda count, n, rank, arange: _concat_chunks(
           n, count // n, arange, lambda j, idx: move_pattern(j, idx + rank * (count // n)))),
    Op("broadcast", "rank 0's buffer, on every rank", 1, False,
       buffers=lambda count, n, new: (lambda b: (b, b))(new(count)),
       issue=lambda inp, out, rank, n: [_dist().broadcast(out, 0, async_op=True)],
       # non-root ranks start from their own pattern, so a broadcast that did nothing is caught
       fill=lambda inp, out, rank, n, arange: _set(out, move_pattern(rank, arange(out.numel()))),
       expected=lambda count, n, rank, arange: move_pattern(0, arange(count))),
    Op("reduce", "sum of every rank's buffer, on rank 0", 1, False,
       buffers=lambda count, n, new: (lambda b: (b, b))(new(count)),
       issue=lambda inp, out, rank, n: [_dist().reduce(out, 0, async_op=True)],
       fill=lambda inp, out, rank, n, arange: _set(out, reduce_pattern(rank, arange(out.numel()))),
       expected=lambda count, n, rank, arange: _sum_over_ranks(n, arange(count)) if rank == 0 else None),
    Op("send_recv", "each rank sends to rank+1 and receives from rank-1 at once (a ring of pairs)", 2, False,
       buffers=lambda count, n, new: (new(count), new(count)),
       issue=_send_recv_issue,
       fill=lambda inp, out, rank, n, arange: (_set(inp, move_pattern(rank, arange(inp.numel()))), out.fill_(-99)),
       expected=lambda count, n, rank, arange: move_pattern((rank - 1) % n, arange(count))),
]}


def op_names(text: list[str] | str) -> list[str]:
    """--op values (repeatable, comma-separated, or 'all') -> op names in table order."""
    items = [text] if isinstance(text, str) else list(text)
    names: list[str] = []
    for item in items:
        for name in item.split(","):
            name = name.strip().lower().replace("-", "_")
            if not name:
                continue
            if name == "all":
                names.extend(OPS)
                continue
            name = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
                    "alltoall": "all_to_all", "sendrecv": "send_recv", "p2p": "send_recv"}.get(name, name)
            if name not in OPS:
                raise UsageError(f"unknown op {name!r}", hint=f"use one or several of {', '.join(OPS)}, or all")
            names.append(name)
    return list(dict.fromkeys(names))


# ---------------------------------------------------------------------------------------------
# Timing core
# ---------------------------------------------------------------------------------------------

def time_stats(samples_s: list[float]) -> dict[str, float]:
    """A row's time fields, from the one stats type of mleng.measure.timing."""
    from mleng.measure.timing import TimingStats

    s = TimingStats.from_samples(samples_s)
    return {"time_us": s.median_s * 1e6, "time_min_us": s.min_s * 1e6, "time_max_us": s.max_s * 1e6,
            "time_p99_us": s.p99_s * 1e6, "time_cv": s.cv}


@dataclasses.dataclass
class Settings:
    ops: list[str]
    sizes: list[int]
    dtype: str = "float32"
    iters: int = 20
    warmup: int = 5
    repeats: int = 5
    blocking: bool = False
    check: bool = False
    cuda_graph: bool = True
    seed: int = 1234


def timing_note(settings: Settings, uses_graph: bool) -> str:
    if settings.blocking:
        return (f"blocking: each of {settings.iters} iterations timed alone (synchronized after each op); "
                f"stats over the {settings.iters} per-iteration times, each the slowest rank's")
    how = "replayed from a CUDA graph" if uses_graph else "issued back to back"
    return (f"non-blocking: {settings.iters} iterations {how}, one synchronization at the end; the loop runs "
            f"{settings.repeats} times and the stats are over the {settings.repeats} loop averages, "
            f"each the slowest rank's")


def _run_once(op: Op, inp, out, rank: int, n: int) -> None:
    for work in op.issue(inp, out, rank, n):
        if work is not None:
            work.wait()


def _line_up(job, device: str) -> None:
    """All ranks start a timed loop together; a tiny all_reduce also works where barrier() would warn."""
    import torch

    flag = torch.ones(1, device=device)
    _dist().all_reduce(flag)
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _capture_graph(op: Op, inp, out, rank: int, n: int, iters: int):
    """A CUDA graph of `iters` back-to-back ops, or (None, reason) where capture is not possible."""
    import torch

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _run_once(op, inp, out, rank, n)  # NCCL needs one op outside capture on this stream
        torch.cuda.current_stream().wait_stream(side)
        import warnings

        graph = torch.cuda.CUDAGraph()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.cuda.graph(graph):
                for _ in range(iters):
                    _run_once(op, inp, out, rank, n)
        torch.cuda.synchronize()
        if any("graph is empty" in str(w.message).lower() for w in caught):
            return graph, EMPTY_GRAPH  # nothing was captured: replaying it times nothing
        return graph, None
    except Exception as exc:  # older NCCL, unsupported op: fall back to eager, and say so
        torch.cuda.synchronize()
        return None, str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def measure_size(job, op: Op, size_bytes: int, settings: Settings) -> dict[str, Any] | None:
    """One row: the op at one size, timed on every rank, the slowest rank's time kept, optionally checked."""
    import torch

    n, rank, device = job.world_size, job.rank, job.device
    dtype = torch_dtype(settings.dtype)
    elem = torch.tensor([], dtype=dtype).element_size()
    count = size_bytes // elem
    if op.split:
        count -= count % n
    if count < (n if op.split else 1):
        return None  # too small to split n ways: nccl-tests skips it too

    generator = torch.Generator(device=device).manual_seed(settings.seed + 7919 * rank)

    def new(numel: int):
        if dtype.is_floating_point:
            return torch.randn(numel, dtype=dtype, device=device, generator=generator)
        return torch.randint(-100, 100, (numel,), dtype=dtype, device=device, generator=generator)

    inp, out = op.buffers(count, n, new)
    from mleng.measure.timing import Stopwatch

    timer = Stopwatch(device)
    for _ in range(settings.warmup):
        _run_once(op, inp, out, rank, n)
    timer.sync()

    graph, graph_note = None, None
    if device.startswith("cuda") and settings.cuda_graph and not settings.blocking:
        graph, graph_note = _capture_graph(op, inp, out, rank, n, settings.iters)
    local: list[float] = []
    if settings.blocking:
        _line_up(job, device)
        for _ in range(settings.iters):
            timer.start()
            _run_once(op, inp, out, rank, n)
            local.append(timer.stop())
    else:
        for _ in range(settings.repeats):
            _line_up(job, device)
            timer.start()
            if graph is not None:
                graph.replay()
            else:
                for _ in range(settings.iters):
                    _run_once(op, inp, out, rank, n)
            local.append(timer.stop() / settings.iters)

    # A collective takes as long as its slowest rank: keep the per-sample maximum over ranks.
    samples = torch.tensor(local, dtype=torch.float64, device=device)
    _dist().all_reduce(samples, op=_dist().ReduceOp.MAX)
    samples_s = samples.cpu().tolist()

    stats = time_stats(samples_s)
    seconds = stats["time_us"] / 1e6
    algbw = count * elem / seconds / 1e9 if seconds > 0 else 0.0
    row: dict[str, Any] = {
        "op": op.name, "size_bytes": count * elem, "count": count, "dtype": settings.dtype,
        **stats, "algbw_gbps": algbw, "busbw_gbps": algbw * op.factor(n),
        "samples": len(samples_s), "iters": settings.iters,
    }
    if n == 1 and inp is out:
        # One rank, one buffer: the op leaves it as it is, so NCCL enqueues no kernel (and gloo copies
        # nothing). Its time is call overhead at any size and in every timing mode (graph, eager, blocking).
        row["one_rank_in_place"] = True
    if graph is not None and graph_note == EMPTY_GRAPH:
        row["timing"] = "cuda_graph"
        row["graph_empty"] = True
    elif graph is not None:
        row["timing"] = "cuda_graph"
    elif graph_note:
        row["timing"] = f"eager (CUDA graph capture failed: {graph_note})"
    del graph
    if settings.check:
        row["wrong"] = check_op(op, inp, out, count, n, rank, device)
    return row


def check_op(op: Op, inp, out, count: int, n: int, rank: int, device: str) -> int:
    """Run the op once on the known pattern; the number of wrong elements summed over ranks."""
    import torch

    def arange(k: int):
        return torch.arange(k, device=device, dtype=torch.int64)

    op.fill(inp, out, rank, n, arange)
    _run_once(op, inp, out, rank, n)
    expected = op.expected(count, n, rank, arange)
    wrong = torch.zeros(1, dtype=torch.int64, device=device)
    if expected is not None:
        wrong += (out != expected.to(out.dtype)).sum()
    _dist().all_reduce(wrong)
    return int(wrong.item())


EMPTY_GRAPH = "empty"
# A measured rate above this multiple of the link's spec is not a fast link: it is a timing that
# measured nothing (an empty graph, an op that did not run). busbw is at most the link's
# unidirectional rate; 2x leaves room for a spec quoted per direction where both were used.
PHYSICS_MARGIN = 2.0


def fastest_link_gbps() -> float:
    """The fastest per-GPU rate any link or accelerator in the specs allows: the ceiling without a reference."""
    from mleng.specs.catalog import load_accelerators, load_links

    rates = [a.intra_node_gbps or 0 for a in load_accelerators().values()]
    rates += [max(link.unidirectional_gbps or 0, link.node_gbps or 0) for link in load_links().values()]
    return max(rates) or 1800.0


def physics_problem(row: dict, reference_gbps: float | None, ceiling_gbps: float | None = None) -> str | None:
    """Why a row's rate cannot be real, or None. An in-place op at one rank and an empty captured CUDA graph
    timed nothing; a busbw above PHYSICS_MARGIN x the link (or, with no reference, x the fastest link in
    the specs) is not a link."""
    if row.get("one_rank_in_place"):
        # Checked first and at any rate: a no-op timed at 1 MiB looks like a plausible 100-200 GB/s.
        return (f"one rank: an in-place {row.get('op', 'op')} moves no data, so any rate for it is impossible "
                "(its time is call overhead)")
    if row.get("graph_empty"):
        return "the captured CUDA graph is empty: nothing ran, so the time measures nothing"
    busbw = row.get("busbw_gbps")
    if not isinstance(busbw, (int, float)):
        return None
    if reference_gbps and busbw > PHYSICS_MARGIN * reference_gbps:
        return (f"busbw {busbw:.4g} GB/s is more than {PHYSICS_MARGIN:g}x the link's {reference_gbps:g} GB/s: "
                "physically impossible, so the timing is wrong")
    if ceiling_gbps and busbw > PHYSICS_MARGIN * ceiling_gbps:
        return (f"busbw {busbw:.4g} GB/s is more than {PHYSICS_MARGIN:g}x the fastest link in the specs "
                f"({ceiling_gbps:g} GB/s): physically impossible, so the timing is wrong")
    return None


def reject_impossible(rows: list[dict], reference_gbps: float | None, ceiling_gbps: float | None = None) -> list[dict]:
    """Turn each impossible row into an error row: its rates move to rejected_* fields, never a number."""
    rejected = []
    for row in rows:
        if row.get("error"):
            continue
        problem = physics_problem(row, reference_gbps, ceiling_gbps)
        if problem:
            row["error"] = problem
            for field in ("busbw_gbps", "algbw_gbps"):
                if field in row:
                    row[f"rejected_{field}"] = row.pop(field)
            rejected.append(row)
    return rejected


def sweep(job, settings: Settings) -> Iterator[dict]:
    """Rows for every op and size, in order; a failing collective becomes a CheckFailed naming op and size."""
    from mleng.distributed.group import collective_error

    for name in settings.ops:
        op = OPS[name]
        if job.world_size < op.min_ranks:
            raise UsageError(f"{name} needs at least {op.min_ranks} ranks; this job has {job.world_size}",
                             hint="start more ranks (--nproc 2) or leave send_recv out")
        for size in settings.sizes:
            try:
                row = measure_size(job, op, size, settings)
            except (UsageError, CheckFailed, KeyboardInterrupt):
                raise
            except Exception as exc:
                raise collective_error(exc, f"{name} at {format_bytes(size)}", job.rank, job.timeout_s) from None
            if row is not None:
                yield row


# ---------------------------------------------------------------------------------------------
# Reference rates
# ---------------------------------------------------------------------------------------------

def reference_rate(backend: str, ranks: list[dict], machine: dict | None = None,
                   given_gbps: float | None = None) -> tuple[float | None, str]:
    """The link rate the peak busbw is compared with (GB/s, unidirectional per GPU) and where it came from."""
    if given_gbps:
        return float(given_gbps), "given with --reference-gbps"
    hosts = {r.get("host") for r in ranks}
    if len(ranks) <= 1:
        return None, "one rank: nothing crosses a link, so there is no reference rate"
    if backend != "nccl":
        where = "loopback" if len(hosts) <= 1 else "TCP between hosts"
        return None, f"no reference rate for {backend} over {where}"
    if len(hosts) <= 1:
        name = next((r.get("gpu_name") for r in ranks if r.get("gpu_name")), None)
        if not name:
            return None, "the GPU model was not detected, so there is no NVLink rate to compare with"
        from mleng.specs import find_accelerator

        acc, why_not = find_accelerator(name)
        if acc is None:
            return None, why_not
        gbps = getattr(acc, "intra_node_gbps", None)
        if not gbps:
            return None, f"the spec entry for {acc.name} has no intra-node link rate"
        link = getattr(acc, "intra_node_link", None) or "intra-node link"
        return float(gbps), f"{acc.name} {link}: {gbps:g} GB/s per GPU, unidirectional (mleng specs)"
    # Across nodes the slowest hop is the NIC share of each GPU: active port rates of this node
    # (rank 0's fingerprint), Gb/s -> GB/s, divided by the ranks on the node.
    ports = []
    for dev in ((machine or {}).get("infiniband") or {}).get("devices", []) or []:
        for port in dev.get("ports", []) or []:
            if port.get("state") == "ACTIVE" and port.get("rate_gbps"):
                ports.append(float(port["rate_gbps"]))
    if not ports:
        return None, ("no active InfiniBand/RoCE port found on rank 0's node, so the NIC rate per GPU is "
                      "unknown; give --reference-gbps")
    per_node = sum(1 for r in ranks if r.get("host") == ranks[0].get("host")) or 1
    gbps = sum(ports) / 8 / per_node
    return gbps, (f"{len(ports)} active NIC port(s), {sum(ports):g} Gb/s in all on {ranks[0].get('host')}, "
                  f"shared by {per_node} rank(s): {gbps:g} GB/s per GPU")


def complete_record(record, rows: list[dict], ranks: list[dict], settings: Settings,
                    given_gbps: float | None = None, min_busbw: float | None = None) -> None:
    """Rank 0's record of a sweep (`mleng comm`): the rows, checked against physics, and the headline against
    the reference rate (from the specs, rank 0's NICs, or --reference-gbps)."""
    record.machine["ranks"] = ranks
    record.rows = rows
    reference, note = reference_rate(record.params["backend"], ranks, record.machine, given_gbps)
    reject_impossible(rows, reference, fastest_link_gbps())
    record.summary = summarize(rows, reference, note, min_busbw)
    record.summary["timing"] = timing_note(settings, any(r.get("timing") == "cuda_graph" for r in rows))


def summarize(rows: list[dict], reference_gbps: float | None, reference_note: str,
              min_busbw: float | None = None) -> dict[str, Any]:
    """Headline: the peak busbw (per op and overall) and its share of the reference rate."""
    per_op: dict[str, dict] = {}
    for row in rows:
        if row.get("error") or "busbw_gbps" not in row:
            continue  # an impossible row is an error, never a peak
        best = per_op.get(row["op"])
        if best is None or row["busbw_gbps"] > best["peak_busbw_gbps"]:
            per_op[row["op"]] = {"peak_busbw_gbps": row["busbw_gbps"], "at_size_bytes": row["size_bytes"],
                                 "ratio": (row["busbw_gbps"] / reference_gbps) if reference_gbps else None}
    wrong = sum(int(r.get("wrong") or 0) for r in rows)
    summary: dict[str, Any] = {"value": None, "unit": "GB/s", "theoretical": reference_gbps, "ratio": None,
                               "metric": "peak busbw", "theoretical_source": reference_note, "ops": per_op}
    if per_op:
        op, best = max(per_op.items(), key=lambda kv: kv[1]["peak_busbw_gbps"])
        summary.update(value=best["peak_busbw_gbps"], op=op, at_size_bytes=best["at_size_bytes"],
                       ratio=best["ratio"])
    summary["verdict"] = "inconclusive" if reference_gbps is None else "measured"
    if any("wrong" in r for r in rows):
        summary["wrong"] = wrong
    errors = [f"{r['op']} at {format_bytes(r['size_bytes'])}: {r['error']}" for r in rows if r.get("error")]
    if errors:
        summary["row_errors"] = errors
    if min_busbw is not None:
        below = sorted(op for op, best in per_op.items() if best["peak_busbw_gbps"] < min_busbw)
        summary["min_busbw_gbps"] = min_busbw
        summary["below_min_busbw"] = below
    return summary
