"""mleng.preflight(): inside the training job, before training starts, check every rank, link and GPU in seconds.

Called on every rank of a torchrun / srun / hand-launched job (or in a plain single process). Every rank joins
within `timeout` or the missing ranks are named; an all-reduce of known values, where each rank owns a slice,
checks the result on every rank and names a rank whose contribution or result is wrong; a quick all-reduce
probe gives the job's bus bandwidth (slowest rank), compared with the link's spec and, across nodes, node
with node; a fixed matmul workload on every rank names the stragglers; each rank's GPU clock, ECC state and
NUMA binding are judged from its NVML fingerprint by the doctor's own checks. Rank 0 prints one summary
and stores one record (kind 'preflight'); when anything fails, PreflightError is raised on every rank.

The job's own process group is used when one exists (no second rendezvous: the arrival keys go on the
group's own store); otherwise a fail-fast group of its own is made and destroyed. Environment variables,
the current CUDA device and torch's random state are as they were before, so training starts as if the
preflight had not run.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from mleng.errors import CheckFailed, MlengError, UsageError
from mleng.preflight.probes import _busbw_probe, _compute_probe, _gpu_findings, _node_probe, _per_node
from mleng.preflight.session import SLOT_ELEMENTS, _Session, _collective_message, _sync, _wait
from mleng.preflight.verdict import _judge, render, stragglers  # noqa: F401 - stragglers: public

if TYPE_CHECKING:
    from mleng.results.record import Measurement


DEFAULT_TIMEOUT_S = 5.0

DEFAULT_MAX_SECONDS = 10.0

# A rank (or node) slower than this fraction of the median of the others is a straggler.
DEFAULT_STRAGGLER_RATIO = 0.5

_calls = itertools.count()  # every rank calls preflight the same number of times: the n-th call's keys

class PreflightError(CheckFailed):
    """A preflight check failed (or could not run): raised on every rank, so the job stops before training.

    `measurement` is the stored record on rank 0 (None on the other ranks and when no record was made).
    """

    def __init__(self, message: str, hint: str | None = None, measurement: Any = None):
        super().__init__(message, hint)
        self.measurement = measurement

def preflight(*, timeout: float = DEFAULT_TIMEOUT_S, max_seconds: float = DEFAULT_MAX_SECONDS,
              probe_bytes: int | str | None = None, straggler_ratio: float = DEFAULT_STRAGGLER_RATIO,
              backend: str | None = None, quiet: bool = False, no_store: bool = False) -> "Measurement | None":
    """Check the job from inside it, on every rank, before training starts; raise PreflightError on every
    rank when something is wrong. Returns the record (kind 'preflight') on rank 0 and None on the others.

    timeout: seconds for every rank to join and for any one collective. max_seconds: the budget of the
    measurements (about 10 s on a healthy node; the probes shrink to fit). probe_bytes: the all-reduce size
    of the bandwidth probe (default 256 MiB on GPUs, 16 MiB on CPU; sizes as `mleng comm -e`).
    straggler_ratio: a rank or node below this fraction of the others' median is named (0 names none).
    backend: for the group preflight makes when there is none (default nccl on GPUs, gloo on CPU).
    quiet: no summary on rank 0's stderr. no_store: keep the record out of the results store.

    Example (train.py, launched with `torchrun --nproc_per_node 8 train.py`):
        >>> import mleng, torch.distributed as dist
        >>> dist.init_process_group("nccl")      # or not: preflight then makes (and removes) its own
        >>> mleng.preflight()                    # raises mleng.PreflightError on every rank if a check fails
    """
    _validate(timeout, max_seconds, straggler_ratio)
    size = _probe_size(probe_bytes)
    saved_env = dict(os.environ)
    import torch  # noqa: F401 - a training script has it already; the budget starts after it
    import torch.distributed  # noqa: F401

    started = time.monotonic()
    params = {"timeout_s": timeout, "max_seconds": max_seconds, "probe_bytes": size,
              "straggler_ratio": straggler_ratio, "backend": backend}
    session = _Session(call=next(_calls), timeout=timeout)
    try:
        try:
            session.open(backend, params)
        except PreflightError:
            raise
        except (CheckFailed, UsageError) as exc:
            if isinstance(exc, UsageError) and session.world_size == 0:
                raise  # bad launcher variables or arguments: the usage error itself
            raise PreflightError(exc.message, hint=_preflight_hint(exc.message, exc.hint)) from None
        return _run(session, params, size, started, quiet=quiet, no_store=no_store)
    finally:
        session.close()
        _restore_env(saved_env)

def _validate(timeout: float, max_seconds: float, straggler_ratio: float) -> None:
    for name, value in (("timeout", timeout), ("max_seconds", max_seconds)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise UsageError(f"preflight {name}={value!r}: give a positive number of seconds",
                             hint=f"e.g. mleng.preflight({name}={DEFAULT_TIMEOUT_S if name == 'timeout' else DEFAULT_MAX_SECONDS:g})")
    if not isinstance(straggler_ratio, (int, float)) or not 0 <= straggler_ratio < 1:
        raise UsageError(f"preflight straggler_ratio={straggler_ratio!r}: give a fraction from 0 up to (not "
                         "including) 1", hint="0.5 names ranks below half the others' median; 0 names none")

def _probe_size(probe_bytes: int | str | None) -> int | None:
    if probe_bytes is None:
        return None
    if isinstance(probe_bytes, bool):
        raise UsageError(f"preflight probe_bytes={probe_bytes!r}: give a size, e.g. '64M' or 2**26")
    if isinstance(probe_bytes, int):
        size = probe_bytes
    else:
        from mleng.measure.sizes import parse_size

        size = parse_size(str(probe_bytes), "probe_bytes")
    if size < 4 * SLOT_ELEMENTS:
        raise UsageError(f"preflight probe_bytes={probe_bytes!r} is too small", hint="give at least 64 bytes, e.g. '16M'")
    return size

def _preflight_hint(message: str, hint: str | None) -> str | None:
    if "Unable to find address for" in message:
        names = ", ".join(f"{v}={os.environ[v]}" for v in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
                          if os.environ.get(v))
        return (f"{names or 'the socket interface variable'} names a network interface this host does not have: "
                "list them with `ip -br addr` and set it to one that carries the job's traffic (or unset it)")
    return hint.replace("raise --timeout", "raise preflight's timeout") if hint else hint

def _restore_env(saved: dict[str, str]) -> None:
    for name in [n for n in os.environ if n not in saved]:
        del os.environ[name]
    for name, value in saved.items():
        if os.environ.get(name) != value:
            os.environ[name] = value

# ---------------------------------------------------------------------------------------------
# The checks, on every rank
# ---------------------------------------------------------------------------------------------
def _run(session: _Session, params: dict, probe_bytes: int | None, started: float, quiet: bool, no_store: bool):
    joined_s = time.monotonic() - started
    budget_end = started + params["max_seconds"]
    mine: dict[str, Any] = {"rank": session.rank, "errors": []}
    phases = mine["phases_s"] = {"join": round(joined_s, 3)}
    mark = [time.monotonic()]

    def phase(name: str) -> None:
        now = time.monotonic()
        phases[name] = round(now - mark[0], 3)
        mark[0] = now

    broken = False  # after a failed collective the group is not trusted with another one
    if session.world_size > 1:
        try:
            mine["all_reduce"] = _known_values(session)
        except Exception as exc:  # noqa: BLE001 - reported as this rank's error, judged by rank 0
            mine["errors"].append(_collective_message(exc, "all-reduce of known values", session))
            broken = True
        phase("all_reduce")
    gpu_sample: dict = {}
    mine["compute"] = _compute_probe(session, budget_end, gpu_sample)
    phase("compute")
    if session.world_size > 1 and not broken:
        try:
            mine["busbw"] = _busbw_probe(session, probe_bytes, budget_end)
        except Exception as exc:  # noqa: BLE001
            mine["errors"].append(_collective_message(exc, "bandwidth probe", session))
            broken = True
        phase("busbw")
    hosts = [r["host"] for r in session.ranks]
    if session.world_size > 1 and not broken and _per_node(hosts):
        try:
            mine["node_busbw"] = _node_probe(session, hosts, probe_bytes, budget_end)
        except Exception as exc:  # noqa: BLE001
            mine["errors"].append(_collective_message(exc, "per-node bandwidth probe", session))
        phase("node_busbw")
    mine["gpu"] = [f.to_row() for f in _gpu_findings(session, gpu_sample)]
    phase("gpu")
    reports = _gather(session, mine)
    record = None
    if session.rank == 0:
        phase("gather")
        record = _judge(session, params, reports, joined_s, started)
        record.summary["phases_s"] = phases
        stored = None if no_store else _store(record)
        if not quiet:
            print(render(record, stored), file=sys.stderr, flush=True)
        verdict = {"ok": record.summary["verdict"] != "fail", "problems": record.summary["problems"],
                   "id": record.id}
        if session.world_size > 1:
            _post(session, "outcome", verdict)
    else:
        verdict = _wait_for(session, "outcome", 2 * session.timeout + 5, "rank 0's verdict")
    _finish_together(session)
    if not verdict["ok"]:
        raise PreflightError(_problem_text(verdict["problems"]),
                             hint="fix or drain what is named before training (details in rank 0's summary"
                                  + (f", `mleng results show {verdict['id']}`" if not no_store else "") + ")",
                             measurement=record)
    return record

def _known_values(session: _Session) -> dict[str, Any]:
    """An all-reduce (sum) where rank r alone fills slice r with its own pattern: on every rank, slice r of
    the result must equal rank r's pattern. Then an all-gather of what each rank sent (its slice and the sum
    of what it put elsewhere, which must be 0) says who is at fault: a contribution wrong on every receiver
    names its sender; a wrong result or a wrong gathered piece on one rank only names that receiver."""
    import torch
    import torch.distributed as dist

    n, rank = session.world_size, session.rank
    expected = _slot_patterns(n).to(session.device)
    sent = _contribution(rank, n, session.device)
    result = sent.clone()
    t0 = time.perf_counter()
    _wait(dist.all_reduce(result, async_op=True), session.timeout)
    _sync(session.device)
    elapsed = time.perf_counter() - t0
    wrong = (result != expected).any(dim=1).nonzero().flatten().tolist()
    example = None
    if wrong:
        r = wrong[0]
        example = {"slot": r, "expected": expected[r][:4].tolist(), "got": result[r][:4].tolist()}
    others = sent.clone()
    others[rank] = 0
    piece = torch.cat([sent[rank], others.abs().sum().reshape(1)])
    pieces = [torch.empty_like(piece) for _ in range(n)]
    _wait(dist.all_gather(pieces, piece, async_op=True), session.timeout)
    _sync(session.device)
    zero = torch.zeros(1, device=session.device)
    wrong_senders = [r for r in range(n)
                     if not (torch.equal(pieces[r][:-1], expected[r]) and torch.equal(pieces[r][-1:], zero))]
    return {"wrong_slots": wrong, "example": example, "wrong_senders": wrong_senders, "ms": elapsed * 1e3}

def _contribution(rank: int, n: int, device: str):
    """What this rank puts into the check: its own pattern in its slice, zeros elsewhere."""
    import torch

    sent = torch.zeros(n, SLOT_ELEMENTS, dtype=torch.float32, device=device)
    sent[rank] = _slot_patterns(n)[rank].to(device)
    return sent

def _slot_patterns(n: int):
    """World size x SLOT_ELEMENTS integers below 2^24 (exact in float32), different for every rank and slot."""
    import torch

    r = torch.arange(n, dtype=torch.int64).unsqueeze(1)
    j = torch.arange(SLOT_ELEMENTS, dtype=torch.int64).unsqueeze(0)
    return ((r * 7919 + j * 104729 + 12345) % 65521 + 1).to(torch.float32)

# ---------------------------------------------------------------------------------------------
# Reports to rank 0, the verdict back to everybody
# ---------------------------------------------------------------------------------------------
def _post(session: _Session, key: str, value: Any) -> None:
    session.store.set(key, json.dumps(value, default=str))

def _gather(session: _Session, mine: dict) -> list[dict | None]:
    """Every rank's report on rank 0 through the store (a rank that died or hangs is named, not waited for)."""
    if session.world_size == 1:
        return [mine]
    _post(session, f"report/{session.rank}", mine)
    session.store.add("report/count", 1)
    if session.rank != 0:
        return []
    deadline = time.monotonic() + session.timeout
    while session.store.add("report/count", 0) < session.world_size and time.monotonic() < deadline:
        time.sleep(0.02)
    reports: list[dict | None] = [mine]
    for rank in range(1, session.world_size):
        key = f"report/{rank}"
        reports.append(json.loads(session.store.get(key)) if session.store.check([key]) else None)
    return reports

def _wait_for(session: _Session, key: str, seconds: float, what: str) -> dict:
    try:
        session.store.wait([key], datetime.timedelta(seconds=seconds))
        return json.loads(session.store.get(key))
    except Exception as exc:  # noqa: BLE001
        raise PreflightError(f"rank {session.rank}: {what} did not come within {seconds:g} s ({exc})",
                             hint="look at rank 0's output: it died or hangs") from None

def _finish_together(session: _Session) -> None:
    """Rank 0 serves the store of its own group: it waits until every rank has read the verdict."""
    if session.world_size == 1 or session.store is None:
        return
    session.store.add("done/count", 1)
    if session.rank == 0:
        deadline = time.monotonic() + session.timeout
        while session.store.add("done/count", 0) < session.world_size and time.monotonic() < deadline:
            time.sleep(0.02)

def _store(record) -> str | None:
    from mleng.results.store import save_measurement

    try:
        return save_measurement(record)
    except MlengError as exc:
        print(f"mleng preflight: warning: the record was not stored: {exc.message}", file=sys.stderr)
        return None

def _problem_text(problems: list[str]) -> str:
    return "preflight failed: " + "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
