"""Real training steps measured for memory: the peak of torch's own tracking (MemTracker on a CPU, the CUDA caching
allocator's statistics on a GPU) for `mleng memory --measure` and `--calibrate`.

The step is mleng step's: its model (mleng.step.model), its synthetic tokens, AdamW with its settings, bf16 autocast
with fp32 master weights, gradient clipping, zero_grad(set_to_none=True). What step lacks (selective recompute,
other optimizers) is added here, never in mleng.step.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from mleng.errors import NotAvailableError, UsageError

# Ops whose outputs selective recompute keeps: the matmuls and the attention kernel (everything else, norms,
# rotary, SiLU, products, is recomputed in the backward pass). The policy of torchtitan's "op" SAC, without its
# every-other-matmul rule.
_SAVE_OPS = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")


CPU_TRACKING = ("torch.distributed._tools.mem_tracker.MemTracker (live tensor storages, rounded to 512 bytes as the "
                "CUDA allocator does) over the second step")
CUDA_TRACKING = "torch.cuda.max_memory_allocated (the caching allocator's peak) over the second step"


@dataclasses.dataclass
class ProbeResult:
    peak_bytes: int               # the allocator peak during a steady step (or MemTracker's on a CPU)
    before_step_bytes: int        # live bytes just before that step: weights, optimizer states, buffers
    reserved_peak_bytes: int | None
    device: str
    tracking: str
    phase_peak: dict[str, Any] = dataclasses.field(default_factory=dict)  # MemTracker's totals by phase

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _selective_policy():
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    keep = set()
    for name in _SAVE_OPS:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            keep.add(packet.default)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _wrap_selective(model) -> None:
    """Selective activation checkpointing of every block (torch.utils.checkpoint with a save policy)."""
    from torch import nn
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    policy = _selective_policy()

    class SelectiveBlock(nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x, cos, sin):
            return checkpoint(self.block, x, cos, sin, use_reentrant=False,
                              context_fn=functools.partial(create_selective_checkpoint_contexts, policy))

    for i, layer in enumerate(model.layers):
        model.layers[i] = SelectiveBlock(layer)


def _optimizer(name: str, params, device):
    import torch

    if name == "adamw":
        # mleng step's settings; fused on a CPU too (mleng step fuses on GPUs only), so that a CPU measurement
        # has the GPU's optimizer memory: the unfused CPU path makes a temporary the size of each parameter.
        return torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=1e-2)
    raise UsageError(f"--optimizer {name} cannot be measured here",
                     hint="adamw8bit needs bitsandbytes; measure adamw, sgd or adafactor, or drop --measure")


def measure_step(cfg, seq: int, micro_batch: int, dtype: str = "float32", recompute: str = "none",
                 optimizer: str = "adamw", device: str | None = None, seed: int = 0,
                 phases: bool = False) -> ProbeResult:
    """Peak memory of one steady training step (the second: the first allocates the optimizer states)."""
    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cpu":
        # Memory does not depend on threads, and OpenMP's spinning threads on a busy host turn a 0.1 s step into
        # 10 s: one thread.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return _measure(cfg, seq, micro_batch, dtype, recompute, optimizer, dev, seed, phases)
        finally:
            torch.set_num_threads(threads)
    return _measure(cfg, seq, micro_batch, dtype, recompute, optimizer, dev, seed, phases)


def _measure(cfg, seq, micro_batch, dtype, recompute, optimizer, dev, seed, phases) -> ProbeResult:
    import torch

    from mleng.step.data import SyntheticTokens
    from mleng.step.model import build

    if dtype not in ("float32", "bfloat16"):
        raise UsageError(f"--dtype {dtype}: the measured step runs in float32 or bfloat16 (autocast)")
    torch.manual_seed(seed)
    model = build(cfg, seq, dev, seed=seed)
    if recompute == "full":
        model.enable_checkpointing()
    elif recompute == "selective":
        _wrap_selective(model)
    opt = _optimizer(optimizer, model.parameters(), dev)
    data = SyntheticTokens(cfg.vocab_size, seq, dev, seed=seed)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")

    def step(i: int) -> None:
        tokens, targets = data.batch(i, 0, micro_batch, micro_batch)
        with autocast:
            loss = model(tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    try:
        step(0)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            phase_totals = _cuda_phases(model, step, dev) if phases else {}
            before_alloc = int(torch.cuda.memory_allocated(dev))
            torch.cuda.reset_peak_memory_stats(dev)
            step(2)
            torch.cuda.synchronize(dev)
            peak = int(torch.cuda.max_memory_allocated(dev))
            if phase_totals:
                phase_totals["peak"] = max(peak, phase_totals["peak"])
            return ProbeResult(peak, before_alloc, int(torch.cuda.max_memory_reserved(dev)), str(dev),
                               CUDA_TRACKING, phase_totals)
        from torch.distributed._tools.mem_tracker import MemTracker, _ModState

        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            before = int(tracker.get_tracker_snapshot("current").get(dev, {}).get("Total", 0))
            step(1)
        peak = int(tracker.get_tracker_snapshot("peak").get(dev, {}).get("Total", 0))

        def total(module, state, index=0) -> int:
            shots = tracker.memory_tracking[module].snapshots.get(state) or []
            if not shots:
                raise RuntimeError(f"MemTracker recorded no {state} for {type(module).__name__}")
            return int(shots[index][dev]["Total"])

        phase_totals = {
            "before": before,
            "layer_post_fw": [total(layer, _ModState.POST_FW) for layer in model.layers],
            "forward_end": total(model, _ModState.POST_FW),
            "head_peak_fw": total(model.head, _ModState.PEAK_FW),
            "head_peak_bw": total(model.head, _ModState.PEAK_BW),
            "layer_pre_bw": [total(layer, _ModState.PRE_BW) for layer in model.layers],
            "layer_peak_bw": [total(layer, _ModState.PEAK_BW) for layer in model.layers],
            "peak": peak,
        }
        return ProbeResult(peak, before, None, str(dev), CPU_TRACKING, phase_totals)
    except torch.OutOfMemoryError as exc:
        first = (str(exc).strip().splitlines() or ["out of memory"])[0]
        raise NotAvailableError(f"the measured step ran out of memory: {first.split('. ')[0]}") from None
    finally:
        del model, opt
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def _cuda_phases(model, step, dev) -> dict[str, Any]:
    """The same phases as MemTracker's, from the CUDA caching allocator, which also sees what kernels allocate
    inside themselves (flash attention's backward accumulators, cuBLAS workspaces)."""
    import torch

    def sync_then(fn):
        def call():
            torch.cuda.synchronize(dev)
            return int(fn(dev))
        return call

    return hook_phases(model, step, sync_then(torch.cuda.memory_allocated),
                       sync_then(torch.cuda.max_memory_allocated), lambda: torch.cuda.reset_peak_memory_stats(dev))


def hook_phases(model, step, now, peak, reset) -> dict[str, Any]:
    """Live bytes at the end of each block's forward and of the forward pass, at each block's backward start, and
    the peak between a module's backward start and end (the peak reset at each start), with torch's ModTracker
    hooks around one step. `now`, `peak` and `reset` read the tracking (the CUDA allocator, or LiveBytes)."""
    from torch.distributed._tools.mod_tracker import ModTracker

    layers = {id(m): i for i, m in enumerate(model.layers)}
    n = len(model.layers)
    out: dict[str, Any] = {"layer_post_fw": [0] * n, "layer_pre_bw": [0] * n, "layer_peak_bw": [0] * n,
                           "forward_end": 0, "head_peak_fw": 0, "head_peak_bw": 0, "peak": 0}
    tracker = ModTracker()

    def pre_fw(module, inputs):
        if module is model.head and not tracker.is_bw:
            out["peak"] = max(out["peak"], peak())
            reset()

    def post_fw(module, inputs, outputs):
        if tracker.is_bw:
            return  # a recomputation under activation checkpointing
        if module is model.head:
            out["head_peak_fw"] = peak()
        if id(module) in layers:
            out["layer_post_fw"][layers[id(module)]] = now()
        elif module is model:
            out["forward_end"] = now()

    # A block's backward ends where the next one's starts: the hook on its inputs' gradients fires after the
    # next block's hook on the same tensor. So the peak of the running module is read when the next one starts
    # (and, for the last, when its own inputs' gradients are done).
    running: list = [None]

    def close(module) -> None:
        if module is None:
            return
        value = peak()
        if id(module) in layers:
            i = layers[id(module)]
            out["layer_peak_bw"][i] = max(out["layer_peak_bw"][i], value)
        elif module is model.head:
            out["head_peak_bw"] = max(out["head_peak_bw"], value)

    def pre_bw(module, grads):
        if module is None or not (id(module) in layers or module is model.head):
            return
        close(running[0])
        if id(module) in layers:
            out["layer_pre_bw"][layers[id(module)]] = now()
        out["peak"] = max(out["peak"], peak())
        reset()
        running[0] = module

    def post_bw(module, grads):
        if module is not None and module is running[0]:
            close(module)

    out["before"] = now()
    reset()
    tracker.register_user_hooks(pre_fw, post_fw, pre_bw, post_bw)
    try:
        with tracker:
            step(1)
    finally:
        tracker.clear_user_hooks()
    out["peak"] = max(out["peak"], peak())
    return out


class LiveBytes:
    """A TorchDispatchMode that counts the bytes of live tensor storages (rounded up to 512 bytes as the CUDA
    caching allocator and MemTracker round), with a resettable peak: the allocator statistics' stand-in on a CPU.
    Tensors that exist before it is entered are counted when an op first returns them, so enter it before the
    model is built."""

    def __init__(self):
        import weakref

        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_map_only

        counter = self
        self.live = 0
        self.max = 0
        self._seen: dict[int, int] = {}

        def free(key: int) -> None:
            counter.live -= counter._seen.pop(key, 0)

        def track(t) -> None:
            st = t.untyped_storage()
            key = st._cdata
            size = -(-st.nbytes() // 512) * 512
            old = counter._seen.get(key)
            if old is None:
                counter._seen[key] = size
                counter.live += size
                weakref.finalize(st, free, key)
            elif old != size:
                counter._seen[key] = size
                counter.live += size - old
            counter.max = max(counter.max, counter.live)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tree_map_only(torch.Tensor, track, out)
                return out

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)

    def now(self) -> int:
        return self.live

    def peak(self) -> int:
        return self.max

    def reset(self) -> None:
        self.max = self.live


# ------------------------------------------------------------------------------------------ calibration

# Shrunk shapes whose features vary independently of each other (dim, q, kv, ffn, heads, vocab): what the
# least-squares fit needs. (dim, heads, kv_heads, head_dim, ffn, vocab)
CALIBRATION_SHAPES = (
    (64, 4, 2, 16, 192, 256),
    (128, 4, 2, 32, 384, 512),
    (64, 8, 8, 16, 128, 512),
    (96, 2, 1, 32, 512, 384),
    (64, 4, 1, 32, 256, 1024),
    (128, 8, 2, 8, 256, 256),
    (32, 4, 4, 16, 640, 768),
    (256, 8, 4, 32, 704, 2048),
)
CALIBRATION_LAYERS = (2, 3)
CALIBRATION_TOKENS = ((1, 256), (2, 192))   # (micro_batch, seq)


def calibration_runs() -> list[dict[str, Any]]:
    """Every shape at both layer counts and both token counts."""
    runs = []
    for dim, heads, kv, hd, ffn, vocab in CALIBRATION_SHAPES:
        for layers in CALIBRATION_LAYERS:
            for mb, seq in CALIBRATION_TOKENS:
                runs.append(dict(dim=dim, n_heads=heads, n_kv_heads=kv, head_dim=hd, ffn_dim=ffn, vocab_size=vocab,
                                 n_layers=layers, micro_batch=mb, seq=seq))
    return runs


def run_calibration(dtype: str, recompute: str, device: str | None = None, progress=None) -> dict[str, Any]:
    """Measure every calibration run and fit the activation coefficients of one (dtype, recompute) set."""
    from mleng.plan import memory
    from mleng.step.config import ModelConfig

    measured = []
    runs = calibration_runs()
    for i, run in enumerate(runs):
        cfg = ModelConfig(name="calibration", vocab_size=run["vocab_size"], dim=run["dim"], n_layers=run["n_layers"],
                          n_heads=run["n_heads"], n_kv_heads=run["n_kv_heads"], ffn_dim=run["ffn_dim"],
                          head_dim=run["head_dim"], rope_theta=10000.0)
        result = measure_step(cfg, run["seq"], run["micro_batch"], dtype=dtype, recompute=recompute, device=device,
                              phases=True)
        # The fit reads MemTracker's phases; the peak it is judged against is the same tracker's, so that a
        # GPU calibration is not mixed with allocator rounding.
        measured.append({**run, "peak_bytes": result.phase_peak["peak"], "phases": result.phase_peak,
                         "device": result.device, "tracking": result.tracking})
        if progress:
            progress(i + 1, len(runs), measured[-1])
    return memory.fit_coefficients(measured, dtype=dtype, recompute=recompute)
