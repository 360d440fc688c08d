"""The ops each layout's decoder layer dispatches per training step (forward + backward, one TP 4 rank; eager mode
launches one kernel or one collective per op), counted by ``count_rank_layer_dispatches`` at the 7B presets
(``benchmarks/op_count.py`` writes the table): none grows above what was counted when the BTP path was made leaner
(upper bounds: a change that lowers a count lowers its bound with it), BTP runs its projection groups as 9 GEMMs
forward, and BTP dispatches no more than vanilla on the same low-rank model, nor than 1.5x megatron's full-rank layer
of the same shape. Issue 43's target, BTP within megatron's + 25 %, is not met (the last test, expected to fail): BTP's
layer has more than twice megatron's GEMMs (an A and a B per projection group), twice its collectives, CoLA's latent
activation on two more latents and the online norm's statistics and gamma fold, each at least one op; what remains
above the target is listed in docs/performance.md.
"""

from __future__ import annotations

import pytest
import torch

from boost_hf import BoostLlamaConfig, ParallelConfig
from boost_hf.perf.rank_cost import count_rank_layer_dispatches, fake_process_group

TP = 4
VARIANTS = {
    "llama megatron": ("llama-7b", dict(tp_style="megatron")),
    "llama megatron+sp": ("llama-7b", dict(tp_style="megatron", sequence_parallel=True)),
    "cola vanilla": ("cola-7b", dict(tp_style="vanilla")),
    "cola btp": ("cola-7b", dict(tp_style="btp")),
    "cola btp+sp": ("cola-7b", dict(tp_style="btp", sequence_parallel=True)),
    "svd btp": ("svd-7b", dict(tp_style="btp")),
    "cola btp lowrank": ("cola-7b", dict(tp_style="btp", activation_checkpointing="lowrank")),
}
PRECISIONS = {"bf16-params": dict(autocast_dtype=None, param_dtype=torch.bfloat16),
              "autocast": dict(autocast_dtype=torch.bfloat16, param_dtype=None)}
# ops that launch work per layer, forward + backward, counted when this test was written (before the BTP changes of
# issue 43: btp 86 / 104, btp+sp 94 / 112, svd btp 84 / 102, btp lowrank 119 / 144)
BOUNDS = {
    ("llama megatron", "bf16-params"): 48, ("llama megatron", "autocast"): 62,
    ("llama megatron+sp", "bf16-params"): 56, ("llama megatron+sp", "autocast"): 70,
    ("cola vanilla", "bf16-params"): 79, ("cola vanilla", "autocast"): 101,
    ("cola btp", "bf16-params"): 71, ("cola btp", "autocast"): 87,
    ("cola btp+sp", "bf16-params"): 79, ("cola btp+sp", "autocast"): 95,
    ("svd btp", "bf16-params"): 69, ("svd btp", "autocast"): 85,
    ("cola btp lowrank", "bf16-params"): 97, ("cola btp lowrank", "autocast"): 118,
}


@pytest.fixture(scope="module")
def counted():
    with fake_process_group(TP):
        return {(name, precision): count_rank_layer_dispatches(BoostLlamaConfig.from_preset(preset),
                                                               ParallelConfig(tp_size=TP, **fields), **PRECISIONS[precision])
                for name, (preset, fields) in VARIANTS.items() for precision in PRECISIONS}


@pytest.mark.parametrize("case", list(BOUNDS), ids=lambda case: f"{case[0]}-{case[1]}")
def test_ops_not_above_recorded(counted, case):
    assert counted[case]["total"]["launches"] <= BOUNDS[case], counted[case]["total"]["by_op"]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_btp_runs_its_projection_groups_as_few_gemms(counted, precision):
    """Forward: the 4 A GEMMs (q/k/v and gate/up grouped) and 5 B GEMMs (q and k batched, v alone, as attention keeps v
    for backward and a block of a batched output would keep all of it; gate and up batched; o; down); backward two
    each; no concatenation or stacking anywhere in the layer."""
    total = counted["cola btp", precision]
    assert total["forward"]["gemm"] == 9 and total["backward"]["gemm"] == 18
    assert not any(op in ("other/cat", "other/stack") for op in total["total"]["by_op"])


@pytest.mark.parametrize("precision", PRECISIONS)
def test_btp_dispatches_no_more_than_vanilla_on_the_same_model_nor_than_megatron_plus_50_percent(counted, precision):
    btp = counted["cola btp", precision]["total"]["launches"]
    assert btp <= counted["cola vanilla", precision]["total"]["launches"]
    assert btp <= 1.5 * counted["llama megatron", precision]["total"]["launches"]
    assert counted["cola btp+sp", precision]["total"]["launches"] <= 1.5 * counted["llama megatron+sp", precision]["total"]["launches"]


@pytest.mark.xfail(strict=True, reason="issue 43's target, not met: BTP 71 vs megatron 48 ops with bf16 parameters (1.48x), "
                                       "87 vs 62 under autocast (1.40x); see the module docstring")
@pytest.mark.parametrize("precision", PRECISIONS)
def test_btp_within_megatron_plus_25_percent(counted, precision):
    assert counted["cola btp", precision]["total"]["launches"] <= 1.25 * counted["llama megatron", precision]["total"]["launches"]
