"""The built-in Llama-style decoder for `mleng step`: RMSNorm, RoPE, SwiGLU, grouped-query attention via SDPA.

Flat and readable (nanoGPT/torchtitan style): a reader finds the whole forward pass in this file. Random
weights from a seeded generator; nothing is downloaded. The loss is part of forward so that a compiled
head fuses the output projection with the cross-entropy.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mleng.step.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32 whatever the compute dtype: the mean of squares loses too much in bf16.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.float()).type_as(x)


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, (seq_len, head_dim), in the rotate-half layout of HF's Llama."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.q_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_dim, bias=False)
        self.wo = nn.Linear(cfg.q_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # enable_gqa: the kernel reads each key/value head for its group of query heads, no repeat_kv copy.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)   # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)   # up
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)   # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class CheckpointedBlock(nn.Module):
    """A block whose activations are recomputed in the backward pass (full activation checkpointing)."""

    def __init__(self, block: Block):
        super().__init__()
        self.block = block

    def forward(self, x, cos, sin):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, x, cos, sin, use_reentrant=False)


class Head(nn.Module):
    """Final norm, output projection and the cross-entropy, in one module so that compile can fuse them."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, max_seq_len: int):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.head = Head(cfg)
        if cfg.tie_embeddings:
            self.head.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg.head_dim, max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.head(h, targets)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Normal(0, 0.02) everywhere, output projections of each block scaled by 1/sqrt(2 x layers)
        (GPT-2 / torchtitan practice); norm gains 1. Never zeros or constants."""
        std = 0.02
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("wo.weight", "w2.weight")):
                p.normal_(0.0, std / math.sqrt(2 * self.cfg.n_layers), generator=generator)
            else:
                p.normal_(0.0, std, generator=generator)

    def enable_checkpointing(self) -> None:
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, CheckpointedBlock):
                self.layers[i] = CheckpointedBlock(layer)


def build(cfg: ModelConfig, max_seq_len: int, device, seed: int = 0) -> Transformer:
    """The model on `device` in float32, initialised from `seed` (the same weights on every rank)."""
    with torch.device(device):
        model = Transformer(cfg, max_seq_len)
    generator = torch.Generator(device=device).manual_seed(seed)
    model.init_weights(generator)
    return model


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (a tied embedding once), as torch holds them."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
