"""The communication formula against hand-computed volumes, for every layout and option.

Small model (GQA so that dq != dkv): d=64, dq=64 (8 heads of 8), dkv=32 (4 kv heads), f=96, r=16,
V=128, L=3; micro-batch of N=10 tokens. Volumes do not depend on p > 1, so each case runs at p=2 and 4.

The tensor train (4 cores, tt_rank 16) has cores q/o ``(1,8,8) (8,8,16) | (16,8,8) (8,8,1)``, k/v ``(1,8,8) (8,8,16) |
(16,4,8) (8,8,1)``, gate/up ``(1,8,8) (8,8,16) | (16,8,12) (12,12,1)``, down ``(1,12,12) (12,8,16) | (16,8,8) (8,8,1)``.
"""

from __future__ import annotations

import pytest

from boost_hf.configuration_boost_llama import BoostLlamaConfig
from boost_hf.perf.comm_formula import (
    Collective,
    Communication,
    PassCommunication,
    layer_communication,
    model_communication,
    outside_layers_communication,
    ring_traffic_bytes,
)
from boost_hf.parallel.config import ParallelConfig
from boost_hf.parallel.layouts import LAYOUTS

N = 10
SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=4,
    rank=16,
)


def small(bottleneck):
    """``bottleneck`` (a name, or a dict of config fields)."""
    fields = bottleneck if isinstance(bottleneck, dict) else {"bottleneck": bottleneck}
    return BoostLlamaConfig(**SMALL, **fields)


def comm(all_reduce=(0, 0), all_gather=(0, 0), reduce_scatter=(0, 0)) -> Communication:
    return Communication(
        {"all_reduce": Collective(*all_reduce), "all_gather": Collective(*all_gather), "reduce_scatter": Collective(*reduce_scatter)}
    )


@pytest.fixture(params=[2, 4])
def p(request) -> int:
    return request.param


# (bottleneck, ParallelConfig fields) -> (forward, backward) of one layer, as (calls, elements) pairs.
# d=64, dq=64, dkv=32, f=96, r=16, N=10.
LAYER_CASES = {
    # megatron: 2 x N d forward (o, down) and backward (inputs of qkv, gate_up)
    "megatron": (None, dict(tp_style="megatron"), comm((2, 1280)), comm((2, 1280))),
    "megatron-ungrouped": (None, dict(tp_style="megatron", group_linears=False), comm((2, 1280)), comm((2, 1280))),
    "megatron-full-ckpt": (
        None, dict(tp_style="megatron", activation_checkpointing="full"), comm((2, 1280)), comm((4, 2560))
    ),
    # megatron with sequence parallelism: each all-reduce of N d = 640 becomes a reduce-scatter plus an
    # all-gather of N d (forward: gather before qkv and gate_up, scatter after o and down; backward the mirror),
    # plus, in backward, the re-gather of the qkv and gate_up inputs for their weight gradients (2 N d, as
    # Megatron-LM keeps only the token shard) and the all-reduce of the 2 norm weights' gradients (2 d = 128)
    "megatron-sp": (
        None, dict(tp_style="megatron", sequence_parallel=True), comm(all_gather=(2, 1280), reduce_scatter=(2, 1280)),
        comm((2, 128), (4, 2560), (2, 1280)),
    ),
    "megatron-sp-ungrouped": (
        None, dict(tp_style="megatron", sequence_parallel=True, group_linears=False),
        comm(all_gather=(2, 1280), reduce_scatter=(2, 1280)), comm((2, 128), (4, 2560), (2, 1280)),
    ),
    "megatron-sp-full-ckpt": (  # recomputation re-issues the forward's gathers and scatters
        None, dict(tp_style="megatron", sequence_parallel=True, activation_checkpointing="full"),
        comm(all_gather=(2, 1280), reduce_scatter=(2, 1280)), comm((2, 128), (6, 3840), (4, 2560)),
    ),
    # vanilla: forward N (dq + 2 dkv + d + 2f + d) = 10 * 448; backward grouped N (d + dq + d + f) = 10 * 288,
    # ungrouped N (3d + dq + 2d + f) = 10 * 480
    "vanilla": ("cola", dict(tp_style="vanilla"), comm((7, 4480)), comm((4, 2880))),
    "vanilla-ungrouped": ("cola", dict(tp_style="vanilla", group_linears=False), comm((7, 4480)), comm((7, 4800))),
    "vanilla-svd-sync-norm": ("svd", dict(tp_style="vanilla", rmsnorm="sync"), comm((7, 4480)), comm((4, 2880))),
    "vanilla-full-ckpt": (
        "cola", dict(tp_style="vanilla", activation_checkpointing="full"), comm((7, 4480)), comm((11, 7360))
    ),
    "vanilla-lowrank-ckpt": (
        "cola", dict(tp_style="vanilla", activation_checkpointing="lowrank"), comm((7, 4480)), comm((11, 7360))
    ),
    # LaX under vanilla: latents gathered to full r, 7 N r = 1120, forward and backward,
    # one gather per group of A's sharing an input when grouped (4), one per projection otherwise (7)
    "vanilla-lax": ("lax", dict(tp_style="vanilla"), comm((7, 4480), (4, 1120)), comm((4, 2880), (4, 1120))),
    "vanilla-lax-ungrouped": (
        "lax", dict(tp_style="vanilla", group_linears=False), comm((7, 4480), (7, 1120)), comm((7, 4800), (7, 1120))
    ),
    "vanilla-lax-full-ckpt": (
        "lax",
        dict(tp_style="vanilla", activation_checkpointing="full"),
        comm((7, 4480), (4, 1120)),
        comm((11, 7360), (8, 2240)),
    ),
    "vanilla-lax-lowrank-ckpt": (  # recomputes the B all-reduces, not the all-gathers
        "lax",
        dict(tp_style="vanilla", activation_checkpointing="lowrank"),
        comm((7, 4480), (4, 1120)),
        comm((11, 7360), (4, 1120)),
    ),
    # btp: 7 N r = 1120; online norm +2N x 8 = 160 elements in the same calls (8 statistics columns per
    # row: 1 used, 7 keep the rows 16-byte aligned); sync +2 calls +2N both ways
    "btp-online": ("cola", dict(tp_style="btp", rmsnorm="online"), comm((4, 1280)), comm((4, 1120))),
    "btp-sync": ("cola", dict(tp_style="btp", rmsnorm="sync"), comm((6, 1140)), comm((6, 1140))),
    "btp-local": ("cola", dict(tp_style="btp", rmsnorm="local"), comm((4, 1120)), comm((4, 1120))),
    "btp-online-ungrouped": (
        "cola", dict(tp_style="btp", rmsnorm="online", group_linears=False), comm((7, 1280)), comm((7, 1120))
    ),
    "btp-sync-ungrouped": (
        "svd", dict(tp_style="btp", rmsnorm="sync", group_linears=False), comm((9, 1140)), comm((9, 1140))
    ),
    "btp-lax": ("lax", dict(tp_style="btp"), comm((4, 1280)), comm((4, 1120))),
    "btp-full-ckpt": (
        "cola", dict(tp_style="btp", activation_checkpointing="full"), comm((4, 1280)), comm((8, 2400))
    ),
    "btp-sync-full-ckpt": (
        "cola", dict(tp_style="btp", rmsnorm="sync", activation_checkpointing="full"), comm((6, 1140)), comm((12, 2280))
    ),
    "btp-sync-lowrank-ckpt": (  # the sync norm's statistics all-reduce sits inside a recomputed segment
        "cola", dict(tp_style="btp", rmsnorm="sync", activation_checkpointing="lowrank"), comm((6, 1140)), comm((8, 1160))
    ),
    "btp-lowrank-ckpt": (
        "lax", dict(tp_style="btp", activation_checkpointing="lowrank"), comm((4, 1280)), comm((4, 1120))
    ),
    # btp with latent sequence parallelism: each all-reduce of the A outputs (7 N r + online statistics 160)
    # becomes a reduce-scatter of the same, and the latents are all-gathered before the B's (7 N r = 1120);
    # backward the mirror image
    "btp-sp-online": (
        "cola", dict(tp_style="btp", sequence_parallel=True), comm(all_gather=(4, 1120), reduce_scatter=(4, 1280)),
        comm(all_gather=(4, 1280), reduce_scatter=(4, 1120)),
    ),
    "btp-sp-sync-ungrouped": (
        "svd", dict(tp_style="btp", rmsnorm="sync", group_linears=False, sequence_parallel=True),
        comm((2, 20), (7, 1120), (7, 1120)), comm((2, 20), (7, 1120), (7, 1120)),
    ),
    "btp-sp-full-ckpt": (
        "cola", dict(tp_style="btp", sequence_parallel=True, activation_checkpointing="full"),
        comm(all_gather=(4, 1120), reduce_scatter=(4, 1280)), comm(all_gather=(8, 2400), reduce_scatter=(8, 2400)),
    ),
    "btp-sp-lowrank-ckpt": (  # recomputing a step that applies B's re-gathers its latents
        "cola", dict(tp_style="btp", sequence_parallel=True, activation_checkpointing="lowrank"),
        comm(all_gather=(4, 1120), reduce_scatter=(4, 1280)), comm(all_gather=(8, 2400), reduce_scatter=(4, 1120)),
    ),
    # LaX (Kronecker gate 4 x 4 (x) 4 x 4, latent LayerNorm over r = 16): after block 0, backward all-reduces
    # the gradients of each projection's 4 crossing parameters, 7 x (16 + 16 + 16 + 16) = 448
    "btp-sp-lax": (
        "lax", dict(tp_style="btp", sequence_parallel=True), comm(all_gather=(4, 1120), reduce_scatter=(4, 1280)),
        comm((28, 448), (4, 1280), (4, 1120)),
    ),
    # tensor train: as btp / vanilla, plus in backward one all-reduce per factor of its whole cores' gradients (14).
    # btp holds cores 0 and 2 split: whole A cores 6 x 1024 + 1536 (down) = 7680, B cores 5 x 64 + 2 x 144 = 608;
    # vanilla holds cores 1 and 2 split: whole A cores 6 x 64 + 144 = 528, B cores 608; with 2 cores, none is whole
    "btp-tt": ("tt", dict(tp_style="btp"), comm((4, 1280)), comm((4 + 14, 1120 + 8288))),
    "btp-tt-ungrouped-lowrank-ckpt": (
        "tt", dict(tp_style="btp", group_linears=False, activation_checkpointing="lowrank"), comm((7, 1280)), comm((7 + 14, 1120 + 8288)),
    ),
    "btp-tt-sp": (
        "tt", dict(tp_style="btp", sequence_parallel=True), comm(all_gather=(4, 1120), reduce_scatter=(4, 1280)),
        comm((14, 8288), (4, 1280), (4, 1120)),
    ),
    "btp-tt-two-cores": ({"bottleneck": "tt", "tt_cores": 2}, dict(tp_style="btp"), comm((4, 1280)), comm((4, 1120))),
    "vanilla-tt": ("tt", dict(tp_style="vanilla"), comm((7, 4480)), comm((4 + 14, 2880 + 1136))),
    "btp-sp-sync-lowrank-ckpt": (
        "svd", dict(tp_style="btp", rmsnorm="sync", sequence_parallel=True, activation_checkpointing="lowrank"),
        comm((2, 20), (4, 1120), (4, 1120)), comm((4, 40), (8, 2240), (4, 1120)),
    ),
}


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_layer_communication(case, p):
    bottleneck, fields, forward, backward = LAYER_CASES[case]
    got = layer_communication(small(bottleneck), ParallelConfig(tp_size=p, **fields), N)
    assert got == PassCommunication(forward, backward)


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_nothing_is_communicated_without_tensor_parallelism(case):
    bottleneck, fields, _, _ = LAYER_CASES[case]
    parallel = ParallelConfig(tp_size=1, **fields)
    assert layer_communication(small(bottleneck), parallel, N) == PassCommunication()
    assert model_communication(small(bottleneck), parallel, N, with_logits=True) == PassCommunication()


@pytest.mark.parametrize(
    "bottleneck, style, with_loss, with_logits, forward, backward",
    [
        # btp: no embedding collective; all-gather N d = 640 before the final norm
        ("cola", "btp", True, False, comm((2, 30), (1, 640)), comm((1, 640))),
        ("cola", "btp", False, False, comm(all_gather=(1, 640)), comm((1, 640))),
        # full logits: all-gather N V = 1280
        ("cola", "btp", True, True, comm((2, 30), (2, 1920)), comm((1, 640))),
        # vocab-parallel embedding all-reduce N d, then the loss' max (N) and fused [sum-exp, target] (2N)
        ("cola", "vanilla", True, False, comm((3, 670)), comm((1, 640))),
        (None, "megatron", True, False, comm((3, 670)), comm((1, 640))),
        (None, "megatron", False, True, comm((1, 640), (1, 1280)), comm((1, 640))),
        # sequence parallelism: the embedding all-reduce, the final norm's all-gather along tokens (N d) before
        # the head; backward: the first layer's shard gathered (N d), the head's input gradient reduce-scattered
        # (N d), the final norm's weight gradient all-reduced (d)
        (None, "megatron-sp", True, False, comm((3, 670), (1, 640)), comm((1, 64), (1, 640), (1, 640))),
    ],
)
def test_outside_layers(bottleneck, style, with_loss, with_logits, forward, backward, p):
    parallel = ParallelConfig(tp_size=p, tp_style=style.removesuffix("-sp"), sequence_parallel=style.endswith("-sp"))
    got = outside_layers_communication(small(bottleneck), parallel, N, with_loss=with_loss, with_logits=with_logits)
    assert got == PassCommunication(forward, backward)


def test_lax_block_zero_has_no_crossing_gradients_to_reduce(p):
    config, parallel = small("lax"), ParallelConfig(tp_size=p, tp_style="btp", sequence_parallel=True)
    first, later = layer_communication(config, parallel, N, layer_idx=0), layer_communication(config, parallel, N)
    assert later.backward == first.backward + comm((28, 448))
    outside = outside_layers_communication(config, parallel, N)
    assert model_communication(config, parallel, N) == first + later.scaled(2) + outside


def test_model_is_layers_plus_outside(p):
    config, parallel = small("lax"), ParallelConfig(tp_size=p, tp_style="vanilla", activation_checkpointing="full")
    got = model_communication(config, parallel, N, with_logits=True)
    # 3 layers of (AR 7/4480, AG 4/1120 | AR 11/7360, AG 8/2240) + outside (AR 3/670, AG 1/1280 | AR 1/640)
    assert got == PassCommunication(comm((24, 14110), (13, 4640)), comm((34, 22720), (24, 6720)))


def test_sequence_parallel_moves_the_same_ring_bytes_as_the_all_reduces_it_replaces(p):
    """Megatron with sequence parallelism: per layer, a reduce-scatter and an all-gather of N d per former
    all-reduce of N d (plus the norm weights' gradients, d each): the same ring traffic, d-sized terms aside,
    and in backward the re-gather of the two column groups' inputs (2 N d), which buys keeping N d / p of each."""
    config = small(None)
    with_sp = layer_communication(config, ParallelConfig(tp_size=p, tp_style="megatron", sequence_parallel=True), N)
    without = layer_communication(config, ParallelConfig(tp_size=p, tp_style="megatron"), N)
    norms = ring_traffic_bytes("all_reduce", 2 * 2 * config.hidden_size, p)
    regather = ring_traffic_bytes("all_gather", 2 * 2 * N * config.hidden_size, p)
    assert with_sp.forward.ring_traffic_bytes(p) == without.forward.ring_traffic_bytes(p)
    assert with_sp.backward.ring_traffic_bytes(p) == without.backward.ring_traffic_bytes(p) + norms + regather


def test_sequence_parallel_configuration_is_validated():
    with pytest.raises(ValueError, match="sequence_parallel must be True or False"):
        ParallelConfig(tp_size=2, tp_style="megatron", sequence_parallel="yes")
    with pytest.raises(ValueError, match="not supported by tp_style='vanilla'.*sequence_parallel=False"):
        ParallelConfig(tp_size=2, tp_style="vanilla", sequence_parallel=True)
    assert not LAYOUTS["megatron"](ParallelConfig(tp_size=1, tp_style="megatron", sequence_parallel=True)).sequence_parallel


def test_invalid_layouts_raise():
    with pytest.raises(ValueError, match="low-rank model"):
        layer_communication(small(None), ParallelConfig(tp_size=2, tp_style="megatron", activation_checkpointing="lowrank"), N)
    with pytest.raises(ValueError, match="full-rank layout"):
        layer_communication(small("cola"), ParallelConfig(tp_size=2, tp_style="megatron"), N)


@pytest.mark.parametrize(
    "preset, style, gib",
    [("cola-7b", "btp", 0.21875 + 0.00048828125), ("llama-7b", "megatron", 0.25), ("cola-7b", "vanilla", 1.296875)],
)
def test_boost_md_per_layer_volume_at_7b(preset, style, gib):
    """BOOST.md section 6: 7B, batch 4 x 4096, bf16: ~0.22 (btp), 0.25 (full), ~1.3 GiB (vanilla) forward."""
    parallel = ParallelConfig(tp_size=4, tp_style=style)
    forward = layer_communication(BoostLlamaConfig.from_preset(preset), parallel, 4 * 4096).forward
    # btp carries 2N x 8 norm-statistics elements (0.0005 GiB; one column used, 7 for alignment) on top of 7 N r.
    assert forward.bytes(2) / 2**30 == pytest.approx(gib, abs=1e-4)


def test_boost_md_formulas_at_7b():
    n, d, f, r = 16384, 4096, 11008, 1024
    cola, llama = BoostLlamaConfig.from_preset("cola-7b"), BoostLlamaConfig.from_preset("llama-7b")
    btp = layer_communication(cola, ParallelConfig(tp_size=4), n)
    assert btp.forward == comm((4, 7 * n * r + 2 * n * 8))
    vanilla = layer_communication(cola, ParallelConfig(tp_size=4, tp_style="vanilla"), n)
    assert vanilla.forward == comm((7, n * (5 * d + 2 * f)))
    assert vanilla.backward == comm((4, n * (3 * d + f)))
    vanilla_ungrouped = layer_communication(cola, ParallelConfig(tp_size=4, tp_style="vanilla", group_linears=False), n)
    assert vanilla_ungrouped.backward == comm((7, n * (6 * d + f)))
    megatron = layer_communication(llama, ParallelConfig(tp_size=4, tp_style="megatron"), n)
    assert megatron.forward == megatron.backward == comm((2, 2 * n * d))


def test_communication_arithmetic():
    a = comm((2, 100), (1, 10))
    b = Communication({"all_reduce": Collective(1, 5)})
    assert (a + b) == comm((3, 105), (1, 10))
    assert a.scaled(3) == comm((6, 300), (3, 30))
    assert a.calls == 3 and a.elements == 110 and a.bytes(2) == 220 and a.bytes(4) == 440
    assert a["all_gather"] == Collective(1, 10) and b["all_gather"] == Collective()
    assert b == comm((1, 5)) and hash(b) == hash(comm((1, 5)))  # zero kinds do not matter
    assert Communication().calls == 0 and Communication().elements == 0
    assert a.only("all_reduce") == comm((2, 100))
    assert a.to_dict() == {"all_reduce": {"calls": 2, "elements": 100}, "all_gather": {"calls": 1, "elements": 10}}
    forward_backward = PassCommunication(a, b)
    assert forward_backward + forward_backward == forward_backward.scaled(2)
    with pytest.raises(ValueError, match="Unknown collective kind"):
        Communication({"broadcast": Collective(1, 1)})


def test_ring_traffic():
    assert ring_traffic_bytes("all_reduce", 1000, 4) == 1500  # 2 (p-1)/p
    assert ring_traffic_bytes("all_gather", 1000, 4) == 750  # (p-1)/p
    assert ring_traffic_bytes("all_reduce", 1000, 2) == 1000
    assert ring_traffic_bytes("all_reduce", 1000, 1) == 0
    assert comm((2, 100), (1, 40)).ring_traffic_bytes(tp_size=2, dtype_bytes=2) == 200 + 40
    assert ring_traffic_bytes("reduce_scatter", 1000, 4) == 750  # (p-1)/p of the full input
    with pytest.raises(ValueError):
        ring_traffic_bytes("broadcast", 1000, 4)
