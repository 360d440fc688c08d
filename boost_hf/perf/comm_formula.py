"""How much each parallel layout communicates: the single entry point for the analysis.

The runtime communication counters, the benchmarks, the performance estimator
(:mod:`boost_hf.perf.estimator`) and the tests all call these functions; each asks the
:class:`~boost_hf.parallel.layouts.Layout` of the configuration, which states its own pattern.

Notation: ``d`` hidden size, ``dq`` query width (heads x head_dim), ``dkv`` key/value width, ``f``
intermediate size, ``r`` bottleneck rank, ``N`` tokens in the micro-batch (batch x sequence), ``p``
tensor-parallel size, ``V`` vocabulary size, ``L`` decoder layers. Counts are per tensor-parallel rank
and per micro-batch (see :mod:`boost_hf.parallel.communication` for what an element counts). With
``p == 1`` nothing is communicated at all.

Pipeline parallelism adds point-to-point traffic at each stage boundary
(:func:`stage_boundary_communication`), counted per TP rank and per micro-batch in each direction.
"""

from __future__ import annotations

from typing import NamedTuple

from ..parallel.communication import (
    COLLECTIVE_KINDS,
    Collective,
    CollectiveKind,
    Communication,
    PassCommunication,
    all_gather,
    all_reduce,
    ring_traffic_bytes,
)
from ..parallel.config import ParallelConfig
from ..parallel.layouts import layout_for


def layer_communication(config, parallel: ParallelConfig, tokens: int, layer_idx: int = 1) -> PassCommunication:
    """Collectives of decoder layer ``layer_idx`` (LaX's block 0 has no crossing) for a micro-batch of
    ``tokens`` tokens on one TP rank, including what activation checkpointing re-issues in backward
    (``"full"``: the whole forward; ``"lowrank"``: nothing under btp with the online norm, the sync norm's
    statistics all-reduces, the B all-reduces under vanilla)."""
    layout = layout_for(config, parallel)
    if parallel.tp_size == 1:
        return PassCommunication()
    layer = layout.layer_communication(config, tokens)
    backward = layer.backward + layout.recompute_communication(config, tokens) + layout.parameter_gradient_communication(config, layer_idx)
    return PassCommunication(layer.forward, backward)


def outside_layers_communication(
    config, parallel: ParallelConfig, tokens: int, *, with_loss: bool = True, with_logits: bool = False
) -> PassCommunication:
    """Collectives outside the decoder layers, once per micro-batch: the layout's embedding, final norm
    and LM head; the vocab-parallel cross-entropy (``with_loss``: all-reduces of the max, ``N``, and of
    [sum-exp, target logit], ``2N``); the full logits (``with_logits``: all-gather of ``N V``)."""
    layout = layout_for(config, parallel)
    if parallel.tp_size == 1:
        return PassCommunication()
    outside = layout.outside_layers_communication(config, tokens)
    forward = outside.forward
    if with_loss:
        forward = forward + all_reduce(2, 3 * tokens)
    if with_logits:
        forward = forward + all_gather(1, tokens * config.vocab_size)
    return PassCommunication(forward, outside.backward)


def model_communication(
    config, parallel: ParallelConfig, tokens: int, *, with_loss: bool = True, with_logits: bool = False
) -> PassCommunication:
    """Collectives of a whole model (``L`` decoder layers plus embedding, final norm, LM head and loss)
    for one micro-batch of ``tokens`` tokens on one TP rank."""
    layers = PassCommunication()
    for layer_idx in range(config.num_hidden_layers):
        layers = layers + layer_communication(config, parallel, tokens, layer_idx)
    return layers + outside_layers_communication(config, parallel, tokens, with_loss=with_loss, with_logits=with_logits)


class PointToPoint(NamedTuple):
    """Point-to-point sends of one TP rank to its peer in the neighbouring pipeline stage: ``sends`` tensors
    holding ``elements`` in total; ``tp_collectives``: what the boundary adds inside the TP group in the same
    direction (the all-gather of LaX's shared latents: on the receiving stage forward, the sending stage
    backward)."""

    sends: int
    elements: int
    tp_collectives: Communication = Communication()

    def bytes(self, dtype_bytes: int = 2) -> int:
        """Point-to-point volume in bytes: ``elements * dtype_bytes`` (2 for bf16)."""
        return self.elements * dtype_bytes


def stage_boundary_communication(config, parallel: ParallelConfig, tokens: int) -> PointToPoint:
    """What crosses one pipeline-stage boundary for a micro-batch of ``tokens`` tokens, per TP rank and per
    direction: forward, TP rank ``t`` of stage ``s`` sends the tensors of the layout's
    :meth:`~boost_hf.parallel.layouts.Layout.stage_boundary` to TP rank ``t`` of stage ``s + 1``; backward their
    gradients go back, the same sends and elements.

    Elements: the residual, ``N d/p`` under btp (its own shard along ``d``) and under megatron with sequence
    parallelism (its ``N/p`` tokens), else the replicated ``N d``; plus LaX's 7 handed-on latents in one more send,
    ``7 N r / p`` (a token share: already this rank's under latent sequence parallelism; otherwise replicated, then
    all-gathered over TP, ``7 N r`` elements, in ``tp_collectives``; ``7 N r`` whole when ``p`` does not divide
    ``N``)."""
    boundary = layout_for(config, parallel).stage_boundary(config, 1, tokens)
    gathers = all_gather(1, boundary.gathered) if boundary.latents_shared else Communication()
    return PointToPoint(len(boundary.shapes), boundary.elements, gathers)


class DataParallelTraffic(NamedTuple):
    """What FSDP2 communicates over the data-parallel group in one optimizer step on one rank: ``collectives``
    (calls and elements by kind) and ``bytes`` by kind (all-gathers in the parameters' gathered dtype, reduce-scatters
    and all-reduces in the reduce dtype)."""

    collectives: Communication
    bytes: dict[str, int]


def fully_shard_communication(units, shard: int, replicate: int = 1, *, micro_batches: int = 1, pipeline: bool = False,
                              param_bytes: int = 4, reduce_bytes: int = 4) -> DataParallelTraffic:
    """FSDP2's collectives in one optimizer step of ``micro_batches`` micro-batches on one rank whose parts are
    ``units`` (:class:`~boost_hf.parallel.fully_shard.FullyShardUnit`, e.g. :func:`~boost_hf.parallel.fully_shard.units_of`),
    sharded over ``shard`` ranks in each of ``replicate`` replicas (HSDP). ``P_u``: a unit's elements, each tensor's dim 0
    padded to a multiple of ``shard``.

    * all-gather (``P_u`` elements, ``param_bytes`` each): every unit before each micro-batch's forward, and a unit
      that reshards after forward again before its backward; under pipeline parallelism (``pipeline``) once per step
      (torch's schedule keeps the parameters gathered from the first forward to the step's last backward; a unit that
      reshards after forward gathers a schedule-dependent number of times, not modelled: ``ValueError``);
    * reduce-scatter (``P_u``, ``reduce_bytes``): once per step (the micro-batches before the last accumulate
      unsharded: accelerate's ``no_sync``, the pipeline schedule's);
    * HSDP's all-reduce across the replicas (``P_u / shard``, ``reduce_bytes``): once per step.

    Nothing with ``shard`` 1 but HSDP's all-reduce."""
    from ..parallel.communication import Collective

    units = list(units)
    if pipeline and any(u.reshards_after_forward for u in units):
        raise ValueError("under pipeline parallelism a unit that reshards after forward gathers as often as the schedule "
                         "interleaves its micro-batches: not modelled (use fsdp_reshard_after_forward default or never).")
    sizes = [u.padded_elements(shard) for u in units]
    gathered = [(1 + (u.reshards_after_forward and not pipeline)) * n for u, n in zip(units, sizes)]
    gathers = sum(1 + (u.reshards_after_forward and not pipeline) for u in units)
    rounds = 1 if pipeline else micro_batches
    by_kind = {}
    if shard > 1:
        by_kind["all_gather"] = Collective(rounds * gathers, rounds * sum(gathered))
        by_kind["reduce_scatter"] = Collective(len(units), sum(sizes))
    if replicate > 1:
        by_kind["all_reduce"] = Collective(len(units), sum(sizes) // shard)
    collectives = Communication(by_kind)
    dtype_bytes = {"all_gather": param_bytes, "reduce_scatter": reduce_bytes, "all_reduce": reduce_bytes}
    return DataParallelTraffic(collectives, {kind: c.elements * dtype_bytes[kind] for kind, c in collectives.by_kind.items()})


__all__ = [
    "COLLECTIVE_KINDS",
    "DataParallelTraffic",
    "CollectiveKind",
    "Collective",
    "Communication",
    "PassCommunication",
    "PointToPoint",
    "fully_shard_communication",
    "layer_communication",
    "model_communication",
    "outside_layers_communication",
    "ring_traffic_bytes",
    "stage_boundary_communication",
]
