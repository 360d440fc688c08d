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
    if not spec.is_sharded:
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(spec.tp_size)]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return torch.cat(shards, dim=spec.partition_dim)


__all__ = ["ShardSpec", "attach_shard_spec", "shard_spec_of", "gather_full"]
