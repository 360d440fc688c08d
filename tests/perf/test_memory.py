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
