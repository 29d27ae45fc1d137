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

import dataclasses
import datetime
import itertools
import json
import os
import socket
import statistics
import sys
import time
from typing import Any

from typing import TYPE_CHECKING

from mleng.errors import CheckFailed, MlengError, UsageError

if TYPE_CHECKING:
    from mleng.results.record import Measurement

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MAX_SECONDS = 10.0
# A rank (or node) slower than this fraction of the median of the others is a straggler.
DEFAULT_STRAGGLER_RATIO = 0.5
# Below this share of the link's spec the probe's bus bandwidth is worth a warning (a quick probe at one
# size does not reach the peak a full `mleng comm` sweep finds, so this is not a pass mark).
LOW_BUSBW_RATIO = 0.25
SLOT_ELEMENTS = 16
PROBE_BYTES_GPU = 256 * 2**20
PROBE_BYTES_CPU = 16 * 2**20

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
# The group: the job's own, or one of our own that is destroyed afterwards
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Session:
    call: int
    timeout: float
    rank: int = 0
    world_size: int = 0
    backend: str | None = None
    device: str = "cpu"
    mode: str = "single process"      # "job's group", "own group", "single process"
    launch: Any = None
    store: Any = None
    ranks: list[dict] = dataclasses.field(default_factory=list)
    launch_problem: str | None = None
    _job: Any = None
    _cuda_device: int | None = None
    _rng_state: Any = None
    _subgroups: list = dataclasses.field(default_factory=list)

    def open(self, backend: str | None, params: dict) -> None:
        import torch
        import torch.distributed as dist

        from mleng.distributed.group import rendezvous
        from mleng.distributed.launch import Launch, detect
        from mleng.distributed.rankinfo import describe_rank

        self._rng_state = torch.random.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self._cuda_device = torch.cuda.current_device()
        if dist.is_available() and dist.is_initialized():
            self.mode = "job's group"
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self.backend = str(dist.get_backend())
            if "nccl" in self.backend and torch.cuda.is_available():
                self.device = f"cuda:{torch.cuda.current_device()}"
            try:
                launch = detect()
            except UsageError as exc:
                launch, self.launch_problem = None, f"the launcher's variables are inconsistent: {exc.message}"
            if launch is not None and (launch.rank, launch.world_size) != (self.rank, self.world_size):
                self.launch_problem = (f"the launcher says rank {launch.rank} of {launch.world_size} ({launch.mode}), "
                                       f"the process group says rank {self.rank} of {self.world_size}")
                launch = None
            self.launch = launch or Launch(
                mode="existing group", rank=self.rank, world_size=self.world_size,
                local_rank=_int(os.environ.get("LOCAL_RANK"), 0), local_world_size=_int(os.environ.get("LOCAL_WORLD_SIZE"), None),
                master_addr=os.environ.get("MASTER_ADDR", "?"), master_port=_int(os.environ.get("MASTER_PORT"), 0))
            self.store = dist.PrefixStore(f"mleng-preflight/{self.launch.run_id}/{self.call}/", _default_store())
            info = describe_rank(self.launch, self.device)
            info["launch_problem"] = self.launch_problem
            self.ranks = rendezvous(self.store, self.launch, self.timeout, info=info, params=params)
            return
        launch = detect()  # inconsistent launcher variables: UsageError, here, before anything starts
        if launch is None:
            self.rank, self.world_size = 0, 1
            self.device = "cuda:0" if torch.cuda.is_available() and torch.cuda.device_count() else "cpu"
            self.launch = Launch(mode="plain", rank=0, world_size=1, local_rank=0, local_world_size=1,
                                 master_addr="127.0.0.1", master_port=0)
            self.ranks = [describe_rank(self.launch, self.device)]
            return
        from mleng.distributed.group import choose_backend, join, pick_device

        self.mode = "own group"
        self.rank, self.world_size, self.launch = launch.rank, launch.world_size, launch
        self.backend, kind = choose_backend(backend)
        if kind == "cuda" and self._cuda_device is None and torch.cuda.is_initialized():
            self._cuda_device = torch.cuda.current_device()
        self.device = pick_device(launch, kind)
        # keys of this call apart from the job's own and from an earlier preflight
        ours = dataclasses.replace(launch, run_id=f"{launch.run_id}/preflight-{self.call}")
        self._job = join(ours, self.backend, self.device, self.timeout,
                         info=describe_rank(launch, self.device), params=params)
        self.store, self.ranks = self._job.store, self._job.ranks

    def new_subgroups(self, members: list[list[int]]) -> list:
        import torch.distributed as dist

        groups = [dist.new_group(ranks=m, timeout=datetime.timedelta(seconds=self.timeout)) for m in members]
        self._subgroups.extend(groups)
        return groups

    def close(self) -> None:
        """Destroy what preflight made, and only that; put the CUDA device and torch's RNG back."""
        import torch
        import torch.distributed as dist

        for group in self._subgroups:
            try:
                dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001 - teardown must not hide the outcome
                pass
        self._subgroups.clear()
        if self._job is not None:
            from mleng.distributed.group import leave

            leave(self._job, self.rank)
        self._job, self.store = None, None  # rank 0's TCPStore server goes with the last reference
        if self._cuda_device is not None:
            torch.cuda.set_device(self._cuda_device)
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
        if self._rng_state is not None:
            torch.random.set_rng_state(self._rng_state)


def _int(text: str | None, default: int | None) -> int | None:
    try:
        return int(text) if text not in (None, "") else default
    except ValueError:
        return default


def _default_store():
    from torch.distributed import distributed_c10d

    try:
        return distributed_c10d._get_default_store()
    except Exception as exc:  # noqa: BLE001 - a group without a store (rare: MPI, fake)
        from mleng.errors import NotAvailableError

        raise NotAvailableError(f"the job's process group has no rendezvous store ({exc})",
                                hint="call mleng.preflight() before init_process_group instead") from None


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


def _collective_message(exc: BaseException, what: str, session: _Session) -> str:
    from mleng.distributed.group import collective_error

    if isinstance(exc, MlengError):
        return exc.message
    return collective_error(exc, what, session.rank, session.timeout).message


def _wait(work, timeout: float) -> None:
    if work is not None:
        work.wait(timeout=datetime.timedelta(seconds=timeout))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


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


# ---------------------------------------------------------------------------------------------
# Judging, on rank 0
# ---------------------------------------------------------------------------------------------

def _ranks_text(ranks: list[int], hosts: list[str]) -> str:
    shown = ", ".join(str(r) for r in ranks[:16]) + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")
    on = sorted({hosts[r] for r in ranks})
    return f"rank{'s' if len(ranks) > 1 else ''} {shown} (on {', '.join(on[:8])}{', ...' if len(on) > 8 else ''})"


def stragglers(rates: dict[Any, float], ratio: float) -> list[tuple[Any, float, float]]:
    """(who, rate, median of the others) for each member below ratio x the median of the others."""
    if ratio <= 0 or len(rates) < 2:
        return []
    out = []
    for who, rate in rates.items():
        others = [v for k, v in rates.items() if k != who]
        median = statistics.median(others)
        if median > 0 and rate < ratio * median:
            out.append((who, rate, median))
    return out


def _judge(session: _Session, params: dict, reports: list[dict | None], joined_s: float, started: float):
    from mleng.doctor.findings import Finding, fail, inconclusive, ok, skipped, warn
    from mleng.measure import collectives
    from mleng.results.record import Measurement

    n = session.world_size
    hosts = [r["host"] for r in session.ranks]
    ratio = params["straggler_ratio"]
    findings: list[Finding] = []
    problems: list[str] = []

    def add(finding: Finding) -> None:
        findings.append(finding)
        if finding.severity == "fail":
            problems.append(finding.summary)

    host_list = list(dict.fromkeys(hosts))
    add(ok("join", f"{n}/{n} rank{'s' if n != 1 else ''} on {len(host_list)} host{'s' if len(host_list) != 1 else ''} "
                   f"joined in {joined_s:.2f} s ({session.mode})", measured=round(joined_s, 3)))
    launch_problems = [(r["rank"], r.get("launch_problem")) for r in session.ranks if r.get("launch_problem")]
    if launch_problems:
        bad = [r for r, _ in launch_problems]
        add(fail("launch", f"{_ranks_text(bad, hosts)}: {launch_problems[0][1]}",
                 cause="the script and its launcher disagree about which rank it is"))
    missing = [r for r in range(n) if reports[r] is None]
    if missing:
        add(fail("report", f"{_ranks_text(missing, hosts)} did not report within {session.timeout:g} s: died, hung, "
                           "or still busy", cause="look at those ranks' output"))
    got = {r: rep for r, rep in enumerate(reports) if rep is not None}
    for r, rep in got.items():
        for error in rep.get("errors") or []:
            add(fail("collective", f"rank {r} ({hosts[r]}): {error}"))

    # correctness: a sender wrong on every receiver's all-gather sent wrong data; a rank whose result (or
    # gathered pieces) alone are wrong received wrong data; a result wrong everywhere with every piece right
    # is the reduction itself
    if n > 1:
        views = {r: rep["all_reduce"] for r, rep in got.items() if rep.get("all_reduce")}
        if views:
            senders = sorted(set.intersection(*(set(v["wrong_senders"]) for v in views.values())))
            if len(views) == 1 and len(senders) == n:
                senders = []  # one view where everything is wrong says more about that rank than about all others
            reduced_wrong = {r for r, v in views.items() if v["wrong_slots"]}
            receivers = sorted(r for r, v in views.items()
                               if set(v["wrong_senders"]) - set(senders)
                               or (v["wrong_slots"] and not senders and len(reduced_wrong) < len(views)))
            example = next((v["example"] for v in views.values() if v["example"]), None)
            seen = (f" (slot {example['slot']}: expected {example['expected']}, got {example['got']})"
                    if example else "")
            if senders:
                add(fail("all_reduce", f"{_ranks_text(senders, hosts)} contributed wrong values to an all-reduce "
                                       f"of known values, seen wrong by every rank{seen}",
                         cause="that rank's GPU or memory produced wrong data before it was sent",
                         handbook=["ecc-uncorrectable-errors"]))
            if receivers:
                add(fail("all_reduce", f"{_ranks_text(receivers, hosts)} received a wrong all-reduce result "
                                       "(the other ranks' results were right)",
                         cause="a link into that rank, or its memory, corrupts data"))
            if not senders and not receivers and reduced_wrong:
                add(fail("all_reduce", f"the all-reduce of known values is wrong on every rank{seen}, though every "
                                       "rank's contribution arrived right in an all-gather: the reduction is wrong",
                         cause="a collective library or driver fault; run `mleng comm --check` and `mleng check`"))
            if not senders and not receivers and not reduced_wrong:
                worst = max(v["ms"] for v in views.values())
                add(ok("all_reduce", f"known values correct on all {len(views)} ranks ({n} x {SLOT_ELEMENTS} "
                                     f"slots, {worst:.1f} ms)"))
    else:
        add(skipped("all_reduce", "one rank: nothing to reduce across ranks"))

    # bus bandwidth: the job's, against the spec; correctness at the probe size
    busbw_rows = [rep["busbw"] for rep in got.values() if rep.get("busbw")]
    reference, note = collectives.reference_rate(session.backend or "", session.ranks, None)
    busbw = None
    if busbw_rows:
        row = busbw_rows[0]
        busbw = row["busbw_gbps"]
        wrong = {r: rep["busbw"]["wrong"] for r, rep in got.items() if rep.get("busbw") and rep["busbw"]["wrong"]}
        if wrong:
            add(fail("all_reduce", f"{_ranks_text(sorted(wrong), hosts)} got wrong elements in the "
                                   f"{_fmt_bytes(row['size_bytes'])} all-reduce ({sum(wrong.values())} in all)",
                     cause="data corrupted on a link or in memory at large message sizes"))
        text = (f"all_reduce {_fmt_bytes(row['size_bytes'])}: {busbw:.3g} GB/s busbw, slowest rank "
                f"({row['time_us']:.0f} us, {row['iters']} x {row['repeats']})")
        if reference:
            share = busbw / reference
            text += f" = {share * 100:.0f}% of {reference:g} GB/s ({note})"
            add((warn if share < LOW_BUSBW_RATIO else ok)("busbw", text, measured=busbw, expected=reference,
                                                          handbook=["nccl-low-busbw-intra-node" if len(host_list) == 1
                                                                    else "nccl-low-busbw-inter-node"]
                                                          if share < LOW_BUSBW_RATIO else []))
        else:
            add(inconclusive("busbw", f"{text}; {note}", measured=busbw))
    elif n > 1:
        add(inconclusive("busbw", "not measured: an earlier collective failed"))
    else:
        add(skipped("busbw", "one rank: nothing crosses a link"))

    # node against node
    node_rows = {}
    for rep in got.values():
        row = rep.get("node_busbw")
        if row and row["host"] not in node_rows:
            node_rows[row["host"]] = row["busbw_gbps"]
    if node_rows:
        slow = stragglers(node_rows, ratio)
        summary = ", ".join(f"{h} {v:.3g}" for h, v in node_rows.items())
        if slow:
            add(fail("node_busbw", "straggler node(s): " + "; ".join(
                f"{h} {v:.3g} GB/s against {m:.3g} GB/s on the others" for h, v, m in slow)
                + f" (within-node all-reduce busbw: {summary})", cause="a slower or misconfigured link inside that node",
                handbook=["nccl-low-busbw-intra-node"]))
        else:
            add(ok("node_busbw", f"within-node all-reduce busbw by node, GB/s: {summary}"))

    # stragglers: ranks, then nodes
    rates = {r: rep["compute"]["tflops"] for r, rep in got.items() if rep.get("compute")}
    if rates:
        first = next(rep["compute"] for rep in got.values() if rep.get("compute"))
        low, high = min(rates.values()), max(rates.values())
        spread = (f"{low:.3g}-{high:.3g} TFLOPS per rank" if n > 1 else f"{low:.3g} TFLOPS") + \
            f" ({first['dtype']} {first['shape']} matmuls)"
        # CPU ranks that outnumber their host's cores time their contention, not themselves
        crowded = sorted({hosts[r] for r, rep in got.items() if rep.get("compute", {}).get("device") == "cpu"
                          and sum(1 for h in hosts if h == hosts[r]) > (rep["compute"].get("host_cpus") or 10**9)})
        if crowded:
            counts = {h: sum(1 for x in hosts if x == h) for h in crowded}
            cpus = {hosts[r]: rep["compute"].get("host_cpus") for r, rep in got.items() if hosts[r] in crowded}
            add(inconclusive("straggler", "CPU ranks outnumber the cores on " + ", ".join(
                f"{h} ({counts[h]} ranks, {cpus[h]} cores)" for h in crowded)
                + f", so their speeds measure the crowding, not the ranks: {spread}", measured=rates))
            rates = {r: v for r, v in rates.items() if hosts[r] not in crowded}
        slow = stragglers(rates, ratio)
        per_host: dict[str, list[float]] = {}
        for r, v in rates.items():
            per_host.setdefault(hosts[r], []).append(v)
        host_rates = {h: statistics.median(v) for h, v in per_host.items()}
        slow_hosts = stragglers(host_rates, ratio) if len(host_rates) > 1 else []
        if slow:
            add(fail("straggler", "straggler rank(s): " + "; ".join(
                f"rank {r} ({hosts[r]}) {v:.3g} TFLOPS against {m:.3g} on the others" for r, v, m in slow)
                + f" (below {ratio:g} x; {spread})",
                cause="a throttled or busy GPU/CPU on that rank: the whole job runs at its pace",
                handbook=["gpu-clock-throttling"]))
        if slow_hosts:
            add(fail("straggler", "straggler node(s): " + "; ".join(
                f"{h} {v:.3g} TFLOPS per rank against {m:.3g} on the others" for h, v, m in slow_hosts)))
        if not slow and not slow_hosts and rates:
            add(ok("straggler", f"no rank below {ratio:g} x the others' median: {spread}"
                   if n > 1 else f"one rank: {spread}", measured=rates))

    # each rank's GPU
    for r, rep in got.items():
        for row in rep.get("gpu") or []:
            if row["severity"] in ("skipped",):
                row = dict(row, severity="inconclusive")
            finding = Finding(**row)
            if finding.severity == "fail":
                problems.append(finding.summary)
            findings.append(finding)
    cpu_only = [f for f in findings if f.check == "gpu" and f.severity == "inconclusive"]
    if len(cpu_only) > 1 and len(cpu_only) == n:  # one line for a job of CPU ranks
        findings = [f for f in findings if f not in cpu_only]
        findings.append(inconclusive("gpu", f"all {n} ranks run on the CPU: GPU clocks, ECC and NUMA binding not "
                                            "checked (no GPU visible)"))

    record = Measurement.start("preflight", params)
    record.rows = [f.to_row() for f in findings]
    counts = {s: sum(1 for f in findings if f.severity == s) for s in ("fail", "warn", "ok", "inconclusive", "skipped")}
    verdict = "fail" if counts["fail"] else ("warn" if counts["warn"] else "ok")
    record.summary = {
        "verdict": verdict, "problems": problems, "counts": counts, "world_size": n, "hosts": host_list,
        "group": session.mode, "backend": session.backend, "device": session.device.split(":")[0],
        "value": busbw, "unit": "GB/s", "metric": "probe busbw", "theoretical": reference,
        "ratio": (busbw / reference) if busbw and reference else None, "theoretical_source": note,
        "join_s": round(joined_s, 3), "compute_tflops": rates,
        "ranks": [{k: v for k, v in r.items() if k not in ("params", "params_digest", "launch_problem")}
                  for r in session.ranks],
    }
    record.params["launch"] = session.launch.mode if session.launch else None
    from mleng.machine.fingerprint import collect_for_record

    record.machine = collect_for_record(gpus=session.device.startswith("cuda"))
    record.finish("complete")
    record.elapsed_s = round(time.monotonic() - started, 3)
    return record


def _fmt_bytes(size: int) -> str:
    from mleng.measure.sizes import format_bytes

    return format_bytes(size)


MARK = {"fail": "FAIL", "warn": "WARN", "ok": "ok", "inconclusive": "??", "skipped": "--"}


def render(record, stored: str | None = None) -> str:
    """Rank 0's summary: one line per check, the verdict, where the record is."""
    s = record.summary
    hosts = s["hosts"]
    lines = [f"mleng preflight: {s['world_size']} rank{'s' if s['world_size'] != 1 else ''} on {len(hosts)} "
             f"host{'s' if len(hosts) != 1 else ''} ({', '.join(hosts[:4])}{', ...' if len(hosts) > 4 else ''}), "
             f"{s['group']}" + (f", backend {s['backend']}" if s.get("backend") else "") + f", {record.elapsed_s:.1f} s"]
    for row in record.rows:
        lines.append(f"[{MARK[row['severity']]:>4}] {row['check']:<11} {row['summary']}")
        if row["severity"] in ("fail", "warn") and row.get("handbook"):
            lines.append(f"{'':18}read: " + ", ".join(f"mleng handbook show {h}" for h in row["handbook"][:3]))
    counts = s["counts"]
    lines.append(f"verdict: {s['verdict'].upper()} ({counts['fail']} fail, {counts['warn']} warn, {counts['ok']} ok, "
                 f"{counts['inconclusive']} inconclusive)" + (f"; stored as {stored}" if stored else ""))
    return "\n".join(lines)
