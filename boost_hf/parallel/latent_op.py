"""The online norm's latent scale and the latent activation after it as one kernel forward and one backward
(``torch.library`` custom ops).

Under BTP with the online RMSNorm (:mod:`boost_hf.parallel.fused`) a grouped projection group's reduced A output is
one buffer ``[..., w + STATISTICS_WIDTH]``: the partial latents ``z = [..., :w]`` summed over the ranks and, in
column ``w``, the residual rows' sum of squares ``S``. The latents the B's read are ``act(z s)`` with
``s = rsqrt(S / d + eps)`` and ``act`` SiLU (CoLA) or the identity (SVD). Written as eager ops this is one pass for
the scale and one for the activation forward, and backward the activation's gradient, its scaled copy, a product
with the latent and its sum over the row (the gradient of ``S``): five passes over ``[N, w]`` tensors, four of them
writing one. Here:

==========================================  =====================================================================
op                                          reads -> writes
==========================================  =====================================================================
``boost_hf::scale_activate``                ``buffer -> act(z s) [..., w]``
``boost_hf::scale_activate_backward``       ``grad [..., w], buffer -> grad_buffer`` (written in place)
==========================================  =====================================================================

with, backward, ``l = z s``, ``g_l = grad * act'(l)``: ``grad_z = g_l s`` into ``grad_buffer[..., :w]`` and
``grad_S = -(s^2 / 2d) sum_j g_l l`` into column ``w`` (``d``: the full hidden size), zeros into the other
statistics columns (alignment only). ``s`` and ``l`` are recomputed from the buffer, never stored; arithmetic in fp32 whatever the
buffer's dtype, outputs rounded once to it. On CUDA each op is that arithmetic compiled by inductor
(``torch.compile``, once per width): one generated kernel each way, reading the inputs once and writing the outputs
once (backward: the row sums and the scaled gradients in one kernel, the arithmetic written over the buffer's whole
width so that inductor fuses them; ``tests/parallel/test_latent_op.py`` counts the Triton kernels inductor generates
for it, on the CPU, on the pinned and the minimum torch; ``make gpu-check`` counts the CUDA kernels that run); on
other devices the same arithmetic as eager ops. Being custom ops, they reach the dispatcher (and
:class:`~boost_hf.perf.op_counter.OpCounter`) as one op each, moving what the CUDA kernels move. Under
``torch.compile`` of the model :func:`scale_activate` is the same arithmetic as plain differentiable ops, which
inductor fuses with its neighbours. No communication.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .generated_kernel import KERNEL_NAMES, compiled as _compiled
from .modules import statistics_dtype

#: the latent functions fused with the scale, by ``latent_activation`` name
ACTIVATIONS = ("identity", "silu")


def _scaled(buffer: Tensor, width: int, hidden_size: int, eps: float, statistics_column: int | None = None) -> tuple[Tensor, Tensor]:
    """``(l, s)``: the first ``width`` columns of the buffer scaled, ``z s``, and ``s = rsqrt(S / d + eps)``, in fp32
    (plain differentiable ops); ``S`` is in column ``statistics_column`` (default ``width``)."""
    column = width if statistics_column is None else statistics_column
    inverse_rms = torch.rsqrt(buffer[..., column:column + 1].to(statistics_dtype(buffer)) / hidden_size + eps)
    return buffer[..., :width].to(inverse_rms.dtype) * inverse_rms, inverse_rms


def _forward(buffer: Tensor, width: int, hidden_size: int, eps: float, activation: str) -> Tensor:
    """``act(z s)`` from ``buffer = [z | S | ...]`` in the buffer's dtype (plain differentiable ops)."""
    latent, _ = _scaled(buffer, width, hidden_size, eps)
    return (F.silu(latent) if activation == "silu" else latent).to(buffer.dtype)


def _backward(grad: Tensor, buffer: Tensor, hidden_size: int, eps: float, activation: str, grad_buffer: Tensor) -> None:
    """Write the gradient of ``buffer`` given ``grad`` of ``act(z s)`` into ``grad_buffer`` (plain ops).

    Every term is computed over the buffer's whole width ``w + STATISTICS_WIDTH`` and masked by column (``grad`` is
    zero-padded to it; the latents' columns hold ``g_l s``, column ``w`` the gradient of ``S``, the others zeros), so
    that the row sums and the written gradient share one iteration space: inductor generates one kernel for both (the
    same arithmetic written per column range, as before, made a reduction kernel and a second pointwise one). The
    forward buffer's columns past ``w`` (``S`` and the unwritten alignment columns, whatever they hold) are read but
    only ever selected away (``where``), never multiplied by zero."""
    width, full = grad.shape[-1], buffer.shape[-1]
    latent, inverse_rms = _scaled(buffer, full, hidden_size, eps, statistics_column=width)
    grad_latent = F.pad(grad, (0, full - width)).to(inverse_rms.dtype)
    if activation == "silu":
        sigmoid = torch.sigmoid(latent)
        grad_latent = grad_latent * (sigmoid * (1 + latent * (1 - sigmoid)))
    column = torch.arange(full, device=buffer.device)
    inside = column < width
    # l = z s with s = (S/d + eps)^(-1/2):  dL/dz = g_l s,  dL/dS = sum_j g_l_j z_j (-s^3 / 2d) = -(s^2 / 2d) sum_j g_l_j l_j
    grad_squares = torch.where(inside, grad_latent * latent, 0).sum(-1, keepdim=True) * (inverse_rms * inverse_rms) * (-0.5 / hidden_size)
    grad_buffer.copy_(torch.where(inside, grad_latent * inverse_rms, torch.where(column == width, grad_squares, 0)))


@torch.library.custom_op("boost_hf::scale_activate", mutates_args=())
def _scale_activate(buffer: Tensor, width: int, hidden_size: int, eps: float, activation: str) -> Tensor:
    return _forward(buffer, width, hidden_size, eps, activation)


@_scale_activate.register_kernel("cuda")
def _(buffer: Tensor, width: int, hidden_size: int, eps: float, activation: str) -> Tensor:
    return _compiled(_forward)(buffer, width, hidden_size, eps, activation)


@_scale_activate.register_fake
def _(buffer: Tensor, width: int, hidden_size: int, eps: float, activation: str) -> Tensor:
    return buffer.new_empty((*buffer.shape[:-1], width))


@torch.library.custom_op("boost_hf::scale_activate_backward", mutates_args=("grad_buffer",))
def _scale_activate_backward(grad: Tensor, buffer: Tensor, hidden_size: int, eps: float, activation: str, grad_buffer: Tensor) -> None:
    _backward(grad, buffer, hidden_size, eps, activation, grad_buffer)


@_scale_activate_backward.register_kernel("cuda")
def _(grad: Tensor, buffer: Tensor, hidden_size: int, eps: float, activation: str, grad_buffer: Tensor) -> None:
    _compiled(_backward)(grad, buffer, hidden_size, eps, activation, grad_buffer)


@_scale_activate_backward.register_fake
def _(grad: Tensor, buffer: Tensor, hidden_size: int, eps: float, activation: str, grad_buffer: Tensor) -> None:
    return None


def _setup_context(ctx, inputs, output) -> None:
    buffer, _, hidden_size, eps, activation = inputs
    ctx.save_for_backward(buffer)
    ctx.hidden_size, ctx.eps, ctx.activation = hidden_size, eps, activation


def _autograd_backward(ctx, grad):
    (buffer,) = ctx.saved_tensors
    grad_buffer = torch.empty_like(buffer, memory_format=torch.contiguous_format)
    _scale_activate_backward(grad.contiguous(), buffer, ctx.hidden_size, ctx.eps, ctx.activation, grad_buffer)
    return grad_buffer, None, None, None, None


_scale_activate.register_autograd(_autograd_backward, setup_context=_setup_context)
KERNEL_NAMES.update({_forward: "boost_hf::scale_activate", _backward: "boost_hf::scale_activate_backward"})


def scale_activate(buffer: Tensor, width: int, hidden_size: int, eps: float, activation: str) -> Tensor:
    """``act(z * rsqrt(S / hidden_size + eps))`` for ``buffer = [z (width columns) | S | ...]`` (the reduced output of
    :func:`~boost_hf.parallel.fused.down_projection` with ``statistics=True``), ``activation`` one of
    :data:`ACTIVATIONS`: ``[..., width]`` in the buffer's dtype, computed in fp32. One kernel forward and one
    backward (see the module docstring); under ``torch.compile``, plain ops."""
    if torch.compiler.is_compiling():
        return _forward(buffer, width, hidden_size, eps, activation)
    return _scale_activate(buffer, width, hidden_size, eps, activation)


__all__ = ["ACTIVATIONS", "scale_activate"]
