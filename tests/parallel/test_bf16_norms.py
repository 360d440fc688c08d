"""The norms with bf16 parameters and no autocast (DeepSpeed's bf16 mode, Megatron-LM's): every norm kernel is bf16
in, bf16 out, statistics in fp32, never writing a full-width fp32 tensor, and within bf16 rounding of the same norm
computed in fp32 on the upcast inputs (the reference), forward and backward.

Tolerances are bf16 rounding, derived, not fitted. bf16 keeps 8 significant bits: rounding a value changes it by at
most ``U = 2^-8`` relative (half a unit in the last place; bf16's machine epsilon is ``2^-7``).

* Forward of the full-width and sync norms: ``weight * round(x * rstd)``, rounded again: two roundings, so within
  ``2 U`` relative of the reference, element by element (no sum, no cancellation; the fused CUDA kernel rounds once).
* Input gradients ``rstd (g w - x rstd^2 mean(g w x))``: the fused op computes them in fp32 from the bf16 tensors
  and rounds once, so within ``U`` of the size ``T = rstd (|g w| + |x| rstd^2 mean(|g w x|))`` of the terms it
  subtracts; the sync norm rounds ``g w``, the products of its dot, the sum and the scaled result: within ``4 U T``.
* Weight gradients: sums over tokens of ``grad * round(x * rstd)``: each term off by ``U``, so within
  ``U * sum |grad * x * rstd|`` plus the final rounding.
* The online norm (fused into the A GEMM, :mod:`boost_hf.parallel.fused`): ``gamma`` folded into the A's rounds each
  weight once (``U``), the GEMM output and the scaled latent are rounded once each: within
  ``3 U (|x| rstd) @ |A gamma|^T``; its gradients go through bf16 GEMMs whose outputs are rounded (normwise within
  ``4 U`` of the reference, the usual GEMM bound for inputs without cancellation).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from boost_hf import BoostLlamaForCausalLM, ParallelConfig
from boost_hf.modeling_boost_llama import BoostLlamaRMSNorm
from boost_hf.parallel.fused import down_projection, scale_latents
from boost_hf.parallel.modules import adopt
from boost_hf.parallel.norms import SyncRMSNorm
from boost_hf.parallel.rmsnorm_op import rms_norm
from boost_hf.parallel.shared_storage import cast_parameters
from boost_hf.perf.rank_cost import fake_process_group

U = 2.0 ** -8  # bf16 unit roundoff: rounding changes a value by at most this, relative
EPS = 1e-6
D = 64
# the kernels on this machine's devices (`make gpu-check` runs the CUDA ones: `pytest ... -k cuda`)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))]


def _inputs(d=D, rows=(3, 5)):
    torch.manual_seed(0)
    x = (3 * torch.randn(*rows, d)).to(torch.bfloat16)
    weight = torch.empty(d).uniform_(0.5, 1.5).to(torch.bfloat16)
    grad = torch.randn(*rows, d).to(torch.bfloat16)
    return x, weight, grad


def _reference(x, weight, grad):
    """The single-device norm in fp32 on the upcast bf16 inputs: output, input and weight gradients, and the error
    scales of the gradients: ``T`` (see the module docstring) and ``sum |grad * x * rstd|`` over tokens."""
    norm = BoostLlamaRMSNorm(x.shape[-1], EPS)
    norm.weight.data = weight.float()
    xf = x.float().requires_grad_()
    y = norm(xf)
    grad_x, grad_w = torch.autograd.grad(y, (xf, norm.weight), grad.float())
    xf, gw = xf.detach(), grad.float() * weight.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    terms = rstd * (gw.abs() + xf.abs() * rstd.square() * (gw * xf).abs().mean(-1, keepdim=True))
    scale = (grad.float() * xf * rstd).abs().reshape(-1, x.shape[-1]).sum(0)
    return y.detach(), grad_x, (terms, grad_w, scale)


def _within_bf16_rounding(norm_fn, x, weight, grad, device, input_roundings=1):
    """``norm_fn`` run on ``device`` (inputs made on the CPU and moved), checked against the CPU fp32 reference."""
    xb, wb = x.to(device).requires_grad_(), weight.to(device).requires_grad_()
    y = norm_fn(xb, wb)
    grad_x, grad_w = torch.autograd.grad(y, (xb, wb), grad.to(device))
    assert y.dtype == grad_x.dtype == grad_w.dtype == torch.bfloat16
    y, grad_x, grad_w = y.cpu(), grad_x.cpu(), grad_w.cpu()
    y_ref, grad_x_ref, (terms, grad_w_ref, scale) = _reference(x, weight, grad)
    assert ((y.float() - y_ref).abs() <= 2 * U * y_ref.abs() * (1 + 1e-5)).all()
    assert ((grad_x.float() - grad_x_ref).abs() <= input_roundings * U * terms * (1 + 1e-5)).all()
    assert ((grad_w.float() - grad_w_ref).abs() <= U * (grad_w_ref.abs() + scale) * (1 + 1e-5)).all()


@pytest.mark.parametrize("device", DEVICES)
def test_fused_norm_op_in_bf16_is_within_bf16_rounding_of_fp32(device):
    _within_bf16_rounding(lambda x, w: rms_norm(x, w, EPS), *_inputs(), device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_fused_norm_op_is_pytorchs_kernel_on_cuda_and_the_module_elsewhere(device, dtype):
    """On CUDA each op is PyTorch's fused kernel (outputs bit-identical to ``aten._fused_rms_norm`` and its
    backward); fp32 within fp32 rounding of the reference. Elsewhere the module's arithmetic (bit-identical forward)."""
    x, weight, grad = (t.to(dtype) for t in _inputs())
    xd, wd, gd = x.to(device).requires_grad_(), weight.to(device).requires_grad_(), grad.to(device)
    y = rms_norm(xd, wd, EPS)
    grad_x, grad_w = torch.autograd.grad(y, (xd, wd), gd)
    if device == "cuda":
        fused, rstd = torch.ops.aten._fused_rms_norm(xd.detach(), [D], wd.detach(), EPS)
        expected = torch.ops.aten._fused_rms_norm_backward(gd, xd.detach(), [D], rstd, wd.detach(), [True, True])
        assert torch.equal(y, fused) and torch.equal(grad_x, expected[0]) and torch.equal(grad_w, expected[1])
    else:
        norm = BoostLlamaRMSNorm(D, EPS).to(dtype)
        norm.weight.data = weight
        assert torch.equal(y, norm(x))
    if dtype == torch.float32:
        y_ref, grad_x_ref, (_, grad_w_ref, _) = _reference(x, weight, grad)
        for got, ref in ((y, y_ref), (grad_x, grad_x_ref), (grad_w, grad_w_ref)):
            torch.testing.assert_close(got.cpu(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("device", DEVICES)
def test_sync_norm_in_bf16_is_within_bf16_rounding_of_fp32(device):
    """One rank's arithmetic (the all-reduces of the ``[..., 1]`` statistics are sums, here of one rank)."""
    def sync(x, w):
        norm = adopt(BoostLlamaRMSNorm(D, EPS).to(torch.bfloat16), SyncRMSNorm, group=None, hidden_size=D)
        del norm.weight
        norm.weight = w
        return norm(x)

    _within_bf16_rounding(sync, *_inputs(), device, input_roundings=4)


@pytest.mark.parametrize("device", DEVICES)
def test_online_norm_in_bf16_is_within_bf16_rounding_of_fp32(device):
    """``scale(reduce(down(x)))`` with bf16 x, gamma and A's: ``A (gamma x / rms(x))`` at bf16 rounding."""
    x, gamma, grad = _inputs(rows=(2, 7))
    torch.manual_seed(1)
    factors = [(0.3 * torch.randn(8, D)).to(torch.bfloat16) for _ in range(3)]
    leaves = [t.to(device).requires_grad_() for t in (x, gamma, *factors)]
    (latents,) = scale_latents(down_projection(leaves[0], leaves[2:], gamma=leaves[1], statistics=True), D, EPS)
    assert latents.dtype == torch.bfloat16
    upcast = [t.float().requires_grad_() for t in (x, gamma, *factors)]
    xf, gf, *af = upcast
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    reference = (gf * xf * rstd) @ torch.cat(af).T
    bound = 3 * U * (xf.abs() * rstd) @ (torch.cat(af) * gf).abs().T
    assert ((latents.float().cpu() - reference).abs() <= bound.detach()).all()
    grad_latents = torch.randn(latents.shape).to(torch.bfloat16)
    got = torch.autograd.grad(latents, leaves, grad_latents.to(device))
    expected = torch.autograd.grad(reference, upcast, grad_latents.float())
    for name, a, b in zip(["x", "gamma", "A_q", "A_k", "A_v"], got, expected):
        assert a.dtype == torch.bfloat16, name
        assert (a.float().cpu() - b).norm() <= 4 * U * b.norm(), name


class _WrittenDtypes(TorchDispatchMode):
    """Records ``(op, dtype, numel)`` of every tensor each op writes."""

    def __init__(self):
        super().__init__()
        self.written = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.written.append((func._overloadpacket.__name__, t.dtype, t.numel()))
        return out


LAYOUTS = {
    "megatron": ("full", dict(tp_style="megatron")),
    "megatron-sp": ("full", dict(tp_style="megatron", sequence_parallel=True)),
    "vanilla": ("cola", dict(tp_style="vanilla")),
    "btp": ("cola", dict(tp_style="btp")),
    "btp-sync": ("cola", dict(tp_style="btp", rmsnorm="sync")),
    "btp-local": ("cola", dict(tp_style="btp", rmsnorm="local")),
    "btp-sp": ("cola", dict(tp_style="btp", sequence_parallel=True)),
    "btp-lax": ("lax-dense", dict(tp_style="btp")),
}
TP = 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", LAYOUTS)
def test_layers_with_bf16_parameters_write_no_fp32_activation(make_config, name, device):
    """A decoder layer of one TP-2 rank (fake process group: collectives do nothing, dtypes are what counts) with
    bf16 parameters, forward and backward: its norms run on the bf16 residual, and no op writes an fp32 tensor
    wider than one column of statistics per token (the norms' ``rstd``, the online norm's sums of squares; the
    attention kernel's log-sum-exp per head and token, which is attention's own, is not a norm's)."""
    variant, fields = LAYOUTS[name]
    with fake_process_group(TP):
        model = BoostLlamaForCausalLM(make_config(variant), parallel_config=ParallelConfig(tp_size=TP, **fields)).to(device)
        cast_parameters(model, torch.bfloat16)
        batch, seq, hidden = 2, 4, model.config.hidden_size
        layout = model.model.layers[1]
        if fields["tp_style"] == "btp":
            shape = (batch, seq, hidden // TP)
        elif fields.get("sequence_parallel"):
            shape = (batch, seq // TP, hidden)
        else:
            shape = (batch, seq, hidden)
        x = torch.randn(shape, dtype=torch.bfloat16, device=device, requires_grad=True)
        position = model.model.rotary_emb(x, torch.arange(seq, device=device)[None].expand(batch, -1))
        previous = None
        if variant.startswith("lax"):
            previous = {name: torch.randn(batch, seq, model.config.rank, dtype=torch.bfloat16, device=device) for name in
                        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
        with _WrittenDtypes() as record:
            out, _ = layout(x, position_embeddings=position, lax_latents=previous)
            out.backward(torch.ones_like(out))
    assert out.dtype == x.grad.dtype == torch.bfloat16
    wide_fp32 = sorted({(op, numel) for op, dtype, numel in record.written
                        if dtype == torch.float32 and numel > batch * seq and not op.startswith("_scaled_dot_product")})
    assert not wide_fp32, wide_fp32
    if fields["tp_style"] != "btp":
        assert {"rms_norm", "rms_norm_input_backward", "rms_norm_weight_backward"} <= {w[0] for w in record.written}
