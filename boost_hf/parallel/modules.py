"""Turning single-device modules into sharded ones, in place.

A module is *adopted* by a parallel subclass of its own class (the way FSDP2's ``fully_shard`` does):
the object, its parameter names, its hooks and its place in the model stay; its class gains the
parallel ``forward`` and its parameters become this rank's shards, each carrying a
:class:`~boost_hf.parallel.sharding.ShardSpec`. Layout-specific modules live with their layout
(:mod:`boost_hf.parallel.layouts`); the ones shared by several layouts are here.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from .primitives import copy_to_tp, gather_from_tp, reduce_from_tp
from .sharding import ShardSpec, attach_shard_spec, shard_spec_of


@functools.cache
def parallel_class(mixin: type, cls: type) -> type:
    """``class <Mixin><Cls>(mixin, cls)``, made once per pair."""
    if issubclass(cls, mixin):
        return cls
    return type(f"{mixin.__name__}{cls.__name__}", (mixin, cls), {"__module__": mixin.__module__})


def adopt(module: nn.Module, mixin: type, **attributes) -> nn.Module:
    """Make ``module`` an instance of ``parallel_class(mixin, type(module))`` and set ``attributes``."""
    module.__class__ = parallel_class(mixin, type(module))
    for name, value in attributes.items():
        setattr(module, name, value)
    return module


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype ``x`` is computed in: the autocast dtype of its device when autocast is on there, else its own."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def statistics_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype norm statistics of ``x`` are computed in: fp32, or ``x``'s dtype where that is wider (fp64 in
    gradient checks)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``y + bias`` in ``y``'s dtype (the compute dtype under autocast, as ``F.linear``'s bias); ``y`` if no bias."""
    return y if bias is None else y + bias.to(y.dtype)


def shard_parameter(module: nn.Module, name: str, dim: int | None, plan) -> nn.Parameter:
    """Replace ``module.<name>`` by this rank's contiguous slice along ``dim`` (``None``: replicated).

    A meta parameter becomes an uninitialised local tensor; a materialised one is sliced. The new
    parameter carries its :class:`ShardSpec` (and Megatron's attribute names, read by DeepSpeed)."""
    old = getattr(module, name)
    spec = ShardSpec(tuple(old.shape), dim if plan.tp_size > 1 else None, plan.tp_rank, plan.tp_size)
    if old.is_meta:
        local = torch.empty(spec.local_shape, dtype=old.dtype)
    else:
        local = spec.local_slice(old.detach()).clone()
    param = nn.Parameter(local, requires_grad=old.requires_grad)
    attach_shard_spec(param, spec)
    setattr(module, name, param)
    return param


def shard_repr(param: torch.Tensor) -> str:
    spec = shard_spec_of(param)
    return f"local={tuple(param.shape)}, split_dim={spec.partition_dim}, tp={spec.tp_rank}/{spec.tp_size}"


class VocabParallelEmbedding:
    """``nn.Embedding`` split along the vocabulary (local ``[V/p, d]``): masked local lookup, then an
    all-reduce of ``[B, S, d]`` (forward only). The ``padding_idx`` row gets no gradient, as on one device. The rows
    held are the ``tp_rank``-th block (a module attribute: under FSDP2 the weight the forward reads is the gathered
    tensor, which carries no shard spec)."""

    group = None
    tp_rank = 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows, start = self.weight.shape[0], self.tp_rank * self.weight.shape[0]
        local_ids = input_ids - start
        outside = (local_ids < 0) | (local_ids >= rows)
        padding = None if self.padding_idx is None or not 0 <= self.padding_idx - start < rows else self.padding_idx - start
        embeds = F.embedding(local_ids.masked_fill(outside, 0), self.weight, padding)
        return reduce_from_tp(embeds.masked_fill(outside.unsqueeze(-1), 0.0), self.group)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {shard_repr(self.weight)}"


class VocabParallelHead:
    """LM head ``nn.Linear(d, V)`` split along the vocabulary: replicated ``[B, S, d]`` in, this rank's
    logits ``[B, S, V/p]`` out; all-reduce of the input gradient in backward (``input_gathered``: not here, the
    all-gather along tokens that produced the input reduce-scatters it; sequence parallelism).
    :meth:`gather_logits` all-gathers the full ``[B, S, V]``."""

    group = None
    input_gathered = False

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self.input_gathered:
            hidden_states = copy_to_tp(hidden_states, self.group)
        return F.linear(hidden_states, self.weight)

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        return gather_from_tp(local_logits, -1, self.group)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {shard_repr(self.weight)}"


__all__ = ["add_bias", "adopt", "compute_dtype", "statistics_dtype", "parallel_class", "shard_parameter", "shard_repr", "VocabParallelEmbedding", "VocabParallelHead"]
