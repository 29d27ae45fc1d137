"""FLOPs per token of a training step (forward + backward) from the architecture, under two named conventions.

- "palm" (mleng's default): 6 x N_matmul + 12 x L x H x Q x T per token. PaLM (Chowdhery et al. 2022,
  appendix B) and torchtitan (get_nparams_and_flops) count it this way: 2 FLOPs per weight per token in the
  forward pass and 4 in the backward, plus attention's two matmuls per layer (QK^T and PV, 2 x 2 x H x Q x T
  forward, twice that backward) over the full T x T score matrix, not halved for the causal mask. N_matmul is
  every linear weight, the output projection included (also when tied to the embedding; torchtitan, which
  subtracts the embedding table from the unique parameters, would drop a tied output projection); the
  embedding lookup and the norm gains do no matmul and are not counted. It is what
  torch.utils.flop_counter.FlopCounterMode counts for the same step (tests/test_step_flops.py).
- "book": 6 x N per token, N every parameter, no attention term: the book's estimate
  `model_size_in_B * 3 * 2 * seqlen * global_batch_size` (Megatron-LM / BLOOM), and `* 4 * 2` with activation
  recomputation. It leaves out attention, which grows with T, and counts the embedding table as if it were a
  matmul; at 8B shape and T = 8192 it is 17 % below "palm".

Hardware FLOPs (for HFU) add what activation checkpointing recomputes: under "palm", one more forward pass of
every transformer block except its last matmul (2 x (N_layers - L x dim x ffn) + 4 x L x H x Q x T per token):
torch.utils.checkpoint (non-reentrant) stops recomputing once every saved tensor is back, and the SwiGLU down
projection's output is saved by nothing. Under "book": 8 x N instead of 6 x N.
A fused attention kernel's own recomputation in its backward (flash attention recomputes QK^T) is not counted
as model or hardware FLOPs here; FlopCounterMode does count it on GPUs (5 backward matmuls instead of 4).
"""

from __future__ import annotations

import dataclasses

from mleng.step.config import ModelConfig, param_count

CONVENTIONS = {
    "palm": "6*N_matmul + 12*L*H*Q*T per token (PaLM appendix B, torchtitan); attention over the full T x T",
    "book": "6*N per token, N all parameters, no attention term (the book's model_size*3*2*seqlen; *4*2 recomputing)",
}
DEFAULT_CONVENTION = "palm"
# Print both conventions when they differ by more than this (relative to the default one).
DIFFER_REPORT = 0.01


@dataclasses.dataclass(frozen=True)
class FlopsPerToken:
    convention: str
    model: float            # MFU's numerator per token: fwd + bwd, no recomputation
    hardware: float         # HFU's numerator per token: model + what activation checkpointing recomputes
    dense: float            # the 6N part
    attention: float        # the attention part (0 under "book")

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "formula": CONVENTIONS[self.convention]}


def attention_flops_per_token(cfg: ModelConfig, seq_len: int, passes: int = 3) -> float:
    """QK^T and PV: 2 matmuls x 2 FLOPs x H x Q per token per key position, times T key positions,
    per layer; forward only at passes=1, forward + backward (3x) at passes=3."""
    return passes * 4.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len


def flops_per_token(cfg: ModelConfig, seq_len: int, convention: str = DEFAULT_CONVENTION,
                    recompute: bool = False) -> FlopsPerToken:
    if convention not in CONVENTIONS:
        raise ValueError(f"unknown FLOP convention {convention!r}; known: {', '.join(CONVENTIONS)}")
    params = param_count(cfg)
    if convention == "book":
        dense = 6.0 * params.total
        hardware = 8.0 * params.total if recompute else dense
        return FlopsPerToken("book", dense, hardware, dense, 0.0)
    dense = 6.0 * params.matmul
    attention = attention_flops_per_token(cfg, seq_len, passes=3)
    model = dense + attention
    hardware = model
    if recompute:
        recomputed = params.layers - cfg.n_layers * cfg.dim * cfg.ffn_dim  # all but the down projection
        hardware += 2.0 * recomputed + attention_flops_per_token(cfg, seq_len, passes=1)
    return FlopsPerToken("palm", model, hardware, dense, attention)


def forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """One forward pass, "palm" convention: 2 x N_matmul + 4 x L x H x Q x T."""
    return 2.0 * param_count(cfg).matmul + attention_flops_per_token(cfg, seq_len, passes=1)


def both_conventions(cfg: ModelConfig, seq_len: int, recompute: bool = False) -> dict[str, FlopsPerToken]:
    return {name: flops_per_token(cfg, seq_len, name, recompute) for name in CONVENTIONS}


def conventions_differ(flops: dict[str, FlopsPerToken]) -> bool:
    main = flops[DEFAULT_CONVENTION].model
    return any(abs(f.model - main) > DIFFER_REPORT * main for f in flops.values())
