"""Model shapes for `mleng memory` and `mleng plan`: a `mleng step` preset or a local HF config.json (dense, GQA/MQA,
mixture-of-experts, DeepSeek's multi-head latent attention), with its parameters counted by where they sit.

Torch-free: a bad config is refused before anything heavy loads. `mleng step` builds only the dense Llama shape
(mleng.step.config); this reader covers more families because estimating memory does not need to build them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from mleng.errors import UsageError

# model_type values whose shapes this module knows; anything else is refused by name.
DENSE_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo2", "granite")
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")
KNOWN_TYPES = DENSE_TYPES + MOE_TYPES

_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


@dataclasses.dataclass(frozen=True)
class Arch:
    """A decoder-only transformer as memory sees it."""

    name: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int                     # dense MLP width (SwiGLU: gate, up, down)
    tie_embeddings: bool = False
    model_type: str = "llama"
    source: str = ""
    # mixture of experts (0: dense)
    n_experts: int = 0
    experts_per_token: int = 0
    moe_ffn_dim: int = 0             # one routed expert's width
    shared_ffn_dim: int = 0          # all shared experts together
    dense_layers: int = 0            # leading layers with a dense MLP (DeepSeek's first_k_dense_replace)
    # multi-head latent attention (0: ordinary attention)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    attention_bias: bool = False
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"model {self.name!r}: {field} must be a positive integer, got {value!r}")
        if not self.moe or self.dense_layers:
            if isinstance(self.ffn_dim, bool) or not isinstance(self.ffn_dim, int) or self.ffn_dim < 1:
                raise UsageError(f"model {self.name!r}: ffn_dim must be a positive integer, got {self.ffn_dim!r}")
        if self.n_heads % self.n_kv_heads:
            raise UsageError(f"model {self.name!r}: {self.n_heads} attention heads are not a multiple of "
                             f"{self.n_kv_heads} key/value heads")
        if self.moe and not (0 < self.experts_per_token <= self.n_experts and self.moe_ffn_dim > 0):
            raise UsageError(f"model {self.name!r}: a mixture of experts needs 0 < experts per token <= "
                             f"{self.n_experts} experts and a positive expert width")
        if self.dense_layers > self.n_layers:
            raise UsageError(f"model {self.name!r}: {self.dense_layers} dense layers of {self.n_layers}")

    # -- shape ---------------------------------------------------------------------------------------
    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def attention_kind(self) -> str:
        if self.mla:
            return "MLA"
        if self.n_kv_heads == self.n_heads:
            return "MHA"
        return "MQA" if self.n_kv_heads == 1 else "GQA"

    @property
    def q_dim(self) -> int:
        return self.n_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim if self.mla else self.head_dim)

    @property
    def kv_dim(self) -> int:
        """Width of the keys (and of the values) as attention computes them."""
        return self.q_dim if self.mla else self.n_kv_heads * self.head_dim

    @property
    def attn_out_dim(self) -> int:
        return self.n_heads * (self.v_head_dim if self.mla else self.head_dim)

    @property
    def moe_layers(self) -> int:
        return self.n_layers - self.dense_layers if self.moe else 0

    def active_ffn_dim(self, moe_layer: bool) -> int:
        """MLP width a token goes through: routed experts it is sent to plus the shared ones."""
        if not moe_layer:
            return self.ffn_dim
        return self.experts_per_token * self.moe_ffn_dim + self.shared_ffn_dim

    def with_layers(self, layers: int | None) -> "Arch":
        if layers is None or layers == self.n_layers:
            return self
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise UsageError(f"--layers {layers}: give at least 1 layer")
        return dataclasses.replace(self, n_layers=layers, dense_layers=min(self.dense_layers, layers),
                                   name=f"{self.name.split(' (')[0]} ({layers} layers)")

    # -- parameters ----------------------------------------------------------------------------------
    def attention_params(self) -> int:
        """One layer's attention projections (and MLA's low-rank norms)."""
        d = self.dim
        if self.mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.n_heads * qk
                 if self.q_lora_rank else d * self.n_heads * qk)
            kv = (d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
                  + self.kv_lora_rank * self.n_heads * (self.qk_nope_head_dim + self.v_head_dim))
            return q + kv + self.n_heads * self.v_head_dim * d
        bias = (self.q_dim + 2 * self.kv_dim) if self.attention_bias else 0
        return d * self.q_dim + 2 * d * self.kv_dim + self.q_dim * d + bias

    def dense_mlp_params(self) -> int:
        return 3 * self.dim * self.ffn_dim

    def moe_mlp_params(self) -> int:
        """One MoE layer: every routed expert, the shared experts, the router."""
        return (3 * self.dim * self.moe_ffn_dim * self.n_experts + 3 * self.dim * self.shared_ffn_dim
                + self.dim * self.n_experts)

    def layer_params(self, moe_layer: bool = False) -> int:
        mlp = self.moe_mlp_params() if moe_layer else self.dense_mlp_params()
        return self.attention_params() + mlp + 2 * self.dim

    def params(self) -> "Params":
        dense = self.n_layers - self.moe_layers
        return Params(embedding=self.vocab_size * self.dim, output=self.vocab_size * self.dim,
                      layers=dense * self.layer_params(False) + self.moe_layers * self.layer_params(True),
                      final_norm=self.dim, tied=self.tie_embeddings,
                      largest_layer=self.layer_params(self.moe_layers > 0))

    def kv_elements_per_token_per_layer(self) -> int:
        """What the KV cache keeps per token and layer: keys and values of the key/value heads, or MLA's
        compressed latent plus its decoupled rotary key."""
        if self.mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.n_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["notes"] = list(self.notes)
        out["attention"] = self.attention_kind
        out["parameters"] = self.params().to_dict()
        return out

    def step_config(self):
        """The mleng step ModelConfig of this shape (what --measure and --calibrate build)."""
        from mleng.step.config import ModelConfig

        if self.moe or self.mla or self.attention_bias:
            what = "a mixture of experts" if self.moe else "MLA" if self.mla else "attention biases"
            raise UsageError(f"model {self.name}: mleng step builds dense Llama-style models, not {what}, so "
                             "it cannot be measured here", hint="the estimate needs no measurement; drop --measure")
        return ModelConfig(name=self.name, vocab_size=self.vocab_size, dim=self.dim, n_layers=self.n_layers,
                           n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, ffn_dim=self.ffn_dim,
                           head_dim=self.head_dim, tie_embeddings=self.tie_embeddings, source=self.source)


@dataclasses.dataclass(frozen=True)
class Params:
    embedding: int
    output: int
    layers: int          # every transformer block (attention, MLP or experts, the two norms)
    final_norm: int
    tied: bool
    largest_layer: int   # one block (the widest, for MoE models), the unit FSDP gathers

    @property
    def total(self) -> int:
        return self.embedding + (0 if self.tied else self.output) + self.layers + self.final_norm

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "total": self.total}


def from_step(cfg) -> Arch:
    """A mleng step ModelConfig (a preset, --layers applied) as an Arch."""
    return Arch(name=cfg.name, vocab_size=cfg.vocab_size, dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, ffn_dim=cfg.ffn_dim,
                tie_embeddings=cfg.tie_embeddings, source=cfg.source)


def resolve(model: str, layers: int | None = None) -> Arch:
    """MODEL is a step preset (tiny, 1b, 8b, 70b) or the path of a local config.json (or its folder)."""
    from mleng.step.config import PRESETS

    if not isinstance(model, str) or not model.strip():
        raise UsageError("give a model: a preset (" + ", ".join(PRESETS) + ") or a local config.json")
    key = model.strip().lower()
    if key in PRESETS:
        return from_step(PRESETS[key]).with_layers(layers)
    path = Path(model).expanduser()
    if not path.exists():
        raise UsageError(f"model {model!r}: neither a preset ({', '.join(PRESETS)}) nor a file",
                         hint="give a preset or the path of a local Hugging Face config.json")
    return load_config_file(path).with_layers(layers)


def load_config_file(path: Path) -> Arch:
    from mleng.step.config import read_config_json

    data, file = read_config_json(path, str(path))
    return from_hf(data, name=file.parent.name or file.stem, where=str(file))


def _int(data: dict, key: str, where: str, default: Any = None, least: int = 1) -> Any:
    value = data.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise UsageError(f"{where}: {key} must be an integer of at least {least}, got {value!r}")
    return value


def from_hf(data: dict[str, Any], name: str = "config", where: str = "config.json") -> Arch:
    """A Hugging Face config.json (a composite config's text_config is used when there is one)."""
    if isinstance(data.get("text_config"), dict):
        data = {**data["text_config"], "model_type": data["text_config"].get("model_type", data.get("model_type"))}
    model_type = data.get("model_type") or "llama"
    if model_type not in KNOWN_TYPES:
        raise UsageError(f"{where}: model_type {model_type!r} is not modelled by mleng memory",
                         hint="known: " + ", ".join(KNOWN_TYPES))
    missing = [k for k in _REQUIRED if data.get(k) is None]
    if "intermediate_size" not in data and model_type not in ("qwen3_moe",):
        missing.append("intermediate_size")
    if missing:
        raise UsageError(f"{where}: missing field{'s' if len(missing) > 1 else ''} {', '.join(missing)}",
                         hint="a decoder config.json has hidden_size, intermediate_size, num_hidden_layers, "
                              "num_attention_heads and vocab_size")
    dim = _int(data, "hidden_size", where)
    heads = _int(data, "num_attention_heads", where)
    kv_heads = _int(data, "num_key_value_heads", where, default=heads)
    head_dim = _int(data, "head_dim", where, default=dim // heads if dim % heads == 0 else None)
    if head_dim is None:
        raise UsageError(f"{where}: hidden_size {dim} is not a multiple of num_attention_heads {heads} and there "
                         "is no head_dim")
    notes: list[str] = []
    values: dict[str, Any] = dict(
        name=name, source=where, model_type=model_type, vocab_size=_int(data, "vocab_size", where), dim=dim,
        n_layers=_int(data, "num_hidden_layers", where), n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim,
        ffn_dim=_int(data, "intermediate_size", where, default=0, least=0),
        tie_embeddings=bool(data.get("tie_word_embeddings", model_type.startswith("gemma"))),
        attention_bias=bool(data.get("attention_bias", model_type == "qwen2")))
    if model_type == "mixtral":
        values.update(n_experts=_int(data, "num_local_experts", where, default=8),
                      experts_per_token=_int(data, "num_experts_per_tok", where, default=2),
                      moe_ffn_dim=values["ffn_dim"])
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        values.update(n_experts=_int(data, "num_experts", where), experts_per_token=_int(data, "num_experts_per_tok", where),
                      moe_ffn_dim=_int(data, "moe_intermediate_size", where),
                      shared_ffn_dim=_int(data, "shared_expert_intermediate_size", where, default=0, least=0))
        if data.get("mlp_only_layers") or (data.get("decoder_sparse_step") or 1) != 1:
            notes.append("mlp_only_layers / decoder_sparse_step ignored: every layer counted as an MoE layer")
    elif model_type in ("deepseek_v2", "deepseek_v3"):
        experts = _int(data, "n_routed_experts", where, default=0, least=0)
        if experts:
            values.update(n_experts=experts, experts_per_token=_int(data, "num_experts_per_tok", where),
                          moe_ffn_dim=_int(data, "moe_intermediate_size", where),
                          shared_ffn_dim=_int(data, "n_shared_experts", where, default=0, least=0)
                          * _int(data, "moe_intermediate_size", where),
                          dense_layers=_int(data, "first_k_dense_replace", where, default=0, least=0))
            if (data.get("moe_layer_freq") or 1) != 1:
                notes.append("moe_layer_freq ignored: every layer after first_k_dense_replace counted as MoE")
        if data.get("kv_lora_rank"):
            values.update(q_lora_rank=_int(data, "q_lora_rank", where, default=0, least=0),
                          kv_lora_rank=_int(data, "kv_lora_rank", where),
                          qk_rope_head_dim=_int(data, "qk_rope_head_dim", where),
                          qk_nope_head_dim=_int(data, "qk_nope_head_dim", where),
                          v_head_dim=_int(data, "v_head_dim", where))
        if data.get("num_nextn_predict_layers"):
            notes.append("num_nextn_predict_layers (multi-token prediction modules) not counted")
    if data.get("sliding_window") and data.get("use_sliding_window", True):
        notes.append("sliding_window ignored: attention and the KV cache counted over the whole sequence")
    if data.get("quantization_config"):
        notes.append("quantization_config ignored: the dtype flags set the bytes per parameter")
    try:
        return Arch(notes=tuple(notes), **values)
    except UsageError as exc:
        raise UsageError(f"{where}: {exc.message.split(': ', 1)[-1]}") from None
