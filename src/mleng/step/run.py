"""One rank of `mleng step`: build the model, wrap it (none, DDP, FSDP2), train, time each step, profile two
more, and on rank 0 assemble the `step` record (tokens/s, MFU, MAMFU, HFU, memory, where the time goes)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable

from mleng.errors import CheckFailed, MlengError, UsageError
from mleng.machine.system import host_available_bytes
from mleng.measure.sizes import format_gib
from mleng.step.config import ModelConfig, param_count

PARALLEL = ("none", "ddp", "fsdp")
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}
MAX_GRAD_NORM = 1.0
# Bytes per parameter held for the whole run: fp32 weights 4, fp32 gradients 4, AdamW's two moments 8.
STATE_BYTES_PER_PARAM = 16
OOM_HANDBOOK = "cuda-oom-tried-to-allocate"


@dataclasses.dataclass
class StepOptions:
    cfg: ModelConfig
    seq: int | None = None        # None: the device default (2048 on GPUs, 128 on CPU)
    micro_batch: int = 1
    grad_accum: int = 1
    steps: int = 10
    warmup: int = 3
    dtype: str | None = None      # None: bfloat16 on GPUs, float32 on CPU
    parallel: str | None = None   # None: none at 1 rank, ddp at more
    compile: bool | None = None   # None: on for CUDA, off on CPU
    checkpointing: bool = False
    lr: float = 3e-4
    seed: int = 0
    tokens: str | None = None
    tokens_dtype: str = "uint16"
    profile_steps: int = 2
    mamf: bool = False
    mamf_seconds: float | None = None
    store: bool = True
    timeout_s: float = 300.0
    device: str | None = None     # "cpu" forces the CPU on a GPU machine
    trace_path: str | None = None  # rank 0's profiler trace (chrome://tracing JSON)

    def resolved(self, on_gpu: bool, world_size: int) -> "StepOptions":
        """Defaults that depend on the device and the world, filled in; refuses what cannot run."""
        out = dataclasses.replace(self)
        out.seq = self.seq or (2048 if on_gpu else 128)
        out.dtype = DTYPES[self.dtype] if self.dtype else ("bfloat16" if on_gpu else "float32")
        out.parallel = self.parallel or ("none" if world_size == 1 else "ddp")
        out.compile = on_gpu if self.compile is None else self.compile
        out.mamf_seconds = self.mamf_seconds or (30.0 if on_gpu else 8.0)
        if out.parallel == "none" and world_size > 1:
            raise UsageError(f"--parallel none runs one process, but this launch has {world_size} ranks",
                             hint="use --parallel ddp or fsdp, or run one process")
        return out

    def global_batch(self, world_size: int) -> int:
        return self.micro_batch * self.grad_accum * world_size

    def params(self, world_size: int) -> dict[str, Any]:
        return {"model": self.cfg.to_dict(), "seq": self.seq, "micro_batch": self.micro_batch,
                "grad_accum": self.grad_accum, "global_batch": self.global_batch(world_size),
                "steps": self.steps, "warmup": self.warmup, "profile_steps": self.profile_steps,
                "dtype": self.dtype, "parallel": self.parallel, "compile": self.compile,
                "activation_checkpointing": self.checkpointing, "optimizer": "AdamW", "lr": self.lr,
                "betas": [0.9, 0.95], "weight_decay": 0.1, "max_grad_norm": MAX_GRAD_NORM, "seed": self.seed,
                "tokens": self.tokens, "tokens_dtype": self.tokens_dtype if self.tokens else None,
                "mamf": self.mamf, "timeout_s": self.timeout_s, "world_size": world_size,
                "warmup_min_s_on_gpu": WARMUP_MIN_S}


def validate(options: StepOptions) -> None:
    """Refuse bad numbers before torch is imported or any rank starts."""
    for flag, value, least in (("--steps", options.steps, 1), ("--warmup", options.warmup, 0),
                               ("--micro-batch", options.micro_batch, 1), ("--grad-accum", options.grad_accum, 1),
                               ("--profile-steps", options.profile_steps, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise UsageError(f"{flag} {value}: must be at least {least}")
    if options.seq is not None and (isinstance(options.seq, bool) or not isinstance(options.seq, int)
                                    or options.seq < 1):
        raise UsageError(f"--seq {options.seq}: must be at least 1 token")
    if options.dtype is not None and options.dtype not in DTYPES:
        hint = ("fp16 needs loss scaling, which mleng step does not do; use bfloat16"
                if options.dtype in ("float16", "fp16", "half") else None)
        raise UsageError(f"--dtype {options.dtype}: mleng step trains in bfloat16 or float32", hint=hint)
    if options.parallel is not None and options.parallel not in PARALLEL:
        raise UsageError(f"--parallel {options.parallel}; known: {', '.join(PARALLEL)}")
    if not options.lr > 0:
        raise UsageError(f"--lr {options.lr}: must be positive")
    if options.timeout_s <= 0:
        raise UsageError("--timeout must be positive")
    if options.mamf_seconds is not None and options.mamf_seconds <= 0:
        raise UsageError("--mamf-seconds must be positive")


def state_bytes(cfg: ModelConfig, parallel: str, world_size: int) -> int:
    """What the run holds for its whole length on each rank before any activation: weights, gradients and
    AdamW states (16 bytes per parameter, sharded by FSDP), and at least the full fp32 model once, because
    every rank builds it whole before FSDP shards it."""
    params = param_count(cfg).total
    held = STATE_BYTES_PER_PARAM * params // (world_size if parallel == "fsdp" else 1)
    return max(held, 4 * params)


def precheck(options: StepOptions, world_size: int, local_ranks: int) -> StepOptions:
    """Everything that can be refused before any rank starts and without torch: the defaults of this
    machine filled in, the fit of the model's states (NVML or /proc/meminfo), the tokens file."""
    from mleng.distributed.launch import visible_gpu_count

    on_gpu = options.device != "cpu" and visible_gpu_count() > 0
    opts = options.resolved(on_gpu, world_size)
    if on_gpu:
        free = _nvml_max_free_bytes()  # lenient here; each rank checks its own GPU exactly
        if free is not None:
            _refuse_unless_fits(opts.cfg, opts, world_size, free, "the emptiest GPU here", 1)
    else:
        _refuse_unless_fits(opts.cfg, opts, world_size, host_available_bytes(), "this host", local_ranks)
    if opts.tokens:
        from mleng.step.data import FileTokens

        FileTokens(opts.tokens, opts.tokens_dtype, opts.cfg.vocab_size, opts.seq, opts.global_batch(world_size),
                   device=None).check_batch(0, opts.global_batch(world_size))
    return opts


def _nvml_max_free_bytes() -> int | None:
    from mleng.machine.nvml import nvml

    pynvml, _ = nvml()
    if pynvml is None:  # no NVML: the rank's own check (torch.cuda.mem_get_info) remains
        return None
    try:
        return max(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).free
                   for i in range(pynvml.nvmlDeviceGetCount()))
    except Exception:  # noqa: BLE001
        return None




def check_fits(cfg: ModelConfig, options: StepOptions, world_size: int, device, local_ranks: int) -> None:
    """Refuse, before allocating, a model whose states alone exceed the memory here (a clear estimate;
    activations come on top and are left to the run)."""
    if device.type == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        _refuse_unless_fits(cfg, options, world_size, free, f"{device} ({torch.cuda.get_device_name(device)})", 1)
    else:
        _refuse_unless_fits(cfg, options, world_size, host_available_bytes(), "this host", local_ranks)


def _refuse_unless_fits(cfg: ModelConfig, options: StepOptions, world_size: int, have: int | None, where: str,
                        ranks_here: int) -> None:
    need = state_bytes(cfg, options.parallel, world_size)
    if have is None or need * ranks_here <= have:
        return
    per_layer = (param_count(cfg).attention + param_count(cfg).mlp) // cfg.n_layers
    fixed = max(param_count(cfg).total - cfg.n_layers * per_layer, 0)
    scale = STATE_BYTES_PER_PARAM / (world_size if options.parallel == "fsdp" else 1)
    layers_fit = int((have / ranks_here / scale - fixed) // per_layer) if have / ranks_here / scale > fixed else 0
    hint = (f"--layers {layers_fit} or fewer keeps the width and fits the states" if layers_fit >= 1
            else "this shape's embeddings alone do not fit; use a smaller model")
    if options.parallel != "fsdp":
        hint += "; or --parallel fsdp across more GPUs to shard them"
    raise UsageError(
        f"model {cfg.name} ({param_count(cfg).total / 1e9:.2f} B parameters) cannot fit: weights, gradients and "
        f"AdamW states need {format_gib(need, 1)} per rank{' x ' + str(ranks_here) + ' ranks' if ranks_here > 1 else ''}"
        f" before any activation, and {where} has {format_gib(have, 1)} free", hint=hint)


@dataclasses.dataclass
class RankState:
    """What this rank measured; rank 0 builds the record from its own and the gathered ones."""

    steps: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # {step, phase, time_s, loss}
    memory: dict[str, Any] = dataclasses.field(default_factory=dict)
    breakdown: dict[str, Any] | None = None
    breakdown_error: str | None = None
    identity: dict[str, Any] = dataclasses.field(default_factory=dict)
    mamf_records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    gpu_monitor: dict[str, Any] | None = None
    phase: str = "start"
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def portable(self) -> dict[str, Any]:
        return {"steps": self.steps, "memory": self.memory, "breakdown": self.breakdown,
                "breakdown_error": self.breakdown_error, "identity": self.identity,
                "mamf_records": self.mamf_records}


Progress = Callable[[str, int, int, dict[str, Any]], None]


def run_rank(options: StepOptions, launch, finish: Callable[[Any, list], None],
             progress: Progress | None = None) -> int:
    """Run this rank. On rank 0, finish(record, extra_records) is called before the process group is torn
    down (teardown can hang when a peer is gone), also after Ctrl-C/SIGTERM or a failure, with what was
    measured. Returns 0; errors propagate after the record is finished."""
    import torch

    from mleng.distributed.group import choose_backend, join, leave, pick_device
    from mleng.distributed.rankinfo import describe_rank
    from mleng.distributed.runner import StopSignals
    from mleng.results.record import Measurement

    world = launch.world_size
    cuda = torch.cuda.is_available() and options.device != "cpu"
    opts = options.resolved(cuda, world)
    needs_group = world > 1 or opts.parallel != "none"
    backend = None
    if needs_group:
        backend, kind = choose_backend("gloo" if not cuda else None)
    else:
        kind = "cuda" if cuda else "cpu"
    device = torch.device(pick_device(launch, kind))
    is_root = launch.rank == 0
    params = {**opts.params(world), "backend": backend, "launch": launch.mode}
    record = Measurement.start("step", params) if is_root else None
    state = RankState()
    job = None
    stop = StopSignals().__enter__()
    try:
        with stop.outcome("interrupted; the steps measured so far are kept"):
            if needs_group:
                job = join(launch, backend, str(device), opts.timeout_s, info=describe_rank(launch, str(device)),
                           params=params)
            _train(opts, launch, job, device, state, progress if is_root else None)
            if job is not None and world > 1:
                from mleng.distributed.group import gather_to_rank0

                state.info["ranks"] = gather_to_rank0(job, "step_result", state.portable(),
                                                      timeout_s=opts.timeout_s)
    finally:
        if is_root:
            _summarize(record, opts, state, job, launch, device, stop.status, stop.error)
            finish(record, state.mamf_records)
        leave(job, launch.rank)
        stop.__exit__()
    return 0


# ------------------------------------------------------------------------------------------ the training

def _train(opts: StepOptions, launch, job, device, state: RankState, progress: Progress | None) -> None:
    import torch

    from mleng.step.data import FileTokens, SyntheticTokens
    from mleng.step.efficiency import device_identity

    world, rank = launch.world_size, launch.rank
    cfg = opts.cfg
    state.identity = device_identity(device)
    if opts.mamf:
        state.phase = "mamf"
        _maybe_measure_mamf(opts, job, device, state)
    check_fits(cfg, opts, world, device, launch.local_world_size or world)
    global_batch = opts.global_batch(world)
    if opts.tokens:
        data = FileTokens(opts.tokens, opts.tokens_dtype, cfg.vocab_size, opts.seq, global_batch, device)
    else:
        data = SyntheticTokens(cfg.vocab_size, opts.seq, device, seed=opts.seed)
    state.info["data"] = data.describe()
    state.phase = "build"
    try:
        model, step_fn = _build(opts, device, world, rank, data, global_batch, job)
        total = opts.warmup + opts.steps
        state.phase = "warmup"
        index = 0
        for index in range(opts.warmup):
            _timed_step(step_fn, index, state, device, job, progress, total)
        index = opts.warmup
        if device.type == "cuda" and opts.warmup:
            # A GPU's clock settles over a second or two of load: warm up at least that long after the first
            # step (which compiles). Every rank takes the same decision from rank 0's clock, or they would
            # run different numbers of collectives.
            while _more_warmup(state, job):
                _timed_step(step_fn, index, state, device, job, progress, total)
                index += 1
        state.info["warmup_steps"] = index
        state.phase = "timed"
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        monitor = _start_monitor(device, state.identity.get("uuid")) if rank == 0 else None
        try:
            for i in range(index, index + opts.steps):
                _timed_step(step_fn, i, state, device, job, progress, index + opts.steps)
        finally:
            if rank == 0:
                state.gpu_monitor = _stop_monitor(monitor)
            state.memory = _memory(device, state.identity.get("uuid"))
        if opts.profile_steps:
            state.phase = "profile"
            _profile(step_fn, index + opts.steps, opts.profile_steps, device, state,
                     opts.trace_path if rank == 0 else None)
    except torch.OutOfMemoryError as exc:
        raise _oom(exc, opts, state, device, world) from None
    except RuntimeError as exc:
        if job is not None and _looks_distributed(exc):
            from mleng.distributed.group import collective_error

            raise collective_error(exc, f"the training step ({state.phase})", rank, opts.timeout_s) from None
        raise


def _build(opts: StepOptions, device, world: int, rank: int, data, global_batch: int, job):
    import torch

    from mleng.step.model import build

    cfg = opts.cfg
    model = build(cfg, opts.seq, device, seed=opts.seed)
    if opts.checkpointing:
        model.enable_checkpointing()
    if opts.compile:
        # Per block, as torchtitan does: FSDP2's hooks sit between blocks, and one compiled block's code
        # serves every layer.
        for layer in model.layers:
            layer.compile()
        model.head.compile()
    bf16 = opts.dtype == "bfloat16"
    if opts.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                          gradient_as_bucket_view=True)
    elif opts.parallel == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
            else MixedPrecisionPolicy()
        for layer in model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)  # the root: embeddings and head (tied or not) together
        wrapped = model
    else:
        wrapped = model
    # bf16 compute with fp32 master weights: autocast, except under FSDP2, whose policy casts the parameters.
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 and opts.parallel != "fsdp" \
        else contextlib.nullcontext
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=opts.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                  **({"fused": True} if device.type == "cuda" else {}))
    accum, micro = opts.grad_accum, opts.micro_batch

    def step_fn(index: int):
        from torch.profiler import record_function

        from mleng.step.breakdown import DATA_MARK

        loss_sum = torch.zeros((), device=device)
        for a in range(accum):
            with record_function(DATA_MARK):
                tokens, targets = data.batch(index, (a * world + rank) * micro, micro, global_batch)
            last = a == accum - 1
            sync = wrapped.no_sync() if opts.parallel == "ddp" and not last else contextlib.nullcontext()
            if opts.parallel == "fsdp":
                wrapped.set_requires_gradient_sync(last)
            with sync:
                with autocast():
                    loss = wrapped(tokens, targets)
                (loss / accum).backward()
            loss_sum += loss.detach() / accum
        torch.nn.utils.clip_grad_norm_(wrapped.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss_sum

    return wrapped, step_fn


WARMUP_MIN_S = 2.0  # on GPUs, warm-up after the first step lasts at least this long
WARMUP_MAX_EXTRA = 200


def _more_warmup(state: RankState, job) -> bool:
    after_first = sum(s["time_s"] for s in state.steps[1:])
    more = after_first < WARMUP_MIN_S and len(state.steps) < WARMUP_MAX_EXTRA
    if job is not None and job.world_size > 1:
        import torch
        import torch.distributed as dist

        flag = torch.tensor([int(more)], device=job.device)
        dist.broadcast(flag, src=0)
        more = bool(flag.item())
    return more


def _timed_step(step_fn, index: int, state: RankState, device, job, progress: Progress | None, total: int) -> None:
    from mleng.measure.timing import time_fn

    holder: dict[str, Any] = {}

    def one_step() -> None:
        holder["loss"] = step_fn(index)

    # The one timer: device events on CUDA (synchronised once per step), host clock plus sync elsewhere.
    stats = time_fn(one_step, device=device, warmup=0, iters=1, flush_l2=False)
    loss = holder["loss"]
    if job is not None and job.world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(loss)  # outside the timed region: the logged loss is the mean over ranks
        loss = loss / job.world_size
    entry = {"step": index, "phase": state.phase, "time_s": stats.median_s, "loss": float(loss)}
    state.steps.append(entry)
    if progress is not None:
        progress(state.phase, index, total, entry)


def _profile(step_fn, first: int, count: int, device, state: RankState, trace_path: str | None) -> None:
    from torch.profiler import ProfilerActivity, profile, record_function

    from mleng.distributed.group import native_stderr_silenced
    from mleng.measure.timing import sync
    from mleng.step import breakdown

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=activities)
    with native_stderr_silenced():  # kineto announces start and stop on stderr
        prof.__enter__()
    try:
        sync(device)
        for j in range(count):
            with record_function(breakdown.STEP_MARK):
                step_fn(first + j)
                sync(device)
    finally:
        with native_stderr_silenced():
            prof.__exit__(None, None, None)
    try:
        state.breakdown = breakdown.from_profile(prof.events(), device.type)
    except Exception as exc:  # noqa: BLE001 - the breakdown is a part of the record, never its end
        state.breakdown_error = f"{type(exc).__name__}: {exc}"
    if trace_path:
        try:
            prof.export_chrome_trace(trace_path)
            state.info["trace"] = trace_path
        except Exception as exc:  # noqa: BLE001
            state.info["trace_error"] = str(exc)


def _memory(device, uuid: str | None) -> dict[str, Any]:
    import resource

    import torch

    out: dict[str, Any] = {"host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if device.type == "cuda":
        out.update({"peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
                    "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
                    "device_total_bytes": int(torch.cuda.get_device_properties(device).total_memory),
                    "window": "timed steps (peak statistics reset after warm-up)"})
        out.update(_nvml_memory(device, uuid))
    return out


def _nvml_memory(device, uuid: str | None) -> dict[str, Any]:
    """NVML's used memory of this GPU: every process on it and the CUDA context, unlike the allocator's."""
    from mleng.machine.nvml import gpu_handle, nvml

    pynvml, reason = nvml()
    if pynvml is None:
        return {"nvml_error": reason}
    try:
        info = pynvml.nvmlDeviceGetMemoryInfo(gpu_handle(pynvml, uuid=uuid, index=device.index))
        return {"nvml_used_bytes": int(info.used), "nvml_total_bytes": int(info.total)}
    except Exception as exc:  # noqa: BLE001
        return {"nvml_error": str(exc).splitlines()[0] if str(exc) else type(exc).__name__}


def _start_monitor(device, uuid: str | None):
    if device.type != "cuda":
        return None
    import torch

    from mleng.measure.gpu_monitor import GpuMonitor

    monitor = GpuMonitor(uuid=None if getattr(torch.version, "hip", None) else uuid, index=device.index)
    monitor.start()
    return monitor


def _stop_monitor(monitor) -> dict[str, Any]:
    if monitor is None:
        return {"available": False, "reason": "no NVML telemetry for this device type"}
    monitor.stop()
    return monitor.summary()


def _maybe_measure_mamf(opts: StepOptions, job, device, state: RankState) -> None:
    """--mamf: when any rank's GPU has no stored MAMF in this dtype, every rank measures its own, at the same
    time (the book: the achievable ceiling of a job is the slowest GPU's, measured concurrently)."""
    import torch

    from mleng.measure.matmul import MamfOptions, run_mamf
    from mleng.measure.timing import process_elapsed_s
    from mleng.step.efficiency import find_stored_mamf

    found, _ = find_stored_mamf(state.identity, opts.dtype)
    need = found is None
    if job is not None and job.world_size > 1:
        import torch.distributed as dist

        flag = torch.tensor([int(need)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        need = bool(flag.item())
    if not need:
        return
    mamf = MamfOptions(device=str(device), dtype=opts.dtype,
                       max_seconds=process_elapsed_s() + opts.mamf_seconds,
                       max_dim=1024 if device.type == "cpu" else None)
    record = run_mamf(mamf)
    record.params["measured_for"] = "mleng step --mamf"
    state.mamf_records.append(record.to_dict())
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _looks_distributed(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(word in text for word in ("gloo", "nccl", "connection", "timed out", "peer", "process group"))


def _oom(exc: BaseException, opts: StepOptions, state: RankState, device, world: int) -> MlengError:
    import torch

    first = str(exc).strip().splitlines()[0] if str(exc).strip() else "out of memory"
    first = first.split(". Of the allocated")[0].split(" If reserved but unallocated")[0]
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    states = state_bytes(opts.cfg, opts.parallel, world)
    phase = {"warmup": "warm-up", "timed": "the timed steps", "profile": "the profiled steps"}.get(state.phase,
                                                                                                   state.phase)
    message = (f"out of memory during {phase} (step {len(state.steps)}): {first}; this run holds "
               f"{format_gib(states, 1)} of weights, gradients and AdamW states per rank before activations"
               + (f", peak allocated {format_gib(peak, 1)}" if peak else ""))
    hint = (f"--checkpointing (recompute activations), a smaller --micro-batch or --seq, --layers N, or "
            f"--parallel fsdp over more GPUs; `mleng handbook show {OOM_HANDBOOK}`")
    return UsageError(message, hint=hint)


# ------------------------------------------------------------------------------------------ the record

def _summarize(record, opts: StepOptions, state: RankState, job, launch, device, status: str,
               error: str | None) -> None:
    from mleng.distributed.runner import fingerprint
    from mleng.measure.timing import TimingStats, process_elapsed_s
    from mleng.step import breakdown as bd
    from mleng.step.efficiency import dense_peak, find_stored_mamf, ratio
    from mleng.step.flops import DEFAULT_CONVENTION, both_conventions, conventions_differ

    world = launch.world_size
    record.machine = fingerprint(gpus=device.type == "cuda")
    if job is not None:
        record.machine["ranks"] = [{k: v for k, v in r.items() if k not in ("params", "params_digest")}
                                   for r in job.ranks]
    ranks = state.info.get("ranks") or [state.portable()]
    timed = _slowest_per_step(ranks, "timed")
    warm = _slowest_per_step(ranks, "warmup")
    cfg = opts.cfg
    tokens_per_step = opts.global_batch(world) * opts.seq
    hosts = sorted({r["host"] for r in record.machine.get("ranks", [])}) or [state.identity.get("host")]
    devices = world if device.type == "cuda" else len(hosts)
    flops = both_conventions(cfg, opts.seq, recompute=opts.checkpointing)
    main = flops[DEFAULT_CONVENTION]
    summary: dict[str, Any] = {
        "value": None, "unit": "tokens/s per " + ("GPU" if device.type == "cuda" else "CPU host"),
        "theoretical": None, "ratio": None,
        "model": cfg.name, "parameters": param_count(cfg).to_dict(), "seq": opts.seq,
        "global_batch": opts.global_batch(world), "tokens_per_step": tokens_per_step,
        "world_size": world, "devices": devices, "device_kind": device.type,
        "device_name": state.identity.get("name"), "dtype": opts.dtype, "parallel": opts.parallel,
        "compile": opts.compile, "activation_checkpointing": opts.checkpointing,
        "steps_timed": len(timed), "steps_warmup": len(warm),
        "flop_convention": DEFAULT_CONVENTION,
        "flops_per_token": {name: f.to_dict() for name, f in flops.items()},
        "conventions_differ": conventions_differ(flops),
        "data": state.info.get("data"),
        "wall_s_from_process_start": round(process_elapsed_s(), 2),
    }
    rows: list[dict[str, Any]] = []
    if timed:
        stats = TimingStats.from_samples([s["time_s"] for s in timed])
        tokens_per_s = tokens_per_step / stats.median_s
        per_device = tokens_per_s / devices
        achieved = {name: f.model * per_device / 1e12 for name, f in flops.items()}
        hardware = {name: f.hardware * per_device / 1e12 for name, f in flops.items()}
        peak, peak_note = dense_peak(device, state.identity, opts.dtype)
        mamf, mamf_note = _mamf_ceiling(ranks, opts.dtype, state)
        summary.update({
            "value": round(per_device, 2), "ratio": ratio(achieved[DEFAULT_CONVENTION], peak),
            "theoretical": round(peak * 1e12 / main.model, 2) if peak else None,
            "step_time_s": stats.to_dict(), "tokens_per_s": round(tokens_per_s, 2),
            "tokens_per_s_per_device": round(per_device, 2),
            "tokens_per_s_per_rank": round(tokens_per_s / world, 2),
            "tflops_per_device": {k: _sig(v) for k, v in achieved.items()},
            "peak_tflops": peak, "theoretical_source": peak_note,
            "mfu": ratio(achieved[DEFAULT_CONVENTION], peak), "mfu_book": ratio(achieved["book"], peak),
            "mfu_inconclusive": None if peak else f"no sourced dense peak: {peak_note}",
            "mamf": mamf, "mamf_note": mamf_note,
            "mamfu": ratio(achieved[DEFAULT_CONVENTION], mamf["tflops"] if mamf else None),
            "mamfu_book": ratio(achieved["book"], mamf["tflops"] if mamf else None),
            "hfu": ratio(hardware[DEFAULT_CONVENTION], peak) if opts.checkpointing else None,
            "hfu_book": ratio(hardware["book"], peak) if opts.checkpointing else None,
        })
        if summary["mamfu"] is not None and summary["mamfu"] > 1.0:
            # Not a ceiling then: the MAMF search was cut short or disturbed. Said, not hidden or clipped.
            summary["mamf_note"] = ((summary["mamf_note"] + "; ") if summary["mamf_note"] else "") + (
                f"MAMFU above 100%: this step's matmuls ran faster than that MAMF run found (stop: "
                f"{mamf.get('stop_reason')}), so it is no ceiling; measure again with `mleng mamf --max-seconds 120`")
        rows.append({"phase": "timed", "tokens_per_s_per_device": summary["tokens_per_s_per_device"],
                     "mfu": summary["mfu"], "mamfu": summary["mamfu"],
                     "tflops_per_device": summary["tflops_per_device"][DEFAULT_CONVENTION],
                     "tokens_per_s": summary["tokens_per_s"], "step_time_s_median": stats.median_s,
                     "step_time_s_p90": stats.p90_s, "step_time_s_min": stats.min_s,
                     "step_time_s_max": stats.max_s, "steps": stats.iters, "hfu": summary["hfu"],
                     "peak_allocated_bytes": state.memory.get("peak_allocated_bytes")})
    losses = [s["loss"] for s in state.steps]
    summary["loss"] = {"first": losses[0] if losses else None, "last": losses[-1] if losses else None}
    summary["steps"] = state.steps
    summary["memory"] = state.memory
    if len(ranks) > 1:
        summary["memory_by_rank"] = [r.get("memory") for r in ranks]
    summary["breakdown"] = state.breakdown
    if state.breakdown:
        rows.extend(bd.rows(state.breakdown))
        if len(ranks) > 1:
            summary["breakdown_by_rank"] = [r.get("breakdown") for r in ranks]
    elif state.breakdown_error:
        summary["breakdown_error"] = state.breakdown_error
    summary["gpu_monitor"] = state.gpu_monitor
    if state.info.get("trace"):
        summary["trace"] = state.info["trace"]
    if state.mamf_records or any(r.get("mamf_records") for r in ranks[1:]):
        summary["mamf_measured"] = [m["id"] for r in ranks for m in (r.get("mamf_records") or [])]
    record.rows = rows
    record.summary = summary
    if status == "complete" and not timed:
        status, error = "failed", error or "no step was timed"
    record.finish(status, error)


def _sig(value: float, digits: int = 6) -> float:
    """Six significant digits: a CPU's 0.0019 TFLOPS keeps its precision, an H200's 612.345 too."""
    return float(f"{value:.{digits}g}")


def _slowest_per_step(ranks: list[dict[str, Any]], phase: str) -> list[dict[str, Any]]:
    """A step of the job lasts as long as its slowest rank; steps that some rank did not finish are dropped."""
    per_rank = [[s for s in r.get("steps") or [] if s["phase"] == phase] for r in ranks]
    count = min((len(p) for p in per_rank), default=0)
    return [max((p[i] for p in per_rank), key=lambda s: s["time_s"]) for i in range(count)]


def _mamf_ceiling(ranks: list[dict[str, Any]], dtype: str, state: RankState):
    """The slowest of the ranks' MAMFs: a run measured just now (--mamf) first, else the stored match."""
    from mleng.step.efficiency import find_stored_mamf

    found, notes = [], []
    seen: set[str] = set()
    for r in ranks:
        identity = r.get("identity") or state.identity
        key = identity.get("uuid") or f"{identity.get('host')}/{identity.get('name')}"
        if key in seen:
            continue  # ranks sharing one device (CPU ranks of a host) share its ceiling
        seen.add(key)
        fresh = [m for m in r.get("mamf_records") or [] if m["status"] == "complete" and m["summary"].get("value")]
        if fresh:
            m = fresh[0]
            found.append({"id": m["id"], "tflops": float(m["summary"]["value"]), "match": "measured now (--mamf)",
                          "started_at": m["started_at"], "best_shape": m["summary"].get("best_shape"),
                          "stop_reason": m["summary"].get("stop_reason")})
            continue
        match, note = find_stored_mamf(identity, dtype)
        if match is None:
            notes.append(note)
        else:
            found.append(match)
    if notes:
        return None, "; ".join(dict.fromkeys(notes)) + " (`mleng step --mamf` measures one first)"
    if not found:
        return None, "no MAMF"
    slowest = min(found, key=lambda m: m["tflops"])
    return slowest, (f"the slowest of {len(found)} devices" if len(found) > 1 else None)
