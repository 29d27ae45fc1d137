"""Model shapes for `mleng step`: the presets, --layers, HF-style config.json files, the analytic parameter count.

Torch-free on purpose: bad input (an unknown preset, a config file lacking a field) is refused before torch loads.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from mleng.errors import UsageError


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only Llama-style transformer: RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases."""

    name: str
    vocab_size: int
    dim: int                    # hidden_size
    n_layers: int               # num_hidden_layers
    n_heads: int                # num_attention_heads
    n_kv_heads: int             # num_key_value_heads
    ffn_dim: int                # intermediate_size
    head_dim: int = 0           # 0: dim // n_heads
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    source: str = ""            # where the shape comes from
    notes: tuple[str, ...] = ()  # what of a config file was read but not built (rope_scaling, ...)

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads if self.n_heads else 0)
        validate(self)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def with_layers(self, layers: int | None) -> "ModelConfig":
        """The same width with fewer (or more) layers: the book's way to fit a big shape on a few GPUs."""
        if layers is None or layers == self.n_layers:
            return self
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise UsageError(f"--layers {layers}: give at least 1 layer")
        return dataclasses.replace(self, n_layers=layers, name=f"{self.name.split(' (')[0]} ({layers} layers)")

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["notes"] = list(self.notes)
        return out


def validate(cfg: ModelConfig) -> None:
    for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "head_dim"):
        value = getattr(cfg, field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"model {cfg.name!r}: {field} must be a positive integer, got {value!r}")
    if cfg.n_heads % cfg.n_kv_heads:
        raise UsageError(f"model {cfg.name!r}: {cfg.n_heads} attention heads are not a multiple of "
                         f"{cfg.n_kv_heads} key/value heads (grouped-query attention needs that)")
    if cfg.head_dim % 2:
        raise UsageError(f"model {cfg.name!r}: head_dim {cfg.head_dim} is odd; rotary embeddings need an even one")
    if not cfg.rope_theta > 0 or not cfg.norm_eps > 0:
        raise UsageError(f"model {cfg.name!r}: rope_theta and norm_eps must be positive")


_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5)

# The shapes of published models (random weights here: nothing is downloaded), plus a tiny one for debugging.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig("tiny", vocab_size=512, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=384,
                        rope_theta=10000.0, source="mleng's debugging shape (about 0.5 M parameters, 2 MB in fp32)"),
    "1b": ModelConfig("1b", dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, tie_embeddings=True,
                      source="Llama-3.2-1B config.json (meta-llama/Llama-3.2-1B on Hugging Face)", **_LLAMA3),
    "8b": ModelConfig("8b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                      source="Llama-3-8B / Llama-3.1-8B config.json (meta-llama/Meta-Llama-3-8B)", **_LLAMA3),
    "70b": ModelConfig("70b", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                       source="Llama-3-70B / Llama-3.1-70B config.json (meta-llama/Meta-Llama-3-70B)", **_LLAMA3),
}

# Published parameter counts to check the analytic count against (tests/test_step_model.py).
PUBLISHED_PARAMS = {
    "8b": (8.03e9, "Hugging Face model page meta-llama/Meta-Llama-3-8B: 'Model size 8.03B params' "
                   "(safetensors metadata, 8,030,261,248)"),
}

# HF config.json field -> ours. The first group must be present; the rest have Llama defaults.
_HF_REQUIRED = {"hidden_size": "dim", "intermediate_size": "ffn_dim", "num_hidden_layers": "n_layers",
                "num_attention_heads": "n_heads", "vocab_size": "vocab_size"}
_HF_OPTIONAL = {"num_key_value_heads": "n_kv_heads", "head_dim": "head_dim", "rope_theta": "rope_theta",
                "rms_norm_eps": "norm_eps", "tie_word_embeddings": "tie_embeddings"}
_HF_DEFAULTS = {"rope_theta": 10000.0, "norm_eps": 1e-6, "tie_embeddings": False}  # transformers' LlamaConfig
_SUPPORTED_TYPES = ("llama",)


def load_config_file(path: str) -> ModelConfig:
    """A Hugging Face-style config.json of a Llama model, read locally (never downloaded)."""
    file = Path(path).expanduser()
    if not file.exists():
        raise UsageError(f"--config {path}: no such file", hint="give the path of a local config.json")
    data, file = read_config_json(file, f"--config {path}")
    return config_from_hf(data, name=file.parent.name or file.stem, where=str(file))


def read_config_json(path: Path, label: str) -> tuple[dict[str, Any], Path]:
    """The JSON object of a local config.json (or of the one in a folder), and the file it came from;
    every problem is one UsageError starting with `label` (what the user typed)."""
    file = path
    if file.is_dir():
        if not (file / "config.json").is_file():
            raise UsageError(f"{label} is a folder without a config.json", hint="give the config.json file")
        file = file / "config.json"
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{label}: cannot read it ({exc})") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{label} is not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{label}: expected a JSON object (a Hugging Face config.json)")
    return data, file


def config_from_hf(data: dict[str, Any], name: str = "config", where: str = "config.json") -> ModelConfig:
    model_type = data.get("model_type")
    if model_type is not None and model_type not in _SUPPORTED_TYPES:
        raise UsageError(f"{where}: model_type {model_type!r} is not built by mleng step",
                         hint="mleng step builds Llama-style models (model_type 'llama'); give such a config "
                              "or a preset (--model tiny, 1b, 8b, 70b)")
    missing = [key for key in _HF_REQUIRED if key not in data]
    if missing:
        raise UsageError(f"{where}: missing field{'s' if len(missing) > 1 else ''} {', '.join(missing)}",
                         hint="an HF Llama config.json has hidden_size, intermediate_size, num_hidden_layers, "
                              "num_attention_heads and vocab_size")
    values: dict[str, Any] = dict(_HF_DEFAULTS)
    for key, ours in {**_HF_REQUIRED, **_HF_OPTIONAL}.items():
        if key in data and data[key] is not None:
            values[ours] = data[key]
    values.setdefault("n_kv_heads", values["n_heads"])
    for key in ("attention_bias", "mlp_bias"):
        if data.get(key):
            raise UsageError(f"{where}: {key} is true; mleng step builds Llama without biases")
    notes = []
    if data.get("rope_scaling"):
        notes.append("rope_scaling ignored: it changes the rotary frequencies, not the FLOPs or the speed")
    for key in ("dim", "ffn_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "head_dim"):
        value = values.get(key)
        if key in values and (isinstance(value, bool) or not isinstance(value, int)):
            raise UsageError(f"{where}: {_hf_name(key)} must be an integer, got {value!r}")
    try:
        return ModelConfig(name=name, source=where, notes=tuple(notes), **values)
    except UsageError as exc:
        raise UsageError(f"{where}: {exc.message.split(': ', 1)[-1]}") from None


def _hf_name(ours: str) -> str:
    return next((k for k, v in {**_HF_REQUIRED, **_HF_OPTIONAL}.items() if v == ours), ours)


def resolve(model: str | None, config_file: str | None, layers: int | None) -> ModelConfig:
    """--model PRESET or --config FILE, then --layers."""
    if model and config_file:
        raise UsageError("give --model PRESET or --config FILE, not both")
    if config_file:
        cfg = load_config_file(config_file)
    else:
        key = (model or "tiny").strip().lower()
        if key not in PRESETS:
            raise UsageError(f"unknown model preset {model!r}; known: {', '.join(PRESETS)}",
                             hint="or give a local HF config.json with --config FILE")
        cfg = PRESETS[key]
    return cfg.with_layers(layers)


@dataclasses.dataclass(frozen=True)
class ParamCount:
    """Parameters by where they sit; `total` counts a tied embedding once."""

    embedding: int          # the input embedding table
    output: int             # the output projection (the same tensor as the embedding when tied)
    attention: int          # per model: q, k, v, o projections of every layer
    mlp: int                # per model: gate, up, down of every layer
    norms: int              # RMSNorm gains, every layer's two and the final one
    tied: bool

    @property
    def total(self) -> int:
        return self.embedding + (0 if self.tied else self.output) + self.attention + self.mlp + self.norms

    @property
    def matmul(self) -> int:
        """Weights that take part in a matmul for every token: every linear layer, the output projection
        included (also when tied), the embedding lookup and the norm gains not."""
        return self.output + self.attention + self.mlp

    @property
    def layers(self) -> int:
        """Matmul weights inside the transformer blocks (what activation checkpointing recomputes)."""
        return self.attention + self.mlp

    def to_dict(self) -> dict[str, int | bool]:
        return {**dataclasses.asdict(self), "total": self.total, "matmul": self.matmul, "layers": self.layers}


def param_count(cfg: ModelConfig) -> ParamCount:
    attention_per_layer = cfg.dim * cfg.q_dim + 2 * cfg.dim * cfg.kv_dim + cfg.q_dim * cfg.dim
    mlp_per_layer = 3 * cfg.dim * cfg.ffn_dim
    return ParamCount(
        embedding=cfg.vocab_size * cfg.dim,
        output=cfg.vocab_size * cfg.dim,
        attention=cfg.n_layers * attention_per_layer,
        mlp=cfg.n_layers * mlp_per_layer,
        norms=(2 * cfg.n_layers + 1) * cfg.dim,
        tied=cfg.tie_embeddings,
    )
