"""Preparing a part for data parallelism (:func:`~boost_hf.parallel.parts.prepare_part`) refuses what DDP or FSDP2
would lose: a parameter carrying a gradient hook (one process, no process group)."""

from __future__ import annotations

import pytest

from boost_hf import BoostLlamaForCausalLM
from boost_hf.parallel.parts import PartParallelism, prepare_part
from tests.parallel.tp_cases import tiny_config


@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp2"])
@pytest.mark.parametrize("hook", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_parameter_carrying_a_gradient_hook_is_refused_before_data_parallelism_manages_it(data_parallel, hook):
    """FSDP2 replaces every parameter (a hook on the original would never fire): preparing a part names the parameter
    before DDP or FSDP2 is applied (no process group is needed to refuse it)."""
    model = BoostLlamaForCausalLM(tiny_config(bottleneck="lax"))
    getattr(model.model.layers[1].mlp.down_proj.gate_left, hook)(lambda *args: None)
    with pytest.raises(RuntimeError, match=rf"parameter model\.layers\.1\.mlp\.down_proj\.gate_left carries a gradient hook .* when {data_parallel}"):
        prepare_part(model, PartParallelism(data_parallel=data_parallel))

