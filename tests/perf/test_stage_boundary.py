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
from boost_hf.parallel.layouts import layout_for
from boost_hf.parallel.communication import Communication, all_gather
from boost_hf.perf.comm_formula import PointToPoint, stage_boundary_communication
from boost_hf.perf.rank_cost import fake_process_group

N = 10
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, rank=16)


def boundary(bottleneck, style, p, sequence_parallel=False, tokens=N):
    config = BoostLlamaConfig(**SMALL, bottleneck=bottleneck)
    return stage_boundary_communication(config, ParallelConfig(tp_size=p, tp_style=style, sequence_parallel=sequence_parallel), tokens)


NO_GATHER = Communication()


@pytest.mark.parametrize(
    "bottleneck, style, p, sequence_parallel, expected",
    [
        # the whole residual N d = 640 in one send, whatever the TP size
        (None, "megatron", 1, False, PointToPoint(1, 640)),
        (None, "megatron", 2, False, PointToPoint(1, 640)),
        (None, "megatron", 4, False, PointToPoint(1, 640)),
        ("cola", "vanilla", 4, False, PointToPoint(1, 640)),
        ("svd", "vanilla", 2, False, PointToPoint(1, 640)),
        # megatron with sequence parallelism: this rank's N/p tokens of the residual
        (None, "megatron", 2, True, PointToPoint(1, 320)),
        # btp: this rank's residual shard N d/p (with or without latent sequence parallelism)
        ("cola", "btp", 1, False, PointToPoint(1, 640)),
        ("cola", "btp", 2, False, PointToPoint(1, 320)),
        ("cola", "btp", 4, False, PointToPoint(1, 160)),
        ("svd", "btp", 4, False, PointToPoint(1, 160)),
        ("cola", "btp", 2, True, PointToPoint(1, 320)),
        # LaX: the 7 latents 7 N r = 1120 packed in one more send; whole at p = 1, a 1/p token share at p = 2 with an
        # all-gather of the 7 N r over TP (at p = 4, 4 does not divide N = 10: whole, no gather)
        ("lax", "btp", 1, False, PointToPoint(2, 640 + 1120)),
        ("lax", "btp", 2, False, PointToPoint(2, 320 + 560, all_gather(1, 1120))),
        ("lax", "btp", 4, False, PointToPoint(2, 160 + 1120)),
        ("lax", "vanilla", 2, False, PointToPoint(2, 640 + 560, all_gather(1, 1120))),
        # latent sequence parallelism: the latents are token shards already, 7 N r / p, no gather
        ("lax", "btp", 2, True, PointToPoint(2, 320 + 560)),
    ],
)
def test_stage_boundary_elements(bottleneck, style, p, sequence_parallel, expected):
    assert boundary(bottleneck, style, p, sequence_parallel) == expected


def test_lax_share_at_tp4_when_4_divides_the_tokens():
    # N = 12 at p = 4: residual 12 x 16, latents 12/4 x 112 = 336, the gather 12 x 112 = 1344
    assert boundary("lax", "btp", 4, tokens=12) == PointToPoint(2, 192 + 336, all_gather(1, 1344))
    assert boundary("lax", "btp", 4, tokens=12).tp_collectives != NO_GATHER


@pytest.fixture(scope="module")
def fake_group():
    with fake_process_group(4):
        yield


@pytest.mark.parametrize("bottleneck, style", [(None, "megatron"), ("cola", "vanilla"), ("lax", "vanilla"), ("cola", "btp"),
                                               ("lax", "btp")])
@pytest.mark.parametrize("p", [2, 4])
def test_boundary_holds_what_a_layer_hands_on(fake_group, bottleneck, style, p):
    # one TP rank of a parallel model (its collectives are no-ops): the residual its first decoder layer returns for
    # the next one has the boundary's residual shape, and LaX's 7 latents, each [mb, S, r] and replicated, are the
    # boundary's packed latents gathered over TP
    config = BoostLlamaConfig(**SMALL, bottleneck=bottleneck)
    parallel = ParallelConfig(tp_size=p, tp_style=style)
    model = BoostLlamaForCausalLM(config, parallel_config=parallel)
    handed_on = {}

    def record(module, args, kwargs, output):
        hidden, latents = output
        handed_on["residual"] = tuple(hidden.shape)
        handed_on["latents"] = {name: tuple(latent.shape) for name, latent in (latents or {}).items()}

    model.model.layers[0].register_forward_hook(record, with_kwargs=True)
    model(torch.zeros(2, 8, dtype=torch.long))
    stage = layout_for(config, parallel).stage_boundary(config, 2, 8)
    assert handed_on["residual"] == stage.residual
    if bottleneck != "lax":
        assert stage.latents is None and handed_on["latents"] == {}
        return
    assert list(handed_on["latents"]) == list(config.projection_shapes())
    assert set(handed_on["latents"].values()) == {(2, 8, config.rank)}
    assert stage.latents == (2 * 8 // p, 7 * config.rank) and stage.gathered == 2 * 8 * 7 * config.rank


def test_btp_sends_a_tp_share_of_megatrons_boundary_at_13b():
    # 13B at TP4, micro-batch 4 x 4096 tokens, bf16: megatron 4 x 4096 x 5120 x 2 B = 160 MiB per TP rank, btp 40 MiB
    tokens, mib = 4 * 4096, 2**20
    cola, llama = BoostLlamaConfig.from_preset("cola-13b"), BoostLlamaConfig.from_preset("llama-13b")
    btp = stage_boundary_communication(cola, ParallelConfig(tp_size=4, tp_style="btp"), tokens)
    megatron = stage_boundary_communication(llama, ParallelConfig(tp_size=4, tp_style="megatron"), tokens)
    assert (megatron.bytes(2) / mib, btp.bytes(2) / mib) == (160, 40)
    lax = stage_boundary_communication(BoostLlamaConfig.from_preset("lax-13b"), ParallelConfig(tp_size=4), tokens)
    # r = 1280 = d/4: the 7 latents are 7 x 40 MiB; each TP rank sends a quarter (70 MiB) and the receiving stage
    # all-gathers the 7 x 40 MiB inside its node, instead of 7 x 40 MiB across the nodes from every TP rank
    assert lax.bytes(2) / mib == 40 + 7 * 40 / 4
    assert lax.tp_collectives == all_gather(1, 7 * 1280 * tokens)


def test_invalid_layout_raises():
    with pytest.raises(ValueError, match="tp_style"):
        boundary("cola", "megatron", 2)
