"""The measuring checks of mleng.preflight(), on every rank: the fixed matmul workload that names stragglers,
the all-reduce bus bandwidth probe (the job, and node with node), the NVML sample judged by the doctor's checks."""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from mleng.preflight.session import SLOT_ELEMENTS, _Session, _sync, _wait


PROBE_BYTES_GPU = 256 * 2**20

PROBE_BYTES_CPU = 16 * 2**20

def _compute_probe(session: _Session, budget_end: float, gpu_sample: dict) -> dict[str, Any]:
    """The same fixed matmul on every rank, timed: the best of a few short rounds (capability, not luck of
    the moment), so a rank that is slow throughout (a throttled GPU, a contended core) stands out."""
    import torch

    cuda = session.device.startswith("cuda")
    threads = torch.get_num_threads()
    if not cuda:
        # CPU ranks of one host share its cores: one thread each compares ranks, not thread-pool contention
        torch.set_num_threads(1)
    try:
        return _timed_matmuls(session, budget_end, gpu_sample, cuda)
    finally:
        torch.set_num_threads(threads)

def _timed_matmuls(session: _Session, budget_end: float, gpu_sample: dict, cuda: bool) -> dict[str, Any]:
    import torch

    dim, dtype = (4096, torch.bfloat16) if cuda else (256, torch.float32)
    generator = torch.Generator(device=session.device).manual_seed(1234 + session.rank)
    a = torch.randn(dim, dim, dtype=dtype, device=session.device, generator=generator)
    b = torch.randn(dim, dim, dtype=dtype, device=session.device, generator=generator)
    flops = 2 * dim ** 3
    share = max(0.2, min(1.0, (budget_end - time.monotonic()) * 0.1))
    rounds = 10
    # size a round from a batch long enough to time (a single small call is all noise): share/rounds each
    torch.mm(a, b)
    _sync(session.device)
    batch = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(batch):
            torch.mm(a, b)
        _sync(session.device)
        took = time.perf_counter() - t0
        if took >= 0.02 or batch >= 4096:
            break
        batch *= 4
    one = max(took / batch, 1e-7)
    per_round = max(1, min(100_000, int(share / rounds / one)))
    times = []
    for index in range(rounds):
        t0 = time.perf_counter()
        for _ in range(per_round):
            torch.mm(a, b)
        if cuda and index == rounds - 1:
            gpu_sample.update(_nvml_sample(session))  # read while the GPU is busy: clocks under load
        _sync(session.device)
        times.append((time.perf_counter() - t0) / per_round)
    best = min(times)
    del a, b
    return {"tflops": flops / best / 1e12, "tflops_median": flops / statistics.median(times) / 1e12,
            "shape": f"{dim}x{dim}x{dim}", "dtype": str(dtype).replace("torch.", ""), "calls": rounds * per_round,
            "device": "cuda" if cuda else "cpu", "host_cpus": os.cpu_count()}

def _busbw_probe(session: _Session, probe_bytes: int | None, budget_end: float, group=None,
                 members: int | None = None) -> dict[str, Any]:
    """All-reduce of probe_bytes: bus bandwidth from the slowest rank's time (nccl-tests' 2(n-1)/n), and one
    run on a known integer pattern checked on every rank."""
    import torch
    import torch.distributed as dist

    n = members or session.world_size
    cuda = session.device.startswith("cuda")
    size = probe_bytes or (PROBE_BYTES_GPU if cuda else PROBE_BYTES_CPU)
    count = max(size // 4, SLOT_ELEMENTS)
    generator = torch.Generator(device=session.device).manual_seed(4321 + session.rank)
    buf = torch.randn(count, dtype=torch.float32, device=session.device, generator=generator)
    flag = torch.ones(1, device=session.device)
    timeout = session.timeout

    def all_reduce(t, **kw):
        _wait(dist.all_reduce(t, group=group, async_op=True, **kw), timeout)

    all_reduce(buf)  # warm-up: connections and (NCCL) the communicator
    _sync(session.device)
    t0 = time.perf_counter()
    all_reduce(buf)
    _sync(session.device)
    one = max(time.perf_counter() - t0, 1e-6)
    # the same count on every rank (a collective): from rank 0's estimate, broadcast
    left = max(budget_end - time.monotonic(), 0.5)
    plan = torch.tensor([float(max(1, min(20, int(min(left * 0.15, 1.0) / 5 / one))))], device=session.device)
    _wait(dist.broadcast(plan, src=_first(group), group=group, async_op=True), timeout)
    iters, repeats = int(plan.item()), 5
    samples = []
    for _ in range(repeats):
        all_reduce(flag)  # line up
        _sync(session.device)
        t0 = time.perf_counter()
        works = [dist.all_reduce(buf, group=group, async_op=True) for _ in range(iters)]
        for work in works:
            _wait(work, timeout)
        _sync(session.device)
        samples.append((time.perf_counter() - t0) / iters)
    slowest = torch.tensor(samples, dtype=torch.float64, device=session.device)
    all_reduce(slowest, op=dist.ReduceOp.MAX)
    seconds = statistics.median(slowest.cpu().tolist())
    # correctness at this size: rank r sends (r+1) * (i % 251 + 1); every element's sum is known
    pattern = torch.arange(count, dtype=torch.int64, device=session.device) % 251 + 1
    rank_in_group = dist.get_rank(group) if group is not None else session.rank
    check = (pattern * (rank_in_group + 1)).to(torch.int32)
    all_reduce(check)
    _sync(session.device)
    wrong = int((check.to(torch.int64) != pattern * (n * (n + 1) // 2)).sum().item())
    algbw = count * 4 / seconds / 1e9
    del buf, check, pattern
    return {"size_bytes": count * 4, "time_us": seconds * 1e6, "algbw_gbps": algbw,
            "busbw_gbps": algbw * 2 * (n - 1) / n, "iters": iters, "repeats": repeats, "wrong": wrong,
            "ranks": n}

def _first(group) -> int:
    if group is None:
        return 0
    import torch.distributed as dist

    return dist.get_global_rank(group, 0)

def _per_node(hosts: list[str]) -> bool:
    """A per-node probe says something when there are several nodes, each with several ranks."""
    counts: dict[str, int] = {}
    for host in hosts:
        counts[host] = counts.get(host, 0) + 1
    return len(counts) > 1 and min(counts.values()) > 1

def _node_probe(session: _Session, hosts: list[str], probe_bytes: int | None, budget_end: float) -> dict[str, Any]:
    """Every node's ranks all-reduce among themselves at once: each node's own bus bandwidth, to compare."""
    order = list(dict.fromkeys(hosts))
    members = [[r for r, h in enumerate(hosts) if h == host] for host in order]
    groups = session.new_subgroups(members)
    mine = order.index(hosts[session.rank])
    row = _busbw_probe(session, probe_bytes, budget_end, group=groups[mine], members=len(members[mine]))
    row["host"] = order[mine]
    return row

def _nvml_sample(session: _Session) -> dict[str, Any]:
    """This rank's GPU as NVML sees it now: the fingerprint's device entry (clocks, ECC, NUMA, throttling)."""
    info = session.ranks[session.rank] if session.ranks else {}
    try:
        import pynvml

        from mleng.machine.nvml import device_from_raw, read_device_raw
    except ImportError as exc:
        return {"reason": f"nvidia-ml-py is not installed ({exc})"}
    from mleng.machine.nvml import nvml

    if nvml()[0] is None:
        return {"reason": f"NVML did not start: {nvml()[1]}"}
    try:
        index = None
        uuid = info.get("gpu_uuid")
        if uuid:
            try:
                index = pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(uuid))
            except Exception:  # noqa: BLE001
                index = None
        if index is None:
            return {"reason": f"this rank's GPU ({uuid or 'UUID unknown'}) was not found through NVML"}
        return {"device": device_from_raw(read_device_raw(pynvml, index))}
    except Exception as exc:  # noqa: BLE001
        return {"reason": f"NVML could not read this rank's GPU: {exc}"}

def _gpu_findings(session: _Session, sample: dict) -> list:
    """The doctor's clock, ECC and NUMA-binding checks on this rank's GPU alone."""
    from mleng.doctor.checks import check_clocks, check_ecc, check_numa_affinity
    from mleng.doctor.findings import inconclusive
    from mleng.machine import redact, system

    subject = f"rank {session.rank}"
    if not session.device.startswith("cuda"):
        return [inconclusive("gpu", f"rank {session.rank} runs on the CPU ({'no GPU visible' if session.device == 'cpu' else session.device}): "
                             "GPU clocks, ECC and NUMA binding not checked", subject=subject)]
    device = sample.get("device")
    if device is None:
        return [inconclusive("gpu", f"rank {session.rank}: {sample.get('reason', 'the GPU could not be read')}",
                             subject=subject)]
    env = redact.captured_env()
    env["LOCAL_RANK"] = str(device.get("index"))  # the NUMA check looks at this rank's GPU only
    fp = {"gpus": {"available": True, "count": 1, "devices": [device]}, "process": system.process_info(),
          "cpu": system.cpu_info(), "env": env}
    load = {device.get("index"): {"sm_clock_mhz_mean": device.get("sm_clock_mhz"),
                                  "sm_clock_max_mhz": device.get("sm_clock_max_mhz"),
                                  "throttle_reasons": device.get("throttle_reasons")}}
    findings = check_clocks(fp, load) + check_ecc(fp) + check_numa_affinity(fp)
    for f in findings:
        f.subject = f"rank {session.rank} {f.subject or ''}".strip()
        f.gpu_uuid = f.gpu_uuid or device.get("uuid")
    return findings
