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
(``torch.compile``, once per width): generated kernels that read the inputs once and write the outputs once (the
backward's row sums and scaled gradients in one pass where inductor fuses them; ``make gpu-check`` counts the
kernels); on other devices the same arithmetic as eager ops. Being custom ops, they reach the dispatcher (and
:class:`~boost_hf.perf.op_counter.OpCounter`) as one op each, moving what the CUDA kernels move. Under
``torch.compile`` of the model :func:`scale_activate` is the same arithmetic as plain differentiable ops, which
inductor fuses with its neighbours. No communication.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from .modules import statistics_dtype

#: the latent functions fused with the scale, by ``latent_activation`` name
ACTIVATIONS = ("identity", "silu")


def _scaled(buffer: Tensor, width: int, hidden_size: int, eps: float) -> tuple[Tensor, Tensor]:
    """``(l, s)``: the scaled latents ``z s`` and ``s = rsqrt(S / d + eps)`` in fp32 (plain differentiable ops)."""
    inverse_rms = torch.rsqrt(buffer[..., width:width + 1].to(statistics_dtype(buffer)) / hidden_size + eps)
    return buffer[..., :width].to(inverse_rms.dtype) * inverse_rms, inverse_rms


def _forward(buffer: Tensor, width: int, hidden_size: int, eps: float, activation: str) -> Tensor:
    """``act(z s)`` from ``buffer = [z | S | ...]`` in the buffer's dtype (plain differentiable ops)."""
    latent, _ = _scaled(buffer, width, hidden_size, eps)
    return (F.silu(latent) if activation == "silu" else latent).to(buffer.dtype)


def _backward(grad: Tensor, buffer: Tensor, hidden_size: int, eps: float, activation: str, grad_buffer: Tensor) -> None:
    """Write the gradient of ``buffer`` given ``grad`` of ``act(z s)`` into ``grad_buffer`` (plain ops)."""
    width = grad.shape[-1]
    latent, inverse_rms = _scaled(buffer, width, hidden_size, eps)
    grad_latent = grad.to(inverse_rms.dtype)
    if activation == "silu":
        sigmoid = torch.sigmoid(latent)
        grad_latent = grad_latent * (sigmoid * (1 + latent * (1 - sigmoid)))
    # l = z s with s = (S/d + eps)^(-1/2):  dL/dz = g_l s,  dL/dS = sum_j g_l_j z_j (-s^3 / 2d) = -(s^2 / 2d) sum_j g_l_j l_j
    grad_buffer[..., :width].copy_(grad_latent * inverse_rms)
    grad_buffer[..., width:width + 1].copy_((grad_latent * latent).sum(-1, keepdim=True) * (inverse_rms * inverse_rms) * (-0.5 / hidden_size))
    grad_buffer[..., width + 1:].zero_()  # the unused statistics columns (alignment only)


_KERNELS = {"_forward": "boost_hf::scale_activate", "_backward": "boost_hf::scale_activate_backward"}
"""The op whose CUDA kernel each eager function is."""


def _compiler_unavailable(error: BaseException) -> bool:
    """Whether ``error`` says inductor cannot generate kernels here (no working Triton, a GPU too old for it, a
    compiler that failed), as opposed to an error of the arithmetic itself (shapes, dtypes) or out of memory."""
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import GPUTooOldForTriton, TritonMissing

    if isinstance(error, (TritonMissing, GPUTooOldForTriton)):
        return True
    return isinstance(error, BackendCompilerFailed) and not isinstance(error.inner_exception, torch.OutOfMemoryError)


@functools.cache
def _compiled(function):
    """``function`` compiled by inductor (dynamic shapes: one graph per width and activation), or, where inductor
    cannot compile for this device (:func:`_compiler_unavailable`), ``function`` itself (its eager ops) with a warning
    naming the op and the fallback. Any other error (out of memory, a shape error) is raised."""
    compiled = torch.compile(function, dynamic=True, fullgraph=True)

    def run(*args):
        nonlocal compiled
        try:
            return compiled(*args)
        except Exception as error:
            if compiled is function or not _compiler_unavailable(error):
                raise
            kernel = _KERNELS.get(function.__name__, function.__name__)
            warnings.warn(f"boost_hf: the fused CUDA kernel of {kernel} could not be compiled by inductor "
                          f"({type(error).__name__}: {str(error).splitlines()[0][:200]}); {kernel} falls back to its eager "
                          f"arithmetic ({function.__module__}.{function.__name__}: separate PyTorch ops, several passes over "
                          "the latents instead of one) for the rest of this process.")
            compiled = function
            return function(*args)

    return run


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


def scale_activate(buffer: Tensor, width: int, hidden_size: int, eps: float, activation: str) -> Tensor:
    """``act(z * rsqrt(S / hidden_size + eps))`` for ``buffer = [z (width columns) | S | ...]`` (the reduced output of
    :func:`~boost_hf.parallel.fused.down_projection` with ``statistics=True``), ``activation`` one of
    :data:`ACTIVATIONS`: ``[..., width]`` in the buffer's dtype, computed in fp32. One kernel forward and one
    backward (see the module docstring); under ``torch.compile``, plain ops."""
    if torch.compiler.is_compiling():
        return _forward(buffer, width, hidden_size, eps, activation)
    return _scale_activate(buffer, width, hidden_size, eps, activation)


__all__ = ["ACTIVATIONS", "scale_activate"]
