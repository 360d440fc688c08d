"""RMSNorm of a full-width residual as one kernel forward and two backward (``torch.library`` custom ops).

``y = x * rstd * weight`` with ``rstd = rsqrt(mean(x^2, -1) + eps)``: ``x: [..., d]``, ``weight: [d]`` of ``x``'s
dtype (:data:`FUSED_DTYPES`: fp32 under autocast, bf16 or fp16 with low-precision parameters), ``y`` in that dtype,
``rstd: [..., 1]`` in fp32 whatever the input dtype. Statistics and normalisation are computed in fp32 inside the
kernels: a bf16 input is read as bf16 and its outputs written as bf16, with no full-width fp32 copy in memory. On
CUDA each op is one call of PyTorch's fused RMSNorm kernels (``aten._fused_rms_norm`` and its backward, what
``F.rms_norm`` runs there), which round ``x * rstd * weight`` once; on other devices the arithmetic of
``transformers``' ``LlamaRMSNorm`` (``weight * (x * rstd)`` rounded to ``x``'s dtype first, so the forward is
bit-identical to the single-device module in every dtype) with a hand-written backward in fp32, rounded once to
the gradient's dtype. In bf16 the two differ by the one rounding of ``x * rstd`` (at most 2^-9 relative, bf16's half
unit in the last place); both are within one bf16 rounding of the same arithmetic done in fp32 on the upcast
inputs. Being custom ops, they reach the dispatcher (and :class:`~boost_hf.perf.op_counter.OpCounter`) as one op
each, moving what the fused kernels move:

==========================================  ====================================================
op                                          reads -> writes
==========================================  ====================================================
``boost_hf::rms_norm``                      ``x, weight -> y, rstd``
``boost_hf::rms_norm_input_backward``       ``grad_y, x, rstd, weight -> grad_x``
``boost_hf::rms_norm_weight_backward``      ``grad_y, x, rstd, weight -> grad_weight``
==========================================  ====================================================

Used by the block norms of the layouts whose residual stream is whole on every rank (Megatron, vanilla):
:class:`boost_hf.parallel.norms.FusedRMSNorm` (which runs the plain module under ``torch.compile``, where
inductor fuses it with its neighbours); the weight gradient also by the sync norm under BTP
(:class:`boost_hf.parallel.norms.SyncRMSNorm`, whose ``rstd`` comes from all ranks' statistics). No communication.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: the dtypes the fused kernels take (``x`` and ``weight`` of one of them)
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@torch.library.custom_op("boost_hf::rms_norm", mutates_args=())
def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    xf = x.to(torch.float32)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd).to(x.dtype) * weight, rstd


def _rms_norm_cuda(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
    return y, rstd.view(*x.shape[:-1], 1)


@_rms_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@torch.library.custom_op("boost_hf::rms_norm_input_backward", mutates_args=())
def _input_backward(grad: Tensor, x: Tensor, rstd: Tensor, weight: Tensor) -> Tensor:
    # y = x r w with r = (mean(x^2) + eps)^(-1/2):  dx = r (g w - x r^2 mean(g w x))
    dtype = rstd.dtype
    gw, xf = grad.to(dtype) * weight, x.to(dtype)
    dot = (gw * xf).mean(-1, keepdim=True)
    return ((gw - xf * (rstd * rstd * dot)) * rstd).to(x.dtype)


def _input_backward_cuda(grad: Tensor, x: Tensor, rstd: Tensor, weight: Tensor) -> Tensor:
    return torch.ops.aten._fused_rms_norm_backward(grad, x, [x.shape[-1]], rstd, weight, [True, False])[0]


@_input_backward.register_fake
def _(grad: Tensor, x: Tensor, rstd: Tensor, weight: Tensor) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("boost_hf::rms_norm_weight_backward", mutates_args=())
def _weight_backward(grad: Tensor, x: Tensor, rstd: Tensor, weight: Tensor) -> Tensor:
    dtype = rstd.dtype
    normed = (x.to(dtype) * rstd).to(x.dtype)
    return (grad.to(dtype) * normed).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)


def _weight_backward_cuda(grad: Tensor, x: Tensor, rstd: Tensor, weight: Tensor) -> Tensor:
    return torch.ops.aten._fused_rms_norm_backward(grad, x, [x.shape[-1]], rstd, weight, [False, True])[1]


@_weight_backward.register_fake
def _(grad: Tensor, x: Tensor, rstd: Tensor, weight: Tensor) -> Tensor:
    return torch.empty_like(weight)


# PyTorch's fused CUDA kernels (torch >= 2.9); without them every device runs the arithmetic above
if hasattr(torch.ops.aten, "_fused_rms_norm") and hasattr(torch.ops.aten, "_fused_rms_norm_backward"):
    _rms_norm.register_kernel("cuda")(_rms_norm_cuda)
    _input_backward.register_kernel("cuda")(_input_backward_cuda)
    _weight_backward.register_kernel("cuda")(_weight_backward_cuda)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # no zero-filled gradient for rstd


def _backward(ctx, grad_y, _grad_rstd):
    if grad_y is None:
        return None, None, None
    x, weight, rstd = ctx.saved_tensors
    grad_x = _input_backward(grad_y, x, rstd, weight) if ctx.needs_input_grad[0] else None
    grad_weight = _weight_backward(grad_y, x, rstd, weight) if ctx.needs_input_grad[1] else None
    return grad_x, grad_weight, None


_rms_norm.register_autograd(_backward, setup_context=_setup_context)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) * weight`` (``LlamaRMSNorm`` for ``x`` and ``weight`` of one dtype)."""
    return _rms_norm(x, weight, eps)[0]


def rms_norm_weight_backward(grad: Tensor, x: Tensor, rstd: Tensor, weight: Tensor) -> Tensor:
    """``sum over rows of grad * x * rstd`` (``[d]``, ``weight``'s dtype; ``rstd: [..., 1]`` fp32, from any
    statistics): the gradient of ``weight`` in one op, no autograd."""
    return _weight_backward(grad, x, rstd, weight)


__all__ = ["FUSED_DTYPES", "rms_norm", "rms_norm_weight_backward"]
