"""What crosses a pipeline-stage boundary, per TP rank and micro-batch, against hand-computed values.

Small model: d=64, r=16 (7 projections), N=10 tokens per micro-batch.
"""

from __future__ import annotations

import pytest

from boost_hf.configuration_boost_llama import BoostLlamaConfig
from boost_hf.parallel.config import ParallelConfig
from boost_hf.perf.comm_formula import PointToPoint, stage_boundary_communication

N = 10
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, rank=16)


def boundary(bottleneck, style, p):
    config = BoostLlamaConfig(**SMALL, bottleneck=bottleneck)
    return stage_boundary_communication(config, ParallelConfig(tp_size=p, tp_style=style), N)


@pytest.mark.parametrize(
    "bottleneck, style, p, expected",
    [
        # the whole residual N d = 640 in one send, whatever the TP size
        (None, "megatron", 1, PointToPoint(1, 640)),
        (None, "megatron", 2, PointToPoint(1, 640)),
        (None, "megatron", 4, PointToPoint(1, 640)),
        ("cola", "vanilla", 4, PointToPoint(1, 640)),
        ("svd", "vanilla", 2, PointToPoint(1, 640)),
        # btp: this rank's residual shard N d/p
        ("cola", "btp", 1, PointToPoint(1, 640)),
        ("cola", "btp", 2, PointToPoint(1, 320)),
        ("cola", "btp", 4, PointToPoint(1, 160)),
        ("svd", "btp", 4, PointToPoint(1, 160)),
        # LaX: 7 whole latents N r = 160 more, in 7 more sends, on every TP rank
        ("lax", "btp", 1, PointToPoint(8, 640 + 7 * 160)),
        ("lax", "btp", 2, PointToPoint(8, 320 + 7 * 160)),
        ("lax", "btp", 4, PointToPoint(8, 160 + 7 * 160)),
        ("lax", "vanilla", 4, PointToPoint(8, 640 + 7 * 160)),
    ],
)
def test_stage_boundary_elements(bottleneck, style, p, expected):
    assert boundary(bottleneck, style, p) == expected


def test_btp_sends_a_tp_share_of_megatrons_boundary_at_13b():
    # 13B at TP4, micro-batch 4 x 4096 tokens, bf16: megatron 4 x 4096 x 5120 x 2 B = 160 MiB per TP rank, btp 40 MiB
    tokens, mib = 4 * 4096, 2**20
    cola, llama = BoostLlamaConfig.from_preset("cola-13b"), BoostLlamaConfig.from_preset("llama-13b")
    btp = stage_boundary_communication(cola, ParallelConfig(tp_size=4, tp_style="btp"), tokens)
    megatron = stage_boundary_communication(llama, ParallelConfig(tp_size=4, tp_style="megatron"), tokens)
    assert (megatron.bytes(2) / mib, btp.bytes(2) / mib) == (160, 40)
    lax = stage_boundary_communication(BoostLlamaConfig.from_preset("lax-13b"), ParallelConfig(tp_size=4), tokens)
    assert lax.bytes(2) / mib == 40 + 7 * 40  # r = 1280 = d/4: each latent is as large as a btp residual shard at TP4


def test_invalid_layout_raises():
    with pytest.raises(ValueError, match="tp_style"):
        boundary("cola", "megatron", 2)
