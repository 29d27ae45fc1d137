"""What `mleng step` is asked, checked before torch loads: the options and their defaults on this machine, and
whether the model's states fit on each rank (NVML or /proc/meminfo)."""

from __future__ import annotations

import dataclasses
from typing import Any

from mleng.errors import UsageError
from mleng.machine.system import host_available_bytes
from mleng.measure.sizes import format_gib
from mleng.step.config import ModelConfig, param_count


PARALLEL = ("none", "ddp", "fsdp")
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}
MAX_GRAD_NORM = 1.0
# Bytes per parameter held for the whole run: fp32 weights 4, fp32 gradients 4, AdamW's two moments 8.
STATE_BYTES_PER_PARAM = 16


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


WARMUP_MIN_S = 2.0  # on GPUs, warm-up after the first step lasts at least this long
