"""Tensor-train projections under tensor parallelism.

A tensor-train projection (:class:`~boost_hf.modeling_boost_llama.BoostLlamaTensorTrainLinear`) contracts its input
cores into ``A^T: [d_in, r]`` and its output cores into ``B^T: [r, d_out]`` at every call, so a layout runs it as
any bottleneck ``(A, B)``: each rank contracts *its slice* of each factor, never the whole factor. A layout states
which core of each factor it splits, and along which dimension (:meth:`Layout.tensor_train_splits
<boost_hf.parallel.layouts.base.Layout.tensor_train_splits>`); the other cores are held whole on every rank:

* BTP gives a rank rows of ``A^T`` (``d_in / p``: its residual, head or MLP shard) and columns of ``B^T``
  (``d_out / p``). The first input core's mode ``i_0`` indexes the rows of ``A^T`` slowest, so this rank's rows are
  the slice of that core along its mode; likewise the columns of ``B^T`` and the first output core's mode ``o_0``.
  Both modes must be divisible by ``p`` (:func:`check_btp_modes`).
* Vanilla gives a rank ``r / p`` columns of ``A^T`` and rows of ``B^T``: the slice of the last input core along its
  output rank and of the first output core along its input rank.

Contracting the local slice with the whole cores gives exactly this rank's slice of the factor (init and
checkpoints: slices of the canonical cores). The cores held whole get from each rank only that rank's share of
their gradient: the whole cores of a factor are copied into the TP region together, one flattened
:func:`~boost_hf.parallel.primitives.copy_to_tp` (forward: identity, one copy of those cores; backward: **one
all-reduce of their gradients** per factor), so every rank holds the single-device gradient
(:func:`gradient_communication`).
"""

from __future__ import annotations

import math

import torch

from ..configuration_boost_llama import TensorTrainShape
from ..tensor_train_boost_llama import contract_cores
from .communication import Communication, all_reduce
from .layouts.base import Gemm
from .modules import adopt, shard_parameter, shard_repr
from .primitives import copy_to_tp


def is_tensor_train(projection) -> bool:
    """A tensor-train projection (also one whose class came with a checkpoint's remote code)."""
    return getattr(projection, "tensor_train", None) is not None


class ShardedTensorTrainCores:
    """The cores of a tensor-train projection under TP (an adopted mixin of ``BoostLlamaTensorTrainCores``): some
    cores are this rank's slices, the others whole. Module call ``cores(start, stop)``: this rank's slice of the
    contraction of cores ``start .. stop - 1`` (one factor), the whole cores among them copied into the TP region
    together (backward: one all-reduce of their gradients, ``sum`` of their sizes). ``whole_cores``: the indices of the
    whole cores (a module attribute: under FSDP2 the cores the forward reads are gathered tensors without shard specs)."""

    group = None
    whole_cores: frozenset[int] = frozenset()

    def forward(self, start: int, stop: int) -> torch.Tensor:
        cores = [self[i] for i in range(start, stop)]
        whole = [i - start for i in range(start, stop) if i in self.whole_cores]
        if whole:
            flat = copy_to_tp(torch.cat([cores[i].reshape(-1) for i in whole]), self.group)
            for i, part in zip(whole, flat.split([cores[i].numel() for i in whole])):
                cores[i] = part.view(cores[i].shape)
        return contract_cores(cores)

    def extra_repr(self) -> str:
        return "; ".join(f"{name}: {shard_repr(core)}" for name, core in self.named_parameters(recurse=False))


def shard_tensor_train(projection, splits: dict[int, int], plan) -> None:
    """Make ``projection``'s cores this rank's: core ``i`` split along dimension ``splits[i]``, the others whole
    (replicated, marked as such); under TP the cores module becomes :class:`ShardedTensorTrainCores`."""
    cores = projection.cores
    for i in range(len(cores)):
        shard_parameter(cores, str(i), splits.get(i), plan)
    if plan.tp_size > 1:
        adopt(cores, ShardedTensorTrainCores, group=plan.group,
              whole_cores=frozenset(i for i in range(len(cores)) if splits.get(i) is None))


def check_btp_modes(config, tp_size: int) -> None:
    """Raise ``ValueError`` naming the projection unless ``tp_size`` divides the first input mode and the first
    output mode of every tensor train (the modes BTP splits)."""
    for name in config.projection_shapes():
        shape = config.tensor_train_shape(name)
        for kind, modes in (("input", shape.input_modes), ("output", shape.output_modes)):
            if modes[0] % tp_size != 0:
                raise ValueError(
                    f"tp_style='btp' splits the first {kind} mode of every tensor train over tp_size={tp_size} ranks, but "
                    f"{name}'s {kind} modes are {list(modes)} ({modes[0]} is not divisible by {tp_size}): set "
                    f"tt_leading_mode_multiple={tp_size} (the same balanced modes with one divisible by {tp_size} "
                    "first, where there is one; another model than the release's order), another tt_cores, "
                    "or another tp_size."
                )


def _whole_cores_per_factor(config, splits) -> list[int]:
    """Elements of the whole cores of each factor (7 projections x 2 factors) of one decoder layer that has any.
    ``splits(shape)``: the layout's ``{core: dimension}`` for a
    :class:`~boost_hf.configuration_boost_llama.TensorTrainShape`."""
    sizes = []
    for name in config.projection_shapes():
        shape: TensorTrainShape = config.tensor_train_shape(name)
        split = splits(shape)
        for cores in (range(shape.split), range(shape.split, len(shape.modes))):
            whole = [math.prod(shape.core_shapes[i]) for i in cores if i not in split]
            if whole:
                sizes.append(sum(whole))
    return sizes


def gradient_communication(config, splits) -> Communication:
    """Backward all-reduces of the gradients of the whole cores of one decoder layer: one per factor that has
    any, of their summed sizes (``splits``: see :func:`whole_core_parameters`)."""
    sizes = _whole_cores_per_factor(config, splits)
    return all_reduce(len(sizes), sum(sizes))


def whole_core_parameters(config, splits) -> int:
    """Parameters of one decoder layer's tensor trains that every TP rank holds whole (``splits(shape)``: the
    layout's ``{core: dimension}`` for a :class:`~boost_hf.configuration_boost_llama.TensorTrainShape`)."""
    return sum(_whole_cores_per_factor(config, splits))


def contraction_gemms(config, splits, tp_size: int) -> list[Gemm]:
    """The GEMMs contracting one decoder layer's factors on one rank (forward; once per micro-batch, whatever its
    tokens), with the cores as this rank holds them: the chain ``[rows, r_i] x [r_i, m_i r_{i+1}]`` of each factor,
    ``rows`` the product of the dimensions contracted so far (``1/p`` of them from the split first core under BTP)."""
    gemms = []
    for name in config.projection_shapes():
        shape = config.tensor_train_shape(name)
        local = [list(core) for core in shape.core_shapes]
        if tp_size > 1:
            for i, dim in splits(shape).items():
                local[i][dim] //= tp_size
        for start, stop in ((0, shape.split), (shape.split, len(local))):
            rows = local[start][0] * local[start][1]
            for rank_in, mode, rank_out in local[start + 1:stop]:
                gemms.append(Gemm(f"{name}.cores", rows, rank_in, mode * rank_out, "contraction"))
                rows *= mode
    return gemms


__all__ = [
    "ShardedTensorTrainCores", "check_btp_modes", "contraction_gemms", "gradient_communication", "is_tensor_train",
    "shard_tensor_train", "whole_core_parameters",
]
