"""The communication pattern of each tensor-parallel layout, per group of projections.

A *projection group* is the set of projections that read one input: ``qkv`` (q, k, v), ``o``,
``gate_up`` (gate, up) and ``down``. Every group runs in three steps, so that a decoder layer (and
low-rank activation checkpointing) can cut between them:

1. ``down(x, norm)`` — local work up to the group's first collective (norm + A's, or the input copy);
2. ``reduce(partials)`` — that collective (identity where the layout has none here);
3. ``up(z, carries)`` — everything after it: latent functions, B's, and any trailing collective.

==============================  ===========================================  ==========================================
layout                          forward communication per group              backward communication per group
==============================  ===========================================  ==========================================
:class:`DenseGroup`             row groups (o, down): all-reduce ``N x d``   column groups (qkv, gate_up): all-reduce
(megatron; full rank, p=1)                                                   of the ``N x d`` input grad
:class:`ReplicatedLowRankGroup` every B output all-reduced at full width     A inputs' grads all-reduced (one per group
(vanilla; low rank, p=1)        (one per projection); LaX: latent gathered   when grouped, else one per projection);
                                                                             LaX: latent grads all-gathered
:class:`BottleneckAwareGroup`   A partial outputs all-reduced: ``N x k r``   B inputs' grads all-reduced: ``N x k r``
(btp)                           (+ N norm statistics, online)                (sync norm: + N statistics)
==============================  ===========================================  ==========================================

With ``group_linears`` the A's sharing an input run as one GEMM on concatenated weights (one
collective) and equally-shaped B's as one batched GEMM; the weights stay separate parameters with
canonical names, concatenated at run time (a copy of ``k r d`` elements, small next to the GEMM).
"""

from __future__ import annotations

from itertools import groupby

import torch
import torch.nn.functional as F
from torch import nn

from .norms import online_rms_norm_inverse, online_rms_norm_local, rms_norm, sync_rms_norm
from .primitives import copy_to_tp, gather_from_tp, reduce_from_tp, split_to_tp

Tensors = tuple[torch.Tensor, ...]


def batched_linear(inputs: list[torch.Tensor], weights: list[torch.Tensor], batched: bool) -> list[torch.Tensor]:
    """``[F.linear(x_i, w_i)]``; with ``batched`` equally-shaped weights run as one ``bmm`` over a stack."""
    if not batched:
        return [F.linear(x, w) for x, w in zip(inputs, weights)]
    outputs: list[torch.Tensor | None] = [None] * len(inputs)
    order = sorted(range(len(weights)), key=lambda i: tuple(weights[i].shape))
    for _, same in groupby(order, key=lambda i: tuple(weights[i].shape)):
        idx = list(same)
        if len(idx) == 1:
            outputs[idx[0]] = F.linear(inputs[idx[0]], weights[idx[0]])
            continue
        x = torch.stack([inputs[i] for i in idx])  # [c, ..., r]
        w = torch.stack([weights[i] for i in idx])  # [c, out, r]
        y = torch.bmm(x.reshape(len(idx), -1, x.shape[-1]), w.transpose(1, 2))
        for j, i in enumerate(idx):
            outputs[i] = y[j].reshape(*inputs[i].shape[:-1], w.shape[1])
    return outputs


class ProjectionGroup:
    """Projections reading the same input, and the layout's communication around them."""

    def __init__(self, projections: list[nn.Module], *, group, tp_size: int, grouped: bool, hidden_size: int):
        self.projections = projections
        self.group, self.tp_size, self.grouped, self.hidden_size = group, tp_size, grouped, hidden_size

    def down(self, x: torch.Tensor, norm: nn.Module | None = None) -> Tensors:
        raise NotImplementedError

    def reduce(self, partials: Tensors) -> Tensors:
        return partials

    def up(self, z: Tensors, carries: Tensors = ()) -> tuple[list[torch.Tensor], Tensors]:
        raise NotImplementedError

    def latents(self, z: Tensors, carries: Tensors) -> tuple[list[torch.Tensor], Tensors]:
        """Each projection's latent function on its slice of the reduced ``z`` (one tensor with the
        projections' latents side by side when grouped, one per projection otherwise): ``(latents fed to
        the B's, LaX carries for the next block)``. No communication."""
        zs = z[0].chunk(len(self.projections), dim=-1) if len(z) == 1 else z
        carries = carries or (None,) * len(zs)
        latents, new_carries = zip(*(p.latent(zi, c) for p, zi, c in zip(self.projections, zs, carries)))
        return list(latents), tuple(c for c in new_carries if c is not None)


class DenseGroup(ProjectionGroup):
    """Full-rank projections, Megatron layout: column groups (qkv, gate_up) split their outputs and copy
    the shared input into the TP region once; row groups (o, down) split their inputs and all-reduce."""

    def __init__(self, projections, *, row: bool, **kw):
        super().__init__(projections, **kw)
        self.row = row

    def down(self, x, norm=None):
        h = rms_norm(x, norm.weight, norm.variance_epsilon) if norm is not None else x
        return (h,) if self.row else (copy_to_tp(h, self.group),)

    def up(self, z, carries=()):
        (h,) = z
        weights = [p.weight for p in self.projections]
        if self.row:
            return [reduce_from_tp(F.linear(h, w), self.group) for w in weights], ()
        if self.grouped and len(weights) > 1:
            sizes = [w.shape[0] for w in weights]
            return list(F.linear(h, torch.cat(weights)).split(sizes, dim=-1)), ()
        return [F.linear(h, w) for w in weights], ()


class ReplicatedLowRankGroup(ProjectionGroup):
    """Vanilla low-rank TP (and the single-device low-rank model at p = 1).

    The input is replicated and full width; each A is column-parallel (``r/p`` of the rank), each B
    row-parallel with a full-width all-reduce of its output. Redundant work of this layout: the norm,
    RoPE, attention (all heads) and MLP product run on replicated full-width tensors on every rank.
    For LaX (``gather_latent``), the crossing and LayerNorm need the full r-dim latent: it is
    all-gathered after A and each rank keeps its ``r/p`` slice again before B.
    """

    def __init__(self, projections, *, gather_latent: bool, **kw):
        super().__init__(projections, **kw)
        self.gather_latent = gather_latent and self.tp_size > 1

    def down(self, x, norm=None):
        h = rms_norm(x, norm.weight, norm.variance_epsilon) if norm is not None else x
        a = [p.A for p in self.projections]
        if self.grouped and len(a) > 1:
            return (F.linear(copy_to_tp(h, self.group), torch.cat(a)),)
        return tuple(F.linear(copy_to_tp(h, self.group), w) for w in a)

    def reduce(self, partials):
        if not self.gather_latent:
            return partials
        if len(partials) == len(self.projections):
            return tuple(gather_from_tp(z, -1, self.group) for z in partials)
        # one gather of the grouped [..., k * r/p] latents, laid out [rank][projection][r/p] -> [projection][r]
        z = gather_from_tp(partials[0], -1, self.group)
        k, p = len(self.projections), self.tp_size
        z = z.reshape(*z.shape[:-1], p, k, -1).transpose(-3, -2)
        return (z.reshape(*z.shape[:-3], -1),)

    def up(self, z, carries=()):
        latents, carries = self.latents(z, carries)
        if self.gather_latent:
            if self.grouped and len(latents) > 1:
                latents = list(split_to_tp(torch.stack(latents), -1, self.group).unbind(0))
            else:
                latents = [split_to_tp(l, -1, self.group) for l in latents]
        partial = batched_linear(latents, [p.B for p in self.projections], self.grouped)
        return [reduce_from_tp(y, self.group) for y in partial], carries


class BottleneckAwareGroup(ProjectionGroup):
    """Bottleneck-aware TP (BTP): A row-parallel, B column-parallel, the residual sharded along d.

    ``down`` reads this rank's ``[..., d_in/p]`` shard (normalised with ``rmsnorm`` mode when a norm is
    given) and returns the partial ``[..., k r]`` A output (+1 column of norm statistics, online mode);
    ``reduce`` all-reduces it (one collective when grouped, one per projection otherwise); ``up`` turns
    the replicated latents into this rank's ``[..., d_out/p]`` output shards. B's input gradient is
    all-reduced in backward (one collective for the stacked latents when grouped).
    """

    def __init__(self, projections, *, rmsnorm: str, norm_eps: float | None, **kw):
        super().__init__(projections, **kw)
        self.rmsnorm, self.norm_eps = rmsnorm, norm_eps
        # online mode: the norm statistics ride as one extra column of the first partial output
        self.with_statistics = norm_eps is not None and rmsnorm == "online"

    def down(self, x, norm=None):
        if (norm is None) != (self.norm_eps is None):
            raise ValueError("this projection group was built to read a norm: pass it (and only then)")
        scale = stats = None
        if norm is None:
            h = x
        elif self.rmsnorm == "online":
            h, scale, stats = online_rms_norm_local(x, norm.weight, self.norm_eps)
        elif self.rmsnorm == "sync":
            h = sync_rms_norm(x, norm.weight, self.norm_eps, self.hidden_size, self.group)
        else:
            h = rms_norm(x, norm.weight, self.norm_eps)
        a = [p.A for p in self.projections]
        partials = [F.linear(h, torch.cat(a))] if self.grouped and len(a) > 1 else [F.linear(h, w) for w in a]
        if self.with_statistics:
            partials = [y * scale.to(y.dtype) for y in partials]
            partials[0] = torch.cat([partials[0], stats.to(partials[0].dtype)], dim=-1)
        return tuple(partials)

    def reduce(self, partials):
        return tuple(reduce_from_tp(y, self.group) for y in partials)

    def up(self, z, carries=()):
        z = list(z)
        if self.with_statistics:
            inv_rms = online_rms_norm_inverse(z[0][..., -1:], self.hidden_size, self.norm_eps)
            z[0] = z[0][..., :-1]
            z = [(zi.to(torch.float32) * inv_rms).to(zi.dtype) for zi in z]
        latents, carries = self.latents(z, carries)
        if self.grouped and len(latents) > 1:
            latents = list(copy_to_tp(torch.stack(latents), self.group).unbind(0))
        else:
            latents = [copy_to_tp(l, self.group) for l in latents]
        return batched_linear(latents, [p.B for p in self.projections], self.grouped), carries


__all__ = ["ProjectionGroup", "DenseGroup", "ReplicatedLowRankGroup", "BottleneckAwareGroup", "batched_linear"]
