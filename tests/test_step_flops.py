"""FLOPs per token of a training step: the formula by hand, and against torch.utils.flop_counter.FlopCounterMode.

Counter notes (torch 2.13 on CPU): FlopCounterMode has no formula for the CPU flash-attention kernel
(aten._scaled_dot_product_flash_attention_for_cpu), so with the default SDPA kernel it counts attention as 0
(12.5 % low for tiny at T=128). The counts below run SDPA's math backend, whose QK^T and PV are plain bmm's
the counter sees. On GPUs the counter's flash/efficient backward formula counts 5 matmuls (QK^T recomputed),
not 4: 14/12 of our attention term, which tests/gpu/test_gpu_step.py allows for.
"""

from __future__ import annotations

import pytest

from mleng.step.config import PRESETS, ModelConfig, param_count
from mleng.step.flops import both_conventions, conventions_differ, flops_per_token

TOLERANCE = 0.01  # the bar; the math-backend counts below agree exactly


def test_the_formula_on_a_case_worked_by_hand():
    cfg = ModelConfig("hand", vocab_size=10, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=16)
    # matmul weights: output 10*8=80; q 8*8=64, k 8*4=32, v 32, o 64 -> 192; mlp 3*8*16=384. Sum 656.
    # all parameters: + embedding 80 + norms 3*8=24 = 760.
    assert param_count(cfg).matmul == 656 and param_count(cfg).total == 760
    palm = flops_per_token(cfg, seq_len=4, convention="palm")
    assert palm.dense == 6 * 656 == 3936
    assert palm.attention == 12 * 1 * 2 * 4 * 4 == 384   # 12 x L x H x Q x T
    assert palm.model == 4320
    book = flops_per_token(cfg, seq_len=4, convention="book")
    assert book.model == 6 * 760 == 4560 and book.attention == 0
    # recomputation: one more forward of the block but its down projection (8*16=128 weights)
    palm_ac = flops_per_token(cfg, seq_len=4, convention="palm", recompute=True)
    assert palm_ac.hardware == 4320 + 2 * (192 + 384 - 128) + 4 * 1 * 2 * 4 * 4 == 5344
    assert flops_per_token(cfg, 4, "book", recompute=True).hardware == 8 * 760


def test_the_conventions_differ_at_8b_shape_and_seq_8192():
    flops = both_conventions(PRESETS["8b"], 8192)
    assert conventions_differ(flops)
    ratio = flops["book"].model / flops["palm"].model
    assert 0.82 < ratio < 0.84  # the book's 6N leaves out 12.9 GFLOP/token of attention, counts 0.5 G embedding


def _counted_step_flops(model, tokens, targets, steps=2, optimizer=None) -> int:
    """FLOPs FlopCounterMode sees in the last of `steps` training steps (the book: count on the 2nd)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    total = 0
    for _ in range(steps):
        with sdpa_kernel([SDPBackend.MATH]), FlopCounterMode(display=False) as counter:
            loss = model(tokens, targets)
            loss.backward()
        total = counter.get_total_flops()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return total


@pytest.mark.parametrize("checkpointing", [False, True])
def test_tiny_step_counted_by_flop_counter_mode_agrees(checkpointing):
    import torch

    from mleng.step.model import build

    cfg, batch, seq = PRESETS["tiny"], 4, 128
    model = build(cfg, seq, "cpu", seed=1)
    if checkpointing:
        model.enable_checkpointing()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    counted = _counted_step_flops(model, tokens, tokens.roll(-1, 1), optimizer=optimizer)
    formula = flops_per_token(cfg, seq, recompute=checkpointing)
    expected = (formula.hardware if checkpointing else formula.model) * batch * seq
    assert abs(counted - expected) / expected < TOLERANCE, (counted, expected)


def test_two_layer_1b_shape_counted_by_flop_counter_mode_agrees():
    """On the meta device: FlopCounterMode counts from shapes, and a real CPU step of this shape (384 M
    parameters, a 128256-token vocabulary) takes ~25 s here, beyond this suite's budget."""
    import torch

    from mleng.step.model import Transformer

    cfg, batch, seq = PRESETS["1b"].with_layers(2), 2, 2048
    with torch.device("meta"):
        model = Transformer(cfg, seq)
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    counted = _counted_step_flops(model, tokens, tokens)
    expected = flops_per_token(cfg, seq).model * batch * seq
    assert abs(counted - expected) / expected < TOLERANCE, (counted, expected)
    # the book's 6N misses the attention term (4 % of this step at T=2048)
    assert abs(flops_per_token(cfg, seq, "book").model * batch * seq - counted) / counted > TOLERANCE
