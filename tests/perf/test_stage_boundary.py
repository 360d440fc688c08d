"""What crosses a pipeline-stage boundary, per TP rank and micro-batch, against hand-computed values and
against what a parallel decoder layer actually hands on.

Small model: d=64, r=16 (7 projections), N=10 tokens per micro-batch.
"""

from __future__ import annotations

import pytest
import torch

from boost_hf import BoostLlamaForCausalLM
from boost_hf.configuration_boost_llama import BoostLlamaConfig
from boost_hf.parallel.config import ParallelConfig
from boost_hf.parallel.parallelize import layout_for
from boost_hf.perf.comm_formula import PointToPoint, stage_boundary_communication
from boost_hf.perf.rank_cost import fake_process_group

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


@pytest.fixture(scope="module")
def fake_group():
    with fake_process_group(4):
        yield


@pytest.mark.parametrize("bottleneck, style", [(None, "megatron"), ("cola", "vanilla"), ("lax", "vanilla"), ("cola", "btp"),
                                               ("lax", "btp")])
@pytest.mark.parametrize("p", [2, 4])
def test_widths_are_what_a_layer_hands_on(fake_group, bottleneck, style, p):
    # one TP rank of a parallel model (its collectives are no-ops): the residual and the LaX latents its
    # first decoder layer returns for the next one, in the order of stage_boundary_widths
    config = BoostLlamaConfig(**SMALL, bottleneck=bottleneck)
    parallel = ParallelConfig(tp_size=p, tp_style=style)
    model = BoostLlamaForCausalLM(config, parallel_config=parallel)
    handed_on = {}

    def record(module, args, kwargs, output):
        hidden, *rest = output if isinstance(output, tuple) else (output,)
        handed_on["hidden_states"] = hidden.shape
        for latents in rest:
            handed_on.update({name: latent.shape for name, latent in (latents or {}).items()})

    model.model.layers[0].register_forward_hook(record, with_kwargs=True)
    model(torch.zeros(2, 5, dtype=torch.long))
    widths = layout_for(config, parallel).stage_boundary_widths(config)
    assert {name: tuple(shape) for name, shape in handed_on.items()} == {name: (2, 5, w) for name, w in widths.items()}
    assert list(handed_on) == list(widths)


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
