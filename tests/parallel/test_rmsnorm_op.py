"""The fused RMSNorm ops (:mod:`boost_hf.parallel.rmsnorm_op`) of the layouts whose residual is whole: the
single-device norm's forward bit for bit, its gradients within fp32 rounding, one counted op per kernel."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from boost_hf import BoostLlamaForCausalLM, ParallelConfig
from boost_hf.modeling_boost_llama import BoostLlamaRMSNorm
from boost_hf.parallel.norms import FusedRMSNorm, GatheredRMSNorm
from boost_hf.parallel.rmsnorm_op import rms_norm
from boost_hf.perf.op_counter import OpCounter
from ..tolerances import ONE_OPERATOR, assert_scaled_close

EPS = 1e-6


def _norm_and_input(dtype, d=16):
    torch.manual_seed(0)
    norm = BoostLlamaRMSNorm(d, EPS).to(dtype)
    norm.weight.data.uniform_(0.5, 1.5)
    return norm, (3 * torch.randn(3, 5, d, dtype=dtype)).requires_grad_()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_forward_is_the_single_device_norm_bit_for_bit(dtype):
    norm, x = _norm_and_input(dtype)
    assert torch.equal(rms_norm(x, norm.weight, EPS), norm(x))


def test_gradients_equal_autograd_of_the_single_device_norm():
    norm, x = _norm_and_input(torch.float32)
    weight = norm.weight.detach().clone().requires_grad_()
    grad = torch.randn(3, 5, 16)
    expected = torch.autograd.grad(norm(x), (x, norm.weight), grad)
    got = torch.autograd.grad(rms_norm(x, weight, EPS), (x, weight), grad)
    for a, b in zip(got, expected):
        assert_scaled_close(a, b, ONE_OPERATOR, "gradient")


@pytest.mark.parametrize("op", ["rms_norm", "rms_norm_input_backward", "rms_norm_weight_backward"])
def test_custom_ops_pass_opcheck(op):
    norm, x = _norm_and_input(torch.float32)
    _, rstd = torch.ops.boost_hf.rms_norm(x.detach(), norm.weight.detach(), EPS)
    grad = torch.randn_like(x)
    args = {
        "rms_norm": (x, norm.weight, EPS),
        "rms_norm_input_backward": (grad, x.detach(), rstd, norm.weight.detach()),
        "rms_norm_weight_backward": (grad, x.detach(), rstd, norm.weight.detach()),
    }[op]
    torch.library.opcheck(getattr(torch.ops.boost_hf, op).default, args)


def test_counted_as_one_op_forward_and_two_backward():
    with FakeTensorMode():
        x, weight = torch.empty(4, 8, 64, requires_grad=True), torch.empty(64, requires_grad=True)
        with OpCounter() as forward:
            y = rms_norm(x, weight, EPS)
        with OpCounter() as backward:
            y.backward(torch.empty_like(y))
    assert forward.ops_by_op == {"rms_norm": 1}
    assert forward.bytes_by_op == {"rms_norm": 4 * (2 * x.numel() + 64 + 32)}  # x, weight -> y, rstd [4, 8, 1]
    assert backward.ops_by_op == {"rms_norm_input_backward": 1, "rms_norm_weight_backward": 1}


@pytest.mark.parametrize("variant, style", [("full", "megatron"), ("cola", "vanilla"), ("cola", "btp")])
def test_layouts_with_a_whole_residual_run_the_fused_norm(make_config, variant, style):
    model = BoostLlamaForCausalLM(make_config(variant), parallel_config=ParallelConfig(tp_style=style, activation_checkpointing="full"))
    layer = model.model.layers[0]
    assert isinstance(layer.input_layernorm, FusedRMSNorm) and isinstance(layer.post_attention_layernorm, FusedRMSNorm)
    assert isinstance(model.model.norm, FusedRMSNorm) and not isinstance(model.model.norm, GatheredRMSNorm)
    norm, x = layer.input_layernorm, torch.randn(2, 3, model.config.hidden_size, dtype=torch.float64)
    model.double()  # not fp32: the module's own arithmetic, exactly
    assert torch.equal(norm(x), BoostLlamaRMSNorm.forward(norm, x))
