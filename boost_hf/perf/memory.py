"""Memory per GPU of a training layout, per pipeline rank: what the estimator's time model leaves out.

Everything is bytes on one GPU (one pipeline rank, one TP rank, one DP rank), for AdamW.

**Static part** (exact: ``tests/training/test_pipeline_resume.py`` compares it with the bytes every rank of a
launched run holds, and ``tests/perf/test_memory.py`` the parameter counts with what ``parallelize`` builds):

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

from ..parallel.config import ParallelConfig
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


def _local_elements(layout, config, name: str, shape: tuple[int, ...], p: int) -> int:
    """Elements of parameter ``name`` (canonical) on one of ``p`` TP ranks under ``layout`` (a tensor train's core
    ``i`` split as :meth:`~boost_hf.parallel.layouts.Layout.tensor_train_splits` states)."""
    elements = 1
    for n in shape:
        elements *= n
    if p == 1:
        return elements
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
    return elements if dim is None else elements // p


_RANK_PARAMETERS: dict[tuple, list[RankParameters]] = {}


def rank_parameters(config, parallel: ParallelConfig) -> list[RankParameters]:
    """Per pipeline rank, the parameter tensors one of its TP ranks holds (local element counts)."""
    key = (_config_key(config), type(config), parallel.tp_style, parallel.tp_size, parallel.pp_size,
           parallel.stages_per_rank, parallel.pp_layer_split)
    if key not in _RANK_PARAMETERS:
        _RANK_PARAMETERS[key] = _rank_parameters(config, parallel, key[0])
    return _RANK_PARAMETERS[key]


def _rank_parameters(config, parallel: ParallelConfig, config_json: str) -> list[RankParameters]:
    layout = layout_for(config, parallel)
    p = parallel.tp_size
    skeleton = _skeleton(config_json, type(config))
    layer_template: dict[int, list[tuple[int, bool, bool]]] = {0: [], 1: []}
    outside: dict[str, tuple[int, bool, bool]] = {}
    for name, shape, decays in skeleton:
        local = (_local_elements(layout, config, name, shape, p), decays, len(shape) == 2 or ".cores." in name)
        if name.startswith("model.layers."):
            layer_template[int(name.split(".")[2])].append(local)
        else:
            outside[name] = local
    if config.num_hidden_layers == 1:
        layer_template[1] = layer_template[0]
    stages = parallel.stage_layers(config.num_hidden_layers)
    ranks = []
    for rank in range(parallel.pp_size):
        held = [s for s in range(parallel.num_stages) if s % parallel.pp_size == rank]
        tensors = [t for s in held for i in stages[s] for t in layer_template[min(i, 1)]]
        cast = sum(n for n, _, matrix in tensors if matrix)
        if 0 in held:
            tensors.append(outside["model.embed_tokens.weight"])
        if parallel.num_stages - 1 in held:
            tensors += [outside[name] for name in outside if name != "model.embed_tokens.weight"]
        ranks.append(RankParameters(tuple(n for n, d, _ in tensors if d), tuple(n for n, d, _ in tensors if not d), cast))
    return ranks


@cache
def zero1_shares(parameters: RankParameters, dp: int) -> list[RankParameters]:
    """The tensors each of ``dp`` ranks steps under torch's ``ZeroRedundancyOptimizer``: per parameter group (weight
    decay, then the other), largest first, each to the rank with the fewest elements so far (the lowest rank on a
    tie), the counts carried over from group to group."""
    totals = [(0, rank) for rank in range(dp)]
    shares: list[dict[str, list[int]]] = [{"decay": [], "no_decay": []} for _ in range(dp)]
    for group in ("decay", "no_decay"):
        for n in sorted(getattr(parameters, group), reverse=True):
            total, rank = heapq.heappop(totals)
            shares[rank][group].append(n)
            heapq.heappush(totals, (total + n, rank))
    return [RankParameters(tuple(s["decay"]), tuple(s["no_decay"])) for s in shares]


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


def static_memory(config, parallel: ParallelConfig, *, dp_size: int = 1, precision: str = "autocast",
                  zero1: bool = False, deepspeed_stage: int | None = None) -> list[list[StaticMemory]]:
    """Per pipeline rank, per DP rank: the static bytes of one GPU (module docstring)."""
    key = (_config_key(config), parallel.tp_style, parallel.tp_size, parallel.pp_size, parallel.stages_per_rank,
           parallel.pp_layer_split, dp_size, precision, zero1, deepspeed_stage)
    if key not in _STATIC:
        _STATIC[key] = _static_memory(config, parallel, dp_size, precision, zero1, deepspeed_stage)
    return _STATIC[key]


def _static_memory(config, parallel: ParallelConfig, dp_size: int, precision: str, zero1: bool,
                   deepspeed_stage: int | None) -> list[list[StaticMemory]]:
    policy = precision_bytes(precision)
    if deepspeed_stage is not None:
        return [[_deepspeed_static(params, policy, dp_size, deepspeed_stage)] * dp_size
                for params in rank_parameters(config, parallel)]
    out = []
    for params in rank_parameters(config, parallel):
        n = params.elements
        masters = n * policy.master
        gradients = n * policy.gradient
        buckets = n * policy.gradient if policy.master == 0 and wrapped_in_ddp(parallel, dp_size) else 0
        shares = zero1_shares(params, dp_size) if zero1 and dp_size > 1 else [params] * dp_size
        out.append([
            StaticMemory(n * policy.parameter, masters, gradients, buckets,
                         share.elements * policy.moments + share.tensors * ADAMW_STEP_BYTES)
            for share in shares
        ])
    return out


def _deepspeed_static(params: RankParameters, policy: PrecisionBytes, dp: int, stage: int) -> StaticMemory:
    """DeepSpeed ZeRO ``stage``'s bytes per GPU (the ZeRO paper's accounting, module docstring)."""
    n = params.elements
    half = policy.activation  # DeepSpeed keeps its parameters and gradients in the compute dtype
    optimizer = n * (4 + policy.moments) // dp  # fp32 master + moments, sharded from stage 1 on
    gradients = n * half // (dp if stage >= 2 else 1)
    parameters = n * half // (dp if stage >= 3 else 1)
    return StaticMemory(parameters, 0, gradients, 2 * DEEPSPEED_BUCKET_ELEMENTS * half, optimizer)


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
    ``activations`` is ``None`` where the layout's activations without checkpointing are not modelled. ``save_host``:
    the host memory an asynchronous save (``--save_async``) holds on this rank, its shards (fp32 parameters and the
    optimizer state); a synchronous save holds one tensor at a time, and neither adds GPU memory."""

    pp_rank: int
    parameters: int
    masters: int
    gradients: int
    gradient_buckets: int
    optimizer_states: int
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
        return self.static + self.activations + self.weight_copies + self.transient + self.framework

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
                   deepspeed_stage: int | None = None, framework: Framework = FRAMEWORK) -> list[MemoryBreakdown]:
    """Per pipeline rank, the peak bytes of its fullest GPU while training (module docstring). ``num_micro_batches``:
    the pipeline's ``m`` (the micro-batches of a step at ``pp_size`` 1, which run one after the other)."""
    policy = precision_bytes(precision)
    parallel = replace(parallel, pp_microbatches=None)
    pp, v, m, tokens = parallel.pp_size, parallel.stages_per_rank, num_micro_batches, micro_batch * seq_len
    stages = parallel.stage_layers(config.num_hidden_layers)
    statics = static_memory(config, parallel, dp_size=dp_size, precision=precision, zero1=zero1, deepspeed_stage=deepspeed_stage)
    params = rank_parameters(config, parallel)
    kept = _micro_batch_bytes(config, parallel, tokens, seq_len, precision)
    communicators = 1 + sum(size > 1 for size in (parallel.tp_size, pp, dp_size))
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
        static = max(statics[rank], key=lambda b: b.total)
        dynamic = None if activations is None or transient is None else activations + copies + transient
        out.append(MemoryBreakdown(
            pp_rank=rank, parameters=static.parameters, masters=static.masters, gradients=static.gradients,
            gradient_buckets=static.gradient_buckets, optimizer_states=static.optimizer_states,
            activations=None if dynamic is None else activations, weight_copies=copies,
            transient=transient or 0,
            framework=framework.cuda_context + communicators * framework.nccl_per_communicator
            + round(framework.fragmentation * (dynamic or 0)),
            save_host=params[rank].elements * 4 + static.optimizer_states,
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
    "FRAMEWORK",
    "Framework",
    "MemoryBreakdown",
    "PRECISION_BYTES",
    "PrecisionBytes",
    "RankParameters",
    "StaticMemory",
    "fits",
    "embedding_saved_bytes",
    "head_saved_bytes",
    "kept_without_checkpointing",
    "memory_per_gpu",
    "precision_bytes",
    "rank_parameters",
    "static_memory",
    "wrapped_in_ddp",
    "zero1_shares",
]
