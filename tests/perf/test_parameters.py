"""The one parameter count (``boost_hf.perf.parameters``) equals the model's own count, for every bottleneck."""

from __future__ import annotations

import pytest

from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM
from boost_hf.perf.parameters import parameter_count

SMALL = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=100, rank=16)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize(
    "fields",
    [
        dict(bottleneck=None),
        dict(bottleneck="cola"),
        dict(bottleneck="svd"),
        dict(bottleneck="lax"),  # Kronecker gate, latent LayerNorm
        dict(bottleneck="lax", lax_gate="dense", lax_latent_norm=False),
        dict(bottleneck="lax", lax_gate="identity"),
        dict(bottleneck="tt"),
        dict(bottleneck="cola", attention_bias=True, mlp_bias=True),
        dict(bottleneck=None, attention_bias=True),
    ],
    ids=["llama", "cola", "svd", "lax", "lax-dense-gate", "lax-identity-gate", "tt", "cola-biases", "llama-attention-bias"],
)
def test_parameter_count_is_the_models(fields, tied):
    config = BoostLlamaConfig(**SMALL, **fields, tie_word_embeddings=tied)
    assert parameter_count(config) == sum(p.numel() for p in BoostLlamaForCausalLM(config).parameters())
