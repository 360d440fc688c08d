"""FSDP2 over the data-parallel group of each TP x PP rank computes the single-process model's training steps (CPU,
gloo, 4 processes), and its collectives are what the formula says.

One process group runs every case (tests/parallel/fsdp_cases.py): dp 4 (an unevenly sharded embedding); dp 2 x tp 2
under btp (with sequence parallelism; LaX with latent sequence parallelism, whose gate and latent norm are reduced over
TP inside the forward; LaX with low-rank checkpointing; the tensor train), vanilla, megatron (with sequence
parallelism; tied embeddings); HSDP 2 x 2 resharding after every forward; the whole model as one unit; gradient
accumulation without reduction; pp 2 x dp 2 under 1F1B and interleaved 1F1B (with full checkpointing). fp32 tolerances as in the TP and
pipeline suites: 1e-5 relative, each gradient and parameter by its largest element-wise difference over its largest
element, three AdamW steps with clipping by the global norm.
"""

from __future__ import annotations

import pytest

from boost_hf.parallel.fully_shard import FullyShardUnit, reshards_after_forward
from boost_hf.perf.comm_formula import fully_shard_communication
from tests.distributed import launch
from tests.parallel import fsdp_cases

TOL = 1e-5


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    return launch(fsdp_cases.everything, 4, str(tmp_path_factory.mktemp("saved")), timeout=3000)


@pytest.fixture(scope="module")
def reports(launched):
    return [rank["cases"] for rank in launched]


def _cases(reports):
    return [(rank, c) for rank, r in enumerate(reports) for c in r]


def test_every_case_ran_on_every_rank(reports):
    assert all(len(r) == len(fsdp_cases.cases()) for r in reports)


def test_a_folder_saved_under_fsdp2_ddp_or_compile_names_the_models_own_class(launched):
    """FSDP2 swaps the model's class for ``FSDPBoostLlamaForCausalLM`` (made in torch; also when transformers' own
    ``save_pretrained`` writes an explicit ``state_dict``); DDP and ``torch.compile`` wrap it:
    the saved ``architectures``, ``auto_map`` and remote code are the model's own, never a wrapper's or torch's files."""
    saved = launched[0]["saved"]
    expected = {"architectures": ["BoostLlamaForCausalLM"],
                "auto_map": {"AutoConfig": "configuration_boost_llama.BoostLlamaConfig",
                             "AutoModelForCausalLM": "modeling_boost_llama.BoostLlamaForCausalLM"},
                "python_files": ["configuration_boost_llama.py", "modeling_boost_llama.py", "tensor_train_boost_llama.py",
                                 "weights_boost_llama.py"]}
    assert saved.keys() == {"fsdp2", "fsdp2-state-dict", "ddp", "compile"}
    assert all(record == expected for record in saved.values()), saved


def test_parameters_are_sharded_dtensors_carrying_their_tp_metadata_and_every_one_is_held(reports):
    bad = [c["case"] for _, c in _cases(reports) if not (c["dtensors"] and c["attributes_kept"] and c["every_parameter_held"])]
    assert not bad, bad


def test_loss_and_clipped_grad_norm_match_single_process_and_are_the_same_on_every_rank(reports):
    bad = [(c["case"], c["loss_rel"], c["norm_rel"]) for _, c in _cases(reports)
           if not (c["loss_rel"] < TOL and c["norm_rel"] < TOL and c["same_on_ranks"] and c["clipped"])]
    assert not bad, bad


def test_every_gradient_after_the_reduction_matches_single_process(reports):
    bad = [(c["case"], c["worst_grad"], c["grad_rel"]) for _, c in _cases(reports) if not c["grad_rel"] < TOL]
    assert not bad, bad


def test_parameters_after_three_clipped_adamw_steps_match(reports):
    bad = [(c["case"], c["worst_param"], c["param_rel"]) for _, c in _cases(reports) if not c["param_rel"] < TOL]
    assert not bad, bad


def test_counted_all_gathers_reduce_scatters_and_hsdp_all_reduces_equal_the_formula(reports):
    """A step's FSDP2 collectives over the DP mesh, counted by CommCounter, against fully_shard_communication (calls and
    elements of each kind); HSDP also counts its all-reduce across the replicas."""
    bad = [(rank, c["case"], c["counted"], c["expected"]) for rank, c in _cases(reports)
           if not c["counted"] or c["counted"] != dict(sorted(c["expected"].items()))]
    assert not bad, bad
    hsdp = [c for _, c in _cases(reports) if c["case"].get("sharding", {}).get("dp_replicate_size")]
    assert hsdp and all("all_reduce" in c["counted"] for c in hsdp)


def test_fsdp2_runs_torch_own_collectives_unless_its_groups_are_counted(reports):
    """The counting hooks (which wrap torch's private default collectives) are installed only while a counter of the
    DP mesh's groups is active: before the first step, inside the trainer's counter of the TP group, and after the
    last step every unit runs torch's own all-gather and reduce-scatter and no all-reduce hook."""
    bad = [(rank, c["case"], c["torch_collectives_when_not_counting"]) for rank, c in _cases(reports)
           if not all(c["torch_collectives_when_not_counting"])]
    assert not bad, bad


def test_reshard_after_forward_follows_torchtitan():
    """default: every layer but the last without pipeline parallelism, none under it; always / never as named."""
    assert [reshards_after_forward("default", i, 3, pipeline=False) for i in range(3)] == [True, True, False]
    assert not any(reshards_after_forward("default", i, 3, pipeline=True) for i in range(3))
    assert all(reshards_after_forward("always", i, 3, pipeline=True) for i in range(3))
    assert not any(reshards_after_forward("never", i, 3, pipeline=False) for i in range(3))


def test_formula_pads_dim0_gathers_resharded_units_twice_and_reduces_once_per_step():
    units = [FullyShardUnit(((5, 3), (2,)), True), FullyShardUnit(((4, 4),), False)]
    # dim 0 padded to a multiple of 4: 8 x 3 + 4 = 28, and 16
    traffic = fully_shard_communication(units, 4, 2, micro_batches=3, param_bytes=2, reduce_bytes=4)
    assert traffic.collectives.to_dict() == {"all_gather": {"calls": 9, "elements": 3 * (2 * 28 + 16)},
                                             "reduce_scatter": {"calls": 2, "elements": 44},
                                             "all_reduce": {"calls": 2, "elements": 11}}
    assert traffic.bytes == {"all_gather": 2 * 3 * 72, "reduce_scatter": 4 * 44, "all_reduce": 4 * 11}
    with pytest.raises(ValueError, match="schedule"):
        fully_shard_communication(units, 4, pipeline=True)

