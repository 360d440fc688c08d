"""FSDP2, torch's ``fully_shard``, over the data-parallel group of each TP x PP rank: the last step of
:func:`~boost_hf.parallel.parts.prepare_part`, after tensor parallelism, activation checkpointing and compile, as
torchtitan applies it (``--data_parallel fsdp2``, :mod:`boost_hf.data_parallel_config`).

What it shards is this rank's part as tensor parallelism left it: each parameter's TP-local tensor (``[V/p, d]``, BTP's
``[r, d/p]``, ...) is split once more along its dim 0 over the DP mesh
(:func:`~boost_hf.parallel.state.data_parallel_mesh`: the DP group, or HSDP's replica x shard mesh); TP and the
pipeline never see FSDP (they run on the gathered local tensors, as without it). Units, each one all-gather and one
reduce-scatter: every decoder layer, then the part's root (the embedding, the final norm and the LM head the part
holds). Per unit of ``P`` local elements on ``S`` shard ranks (``P`` with each tensor's dim 0 padded to a multiple of
``S``): an all-gather of ``P`` elements (in the parameters' compute dtype) before its forward, again before its backward
when it reshards after forward (:func:`reshards_after_forward`); a reduce-scatter of ``P`` gradient elements (in the
reduce dtype) once per optimizer step; HSDP adds an all-reduce of ``P / S`` over the ``R`` replicas. The formula is
:func:`~boost_hf.perf.comm_formula.fully_shard_communication`; the collectives are reported to
:class:`~boost_hf.parallel.comm_counter.CommCounter` while one counts the DP mesh's groups (:func:`count_collectives`).

* **Precision**: ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``: under ``bf16_params`` the sharded parameters
  are the fp32 masters, gathered in bf16, their gradients reduced in fp32 (``--grad_reduce_dtype``) and kept fp32;
  under ``autocast`` and ``fp32`` nothing is cast (the autocast runs around the forward as without FSDP). The forward
  inputs are never cast (``cast_forward_inputs=False``): the residual stream keeps the policy's dtype.
* **Parameter metadata**: ``fully_shard`` replaces each parameter with a new ``DTensor`` one; its attributes (the
  shard spec, Megatron's ``tensor_model_parallel``, ...) are copied onto it, so clipping, checkpoints and LORO read
  them as before. The gathered tensors the forward reads carry none: the layers that need their TP rank keep it on
  the module (the vocab-parallel embedding, the tensor-train cores).
* **BTP's grouped storage** (:mod:`boost_hf.parallel.shared_storage`): FSDP gives each parameter its own sharded and
  gathered storage, so the projections a grouped GEMM reads together are no longer row blocks of one buffer;
  :func:`~boost_hf.parallel.shared_storage.joined_rows` then answers ``None`` and the GEMMs concatenate them (the same
  values, one copy more per step).
* **Tied embeddings**: the embedding and the LM head share one parameter in the root unit (one shard, one gradient,
  as on one device); under pipeline parallelism ties are refused before (:func:`~boost_hf.parallel.pipeline.check_pipeline_model`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .comm_counter import record_collective, report_while_counted
from .compile import decoder_layers

ReshardPolicy = str  # "default" | "always" | "never" (DataParallelConfig.fsdp_reshard_after_forward)


@dataclass(frozen=True)
class FullyShard:
    """How FSDP2 is applied to each part: over ``mesh`` (:func:`~boost_hf.parallel.state.data_parallel_mesh`), the
    decoder layers resharding after forward as ``reshard_after_forward`` says (:func:`reshards_after_forward`), the
    parameters gathered in ``param_dtype`` and the gradients reduced in ``reduce_dtype`` (``None``: the parameters'
    own), ``pipeline``: the parts are pipeline stages (torch's schedule gathers and reduces once per step);
    ``layers_apart``: each decoder layer a unit of its own (else the whole part is one unit)."""

    mesh: object
    reshard_after_forward: ReshardPolicy = "default"
    layers_apart: bool = True
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    pipeline: bool = False

    @property
    def shard_size(self) -> int:
        return self.mesh.size(-1)

    @property
    def replicate_size(self) -> int:
        return self.mesh.size(0) if self.mesh.ndim == 2 else 1


def reshards_after_forward(policy: ReshardPolicy, index: int, layers: int, pipeline: bool) -> bool:
    """Whether decoder layer ``index`` of the ``layers`` a part holds frees its gathered parameters after forward:
    ``always``, ``never``, or torchtitan's ``default``: under pipeline parallelism none (each micro-batch's forward would
    gather again), otherwise every layer but the last (whose backward comes right after its forward)."""
    if policy in ("always", "never"):
        return policy == "always"
    return not pipeline and index < layers - 1


@dataclass(frozen=True)
class FullyShardUnit:
    """One FSDP2 unit as the formulas see it: the TP-local ``shapes`` of its parameters (tied ones once) and whether
    it frees its gathered parameters after forward (:func:`reshards_after_forward`)."""

    shapes: tuple[tuple[int, ...], ...]
    reshards_after_forward: bool

    def padded_elements(self, shard: int) -> int:
        """Elements one all-gather (or reduce-scatter) of this unit moves: each tensor's dim 0 padded up to a
        multiple of ``shard`` (FSDP2 shards dim 0 in equal chunks), summed."""
        total = 0
        for shape in self.shapes:
            rows = -(-(shape[0] if shape else 1) // shard) * shard
            for n in shape[1:]:
                rows *= n
            total += rows
        return total


def units_of(part: nn.Module, how: FullyShard) -> list[FullyShardUnit]:
    """The units :func:`fully_shard_part` makes of ``part`` (before or after it ran): each decoder layer's parameters
    (``how.layers_apart``), then the rest of ``part``'s (if any), root last; no communication."""
    layers = list(decoder_layers(getattr(part, "module", part))) if how.layers_apart else []
    units, seen = [], set()
    for index, layer in enumerate(layers):
        params = [p for p in layer.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        units.append(FullyShardUnit(tuple(tuple(p.shape) for p in params),
                                    reshards_after_forward(how.reshard_after_forward, index, len(layers), how.pipeline)))
    rest = [p for p in part.parameters() if id(p) not in seen]
    if rest:  # (a middle pipeline stage's root holds nothing: FSDP2 makes no unit of it)
        units.append(FullyShardUnit(tuple(tuple(p.shape) for p in rest), how.reshard_after_forward == "always"))
    return units


def _parameter_attributes(part: nn.Module) -> list[tuple[nn.Module, str, dict]]:
    return [(module, name, dict(param.__dict__)) for module in part.modules()
            for name, param in module._parameters.items() if param is not None and param.__dict__]


def fully_shard_part(part: nn.Module, how: FullyShard) -> nn.Module:
    """Apply FSDP2 to ``part`` in place (each decoder layer, then ``part`` itself as the root unit) and return it;
    the parameters' attributes carried over, the collectives counted (:func:`count_collectives`). Collective over
    ``how.mesh``: every rank of the DP group calls it for the same parts in the same order."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    attributes = _parameter_attributes(part)
    policy = MixedPrecisionPolicy(param_dtype=how.param_dtype, reduce_dtype=how.reduce_dtype, cast_forward_inputs=False)
    layers = list(decoder_layers(getattr(part, "module", part))) if how.layers_apart else []
    for index, layer in enumerate(layers):
        fully_shard(layer, mesh=how.mesh, mp_policy=policy,
                    reshard_after_forward=reshards_after_forward(how.reshard_after_forward, index, len(layers), how.pipeline))
    fully_shard(part, mesh=how.mesh, mp_policy=policy, reshard_after_forward=how.reshard_after_forward == "always")
    for module, name, values in attributes:
        sharded = module._parameters[name]
        for key, value in values.items():
            setattr(sharded, key, value)
    count_collectives(part, how.mesh)
    return part


def fully_sharded_units(part: nn.Module) -> list[nn.Module]:
    """The FSDP units of ``part`` (its modules that ``fully_shard`` was applied to), root last."""
    from torch.distributed.fsdp import FSDPModule

    return [module for module in part.modules() if isinstance(module, FSDPModule)][::-1]


def count_collectives(part: nn.Module, mesh) -> None:
    """Report every FSDP2 collective of ``part``'s units to :class:`~boost_hf.parallel.comm_counter.CommCounter` while
    a counter of the DP mesh's groups is active (:func:`~boost_hf.parallel.comm_counter.report_while_counted`; outside
    one, torch's collectives run untouched): torch's own all-gather and reduce-scatter (``set_custom_all_gather`` /
    ``set_custom_reduce_scatter`` with the default implementations, recorded first) and, under HSDP, the all-reduce
    across replicas (``set_all_reduce_hook``, which sees its output). Where torch lacks these hooks nothing is counted."""
    groups = tuple(mesh.get_group(d) for d in range(mesh.ndim))
    if not all(hasattr(unit, "set_custom_all_gather") for unit in fully_sharded_units(part)):
        return
    report_while_counted(part, groups, functools.partial(_install_counted_collectives, replicate_group=groups[0] if mesh.ndim == 2 else None))


def _install_counted_collectives(part: nn.Module, replicate_group) -> Callable[[], None]:
    """Make ``part``'s units report their collectives (:func:`count_collectives`); returns what restores torch's."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    class CountedAllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            record_collective("all_gather", output_tensor, group)
            return super().__call__(output_tensor, input_tensor, group, async_op)

    class CountedReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            record_collective("reduce_scatter", input_tensor, group)
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    units = fully_sharded_units(part)
    for unit in units:
        unit.set_custom_all_gather(CountedAllGather())
        unit.set_custom_reduce_scatter(CountedReduceScatter())
        if replicate_group is not None:
            unit.set_all_reduce_hook(lambda reduced, group=replicate_group: record_collective("all_reduce", reduced, group))

    def restore() -> None:
        for unit in units:
            unit.set_custom_all_gather(DefaultAllGather())
            unit.set_custom_reduce_scatter(DefaultReduceScatter())
            if replicate_group is not None:
                unit.set_all_reduce_hook(None)

    return restore


def reshard(part: nn.Module) -> None:
    """Free the gathered parameters ``part``'s units still hold after a forward without backward (evaluation,
    generation: the units that do not reshard after forward keep them), so that the module holds its sharded
    parameters again (what the optimizer steps and the checkpoints read). No communication; a no-op without FSDP2."""
    for unit in fully_sharded_units(part):
        unit.reshard()


@contextlib.contextmanager
def gradients_unsynchronised(part: nn.Module):
    """Within: ``part``'s backward accumulates unsharded gradients without reducing them (a micro-batch that is not
    the last of an optimizer step; accelerate's ``no_sync`` for FSDP2: the reduce-scatter, and HSDP's all-reduce, wait
    for the last)."""
    part.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        part.set_requires_gradient_sync(True)


__all__ = ["FullyShard", "FullyShardUnit", "count_collectives", "fully_shard_part", "fully_sharded_units", "gradients_unsynchronised",
           "reshard", "reshards_after_forward", "units_of"]
