"""Parameter-holding layers whose shards are decided by a plan (:mod:`boost_hf.parallel.plan`).

The layers only hold parameters (local shards with :class:`~boost_hf.parallel.sharding.ShardSpec`
metadata) and do local math; the communication pattern of each layout lives in
:mod:`boost_hf.parallel.groups`. Canonical parameter names never depend on the layout:
``q_proj.weight`` (full rank), ``q_proj.A`` / ``q_proj.B`` (+ ``q_proj.gate`` /
``q_proj.gate_left`` / ``q_proj.gate_right`` / ``q_proj.latent_norm.{weight,bias}`` for LaX).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from .primitives import copy_to_tp, gather_from_tp, reduce_from_tp
from .sharding import (
    bottleneck_factor_init,
    constant_init,
    normal_init,
    sharded_parameter,
)

LATENT_NORM_EPS = 1e-5


class DenseProjection(nn.Module):
    """Full-rank projection ``y = x W^T``, ``weight: [d_out, d_in]`` (canonical), bias-free.

    ``split_dim`` 0 = column-parallel (local ``[d_out/p, d_in]``), 1 = row-parallel (``[d_out, d_in/p]``).
    """

    def __init__(self, d_in: int, d_out: int, *, split_dim: int | None, tp_rank: int, tp_size: int, std: float):
        super().__init__()
        self.d_in, self.d_out = d_in, d_out
        self.weight = sharded_parameter((d_out, d_in), split_dim, tp_rank, tp_size, normal_init(std))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        spec = self.weight.shard_spec
        return f"d_in={self.d_in}, d_out={self.d_out}, local={tuple(self.weight.shape)}, split_dim={spec.partition_dim}, tp={spec.tp_rank}/{spec.tp_size}"


class BottleneckProjection(nn.Module):
    """Low-rank projection ``y = B latent(A x)``: ``A: [r, d_in]``, ``B: [d_out, r]`` (canonical shapes).

    ``latent(z)`` is, in order: the LaX crossing ``c = z + G h_prev`` (only when ``crossing`` is set: not in
    block 0), the LaX LayerNorm over r, then the latent activation. With ``carries_latent`` (LaX) ``c`` is
    also returned as the carry that the same projection of the next block crosses in.
    Under BTP ``A`` is row-parallel (``a_split_dim=1``) and ``B`` column-parallel (``b_split_dim=0``);
    under vanilla TP ``A`` is column-parallel along r (0) and ``B`` row-parallel along r (1).
    The LaX gate and LayerNorm act on the full r-dim latent and are replicated.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        rank: int,
        *,
        a_split_dim: int | None,
        b_split_dim: int | None,
        tp_rank: int,
        tp_size: int,
        activation: str | None,
        crossing: str | None = None,
        kronecker_factors: tuple[int, int] | None = None,
        latent_norm: bool = False,
        carries_latent: bool = False,
    ):
        super().__init__()
        self.d_in, self.d_out, self.rank = d_in, d_out, rank
        factor_init = bottleneck_factor_init(rank, d_in, d_out)
        self.A = sharded_parameter((rank, d_in), a_split_dim, tp_rank, tp_size, factor_init)
        self.B = sharded_parameter((d_out, rank), b_split_dim, tp_rank, tp_size, factor_init)
        self.crossing = crossing
        self.carries_latent = carries_latent
        if crossing == "dense":
            self.gate = sharded_parameter((rank, rank), None, tp_rank, tp_size, normal_init(0.02))
        elif crossing == "kronecker":
            a, b = kronecker_factors
            std = 0.02**0.5  # entries of kron(L, R) then have std 0.02 like the dense gate
            self.gate_left = sharded_parameter((a, a), None, tp_rank, tp_size, normal_init(std))
            self.gate_right = sharded_parameter((b, b), None, tp_rank, tp_size, normal_init(std))
        if latent_norm:
            self.latent_norm = nn.LayerNorm(rank, eps=LATENT_NORM_EPS)
            for name, value in (("weight", 1.0), ("bias", 0.0)):
                param = sharded_parameter((rank,), None, tp_rank, tp_size, constant_init(value))
                setattr(self.latent_norm, name, param)
        else:
            self.latent_norm = None
        self.act = ACT2FN[activation] if activation else None

    def cross(self, h_prev: torch.Tensor) -> torch.Tensor:
        """``G h_prev`` for the LaX crossing; ``h_prev: [..., r]`` (full rank, replicated)."""
        if self.crossing == "identity":
            return h_prev
        if self.crossing == "dense":
            return F.linear(h_prev, self.gate)
        a, b = self.gate_left.shape[0], self.gate_right.shape[0]
        h = h_prev.reshape(*h_prev.shape[:-1], a, b)
        # kron(L, R) vec(H) = vec(L H R^T) for row-major H of shape [a, b]
        return (self.gate_left @ h @ self.gate_right.T).reshape(h_prev.shape)

    def latent(self, z: torch.Tensor, h_prev: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(latent fed to B, carry for the next block)``; ``z: [..., r_local]``."""
        if self.crossing is not None and h_prev is not None:
            z = z + self.cross(h_prev)
        carry = z if self.carries_latent else None
        if self.latent_norm is not None:
            z = self.latent_norm(z)
        if self.act is not None:
            z = self.act(z)
        return z, carry

    def extra_repr(self) -> str:
        a, b = self.A.shard_spec, self.B.shard_spec
        return (
            f"d_in={self.d_in}, d_out={self.d_out}, rank={self.rank}, A_local={tuple(self.A.shape)} (split {a.partition_dim}), "
            f"B_local={tuple(self.B.shape)} (split {b.partition_dim}), crossing={self.crossing}, tp={a.tp_rank}/{a.tp_size}"
        )


class ParallelEmbedding(nn.Module):
    """Token embedding ``weight: [V, d]`` (canonical).

    ``split_dim=None``: replicated lookup. ``0`` (vocab-parallel, local ``[V/p, d]``): masked local
    lookup, then all-reduce of ``[N, d]`` (forward), nothing backward. ``1`` (hidden-sharded, local
    ``[V, d/p]``, BTP): each rank looks up its own d/p slice; no communication at all.
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, split_dim: int | None, tp_rank: int, tp_size: int, std: float, group):
        super().__init__()
        self.vocab_size, self.hidden_size, self.group = vocab_size, hidden_size, group
        self.weight = sharded_parameter((vocab_size, hidden_size), split_dim, tp_rank, tp_size, normal_init(std))
        self.vocab_parallel = self.weight.shard_spec.is_sharded and self.weight.shard_spec.partition_dim == 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.vocab_parallel:
            return F.embedding(input_ids, self.weight)
        spec = self.weight.shard_spec
        start = spec.tp_rank * self.weight.shape[0]
        local_ids = input_ids - start
        outside = (local_ids < 0) | (local_ids >= self.weight.shape[0])
        embeds = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        embeds = embeds.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(embeds, self.group)

    def extra_repr(self) -> str:
        spec = self.weight.shard_spec
        return f"{self.vocab_size}, {self.hidden_size}, local={tuple(self.weight.shape)}, split_dim={spec.partition_dim}, tp={spec.tp_rank}/{spec.tp_size}"


class VocabParallelLMHead(nn.Module):
    """LM head ``weight: [V, d]`` split along the vocabulary (local ``[V/p, d]``).

    Input ``[N, d]`` replicated; output local logits ``[N, V/p]``. Communicates only in backward
    (all-reduce of the ``[N, d]`` input gradient). :meth:`gather_logits` all-gathers ``[N, V]``.
    """

    def __init__(self, hidden_size: int, vocab_size: int, *, tp_rank: int, tp_size: int, std: float, group):
        super().__init__()
        self.hidden_size, self.vocab_size, self.group = hidden_size, vocab_size, group
        self.weight = sharded_parameter((vocab_size, hidden_size), 0, tp_rank, tp_size, normal_init(std))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(hidden_states, self.group), self.weight)

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        return gather_from_tp(local_logits, -1, self.group)

    def extra_repr(self) -> str:
        spec = self.weight.shard_spec
        return f"{self.hidden_size}, {self.vocab_size}, local={tuple(self.weight.shape)}, tp={spec.tp_rank}/{spec.tp_size}"


__all__ = ["DenseProjection", "BottleneckProjection", "ParallelEmbedding", "VocabParallelLMHead", "LATENT_NORM_EPS"]
