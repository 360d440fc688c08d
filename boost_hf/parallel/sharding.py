"""Sharding metadata carried by every parameter, and the generic code that reads it.

Each parameter of a boost-hf model carries a :class:`ShardSpec` (``param.shard_spec``) plus Megatron's
attribute names (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``), which DeepSpeed
reads for gradient clipping. Checkpoint, grad-norm and optimizer code only read this metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ShardSpec:
    """How a local parameter relates to its canonical (unsharded) tensor.

    ``partition_dim`` is ``None`` for a replicated parameter; otherwise the local tensor is the
    ``tp_rank``-th of ``tp_size`` contiguous chunks of the full tensor along that dimension.
    """

    full_shape: tuple[int, ...]
    partition_dim: int | None = None
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def is_sharded(self) -> bool:
        return self.partition_dim is not None and self.tp_size > 1

    @property
    def local_shape(self) -> tuple[int, ...]:
        if not self.is_sharded:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.partition_dim] //= self.tp_size
        return tuple(shape)

    def local_slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the canonical tensor ``full``."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"expected a tensor of shape {self.full_shape}, got {tuple(full.shape)}")
        if not self.is_sharded:
            return full
        return full.chunk(self.tp_size, dim=self.partition_dim)[self.tp_rank]


def attach_shard_spec(param: torch.Tensor, spec: ShardSpec) -> None:
    param.shard_spec = spec
    param.tensor_model_parallel = spec.is_sharded
    param.partition_dim = spec.partition_dim if spec.is_sharded else -1
    param.partition_stride = 1


def shard_spec_of(param: torch.Tensor) -> ShardSpec:
    spec = getattr(param, "shard_spec", None)
    return spec if spec is not None else ShardSpec(tuple(param.shape))


def gather_full(tensor: torch.Tensor, spec: ShardSpec, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The canonical tensor from every rank's shard (all-gather in ``group``); no autograd."""
    return gather_full_many([tensor], [spec], group)[0]


def gather_full_many(tensors: list[torch.Tensor], specs: list[ShardSpec], group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """The canonical tensors from every rank's shards, in one all-gather per dtype (of the flattened local shards
    of the sharded tensors) instead of one per tensor; replicated tensors are returned as they are. Every rank
    passes its shards of the same tensors in the same order. No autograd."""
    full = list(tensors)
    sharded = [i for i, spec in enumerate(specs) if spec.is_sharded]
    for dtype in dict.fromkeys(tensors[i].dtype for i in sharded):
        indices = [i for i in sharded if tensors[i].dtype == dtype]
        local = torch.cat([tensors[i].detach().reshape(-1) for i in indices])
        per_rank = [torch.empty_like(local) for _ in range(specs[indices[0]].tp_size)]
        dist.all_gather(per_rank, local, group=group)
        offset = 0
        for i in indices:
            size, shape = tensors[i].numel(), tensors[i].shape
            full[i] = torch.cat([chunk[offset:offset + size].view(shape) for chunk in per_rank], dim=specs[i].partition_dim)
            offset += size
    return full


__all__ = ["ShardSpec", "attach_shard_spec", "shard_spec_of", "gather_full", "gather_full_many"]
