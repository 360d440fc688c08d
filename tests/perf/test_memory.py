"""The memory model's parameter accounting (``boost_hf.perf.memory``) against what the model and ``parallelize`` build
(meta and fake-group models, nothing trained; the bytes every rank of launched runs holds are compared in
``tests/training/test_pipeline_resume.py``)."""

from __future__ import annotations

import pytest
import torch

from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM, ParallelConfig
from boost_hf.parallel import parallelize
from boost_hf.perf.memory import decay_parameter_names, rank_parameters
from boost_hf.perf.rank_cost import fake_process_group


@pytest.mark.parametrize("preset", ["cola-60m", "lax-60m", "llama-60m"])
def test_decay_groups_are_the_trainers(preset):
    from transformers import Trainer

    with torch.device("meta"):
        model = BoostLlamaForCausalLM(BoostLlamaConfig.from_preset(preset, num_hidden_layers=2))
    assert decay_parameter_names(model) == Trainer.get_decay_parameter_names(None, model)


@pytest.mark.parametrize("preset,style", [("cola-60m", "btp"), ("cola-60m", "vanilla"), ("tt-60m", "btp"),
                                          ("tt-60m", "vanilla"), ("lax-60m", "btp"), ("llama-60m", "megatron")])
def test_rank_parameters_are_what_parallelize_builds(preset, style):
    """Every element a TP rank holds after ``parallelize`` (tensor-train cores split as the layout states them)."""
    config = BoostLlamaConfig.from_preset(preset, num_hidden_layers=2)
    parallel = ParallelConfig(tp_size=2, tp_style=style)
    with fake_process_group(2):
        model = parallelize(BoostLlamaForCausalLM(config), parallel)
        held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    (rank,) = rank_parameters(config, parallel)
    assert held == rank.elements


# ------------------------------------------------------------------------------------------------ FSDP2
def _small_cola():
    """2 layers, d 16, f 40, r 4, a vocabulary of 30 rows (not a multiple of 4: FSDP2 pads it)."""
    return BoostLlamaConfig.from_preset("cola-60m", hidden_size=16, intermediate_size=40, num_attention_heads=2,
                                        num_key_value_heads=2, rank=4, vocab_size=30, num_hidden_layers=2)


# by hand, at tp 1: a layer's tensors: six A [4, 16], down_proj.A [4, 40], five B [16, 4], gate/up B [40, 4], two
# norms [16]: 6 x 64 + 160 + 5 x 64 + 2 x 160 + 2 x 16 = 1216 elements, every dim 0 a multiple of 4; the root: the
# embedding and the LM head [30, 16] (padded to 32 rows over 4 ranks: 512 each, 480 unpadded) and the final norm [16]
LAYER, ROOT_PADDED, ROOT = 1216, 2 * 512 + 16, 2 * 480 + 16
TENSORS = 2 * (7 * 2 + 2) + 3  # a layer: 7 projections of A and B, 2 norms


def test_fully_shard_static_bytes_by_hand():
    """FSDP2 over 4 ranks: 1/4 of the padded tensors as fp32 parameters and gradients (also under bf16_params: the
    sharded parameters are the masters), no masters or buckets; AdamW's moments of the rows each rank holds: the
    30-row tensors split 8, 8, 8, 6."""
    from boost_hf.data_parallel_config import DataParallelConfig
    from boost_hf.perf.memory import static_memory

    fsdp2 = DataParallelConfig(data_parallel="fsdp2")
    per_rank = (2 * LAYER + ROOT_PADDED) // 4
    assert per_rank == 868
    for precision in ("fp32", "autocast", "bf16_params"):
        (ranks,) = static_memory(_small_cola(), ParallelConfig(), dp_size=4, precision=precision, data_parallel=fsdp2)
        assert [(r.parameters, r.masters, r.gradients, r.gradient_buckets) for r in ranks] == [(4 * 868, 0, 4 * 868, 0)] * 4
        held = [868] * 3 + [868 - 2 * 2 * 16]  # the last rank holds 6 of the 30 rows of the embedding and the head
        assert [r.optimizer_states for r in ranks] == [8 * n + 4 * TENSORS for n in held]
    with pytest.raises(ValueError, match="zero1"):
        static_memory(_small_cola(), ParallelConfig(), dp_size=4, zero1=True, data_parallel=fsdp2)


def test_fully_shard_working_set_by_hand():
    """The units at tp 1: layer 0 (reshards after forward), layer 1 and the root (kept gathered, torchtitan's default).
    Gathered: the kept units, the resharding one running, and one flat buffer of the largest unit; gradients with one
    micro-batch: the root's, the running unit's, two reduce-scatter inputs; with two micro-batches every unit's."""
    from boost_hf.data_parallel_config import DataParallelConfig
    from boost_hf.perf.memory import fully_shard_units, fully_shard_working_set, precision_bytes

    (parts,) = fully_shard_units(_small_cola(), ParallelConfig(), DataParallelConfig(data_parallel="fsdp2"))
    (part,) = parts
    assert [(u.padded_elements(4), u.reshards_after_forward) for u in part.units] == [(LAYER, True), (LAYER, False),
                                                                                      (ROOT_PADDED, False)]
    gathered = LAYER + ROOT_PADDED + LAYER + LAYER

    def working(policy, accumulating, pipeline=False):
        ws = fully_shard_working_set(parts, 4, precision_bytes(policy), pipeline=pipeline, accumulating=accumulating)
        return ws.gathered_parameters, ws.unsharded_gradients

    # the larger moment: a layer reduced (the root's gradients held, the layer's, two reduce-scatter inputs) here
    assert working("fp32", False) == (4 * gathered, 4 * ROOT + 4 * LAYER + 2 * 4 * LAYER)
    assert working("bf16_params", False) == (2 * gathered, 2 * ROOT + (2 + 4) * LAYER + 2 * 4 * LAYER)
    assert working("fp32", True) == (4 * gathered, 4 * (2 * LAYER + ROOT) + 4 * LAYER + 2 * 4 * LAYER)
    # under a pipeline every unit stays gathered: the whole part, and one flat buffer
    assert working("fp32", True, pipeline=True)[0] == 4 * (2 * LAYER + ROOT_PADDED + LAYER)
    # a vocabulary of 300 rows: the root (2 x 300 x 16 + 16 = 9616 elements, none padded) is the largest unit, and the
    # larger moment is its own reduction (its gradients, their reduce-scatter input, layer 0's kept one)
    large = BoostLlamaConfig.from_dict({**_small_cola().to_dict(), "vocab_size": 300})
    (parts,) = fully_shard_units(large, ParallelConfig(), DataParallelConfig(data_parallel="fsdp2"))
    assert working("fp32", False) == (4 * (LAYER + 9616 + LAYER + 9616), 4 * (9616 + 9616 + LAYER))


def test_fully_sharded_bytes_shrink_with_the_shard_and_hsdp_holds_what_fsdp2_holds_at_its_shard():
    from boost_hf.data_parallel_config import DataParallelConfig
    from boost_hf.perf.memory import memory_per_gpu, static_memory

    config = BoostLlamaConfig.from_preset("cola-350m")
    parallel = ParallelConfig(tp_size=2, tp_style="btp")

    def fullest(dp, replicas=1):
        data_parallel = DataParallelConfig(data_parallel="fsdp2", dp_replicate_size=replicas)
        return max(static_memory(config, parallel, dp_size=dp, precision="bf16_params", data_parallel=data_parallel)[0],
                   key=lambda m: m.total)

    totals = [fullest(dp).total for dp in (2, 4, 8, 16)]
    assert totals == sorted(totals, reverse=True) and totals[0] > 1.9 * totals[1]
    ddp = static_memory(config, parallel, dp_size=4, precision="bf16_params", zero1=True)[0][0]
    assert fullest(4).total < ddp.total / 3
    assert fullest(16, replicas=4) == fullest(4) and fullest(8, replicas=2) == fullest(4)
    for micro_batches in (1, 4):
        def breakdown(dp, replicas):
            data_parallel = DataParallelConfig(data_parallel="fsdp2", dp_replicate_size=replicas)
            (rank,) = memory_per_gpu(config, parallel, micro_batch=1, seq_len=512, num_micro_batches=micro_batches,
                                     dp_size=dp, precision="bf16_params", data_parallel=data_parallel)
            return rank

        hsdp, fsdp2 = breakdown(16, 4), breakdown(4, 1)
        same = ("parameters", "gradients", "optimizer_states", "gathered_parameters", "unsharded_gradients", "activations")
        assert {k: getattr(hsdp, k) for k in same} == {k: getattr(fsdp2, k) for k in same}
        assert hsdp.framework == fsdp2.framework + 2**28  # one more communicator: the replica group
