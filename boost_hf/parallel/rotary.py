"""Rotary position embedding (RoPE) of the tensor-parallel attention, in the compute dtype.

``transformers``' rotary embedding returns ``cos, sin: [B, S, head_dim]`` in the residual stream's dtype
(fp32 under autocast), so its ``apply_rotary_pos_emb`` promotes bf16 queries and keys to fp32 and
attention casts them back. Here (as in Megatron-LM, which casts the tables to the activation dtype):

* :class:`ComputeDtypeRotaryEmbedding`, adopted by the model's ``rotary_emb``, returns the tables in the
  autocast dtype, once per model forward;
* :func:`apply_rotary` rotates queries and keys in the ``[B, S, heads, head_dim]`` layout the projections
  produce (no transpose copy), in 3 element-wise ops per tensor forward and 3 backward (forward: 3 for both
  when q and k are adjacent views of one fused GEMM output, as under Megatron, or consecutive blocks of one batched
  GEMM output, as BTP's B's; backward: written into the blocks of the batched GEMM's gradient buffer when it has
  one, :func:`~boost_hf.parallel.fused.stacked_slot`). Its outputs are fresh
  ``[B, S, heads, head_dim]`` tensors whose gradients come back in the same layout, so the views
  ``[B, S, heads * head_dim] -> [B, S, heads, head_dim]`` need no copy in backward.

The function is ``transformers``' (``x cos + rotate_half(x) sin``, with ``rotate_half(x) = [-x2, x1]`` on
the halves of ``head_dim``) for any tables; with fp32 inputs it rounds as the reference does. Under
``torch.compile`` the reference formula runs (inductor fuses it).
"""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .modules import compute_dtype


class ComputeDtypeRotaryEmbedding:
    """The model's rotary embedding returning ``cos, sin: [B, S, head_dim]`` in the compute dtype (the
    autocast dtype of the input's device when autocast is on, else the input's dtype)."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = super().forward(x, position_ids)
        dtype = compute_dtype(x)
        return cos.to(dtype), sin.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, transpose: bool = False,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """``x cos + rotate_half(x) sin`` (``transpose``: its transpose, ``x cos - rotate_half(x sin)``, the
    gradient's map) as a new contiguous tensor (or into ``out``, contiguous, ``x``'s shape), in 3 element-wise ops:
    ``out = x cos``, then each half of ``out`` gains the other half of ``x`` times ``sin``. ``x: [..., D]``; ``cos, sin``
    broadcast to it."""
    half = x.shape[-1] // 2
    out = torch.mul(x, cos) if out is None else torch.mul(x, cos, out=out)
    (x1, x2), (out1, out2), (sin1, sin2) = (t.split(half, dim=-1) for t in (x, out, sin))
    if transpose:  # [x1 c1 + x2 s2, x2 c2 - x1 s1]
        out1.addcmul_(x2, sin2)
        out2.addcmul_(x1, sin1, value=-1)
    else:  # [x1 c1 - x2 s1, x2 c2 + x1 s2]
        out1.addcmul_(x2, sin1, value=-1)
        out2.addcmul_(x1, sin2)
    return out


def _adjacent(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """``[B, S, Hq + Hk, D]``: one view of ``query`` and ``key`` when ``key``'s heads directly follow
    ``query``'s in memory (q and k sliced from one fused GEMM output), else ``None``."""
    if query._base is None or key._base is not query._base or query.stride() != key.stride():
        return None
    if key.storage_offset() != query.storage_offset() + query.shape[2] * query.stride(2):
        return None
    shape = (*query.shape[:2], query.shape[2] + key.shape[2], query.shape[3])
    return query.as_strided(shape, query.stride(), query.storage_offset())


def _stacked(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """``[2, B, S, H, D]``: one view of ``query`` and ``key`` when both are contiguous, of one shape, and ``key``
    directly follows ``query`` in memory (consecutive blocks of one batched GEMM output), else ``None``."""
    if query._base is None or key._base is not query._base or query.shape != key.shape:
        return None
    if not (query.is_contiguous() and key.is_contiguous()) or key.storage_offset() != query.storage_offset() + query.numel():
        return None
    return query.as_strided((2, *query.shape), (query.numel(), *query.stride()), query.storage_offset())


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, cos, sin, slots):
        ctx.save_for_backward(cos, sin)
        ctx.slots = slots
        both = _adjacent(query, key)
        if both is not None:
            return _rotate(both, cos, sin).split((query.shape[2], key.shape[2]), dim=2)
        both = _stacked(query, key)
        if both is not None:
            return _rotate(both, cos, sin).unbind(0)
        return _rotate(query, cos, sin), _rotate(key, cos, sin)

    @staticmethod
    def backward(ctx, grad_query, grad_key):
        cos, sin = ctx.saved_tensors
        grads = []
        for grad, slot in zip((grad_query, grad_key), ctx.slots):
            out = None if slot is None else slot[0].slot(slot[1]).view(grad.shape)
            grads.append(None if grad is None else _rotate(grad, cos, sin, transpose=True, out=out))
        return *grads, None, None, None


def apply_rotary(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 slots=(None, None)) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of ``query: [B, S, Hq, D]`` and ``key: [B, S, Hk, D]`` (views of the projections' outputs,
    last dim contiguous) with ``cos, sin: [B or 1, S, D]``; returns ``[B, S, H, D]`` tensors in the dtype
    of ``query`` (the tables are cast to it if they are not already). ``slots``: for each of ``query`` and ``key``,
    ``(gradients, i)`` when the block of a gradient buffer should receive its gradient
    (:func:`~boost_hf.parallel.fused.stacked_slot`), else ``None``."""
    cos, sin = cos.to(query.dtype), sin.to(query.dtype)
    if torch.compiler.is_compiling() or cos.requires_grad or sin.requires_grad:
        return apply_rotary_pos_emb(query, key, cos, sin, unsqueeze_dim=2)
    return _Rotary.apply(query, key, cos.unsqueeze(2), sin.unsqueeze(2), tuple(slots))


__all__ = ["ComputeDtypeRotaryEmbedding", "apply_rotary"]
