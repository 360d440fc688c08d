"""The Megatron layout's grouped GEMMs (boost_hf/parallel/layouts/megatron.py), on one process: TP1 with full
activation checkpointing runs the parallel decoder layer (parity at TP 2 and 4 is in test_tensor_parallel)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM, ParallelConfig

from ..tolerances import assert_scaled_close, fp32_rounding

LOGITS = fp32_rounding(2 * 10 * 128)  # 2 blocks of d 64, d_ff 128 (see tests/tolerances.py): 1.8e-5

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class _CountGemms(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.gemms = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.gemms += func._overloadpacket.__name__ in ("mm", "addmm", "bmm")
        return func(*args, **(kwargs or {}))


def _models(group_linears: bool = True):
    config = BoostLlamaConfig.from_preset(
        "llama-60m", num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128,
    )
    torch.manual_seed(0)
    reference = BoostLlamaForCausalLM(config).eval()
    model = BoostLlamaForCausalLM(config).eval()
    model.load_state_dict(reference.state_dict())
    ParallelConfig(tp_size=1, activation_checkpointing="full", group_linears=group_linears).parallelize(model)
    return reference, model, torch.randint(0, config.vocab_size, (2, 16))


def test_one_gemm_per_group_and_every_projection_called_as_a_module():
    reference, model, ids = _models()
    calls = []
    for name, module in model.named_modules():
        if name.endswith(PROJECTIONS):
            module.register_forward_hook(lambda m, args, out, name=name: calls.append((name, args[0].shape, out.shape)))
    with torch.no_grad(), _CountGemms() as counted:
        logits = model(ids).logits
    assert counted.gemms == 4 * 2 + 1  # qkv, o, gate_up, down per layer; the LM head
    assert sorted(name for name, _, _ in calls) == sorted(n for n, _ in model.named_modules() if n.endswith(PROJECTIONS))
    for name, in_shape, out_shape in calls:  # each hook sees its projection's input and output
        projection = model.get_submodule(name)
        assert in_shape[-1] == projection.weight.shape[1] and out_shape[-1] == projection.weight.shape[0]
    with torch.no_grad():
        assert_scaled_close(logits, reference(ids).logits, LOGITS, "logits")


def test_ungrouped_runs_every_projection_as_its_own_gemm():
    reference, model, ids = _models(group_linears=False)
    with torch.no_grad(), _CountGemms() as counted:
        logits = model(ids).logits
    assert counted.gemms == 7 * 2 + 1
    with torch.no_grad():
        assert_scaled_close(logits, reference(ids).logits, LOGITS, "logits")


def _double_input(module, args):
    return (2 * args[0],)


@pytest.mark.parametrize("change", ["pre_hook", "replaced"])
def test_a_projection_with_a_pre_hook_or_replaced_runs_its_own_gemm(change):
    reference, model, ids = _models()
    for m in (reference, model):
        attention = m.model.layers[1].self_attn
        if change == "pre_hook":
            attention.k_proj.register_forward_pre_hook(_double_input)
        else:
            replacement = nn.Linear(attention.k_proj.in_features, attention.k_proj.out_features, bias=False)
            replacement.weight = attention.k_proj.weight
            attention.k_proj = replacement
    with torch.no_grad(), _CountGemms() as counted:
        logits = model(ids).logits
    with torch.no_grad():
        expected = reference(ids).logits
    assert counted.gemms == 4 * 2 + 1 + 2  # layer 1's q, k and v run as three GEMMs
    assert_scaled_close(logits, expected, LOGITS, "logits")
