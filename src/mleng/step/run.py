"""One rank of `mleng step`: build the model, wrap it (none, DDP, FSDP2), train, time each step, profile two
more; rank 0 then assembles the `step` record (record.py) before the group is torn down."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from mleng.errors import MlengError, UsageError
from mleng.measure.sizes import format_gib
from mleng.step.options import MAX_GRAD_NORM, StepOptions, WARMUP_MIN_S, check_fits, state_bytes
from mleng.step.options import precheck, validate  # noqa: F401 - callers of mleng.step.run import them here
from mleng.step.record import RankState, _summarize


OOM_HANDBOOK = "cuda-oom-tried-to-allocate"


Progress = Callable[[str, int, int, dict[str, Any]], None]


def run_rank(options: StepOptions, launch, finish: Callable[[Any, list], None],
             progress: Progress | None = None) -> int:
    """Run this rank. On rank 0, finish(record, extra_records) is called before the process group is torn
    down (teardown can hang when a peer is gone), also after Ctrl-C/SIGTERM or a failure, with what was
    measured. Returns 0; errors propagate after the record is finished."""
    import torch

    from mleng.distributed.group import choose_backend, pick_device
    from mleng.distributed.runner import RankSession

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
    params = {**opts.params(world), "backend": backend, "launch": launch.mode}
    # The CLI's finish stores (or not) and prints: the session itself stores nothing.
    session = RankSession(launch, "step", params, backend=backend, timeout_s=opts.timeout_s, no_store=True,
                          interrupted="interrupted; the steps measured so far are kept", gpus=device.type == "cuda")
    state = RankState()

    def complete(record, job, status, error) -> None:
        _summarize(record, opts, state, job, launch, device, status, error)

    with session.running(complete, lambda s: finish(s.record, state.mamf_records)):
        job = session.join() if needs_group else None
        _train(opts, launch, job, device, state, progress if session.is_root else None)
        if job is not None and world > 1:
            from mleng.distributed.group import gather_to_rank0

            state.info["ranks"] = gather_to_rank0(job, "step_result", state.portable(), timeout_s=opts.timeout_s)
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
