"""Where a training step's time goes, from a torch.profiler window of a few steps.

On a GPU: every instant of the window is given to one thing, so the shares add up to 100 %: a GEMM kernel,
else an attention kernel, else another (elementwise, reduction, optimizer, copy) kernel, else a communication
kernel with no compute beside it (communication not overlapped), else nothing on the GPU (idle: the host
launching, waiting for data, synchronizing). Communication in total (overlapped or not) is given beside.
On a CPU: the same categories from each op's self time on the thread that runs the step; "idle" is the time
in no torch op there (Python and framework overhead).
"""

from __future__ import annotations

import re
from typing import Any, Iterable

CATEGORIES = ("gemm", "attention", "elementwise_other", "communication_exposed", "idle")
MEANING = {
    "cuda": {"idle": "no kernel running: launch gaps, data wait, host synchronisation"},
    "cpu": {"idle": "in no torch op on the step's thread: Python and framework overhead"},
}
STEP_MARK = "mleng.step"
DATA_MARK = "mleng.data"

_COMM = re.compile(r"nccl|rccl|c10d|gloo|record_param_comms|all_?reduce|all_?gather|reduce_?scatter", re.I)
_ATTENTION = re.compile(r"flash|fmha|attention|attn|sdpa|_efficient_attention|cudnn_?sdpa", re.I)
_GEMM = re.compile(r"gemm|gemv|cutlass|cublas|xmma|nvjet|matmul|splitk|triton_tem|wgmma|hgmma|"
                   r"^aten::(mm|addmm|bmm|baddbmm|addbmm|matmul|linear|_scaled_mm)$|sm\d+_.*(gemm|mma)", re.I)

# Priority when kernels of several kinds run at once (different streams): compute first, then communication.
_PRIORITY = {"gemm": 0, "attention": 1, "elementwise_other": 2, "communication": 3}


def classify(name: str) -> str:
    """gemm, attention, communication or elementwise_other for a kernel or an op name."""
    if _COMM.search(name):
        return "communication"
    if _ATTENTION.search(name):
        return "attention"
    if _GEMM.search(name):
        return "gemm"
    return "elementwise_other"


def attribute(intervals: Iterable[tuple[float, float, str]], start: float, end: float) -> dict[str, float]:
    """Each instant of [start, end] to the highest-priority category running then; the rest is idle.
    Intervals are (start, end, category) in one clock; the result is in that clock's unit."""
    events: list[tuple[float, int, str]] = []
    for s, e, category in intervals:
        s, e = max(s, start), min(e, end)
        if e > s:
            events.append((s, 1, category))
            events.append((e, -1, category))
    events.sort(key=lambda item: (item[0], item[1]))
    out = {c: 0.0 for c in CATEGORIES}
    comm_total = 0.0
    active = {c: 0 for c in _PRIORITY}
    previous = start
    for t, delta, category in events:
        if t > previous:
            running = [c for c, n in active.items() if n > 0]
            span = t - previous
            if not running:
                out["idle"] += span
            else:
                top = min(running, key=_PRIORITY.__getitem__)
                out["communication_exposed" if top == "communication" else top] += span
            if active["communication"] > 0:
                comm_total += span
            previous = t
        active[category] += delta
    if end > previous:
        out["idle"] += end - previous
    out["communication_total"] = comm_total
    return out


def _window(events) -> tuple[float, float, int, Any]:
    marks = [e for e in events if e.name == STEP_MARK]
    if not marks:
        raise ValueError("no step marks in the profile")
    return (min(e.time_range.start for e in marks), max(e.time_range.end for e in marks), len(marks),
            marks[0].thread)


def from_profile(events, device_type: str) -> dict[str, Any]:
    """The breakdown of the profiled steps: seconds and shares per category (see the module docstring)."""
    events = list(events)
    start, end, steps, step_thread = _window(events)
    data_us = sum(e.time_range.end - e.time_range.start for e in events if e.name == DATA_MARK)
    if device_type == "cuda":
        kernels = [e for e in events if _is_device_event(e) and e.time_range.end > start and e.time_range.start < end]
        if not kernels:
            raise ValueError("the profile holds no GPU kernels (CUPTI unavailable?)")
        seconds = attribute(((e.time_range.start, e.time_range.end, classify(e.name)) for e in kernels), start, end)
        source = f"{len(kernels)} GPU kernels"
    else:
        seconds = {c: 0.0 for c in CATEGORIES}
        comm = 0.0
        inside = 0.0
        for e in events:
            if e.thread != step_thread or e.name in (STEP_MARK, DATA_MARK) or _is_device_event(e):
                continue
            if e.time_range.end <= start or e.time_range.start >= end:
                continue
            category = classify(e.name)
            self_us = float(e.self_cpu_time_total)
            inside += self_us
            if category == "communication":
                seconds["communication_exposed"] += self_us
                comm += self_us
            else:
                seconds[category] += self_us
        seconds["idle"] = max(end - start - inside, 0.0)
        seconds["communication_total"] = comm
        source = "CPU op self times"
    window_us = end - start
    out: dict[str, Any] = {
        "device": device_type, "steps": steps, "window_s": window_us / 1e6, "source": source,
        "seconds": {k: v / 1e6 for k, v in seconds.items()},
        "shares": {k: (v / window_us if window_us else None) for k, v in seconds.items()},
        "data_host_s": data_us / 1e6,
        "meaning": MEANING.get(device_type, MEANING["cpu"]),
    }
    return out


def _is_device_event(e) -> bool:
    kind = getattr(e, "device_type", None)
    return kind is not None and getattr(kind, "name", str(kind)).upper() in ("CUDA", "HIP", "XPU", "PRIVATEUSE1")


def rows(breakdown: dict[str, Any]) -> list[dict[str, Any]]:
    """One record row per category (phase 'profile'), so `results compare` matches them run to run."""
    out = []
    for name in (*CATEGORIES, "communication_total"):
        out.append({"phase": "profile", "name": name, "time_s": breakdown["seconds"][name],
                    "share": breakdown["shares"][name]})
    return out
