"""Sharding metadata carried by every parameter, and the generic code that reads it.

Each parameter of a boost-hf model carries a :class:`ShardSpec` (``param.shard_spec``) plus Megatron's
attribute names (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``), which DeepSpeed
reads for gradient clipping. Checkpoint, grad-norm and optimizer code only read this metadata.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

# Initialisers of a full (unsharded) tensor from a generator: name -> fn(shape, generator) -> tensor.
Initializer = Callable[[tuple[int, ...], torch.Generator], torch.Tensor]


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


def sharded_parameter(
    full_shape: tuple[int, ...],
    partition_dim: int | None,
    tp_rank: int,
    tp_size: int,
    init: Initializer,
    dtype: torch.dtype | None = None,
) -> nn.Parameter:
    """An (uninitialised) parameter holding this rank's shard, carrying its metadata and initialiser."""
    if partition_dim is not None and tp_size > 1 and full_shape[partition_dim] % tp_size != 0:
        raise ValueError(
            f"cannot split dimension {partition_dim} of a {full_shape} parameter over tp_size={tp_size}: "
            "choose a tp_size that divides it."
        )
    spec = ShardSpec(tuple(full_shape), partition_dim if tp_size > 1 else None, tp_rank, tp_size)
    param = nn.Parameter(torch.empty(spec.local_shape, dtype=dtype))
    attach_shard_spec(param, spec, init)
    return param


def attach_shard_spec(param: torch.Tensor, spec: ShardSpec, init: Initializer | None = None) -> None:
    param.shard_spec = spec
    param.tensor_model_parallel = spec.is_sharded
    param.partition_dim = spec.partition_dim if spec.is_sharded else -1
    param.partition_stride = 1
    if init is not None:
        param.full_init = init


def shard_spec_of(param: torch.Tensor) -> ShardSpec:
    spec = getattr(param, "shard_spec", None)
    return spec if spec is not None else ShardSpec(tuple(param.shape))


def name_seed(seed: int, name: str) -> int:
    """A per-parameter seed from the global seed and the canonical name (stable across runs and TP sizes)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_from_full(param: torch.Tensor, name: str, seed: int) -> torch.Tensor:
    """The full tensor of ``param`` as initialised from (``seed``, ``name``), sliced to this rank's shard."""
    spec = shard_spec_of(param)
    generator = torch.Generator(device="cpu").manual_seed(name_seed(seed, name))
    full = param.full_init(spec.full_shape, generator)
    return spec.local_slice(full).to(dtype=param.dtype)


def gather_full(tensor: torch.Tensor, spec: ShardSpec, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The canonical tensor from every rank's shard (all-gather in ``group``); no autograd."""
    if not spec.is_sharded:
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(spec.tp_size)]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return torch.cat(shards, dim=spec.partition_dim)


# Initialisers -------------------------------------------------------------------------------------

def normal_init(std: float) -> Initializer:
    return lambda shape, gen: torch.empty(shape).normal_(0.0, std, generator=gen)


def constant_init(value: float) -> Initializer:
    return lambda shape, gen: torch.full(shape, float(value))


def eye_init() -> Initializer:
    return lambda shape, gen: torch.eye(*shape)


def bottleneck_factor_init(rank: int, d_in: int, d_out: int) -> Initializer:
    """CoLA's init for A and B: ``N(0, s^2)``, ``s = r^(-1/4) (d_in + d_out)^(-1/4)`` (Xavier-like product)."""
    return normal_init((rank ** -0.25) * ((d_in + d_out) ** -0.25))


__all__ = [
    "ShardSpec",
    "sharded_parameter",
    "attach_shard_spec",
    "shard_spec_of",
    "init_from_full",
    "gather_full",
    "name_seed",
    "normal_init",
    "constant_init",
    "eye_init",
    "bottleneck_factor_init",
]
