"""Memory per GPU of a training layout, per pipeline rank: what the estimator's time model leaves out.

Everything is bytes on one GPU (one pipeline rank, one TP rank, one DP rank), for AdamW.

**Static part** (exact: ``tests/training/test_pipeline_resume.py`` compares it with the bytes every rank of a
launched run holds, ``tests/perf/test_memory_measured.py`` under FSDP2, and ``tests/perf/test_memory.py`` the
parameter counts with what ``parallelize`` builds):

* *parameters*: the rank's decoder layers (the layers of its pipeline stages), the embedding on the first stage, the
  final norm and the LM head on the last; each sharded over TP as its :class:`~boost_hf.parallel.layouts.Layout`
  states it (:meth:`~boost_hf.parallel.layouts.Layout.projection_splits`, ``norm_split``, ``embedding_split``; the LM
  head vocab-parallel; LaX's gates and latent norms and the final norm replicated);
* per parameter element, by precision policy (:data:`PRECISION_BYTES`, the one table; the policies are
  ``boost_hf/training/precision.py``'s):

  ==============  =========  ======  ===================  ==================  =================================
  policy          parameter  master  gradient             AdamW moments       kept per forward (autocast)
  ==============  =========  ======  ===================  ==================  =================================
  ``fp32``        4          -       4 (+4 DDP buckets)    8 (``8/dp`` ZeRO-1)  -
  ``autocast``    4          -       4 (+4 DDP buckets)    8 (``8/dp`` ZeRO-1)  2: a bf16 copy of each weight
  ``bf16_params`` 2          4       4 (one flat buffer)  8 (``8/dp`` ZeRO-1)  -
  ==============  =========  ======  ===================  ==================  =================================

* *DDP's buckets*: ``DistributedDataParallel`` (``gradient_as_bucket_view=False``, torch's default and the trainer's)
  copies the gradients into buckets of the same dtype and size before all-reducing them: one more gradient's bytes
  wherever the model is wrapped in DDP (every rank of a launched run at ``pp_size`` 1, also at dp 1 under TP;
  under PP only at dp > 1). ``bf16_params`` all-reduces its flat fp32 buffer itself (no DDP).
* *optimizer state*: AdamW's two moments of each parameter this rank steps (fp32: the masters' dtype), and one
  4-byte ``step`` counter per parameter tensor. ``--zero1_optimizer`` (torch's ``ZeroRedundancyOptimizer``) gives
  each DP rank the state of a share of the tensors, whole, by torch's greedy partition (the largest tensor first, to
  the rank with the fewest elements; the weight-decay group, then the other): :func:`zero1_shares`. The masters are
  not sharded (every DP rank keeps its stage's).
* *DeepSpeed ZeRO* (``deepspeed_stage`` 1-3, ``pp_size`` 1 only): the ZeRO paper's accounting (Rajbhandari et al.,
  SC'20, section 3: ``2 + 2 + K`` bytes per parameter with ``K = 12`` for fp32 master + moments under bf16), stage 1
  shards the ``K`` bytes over DP, stage 2 also the gradients, stage 3 also the parameters; plus its two buckets
  (``reduce_bucket_size`` and ``allgather_bucket_size``, 5e8 elements each by default, in the gradient dtype). Not
  measured here (DeepSpeed's own buffers); ``boost-hf plan`` does not propose DeepSpeed.
* *FSDP2* (``--data_parallel fsdp2``, :mod:`boost_hf.parallel.fully_shard`; HSDP, ``--dp_replicate_size R``, the same
  with ``S = dp / R`` shard ranks, each replica holding the same bytes): every tensor's dim 0 is padded to a multiple
  of ``S`` (torch chunks it in ``ceil(rows / S)`` rows) and each rank holds ``1/S`` of the padded tensor; AdamW's
  moments are made for the rows the rank really holds (the last ranks of a short dim 0 hold fewer, or none):

  ==============  ===========================  ====================  =========================  ==================
  policy          sharded parameter            sharded gradient      AdamW moments              gathered / reduced
  ==============  ===========================  ====================  =========================  ==================
  ``fp32``        4/S                          4/S                   8/S (the rows held)        4 / 4
  ``autocast``    4/S                          4/S                   8/S                        4 / 4
  ``bf16_params`` 4/S (it is the fp32 master)  4/S (reduced in fp32)  8/S                        2 / 4
  ==============  ===========================  ====================  =========================  ==================

  No other master, no DDP buckets (:func:`static_memory` with ``data_parallel``; ``tests/perf/test_memory_measured.py``
  compares it with what ``fully_shard``'ed models hold on gloo ranks, exactly). Its **working set** (per pipeline
  rank, over the units of its parts, :func:`fully_shard_units`: each decoder layer, then the root with the embedding,
  final norm and LM head; ``P_u`` a unit's padded elements, ``E_u`` its elements;
  :func:`fully_shard_working_set`), held with the activations:

  - *gathered parameters*, ``P_u`` in the gathered dtype each: the units that stay gathered from forward to backward
    (torchtitan's ``default``: the root and the last layer at ``pp_size`` 1; under pipeline parallelism every unit of
    the rank's stages, as torch's schedule reshards neither after forward nor after backward before the step's last
    micro-batch: the rank's whole unsharded parameters), the two largest units that reshard (the one running and the
    one FSDP2 prefetches: it issues the next unit's all-gather while one computes, forward and backward), and one flat
    all-gather buffer of the largest unit (torch copies each all-gather's flat output into per-parameter tensors and
    keeps the flat one until the next unit's copy-out);
  - *unsharded gradients*: when gradients accumulate (``pp_size`` > 1, or several micro-batches at ``pp_size`` 1:
    accelerate's ``no_sync``, the schedule's) every unit's ``E_u`` in the reduce dtype (FSDP2 upcasts a bf16 gradient
    to fp32 to accumulate it), held from the first micro-batch's backward to the last one's reduce-scatters (the
    rank's whole gradient, unsharded), plus the running unit's new gradient (``E_u``, gathered dtype) and two
    reduce-scatter inputs (``P_u``, reduce dtype: the unit being reduced and the one before, which torch keeps until
    the next); with one micro-batch at ``pp_size`` 1, the larger of: while a layer is reduced, the root's gradients
    (``E_u``, gathered dtype: the LM head's is made first in backward and the root reduced last), the layer's
    gradients (``E_u`` in the gathered dtype and their cast to the reduce dtype where it differs) and two
    reduce-scatter inputs of a layer; while the root is reduced, its gradients with their cast, its reduce-scatter
    input and the one of the layer before.

  Counted at once (a bound: the sharded gradients are made only by the last backward's reduce-scatters).
  ``benchmarks/data_parallel_memory.py`` measures the peak of a step beside DDP and ZeRO-1.

**Activations** (per micro-batch, times the micro-batches the rank keeps in flight,
:func:`~boost_hf.perf.pipeline.micro_batches_in_flight`): under ``"full"`` and ``"lowrank"`` checkpointing what
:func:`~boost_hf.perf.activation_memory.saved_bytes_per_layer` states (tested equal to what the layers save), the
residual at the policy's residual bytes; without checkpointing the layer's saved tensors as
:func:`~boost_hf.perf.activation_memory.saved_bytes_without_checkpointing` counts them, where it models the layout
(otherwise ``None``: not modelled, and :func:`fits` says so instead of claiming a fit). The last stage adds what the
final norm, the LM head and the vocab-parallel loss keep (:func:`head_saved_bytes`), the first the token ids.

**Transients** (the largest one counts): the working set of one layer's backward, an allowance of one layer's
activations without checkpointing for the gradients it produces (twice that under checkpointing: the recomputed layer
as well); under ``autocast`` with checkpointing the cast cache, which keeps a bf16 copy of every weight of the rank
for the whole forward of a micro-batch (autocast caches the casts of leaf parameters until its region exits; without
checkpointing the copies are kept for backward anyway, per micro-batch in flight); the save of a checkpoint: every rank writes its own shards through ``torch.distributed.checkpoint``
(``boost_hf/checkpoint/folders.py``), copying one tensor at a time to the host (``--save_async``: all its shards, to
host memory once): no GPU memory beyond one tensor's host copy, which :attr:`MemoryBreakdown.save_host` reports.

**Framework allowance** (:data:`FRAMEWORK`, not measured on this CPU machine; an explicit allowance, overridable):
the CUDA context with cuBLAS/cuDNN workspaces (1 GiB: PyTorch's CUDA notes say the context is not counted by the
allocator and takes several hundred MB, more with eager module loading), NCCL's buffers (0.25 GiB per communicator
the rank uses, TP, DP, PP and the world: ``NCCL_BUFFSIZE`` 4 MiB x 2 directions x up to 32 channels), and the caching
allocator's fragmentation (10 % of the activations and transients: blocks are rounded and split; PyTorch's
``expandable_segments`` reduces it).
"""

from __future__ import annotations

import heapq
import weakref
from dataclasses import asdict, dataclass, replace
from functools import cache

from ..data_parallel_config import DataParallelConfig
from ..parallel.config import ParallelConfig
from ..parallel.fully_shard import FullyShardUnit, reshards_after_forward
from ..parallel.layouts import layout_for
from ..parallel.layouts.base import GROUPS
from ..parallel.layouts.base import whole_norm_saved_bytes
from .activation_memory import (
    rotary_saved_bytes,
    runs_single_device_layers,
    saved_bytes_per_layer,
    saved_bytes_without_checkpointing,
)
from .pipeline import micro_batches_in_flight

GIB = 2**30


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes per element a precision policy keeps: per parameter (``parameter``, ``master``, ``gradient``,
    ``moments`` of AdamW, ``weight_copy``: the bf16 copy of a weight a forward makes and keeps for its backward), per
    activation (``activation``: the compute dtype; ``residual``: the residual stream saved for backward) and per
    gradient element all-reduced over DP (``reduce``)."""

    name: str
    parameter: int
    master: int
    gradient: int
    moments: int
    weight_copy: int
    activation: int
    residual: int
    reduce: int


#: the one table of bytes per element of each precision policy (module docstring)
PRECISION_BYTES: dict[str, PrecisionBytes] = {
    p.name: p for p in (
        PrecisionBytes("fp32", parameter=4, master=0, gradient=4, moments=8, weight_copy=0, activation=4, residual=4, reduce=4),
        PrecisionBytes("autocast", parameter=4, master=0, gradient=4, moments=8, weight_copy=2, activation=2, residual=4, reduce=4),
        PrecisionBytes("bf16_params", parameter=2, master=4, gradient=4, moments=8, weight_copy=0, activation=2, residual=2, reduce=4),
    )
}
ADAMW_STEP_BYTES = 4  # torch's AdamW keeps one fp32 ``step`` per parameter tensor
DEEPSPEED_BUCKET_ELEMENTS = 5 * 10**8  # DeepSpeed's default reduce_bucket_size and allgather_bucket_size


@dataclass(frozen=True)
class Framework:
    """The framework allowance (module docstring): ``cuda_context`` bytes, ``nccl_per_communicator`` bytes and
    ``fragmentation`` as a fraction of the activations and transients."""

    cuda_context: int = GIB
    nccl_per_communicator: int = GIB // 4
    fragmentation: float = 0.10


FRAMEWORK = Framework()


def precision_bytes(policy: str, grad_reduce_dtype: str | None = None) -> PrecisionBytes:
    """``policy``'s bytes; ``grad_reduce_dtype="bf16"`` (``bf16_params`` only, ``--grad_reduce_dtype``): the DP
    all-reduce moves 2 bytes per gradient element instead of 4."""
    if policy not in PRECISION_BYTES:
        raise ValueError(f"Unknown precision policy {policy!r}: use one of {', '.join(PRECISION_BYTES)}.")
    if grad_reduce_dtype not in (None, "fp32", "bf16"):
        raise ValueError(f"grad_reduce_dtype must be fp32 or bf16, got {grad_reduce_dtype!r}.")
    if grad_reduce_dtype == "bf16":
        if policy != "bf16_params":
            raise ValueError(f"grad_reduce_dtype bf16 needs the bf16_params precision policy, not {policy!r}.")
        return replace(PRECISION_BYTES[policy], reduce=2)
    return PRECISION_BYTES[policy]


# ---------------------------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class RankParameters:
    """One pipeline rank's parameter tensors on one TP rank, as their local element counts: ``decay`` (AdamW's
    weight-decay group) and ``no_decay`` (biases and norms), the groups transformers' ``Trainer`` builds; ``cast``:
    the elements of its decoder layers' GEMM weights (what autocast copies to bf16 in every forward)."""

    decay: tuple[int, ...]
    no_decay: tuple[int, ...]
    cast: int = 0

    @property
    def elements(self) -> int:
        return sum(self.decay) + sum(self.no_decay)

    @property
    def tensors(self) -> int:
        return len(self.decay) + len(self.no_decay)


_CONFIG_KEYS: dict[int, tuple[weakref.ref, str]] = {}


def _config_key(config) -> str:
    """``config``'s JSON, computed once per config object (the memory model is asked about one model many times)."""
    known = _CONFIG_KEYS.get(id(config))
    if known is None or known[0]() is not config:
        known = (weakref.ref(config), config.to_json_string(use_diff=False))
        _CONFIG_KEYS[id(config)] = known
    return known[1]


@cache
def _skeleton(config_json: str, config_class) -> tuple[tuple[str, tuple[int, ...], bool], ...]:
    """``(name, shape, decays)`` of every parameter of the single-device model of ``config_json`` with at most 2
    decoder layers (block 0 and a block after it: LaX's block 0 has no crossing), built on the meta device."""
    import json

    import torch

    from ..modeling_boost_llama import BoostLlamaForCausalLM

    values = json.loads(config_json)
    values["num_hidden_layers"] = min(values["num_hidden_layers"], 2)
    with torch.device("meta"):
        model = BoostLlamaForCausalLM(config_class.from_dict(values))
    decays = set(decay_parameter_names(model))
    return tuple((name, tuple(p.shape), name in decays) for name, p in model.named_parameters() if p.requires_grad)


#: ``transformers.Trainer.get_decay_parameter_names``' patterns (its method body; importing the Trainer costs seconds)
NO_DECAY_PATTERNS = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")


def decay_parameter_names(model) -> list[str]:
    """The parameters transformers' ``Trainer`` gives weight decay (``tests/perf/test_memory.py`` checks this equals
    ``Trainer.get_decay_parameter_names``)."""
    from torch import nn
    from transformers.trainer_pt_utils import get_parameter_names

    return get_parameter_names(model, [nn.LayerNorm], list(NO_DECAY_PATTERNS))


def _local_shape(layout, config, name: str, shape: tuple[int, ...], p: int) -> tuple[int, ...]:
    """Shape of parameter ``name`` (canonical ``shape``) on one of ``p`` TP ranks under ``layout``: the dimension the
    layout splits divided by ``p`` (a tensor train's core ``i`` split as
    :meth:`~boost_hf.parallel.layouts.Layout.tensor_train_splits` states)."""
    if p == 1:
        return shape
    parts = name.split(".")
    if parts[0] == "lm_head":
        dim = 0
    elif name == "model.embed_tokens.weight":
        dim = layout.embedding_split()
    elif parts[:2] == ["model", "layers"]:
        module, leaf = parts[-2], parts[-1]
        group = next((g for g, names in GROUPS.items() if module in names), None)
        if module == "cores":
            dim = layout.tensor_train_splits(config.tensor_train_shape(parts[-3])).get(int(leaf))
        elif group is not None:
            dim = layout.projection_splits(group).get(leaf)
        elif module in ("input_layernorm", "post_attention_layernorm"):
            dim = layout.norm_split
        else:
            dim = None
    else:
        dim = None  # the final norm
    if dim is None:
        return shape
    dim %= len(shape)
    return tuple(n // p if i == dim else n for i, n in enumerate(shape))


def _elements(shape: tuple[int, ...]) -> int:
    elements = 1
    for n in shape:
        elements *= n
    return elements


@dataclass(frozen=True)
class _Tensor:
    """One parameter tensor of a TP rank: its local ``shape``, whether AdamW decays it, whether it is a decoder
    layer's GEMM weight (what autocast copies)."""

    shape: tuple[int, ...]
    decays: bool
    matrix: bool

    @property
    def elements(self) -> int:
        return _elements(self.shape)


@dataclass(frozen=True)
class _Part:
    """What one pipeline stage (a part, :mod:`boost_hf.parallel.parts`) holds on one TP rank: its decoder layers'
    tensors, layer by layer, and the rest (the embedding on the first stage, the final norm and LM head on the last)."""

    layers: tuple[tuple[_Tensor, ...], ...]
    rest: tuple[_Tensor, ...]


_RANK_PARTS: dict[tuple, list[list[_Part]]] = {}
_RANK_PARAMETERS: dict[tuple, list["RankParameters"]] = {}
_UNITS: dict[tuple, list[list["PartUnits"]]] = {}
_WORKING_SETS: dict[tuple, list["FullyShardWorkingSet"]] = {}


def _parts_key(config, parallel: ParallelConfig) -> tuple:
    """What decides the tensors each rank holds: the model and the TP and pipeline split (the key of the caches)."""
    return (_config_key(config), type(config), parallel.tp_style, parallel.tp_size, parallel.pp_size,
            parallel.stages_per_rank, parallel.pp_layer_split)


def _rank_parts(config, parallel: ParallelConfig) -> list[list[_Part]]:
    """Per pipeline rank, the parts (stages) it holds, first to last, with their TP-local tensors."""
    key = _parts_key(config, parallel)
    if key not in _RANK_PARTS:
        layout = layout_for(config, parallel)
        layer_template: dict[int, list[_Tensor]] = {0: [], 1: []}
        outside: dict[str, _Tensor] = {}
        for name, shape, decays in _skeleton(key[0], type(config)):
            tensor = _Tensor(_local_shape(layout, config, name, shape, parallel.tp_size), decays,
                             len(shape) == 2 or ".cores." in name)
            if name.startswith("model.layers."):
                layer_template[int(name.split(".")[2])].append(tensor)
            else:
                outside[name] = tensor
        if config.num_hidden_layers == 1:
            layer_template[1] = layer_template[0]
        stages = parallel.stage_layers(config.num_hidden_layers)
        last = parallel.num_stages - 1
        embedding = outside.pop("model.embed_tokens.weight")
        parts = [_Part(tuple(tuple(layer_template[min(i, 1)]) for i in stages[s]),
                       ((embedding,) if s == 0 else ()) + (tuple(outside.values()) if s == last else ()))
                 for s in range(parallel.num_stages)]
        _RANK_PARTS[key] = [[parts[s] for s in range(parallel.num_stages) if s % parallel.pp_size == rank]
                            for rank in range(parallel.pp_size)]
    return _RANK_PARTS[key]


@dataclass(frozen=True)
class PartUnits:
    """FSDP2's units of one part (a pipeline stage, or the whole model) on one TP rank, as
    :func:`~boost_hf.parallel.fully_shard.units_of` makes them: ``layers``, one per decoder layer (``fsdp_units``
    ``decoder_layers``), and the ``root``: the rest of the part (its embedding, final norm and LM head), or the whole
    part under ``fsdp_units`` ``model``; ``None`` where nothing is left (a middle pipeline stage)."""

    layers: tuple[FullyShardUnit, ...]
    root: FullyShardUnit | None

    @property
    def units(self) -> tuple[FullyShardUnit, ...]:
        return self.layers + ((self.root,) if self.root is not None else ())


def unit_elements(unit: FullyShardUnit) -> int:
    """Elements of ``unit``'s parameters as they are (no padding): its unsharded gradients'."""
    return sum(_elements(shape) for shape in unit.shapes)


def fully_shard_units(config, parallel: ParallelConfig, data_parallel: DataParallelConfig) -> list[list[PartUnits]]:
    """Per pipeline rank, the FSDP2 units of each part it holds (TP-local shapes; each decoder layer resharding after
    forward as :func:`~boost_hf.parallel.fully_shard.reshards_after_forward` says for ``data_parallel``'s policy, the
    root only under ``always``), what the trainer's :func:`~boost_hf.parallel.fully_shard.units_of` finds on the
    built model (``tests/perf/test_memory_measured.py``). Found once per layout (a list not to change)."""
    key = (*_parts_key(config, parallel), data_parallel.fsdp_reshard_after_forward, data_parallel.fsdp_units)
    if key not in _UNITS:
        _UNITS[key] = _fully_shard_units(config, parallel, data_parallel)
    return _UNITS[key]


def _fully_shard_units(config, parallel: ParallelConfig, data_parallel: DataParallelConfig) -> list[list[PartUnits]]:
    pipeline, policy = parallel.pp_size > 1, data_parallel.fsdp_reshard_after_forward
    apart = data_parallel.fsdp_units == "decoder_layers"
    out = []
    for parts in _rank_parts(config, parallel):
        rank = []
        for part in parts:
            layers = part.layers if apart else ()
            rest = part.rest if apart else (*(t for layer in part.layers for t in layer), *part.rest)
            rank.append(PartUnits(
                tuple(FullyShardUnit(tuple(t.shape for t in layer), reshards_after_forward(policy, i, len(layers), pipeline))
                      for i, layer in enumerate(layers)),
                FullyShardUnit(tuple(t.shape for t in rest), policy == "always") if rest else None,
            ))
        out.append(rank)
    return out


def rank_parameters(config, parallel: ParallelConfig) -> list[RankParameters]:
    """Per pipeline rank, the parameter tensors one of its TP ranks holds (local element counts): its stages' decoder
    layers, then the embedding (first stage) and the final norm and LM head (last stage). Found once per layout (a
    list not to change)."""
    key = _parts_key(config, parallel)
    if key not in _RANK_PARAMETERS:
        ranks = []
        for parts in _rank_parts(config, parallel):
            layers = [t for part in parts for layer in part.layers for t in layer]
            tensors = layers + [t for part in parts for t in part.rest]
            ranks.append(RankParameters(tuple(t.elements for t in tensors if t.decays),
                                        tuple(t.elements for t in tensors if not t.decays),
                                        sum(t.elements for t in layers if t.matrix)))
        _RANK_PARAMETERS[key] = ranks
    return _RANK_PARAMETERS[key]


@cache
def zero1_shares(parameters: RankParameters, dp: int) -> list[RankParameters]:
    """The tensors each of ``dp`` ranks steps under torch's ``ZeroRedundancyOptimizer``: per parameter group (weight
    decay, then the other), largest first, each to the rank with the fewest elements so far (the lowest rank on a
    tie), the counts carried over from group to group. A rank is given a tensor only when every lower rank has been
    given one, so of more ranks than tensors the last ``dp - tensors`` get none (not run through the heap)."""
    ranks = min(dp, len(parameters.decay) + len(parameters.no_decay))
    totals = [(0, rank) for rank in range(ranks)]
    shares: list[dict[str, list[int]]] = [{"decay": [], "no_decay": []} for _ in range(ranks)]
    for group in ("decay", "no_decay"):
        for n in sorted(getattr(parameters, group), reverse=True):
            total, rank = heapq.heappop(totals)
            shares[rank][group].append(n)
            heapq.heappush(totals, (total + n, rank))
    empty = [RankParameters((), ())] * (dp - ranks)
    return [RankParameters(tuple(s["decay"]), tuple(s["no_decay"])) for s in shares] + empty


# ---------------------------------------------------------------------------------------------- static bytes
@dataclass(frozen=True)
class StaticMemory:
    """Bytes one GPU holds for the whole run (module docstring)."""

    parameters: int
    masters: int
    gradients: int
    gradient_buckets: int
    optimizer_states: int

    @property
    def total(self) -> int:
        return self.parameters + self.masters + self.gradients + self.gradient_buckets + self.optimizer_states


def wrapped_in_ddp(parallel: ParallelConfig, dp_size: int) -> bool:
    """Whether the trainer wraps the model (or each pipeline stage) in ``DistributedDataParallel``: at ``pp_size`` 1 on
    any launched world (the trainer wraps even a DP group of one under TP), under PP at dp > 1."""
    if parallel.pp_size > 1:
        return dp_size > 1
    return dp_size * parallel.tp_size > 1


_STATIC: dict[tuple, list[list[StaticMemory]]] = {}
_FULLEST: dict[tuple, list[StaticMemory]] = {}
DDP = DataParallelConfig()


def static_memory(config, parallel: ParallelConfig, *, dp_size: int = 1, precision: str = "autocast",
                  zero1: bool = False, deepspeed_stage: int | None = None,
                  data_parallel: DataParallelConfig = DDP) -> list[list[StaticMemory]]:
    """Per pipeline rank, per DP rank: the static bytes of one GPU (module docstring); ``data_parallel``: DDP (the
    default) or FSDP2 / HSDP (``data_parallel="fsdp2"``, sharded over ``dp_size / dp_replicate_size`` ranks)."""
    key = _static_key(config, parallel, dp_size, precision, zero1, deepspeed_stage, data_parallel)
    if key not in _STATIC:
        _STATIC[key] = _static_memory(config, parallel, dp_size, precision, zero1, deepspeed_stage, data_parallel)
    return _STATIC[key]


def fullest_static_memory(config, parallel: ParallelConfig, *, dp_size: int = 1, precision: str = "autocast",
                          zero1: bool = False, deepspeed_stage: int | None = None,
                          data_parallel: DataParallelConfig = DDP) -> list[StaticMemory]:
    """Per pipeline rank, the static bytes of its fullest DP rank (the first of them) of :func:`static_memory`,
    without listing every DP rank: the fullest is DP rank 0 (every rank alike; FSDP2's shard 0 holds the most rows of
    every tensor) but under ZeRO-1, where it is among the first ranks, one per tensor (the others step nothing)."""
    key = _static_key(config, parallel, dp_size, precision, zero1, deepspeed_stage, data_parallel)
    if key not in _FULLEST:
        ranks = 1 + (max(p.tensors for p in rank_parameters(config, parallel)) if zero1 else 0)
        _FULLEST[key] = [max(dp_ranks, key=lambda b: b.total) for dp_ranks in _static_memory(
            config, parallel, dp_size, precision, zero1, deepspeed_stage, data_parallel, dp_ranks=min(ranks, dp_size))]
    return _FULLEST[key]


def _static_key(config, parallel: ParallelConfig, *settings) -> tuple:
    return (_config_key(config), parallel.tp_style, parallel.tp_size, parallel.pp_size, parallel.stages_per_rank,
            parallel.pp_layer_split, *settings)


def _static_memory(config, parallel: ParallelConfig, dp_size: int, precision: str, zero1: bool,
                   deepspeed_stage: int | None, data_parallel: DataParallelConfig,
                   dp_ranks: int | None = None) -> list[list[StaticMemory]]:
    """:func:`static_memory` of DP ranks ``0 .. dp_ranks - 1`` (default: all ``dp_size``)."""
    policy = precision_bytes(precision)
    dp_ranks = dp_size if dp_ranks is None else dp_ranks
    if data_parallel.fully_sharded and (zero1 or deepspeed_stage is not None):
        raise ValueError("FSDP2 shards the optimizer state itself: it runs without --zero1_optimizer and DeepSpeed.")
    if deepspeed_stage is not None:
        return [[_deepspeed_static(params, policy, dp_size, deepspeed_stage)] * dp_ranks
                for params in rank_parameters(config, parallel)]
    if fully_sharded(data_parallel, dp_size):
        shard = data_parallel.shard_size(dp_size)
        out = []
        for parts in _rank_parts(config, parallel):
            by_shard = _fully_sharded_static(parts, policy, shard, min(shard, dp_ranks))
            out.append([by_shard[dp_rank % shard] for dp_rank in range(dp_ranks)])
        return out
    out = []
    for params in rank_parameters(config, parallel):
        n = params.elements
        masters = n * policy.master
        gradients = n * policy.gradient
        buckets = n * policy.gradient if policy.master == 0 and wrapped_in_ddp(parallel, dp_size) else 0
        shares = zero1_shares(params, dp_size)[:dp_ranks] if zero1 and dp_size > 1 else [params] * dp_ranks
        out.append([
            StaticMemory(n * policy.parameter, masters, gradients, buckets,
                         share.elements * policy.moments + share.tensors * ADAMW_STEP_BYTES)
            for share in shares
        ])
    return out


def fully_sharded(data_parallel: DataParallelConfig, dp_size: int) -> bool:
    """Whether FSDP2 shards anything: asked for, over more than one DP rank (at dp 1 the trainer runs as without
    it)."""
    return data_parallel.fully_sharded and dp_size > 1


def _fully_sharded_static(parts: list[_Part], policy: PrecisionBytes, shard: int, indices: int) -> list[StaticMemory]:
    """FSDP2's static bytes on shard indices ``0 .. indices - 1`` of ``shard`` (module docstring): every tensor's dim 0
    padded to a multiple of ``shard``, ``1/shard`` of it held as the parameter (the fp32 master under ``bf16_params``)
    and its gradient; AdamW's moments of the rows each shard holds (unpadded, torch's ``chunk``: ``ceil(rows / shard)``
    rows to each of the first ``rows // chunk`` shards, the rest to the next one, none to the others) and one ``step``
    per tensor. ``O(tensors + indices)``: each tensor adds its rows to a running difference over the shard indices."""
    tensors = [t for part in parts for t in (*(t for layer in part.layers for t in layer), *part.rest)]
    padded = sum(FullyShardUnit((t.shape,), False).padded_elements(shard) for t in tensors) // shard
    change = [0] * (indices + 2)  # change[i]: elements held by shard i minus those held by shard i - 1
    for t in tensors:
        rows, row = (t.shape[0], _elements(t.shape[1:])) if t.shape else (1, 1)
        chunk = -(-rows // shard)
        whole, rest = divmod(rows, chunk)  # shards holding a whole chunk; the rows of the next one
        change[0] += chunk * row
        change[min(whole, indices)] += (rest - chunk) * row
        change[min(whole + 1, indices + 1)] -= rest * row
    out, held = [], 0
    for index in range(indices):
        held += change[index]
        out.append(StaticMemory(padded * (policy.master or policy.parameter), 0, padded * policy.gradient, 0,
                                held * policy.moments + len(tensors) * ADAMW_STEP_BYTES))
    return out


def _deepspeed_static(params: RankParameters, policy: PrecisionBytes, dp: int, stage: int) -> StaticMemory:
    """DeepSpeed ZeRO ``stage``'s bytes per GPU (the ZeRO paper's accounting, module docstring)."""
    n = params.elements
    half = policy.activation  # DeepSpeed keeps its parameters and gradients in the compute dtype
    optimizer = n * (4 + policy.moments) // dp  # fp32 master + moments, sharded from stage 1 on
    gradients = n * half // (dp if stage >= 2 else 1)
    parameters = n * half // (dp if stage >= 3 else 1)
    return StaticMemory(parameters, 0, gradients, 2 * DEEPSPEED_BUCKET_ELEMENTS * half, optimizer)


@dataclass(frozen=True)
class FullyShardWorkingSet:
    """FSDP2's bytes beyond its shards on one GPU during a step (module docstring): ``gathered_parameters``, the
    unsharded parameters held at once, and ``unsharded_gradients``, the gradients before their reduce-scatter."""

    gathered_parameters: int
    unsharded_gradients: int


def fully_shard_working_set(parts: list[PartUnits], shard: int, policy: PrecisionBytes, *, pipeline: bool,
                            accumulating: bool) -> FullyShardWorkingSet:
    """The working set of one pipeline rank whose parts have ``parts``' units, sharded over ``shard`` ranks, under
    ``policy`` (gathered in its ``parameter`` dtype, reduced in its ``reduce`` dtype); ``pipeline``: torch's schedule
    keeps every unit gathered for the whole step; ``accumulating``: the unsharded gradients of every unit are kept from
    the first micro-batch's backward to the last's (accelerate's ``no_sync``, the pipeline schedule's) (module
    docstring)."""
    units = [u for part in parts for u in part.units]
    if not units:
        return FullyShardWorkingSet(0, 0)
    padded = [u.padded_elements(shard) for u in units]
    stays = [pipeline or not u.reshards_after_forward for u in units]  # gathered from its forward to its backward
    kept = sum(n for n, stay in zip(padded, stays) if stay)
    resharding = sorted((n for n, stay in zip(padded, stays) if not stay), reverse=True)
    gathered = (kept + sum(resharding[:2]) + max(padded)) * policy.parameter  # + the running and prefetched, a flat buffer
    c, r = policy.parameter, policy.reduce  # a gradient as autograd makes it (the gathered dtype), as it is reduced
    if accumulating:  # every unit's, in the reduce dtype; the running unit's new gradient; two reduce-scatter inputs
        elements = [unit_elements(u) for u in units]
        return FullyShardWorkingSet(gathered, sum(elements) * r + max(elements) * c + 2 * max(padded) * r)
    cast = r if r != c else 0  # FSDP2 casts a unit's gradients to the reduce dtype before its reduce-scatter
    roots = [part.root for part in parts if part.root is not None]
    root = sum(unit_elements(u) for u in roots)
    layers = [u for part in parts for u in part.layers]
    layer = max((unit_elements(u) for u in layers), default=0)
    layer_padded = max((u.padded_elements(shard) for u in layers), default=0)
    while_a_layer_reduces = (root * c + layer * (c + cast) + 2 * layer_padded * r) if layers else 0
    while_the_root_reduces = root * (c + cast) + sum(u.padded_elements(shard) for u in roots) * r + layer_padded * r
    return FullyShardWorkingSet(gathered, max(while_a_layer_reduces, while_the_root_reduces))


# ---------------------------------------------------------------------------------------------- activations
def head_saved_bytes(config, parallel: ParallelConfig, tokens: int, precision: str = "autocast") -> int:
    """What the final norm, the LM head and the vocab-parallel loss keep for backward on one rank for ``tokens``
    tokens: the final norm's (:func:`~boost_hf.parallel.layouts.base.whole_norm_saved_bytes` on the gathered residual,
    whose output is the head's input; on this rank's ``N/p`` tokens under Megatron's sequence parallelism, the head
    then keeping the gathered ``[N, d]`` input instead; the single-device norm keeps its fp32 input, ``1/rms`` and the
    normalised values in the residual's dtype, and the head its own input), autocast's bf16 copy of the head's weight,
    the fp32 logits and their exponentials (``2 N V/p`` fp32), the shifted labels (int64), the per-token loss (fp32)
    and two masks."""
    policy = precision_bytes(precision)
    a, p, d, vocab = policy.activation, parallel.tp_size, config.hidden_size, config.vocab_size // parallel.tp_size
    if runs_single_device_layers(parallel):
        norm = tokens * d * (4 + policy.residual + a) + tokens * 4
    elif parallel.sequence_parallel and parallel.tp_style == "megatron":  # (at tp_size 1 the same bytes)
        shard = tokens // p
        norm = whole_norm_saved_bytes(shard, d, a, policy.residual) - shard * d * a + tokens * d * a
    else:
        norm = whole_norm_saved_bytes(tokens, d, a, policy.residual)
    loss = 2 * tokens * vocab * 4 + tokens * (8 + 4 + 1 + 1)
    return norm + vocab * d * policy.weight_copy + loss


def embedding_saved_bytes(config, parallel: ParallelConfig, tokens: int) -> int:
    """What the embedding keeps for backward: the token ids (int64) and, split over the vocabulary, which ids are
    this rank's (a bool each)."""
    vocab_split = parallel.tp_size > 1 and layout_for(config, parallel).embedding_split() == 0
    return tokens * (8 + (1 if vocab_split else 0))


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one GPU of one pipeline rank (its fullest DP rank), by what holds them (module docstring).
    ``gathered_parameters`` and ``unsharded_gradients``: FSDP2's working set (0 without it). ``activations`` is ``None`` where the layout's activations without checkpointing are not modelled. ``save_host``:
    the host memory an asynchronous save (``--save_async``) holds on this rank, its shards (fp32 parameters and the
    optimizer state); a synchronous save holds one tensor at a time, and neither adds GPU memory."""

    pp_rank: int
    parameters: int
    masters: int
    gradients: int
    gradient_buckets: int
    optimizer_states: int
    gathered_parameters: int
    unsharded_gradients: int
    activations: int | None
    weight_copies: int
    transient: int
    framework: int
    save_host: int

    @property
    def static(self) -> int:
        return self.parameters + self.masters + self.gradients + self.gradient_buckets + self.optimizer_states

    @property
    def total(self) -> int | None:
        """Peak bytes (``None`` when the activations are not modelled)."""
        if self.activations is None:
            return None
        return (self.static + self.gathered_parameters + self.unsharded_gradients + self.activations
                + self.weight_copies + self.transient + self.framework)

    def parts(self) -> dict[str, int | None]:
        """GPU bytes by part, for a report."""
        out = {k: v for k, v in asdict(self).items() if k not in ("pp_rank", "save_host")}
        out["total"] = self.total
        return out


@dataclass(frozen=True)
class _MicroBatchBytes:
    """What one micro-batch keeps for backward, by part (bytes on one rank): a decoder layer (block 0, a later block;
    ``None``: not modelled), the rotary tables, the head and loss, the embedding; and one layer's backward working set
    (``None``: not modelled)."""

    first_layer: int | None
    other_layer: int | None
    rotary: int
    head: int
    embedding: int
    working_set: int | None


_MICRO_BATCH_BYTES: dict[tuple, _MicroBatchBytes] = {}


def _micro_batch_bytes(config, parallel: ParallelConfig, tokens: int, seq_len: int, precision: str) -> _MicroBatchBytes:
    key = (_config_key(config), parallel.tp_style, parallel.tp_size, parallel.sequence_parallel, parallel.rmsnorm,
           parallel.group_linears, parallel.activation_checkpointing, tokens, seq_len, precision)
    if key not in _MICRO_BATCH_BYTES:
        policy = precision_bytes(precision)
        working_set = kept_without_checkpointing(config, parallel, tokens, policy)
        if parallel.activation_checkpointing == "none":
            first = other = working_set
        else:
            first, other = (saved_bytes_per_layer(config, parallel, tokens, i, residual_bytes=policy.residual,
                                                  latent_bytes=policy.activation) for i in (0, 1))
        _MICRO_BATCH_BYTES[key] = _MicroBatchBytes(
            first, other,
            # the rotary tables and the int64 position ids they were computed from
            rotary_saved_bytes(config, parallel, seq_len, activation_bytes=policy.activation, residual_bytes=policy.residual)
            + seq_len * 8,
            head_saved_bytes(config, parallel, tokens, precision), embedding_saved_bytes(config, parallel, tokens),
            working_set,
        )
    return _MICRO_BATCH_BYTES[key]


def memory_per_gpu(config, parallel: ParallelConfig, *, micro_batch: int, seq_len: int, num_micro_batches: int,
                   dp_size: int = 1, precision: str = "autocast", zero1: bool = False,
                   deepspeed_stage: int | None = None, data_parallel: DataParallelConfig = DDP,
                   framework: Framework = FRAMEWORK) -> list[MemoryBreakdown]:
    """Per pipeline rank, the peak bytes of its fullest GPU while training (module docstring). ``num_micro_batches``:
    the pipeline's ``m`` (the micro-batches of a step at ``pp_size`` 1, which run one after the other);
    ``data_parallel``: DDP (with ``zero1``) or FSDP2 / HSDP."""
    policy = precision_bytes(precision)
    parallel = replace(parallel, pp_microbatches=None)
    pp, v, m, tokens = parallel.pp_size, parallel.stages_per_rank, num_micro_batches, micro_batch * seq_len
    stages = parallel.stage_layers(config.num_hidden_layers)
    fullest = fullest_static_memory(config, parallel, dp_size=dp_size, precision=precision, zero1=zero1,
                                    deepspeed_stage=deepspeed_stage, data_parallel=data_parallel)
    params = rank_parameters(config, parallel)
    kept = _micro_batch_bytes(config, parallel, tokens, seq_len, precision)
    communicators = 1 + sum(size > 1 for size in (parallel.tp_size, pp, dp_size))
    sharded = fully_sharded(data_parallel, dp_size)
    if sharded:
        shard = data_parallel.shard_size(dp_size)
        communicators += shard > 1 and data_parallel.dp_replicate_size > 1  # HSDP: a shard and a replica group
        key = (*_parts_key(config, parallel), data_parallel.fsdp_reshard_after_forward, data_parallel.fsdp_units, shard,
               precision, pp > 1, pp > 1 or m > 1)
        if key not in _WORKING_SETS:  # found once per layout
            _WORKING_SETS[key] = [
                fully_shard_working_set(parts, shard, policy, pipeline=pp > 1, accumulating=pp > 1 or m > 1)
                for parts in fully_shard_units(config, parallel, data_parallel)]
        working_sets = _WORKING_SETS[key]
    else:
        working_sets = [FullyShardWorkingSet(0, 0)] * pp
    checkpointed = parallel.activation_checkpointing != "none"
    out = []
    for rank in range(pp):
        held = [s for s in range(parallel.num_stages) if s % pp == rank]
        layers = [i for s in held for i in stages[s]]
        in_flight = micro_batches_in_flight(parallel.pp_schedule, pp, m, v, rank) if pp > 1 else 1
        all_at_once = m if parallel.pp_schedule == "gpipe" else 1  # the last stage runs each backward right after
        activations = None
        if kept.other_layer is not None:
            per_micro_batch = sum(kept.first_layer if i == 0 else kept.other_layer for i in layers)
            activations = round((per_micro_batch + (kept.rotary if layers else 0)) * in_flight)
            if parallel.num_stages - 1 in held:
                activations += kept.head * all_at_once
            if 0 in held:
                activations += round(kept.embedding * (m if all_at_once > 1 else in_flight))
        # autocast's bf16 weight copies: kept by every forward in flight; under checkpointing only its cast cache,
        # the rank's weights for the whole forward of one micro-batch
        weight_copies = params[rank].cast * policy.weight_copy
        copies = 0 if checkpointed else round(weight_copies * in_flight)
        transient = None
        if kept.working_set is not None:  # a layer's backward: its activations' gradients (and the recomputed layer)
            transient = max(kept.working_set * (2 if checkpointed else 1) if layers else 0,
                            weight_copies if checkpointed else 0)
        static = fullest[rank]
        working = working_sets[rank]
        dynamic = None if activations is None or transient is None else (
            activations + copies + transient + working.gathered_parameters + working.unsharded_gradients)
        out.append(MemoryBreakdown(
            pp_rank=rank, parameters=static.parameters, masters=static.masters, gradients=static.gradients,
            gradient_buckets=static.gradient_buckets, optimizer_states=static.optimizer_states,
            gathered_parameters=working.gathered_parameters, unsharded_gradients=working.unsharded_gradients,
            activations=None if dynamic is None else activations, weight_copies=copies,
            transient=transient or 0,
            framework=framework.cuda_context + communicators * framework.nccl_per_communicator
            + round(framework.fragmentation * (dynamic or 0)),
            save_host=(static.parameters if sharded else params[rank].elements * 4) + static.optimizer_states,
        ))
    return out


def kept_without_checkpointing(config, parallel: ParallelConfig, tokens: int, policy: PrecisionBytes) -> int | None:
    """What one decoder layer keeps for backward without checkpointing (and holds while a checkpointed layer's
    backward recomputes it), :func:`~boost_hf.perf.activation_memory.saved_bytes_without_checkpointing`."""
    return saved_bytes_without_checkpointing(config, parallel, tokens, activation_bytes=policy.activation,
                                             residual_bytes=policy.residual, casts_inputs=policy.weight_copy > 0)


def fits(breakdown: list[MemoryBreakdown], gpu_memory_bytes: int) -> tuple[bool | None, int | None]:
    """``(fits, peak bytes of the fullest rank)``; ``(None, None)`` when a rank's activations are not modelled."""
    totals = [b.total for b in breakdown]
    if None in totals:
        return None, None
    peak = max(totals)
    return peak <= gpu_memory_bytes, peak


__all__ = [
    "ADAMW_STEP_BYTES",
    "NO_DECAY_PATTERNS",
    "decay_parameter_names",
    "DDP",
    "FRAMEWORK",
    "Framework",
    "FullyShardWorkingSet",
    "MemoryBreakdown",
    "PartUnits",
    "PRECISION_BYTES",
    "PrecisionBytes",
    "RankParameters",
    "StaticMemory",
    "fits",
    "fully_shard_units",
    "fully_shard_working_set",
    "fully_sharded",
    "embedding_saved_bytes",
    "head_saved_bytes",
    "kept_without_checkpointing",
    "memory_per_gpu",
    "precision_bytes",
    "rank_parameters",
    "static_memory",
    "unit_elements",
    "wrapped_in_ddp",
    "zero1_shares",
]
