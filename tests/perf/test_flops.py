"""FLOPs formulas: BOOST.md's per-layer expressions, the LaX gates, attention and the model totals."""

from __future__ import annotations

import pytest

from boost_hf.configuration_boost_llama import BoostLlamaConfig
from boost_hf.perf.parameters import parameter_count
from boost_hf.perf.flops import (
    attention_flops_per_token,
    crossing_flops_per_token,
    forward_flops_per_token,
    linear_flops_per_token,
    lm_head_flops_per_token,
    projection_flops_per_token,
    training_flops_per_token,
)

GQA = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
           num_key_value_heads=4, rank=16)


def test_boost_md_per_layer_formulas_at_7b():
    d, f, r = 4096, 11008, 1024
    full = linear_flops_per_token(BoostLlamaConfig.from_preset("llama-7b"))
    low = linear_flops_per_token(BoostLlamaConfig.from_preset("cola-7b"))
    assert full == 2 * (4 * d * d + 3 * d * f)
    assert low == 2 * (8 * d * r + 3 * r * (d + f))
    assert full / low == pytest.approx(2.53, abs=0.01)  # "2.53x fewer at r = d/4, d_ff = 2.69 d"


def test_gqa_projection_flops():
    d, dq, dkv, f, r = 64, 64, 32, 96, 16
    full = BoostLlamaConfig(**GQA)
    assert linear_flops_per_token(full) == 2 * (2 * d * dq + 2 * d * dkv + 3 * d * f)
    low = BoostLlamaConfig(**GQA, bottleneck="svd")
    per_projection = projection_flops_per_token(low)
    assert per_projection["k_proj"] == 2 * r * (d + dkv)
    assert per_projection["o_proj"] == 2 * r * (dq + d)
    assert linear_flops_per_token(low) == 2 * r * ((d + dq) + 2 * (d + dkv) + (dq + d) + 2 * (d + f) + (f + d))


def test_lax_crossing_flops():
    r = 16
    dense = BoostLlamaConfig(**GQA, bottleneck="lax", lax_gate="dense")
    kron = BoostLlamaConfig(**GQA, bottleneck="lax", lax_gate="kronecker")
    identity = BoostLlamaConfig(**GQA, bottleneck="lax", lax_gate="identity")
    a, b = kron.kronecker_factors
    assert crossing_flops_per_token(dense) == 7 * 2 * r * r
    assert crossing_flops_per_token(kron) == 7 * 2 * r * (a + b) < crossing_flops_per_token(dense)
    assert crossing_flops_per_token(identity) == 0
    assert crossing_flops_per_token(BoostLlamaConfig(**GQA, bottleneck="cola")) == 0
    assert linear_flops_per_token(dense) == linear_flops_per_token(dense, crossing=False) + 7 * 2 * r * r


def test_attention_flops_convention():
    config = BoostLlamaConfig(**GQA)
    assert attention_flops_per_token(config, 256, causal=False) == 4 * 256 * 64
    assert attention_flops_per_token(config, 256) == 2 * 256 * 64  # causal: half the keys on average


def test_model_totals():
    config = BoostLlamaConfig(**GQA, bottleneck="lax")
    s, layers = 32, 3
    expected = (
        layers * linear_flops_per_token(config, crossing=False)
        + (layers - 1) * crossing_flops_per_token(config)  # block 0 has no crossing
        + layers * attention_flops_per_token(config, s)
        + 2 * 64 * 128
    )
    assert lm_head_flops_per_token(config) == 2 * 64 * 128
    assert forward_flops_per_token(config, s) == expected
    assert training_flops_per_token(config, s) == 3 * expected


def test_training_flops_match_the_6n_rule():
    """Non-causal training FLOPs of LLaMA-7B = 6 x (non-embedding weights + LM head) + 12 L d s (PaLM)."""
    config = BoostLlamaConfig.from_preset("llama-7b")
    s, d, layers, vocab = 4096, 4096, 32, 32000
    weights = parameter_count(config) - vocab * d - (2 * layers + 1) * d  # drop the lookup table and norms
    assert training_flops_per_token(config, s, causal=False) == 6 * weights + 12 * layers * d * s
