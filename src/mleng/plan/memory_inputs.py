"""What a memory estimate reads and counts: the data files (measured activation coefficients, device memory
and overheads), the training setup and its checks, bytes per parameter of each optimizer, the features of a layer
and the phases of a step. Torch-free."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from mleng.errors import UsageError
from mleng.measure.sizes import GIB
from mleng.plan.arch import Arch


DATA_DIR = Path(__file__).parent / "data"
COEFFICIENTS_FILE = DATA_DIR / "activation_coefficients.toml"
DEVICES_FILE = DATA_DIR / "device_memory.toml"

DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16",
          "float32": "float32", "fp32": "float32"}
OPTIMIZERS = ("adamw", "adamw8bit", "sgd", "adafactor")
RECOMPUTE = ("none", "selective", "full")
INFERENCE_WEIGHTS = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "fp4": 0.5 + 1 / 16}
KV_DTYPES = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0}

# Bytes per parameter of the optimizer states (the book, section 5.6: AdamW 8, 8-bit AdamW 2, SGD 4).
# Adafactor is counted from the shapes instead (factored second moments): see optimizer_bytes().
OPTIMIZER_BYTES = {"adamw": 8.0, "adamw8bit": 2.0, "sgd": 4.0}
OPTIMIZER_NOTES = {
    "adamw": "AdamW: two fp32 moments, 8 B/param (the book)",
    "adamw8bit": "8-bit AdamW (bitsandbytes): two 8-bit moments, 2 B/param (the book; block scales not counted)",
    "sgd": "SGD with momentum: one fp32 buffer, 4 B/param (the book)",
    "adafactor": "Adafactor without momentum (torch.optim.Adafactor and HF defaults): factored second moments, "
                 "a row and a column fp32 vector per matrix, whole fp32 moments for vectors; the book's 4 B/param counts a "
                 "momentum buffer these defaults do not keep",
}

# The components of a fit (see fit_coefficients): what each measures, and the features it is linear in.
# Token features are bytes per token per element of the feature; static ones bytes per parameter.
LAYER_FEATURES = ("dim", "q_dim", "kv_dim", "ffn_dim", "n_heads", "layer_params")
HEAD_FEATURES = ("vocab", "dim", "one", "output_params", "block_params")
COMPONENTS = {
    "saved_per_layer": ("what one block's forward leaves saved for its backward", LAYER_FEATURES),
    "before_layers": ("what is saved before the first block (tokens, embedding output)", ("one", "dim")),
    "head_forward": ("the head's forward above the last block's output (logits, their fp32 copy, log-softmax)",
                     HEAD_FEATURES),
    "head_saved": ("what the final norm, output projection and loss leave saved", HEAD_FEATURES),
    "head_backward": ("the head's backward above the end of the forward pass (logits' gradients, output "
                      "weight gradients)", HEAD_FEATURES),
    "after_head": ("change from the end of the forward pass to the start of the last block's backward (head "
                   "freed, its gradients kept, autocast's weight cache dropped)", HEAD_FEATURES),
    "layer_backward": ("a block's backward above its start (recomputed activations, temporaries, the "
                       "block's weight gradients as they arrive)", LAYER_FEATURES),
    "backward_per_layer": ("change from one block's backward start to the next one's (its saved tensors freed, "
                           "its weight gradients kept)", LAYER_FEATURES),
}
STATIC_FEATURES = ("layer_params", "output_params", "block_params")


# ------------------------------------------------------------------------------------------ data files
def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        return {}
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path} is not valid TOML ({exc})") from None


def load_coefficients(path: Path | None = None) -> dict[str, Any]:
    return _read_toml(path or COEFFICIENTS_FILE)


def coefficient_set(dtype: str, recompute: str, data: dict[str, Any] | None = None) -> tuple[dict[str, Any], str]:
    """The measured set for this dtype and recompute mode, and a line saying where it comes from."""
    data = load_coefficients() if data is None else data
    key_dtype = "bfloat16" if dtype == "float16" else dtype
    key = f"{key_dtype}/{recompute}"
    sets = data.get("sets") or {}
    if key not in sets:
        have = ", ".join(sorted(sets)) or "none"
        raise UsageError(f"no measured activation coefficients for {key} (measured: {have})",
                         hint=f"mleng memory --calibrate --dtype {key_dtype} --recompute {recompute}")
    entry = sets[key]
    meta = data.get("meta", {})
    where = (f"activation coefficients {key} measured {entry.get('measured_at', meta.get('date', '?'))} on "
             f"{entry.get('device', '?')} ({entry.get('machine', meta.get('machine', '?'))}) by "
             f"`{entry.get('command', meta.get('command', 'mleng memory --calibrate'))}`; fit residual median "
             f"{entry.get('fit', {}).get('median_abs_error_pct', '?')}%, max {entry.get('fit', {}).get('max_abs_error_pct', '?')}%")
    if dtype == "float16":
        where += "; float16 read as bfloat16 (same sizes)"
    return entry, where


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    key: str
    name: str
    total_bytes: int
    driver_reserved_bytes: int
    source: str
    sources: tuple[str, ...] = ()

    @property
    def usable_bytes(self) -> int:
        return self.total_bytes - self.driver_reserved_bytes


def device_memory(gpu: str, usable_gib: float | None = None) -> DeviceMemory:
    """What a process can have of this GPU: the device total NVML reports (recorded, with its source) less what
    the driver already holds with no process running; the spec label only where no total is recorded."""
    from mleng.specs import lookup_accelerator

    acc = lookup_accelerator(gpu)
    data = _read_toml(DEVICES_FILE)
    sources = data.get("source", {})
    entry = (data.get("device") or {}).get(acc.key)
    defaults = data.get("defaults", {})
    if usable_gib is not None:
        if not usable_gib > 0:
            raise UsageError(f"--usable-gib {usable_gib:g}: must be positive")
        return DeviceMemory(acc.key, acc.name, int(usable_gib * GIB), 0, "given with --usable-gib")
    reserved = defaults.get("idle_used_bytes", 0)
    if entry:
        total = int(entry["nvml_total_mib"]) * 2**20
        short = "; ".join(sources.get(s, {}).get("short", s) for s in entry.get("sources", []))
        titles = tuple(sources.get(s, {}).get("title", s) for s in entry.get("sources", []))
        notes = [entry["note"]] if entry.get("note") else []
        if entry.get("idle_used_bytes") is not None:
            reserved = entry["idle_used_bytes"]
        else:
            notes.append(defaults.get("idle_used_note", ""))
        text = f"NVML memory.total {total / GIB:.2f} GiB ({short}); the label says {acc.memory_gib:g} GB"
        return DeviceMemory(acc.key, acc.name, total, int(reserved), "; ".join([text, *filter(None, notes)]), titles)
    if not acc.memory_gib:
        raise UsageError(f"{acc.name} has no memory size in mleng specs", hint="give --usable-gib")
    return DeviceMemory(acc.key, acc.name, int(acc.memory_gib * GIB), int(reserved),
                        f"the spec label {acc.memory_gib:g} GB read as GiB: no NVML total recorded for {acc.name} "
                        "(totals run 0-7% off the label; --usable-gib overrides); "
                        + defaults.get("idle_used_note", ""))


def overheads() -> dict[str, Any]:
    return _read_toml(DEVICES_FILE).get("overheads", {})


# ------------------------------------------------------------------------------------------ training setup
@dataclasses.dataclass
class TrainSetup:
    seq: int = 2048
    micro_batch: int = 1
    dtype: str = "bfloat16"
    optimizer: str = "adamw"
    zero: int = 0
    fsdp: bool = False
    gpus: int = 1
    tp: int = 1
    pp: int = 1
    recompute: str = "none"
    grad_accum: int | None = None     # micro-batches per step; PP keeps min(pp, this) in flight on stage 0
    gpu: str | None = None
    usable_gib: float | None = None
    context_gib: float | None = None
    nccl_gib: float | None = None
    fragmentation: float | None = None

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def stage(self) -> int:
        """ZeRO stage in effect (FSDP full sharding is stage 3)."""
        return 3 if self.fsdp else self.zero


def _positive_int(flag: str, value: Any, least: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise UsageError(f"{flag} {value}: must be an integer of at least {least}")


def validate(arch: Arch, s: TrainSetup) -> TrainSetup:
    """Refuse what cannot be laid out; returns the setup with its dtype spelled one way."""
    for flag, value in (("--seq", s.seq), ("--micro-batch", s.micro_batch), ("--gpus", s.gpus), ("--tp", s.tp),
                        ("--pp", s.pp)):
        _positive_int(flag, value)
    if s.grad_accum is not None:
        _positive_int("--grad-accum", s.grad_accum)
    if s.dtype not in DTYPES:
        raise UsageError(f"--dtype {s.dtype}: known: bfloat16 (bf16), float16 (fp16), float32 (fp32)")
    s.dtype = DTYPES[s.dtype]
    if s.optimizer not in OPTIMIZERS:
        raise UsageError(f"--optimizer {s.optimizer}: known: {', '.join(OPTIMIZERS)}")
    if s.recompute not in RECOMPUTE:
        raise UsageError(f"--recompute {s.recompute}: known: {', '.join(RECOMPUTE)}")
    if isinstance(s.zero, bool) or s.zero not in (0, 1, 2, 3):
        raise UsageError(f"--zero {s.zero}: ZeRO stages are 0, 1, 2 and 3")
    if s.fsdp and s.zero not in (0, 3):
        raise UsageError(f"--fsdp shards weights, gradients and states (ZeRO-3); it does not combine with --zero {s.zero}")
    if arch.n_heads % s.tp:
        raise UsageError(f"--tp {s.tp} does not divide the {arch.n_heads} attention heads of {arch.name}",
                         hint="tensor parallelism splits whole heads: choose a divisor of the head count")
    if not arch.mla and arch.n_kv_heads % s.tp and s.tp % arch.n_kv_heads:
        raise UsageError(f"--tp {s.tp} and the {arch.n_kv_heads} key/value heads of {arch.name} do not divide "
                         "each other", hint="choose a --tp that divides the key/value heads (or a multiple of them)")
    if s.pp > arch.n_layers:
        raise UsageError(f"--pp {s.pp} is more pipeline stages than the {arch.n_layers} layers of {arch.name}")
    if s.gpus % (s.tp * s.pp):
        raise UsageError(f"--gpus {s.gpus} is not a multiple of --tp {s.tp} x --pp {s.pp} = {s.tp * s.pp}",
                         hint="GPUs = data-parallel replicas x tp x pp")
    if s.fragmentation is not None and not 0 <= s.fragmentation < 1:
        raise UsageError(f"--fragmentation {s.fragmentation:g}: a fraction of the allocated peak, 0 to below 1")
    for flag, value in (("--context-gib", s.context_gib), ("--nccl-gib", s.nccl_gib)):
        if value is not None and value < 0:
            raise UsageError(f"{flag} {value:g}: cannot be negative")
    return s


# ------------------------------------------------------------------------------------------ the model
def _dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def optimizer_bytes(arch: Arch, optimizer: str, params: float) -> tuple[float, str]:
    """Optimizer state bytes for `params` parameters of this shape."""
    if optimizer != "adafactor":
        return OPTIMIZER_BYTES[optimizer] * params, OPTIMIZER_NOTES[optimizer]
    # Factored: rows + cols per matrix. Per-parameter equivalent from the shapes (the embeddings and every
    # projection are matrices; norms are vectors kept whole).
    total = arch.params().total
    matrices = arch.vocab_size + arch.dim  # embedding (and output)
    per_layer = 4 * (arch.dim + arch.q_dim) + 3 * (arch.dim + arch.ffn_dim)
    rows_cols = matrices * (1 if arch.tie_embeddings else 2) + arch.n_layers * per_layer
    vectors = (2 * arch.n_layers + 1) * arch.dim
    per_param = 4.0 * (rows_cols + vectors) / total
    return per_param * params, OPTIMIZER_NOTES["adafactor"] + f" ({per_param:.4f} B/param for this shape)"


def features(arch: Arch, tp: int = 1) -> dict[str, float]:
    """The quantities activations are linear in, per GPU under tensor parallelism (Megatron's layout without
    sequence parallelism: hidden-sized tensors replicated, heads, MLP width and vocabulary split)."""
    moe_share = arch.moe_layers / arch.n_layers
    ffn = (1 - moe_share) * arch.ffn_dim + moe_share * arch.active_ffn_dim(True)
    params = arch.params()
    matmul_layer = (params.layers - 2 * arch.dim * arch.n_layers) / arch.n_layers
    return {"dim": arch.dim, "q_dim": arch.q_dim / tp, "kv_dim": max(arch.kv_dim / tp, arch.head_dim),
            "ffn_dim": ffn / tp, "n_heads": arch.n_heads / tp, "layer_params": matmul_layer / tp,
            "vocab": arch.vocab_size / tp, "one": 1.0, "output_params": arch.vocab_size * arch.dim / tp,
            "block_params": matmul_layer * arch.n_layers / tp}


def _apply(component: dict[str, float], feats: dict[str, float], tokens: float,
           names: tuple[str, ...]) -> tuple[float, float, dict[str, float]]:
    """(token-proportional bytes from non-vocab features, vocab bytes, static bytes by feature) of one component."""
    act = vocab = 0.0
    static: dict[str, float] = {}
    for name in names:
        c = float(component.get(name, 0.0))
        if name in STATIC_FEATURES:
            static[name] = c * feats[name]
        elif name == "vocab":
            vocab += c * feats[name] * tokens
        else:
            act += c * feats[name] * tokens
    return act, vocab, static


def _static_row(component: str, feature: str) -> str:
    """Which table row a fitted static term belongs to: autocast's weight copies, or gradients."""
    if feature == "block_params" or component in ("saved_per_layer", "head_saved", "head_forward"):
        return "weights"
    return "gradients"


@dataclasses.dataclass
class Phase:
    name: str
    weights: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    logits: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits

    def add(self, row: str, value: float) -> None:
        setattr(self, row, getattr(self, row) + value)

    def copy(self, name: str) -> "Phase":
        return dataclasses.replace(self, name=name)


def _fit(dev: DeviceMemory, need: float) -> dict[str, Any]:
    return {"name": dev.name, "key": dev.key, "usable_bytes": dev.usable_bytes,
            "usable_gib": round(dev.usable_bytes / GIB, 2), "device_total_gib": round(dev.total_bytes / GIB, 2),
            "driver_reserved_gib": round(dev.driver_reserved_bytes / GIB, 2), "usable_source": dev.source,
            "usable_sources": list(dev.sources),
            "fits": need <= dev.usable_bytes, "headroom_gib": round((dev.usable_bytes - need) / GIB, 2)}
