"""Pipeline parallelism on PyTorch's engine (``torch.distributed.pipelining``), composed with TP and DP.

The one module of boost-hf that touches the (alpha) engine. :func:`keep_this_ranks_stages` cuts the
single-device skeleton *before* tensor parallelism is applied (a deep copy of a parallelized model would
hold process groups): this rank keeps the decoder layers of its stages, under their canonical names
(``model.layers.{i}``, :class:`StageLayers`), the embedding if it runs the first stage and the final norm
and LM head if it runs the last; everything else is deleted. The Layout machinery then shards what is
left, as for a whole model. :class:`Pipeline` runs one :class:`PipelineChunk` per stage as a
``PipelineStage`` with static shapes (no shape-inference forward) under the configured schedule.

What crosses a stage boundary, per micro-batch of ``mb`` sequences of ``S`` tokens (``N = mb S``), from each rank
to the rank of the same ``(dp, tp)`` coordinates on the next stage (and the same shapes back as gradients), as the
layout's :meth:`~boost_hf.parallel.layouts.Layout.stage_boundary` states it (the formula,
:func:`~boost_hf.perf.comm_formula.stage_boundary_communication`, and the engine's static shapes both read it):

* the residual stream as the layout holds it: under BTP this TP rank's ``[mb, S, d/p]`` shard (no gather), under
  Megatron with sequence parallelism its ``[mb, S/p, d]`` token shard, otherwise (Megatron, vanilla) the
  replicated ``[mb, S, d]``;
* LaX only: the handed-on latents of the 7 projections packed side by side, ``[rows, 7 r]`` (one send). Under BTP's
  latent sequence parallelism they are this rank's ``N/p`` token rows already. Otherwise (BTP, vanilla) they are
  replicated over TP, and each TP rank sends only its ``1/p`` share of the ``N`` rows; the receiving stage
  all-gathers the shares over TP (:func:`receive_latents`); backward is the mirror image (each rank sends back its
  share of the gradient, which is the same on every TP rank, and the sending stage all-gathers it,
  :func:`send_latents`). Where ``p`` does not divide ``N`` every rank sends the whole ``N`` rows.

Why a share: the boundary is what crosses nodes (TP inside a node, PP across), and the latents dominate it. At
lax-7b's shapes (d 4096, r 1024) at TP4, each TP rank would send ``d/p + 7r = 8192`` elements per token across the
network whole, ``d/p + 7r/p = 2816`` with the share, plus an all-gather of ``7r = 7168`` inside the node. With the
estimator's A100 numbers (25 GB/s network per GPU, 230 GB/s NVLink bus bandwidth) and a micro-batch of 4 x 4096
tokens in bf16, one direction takes 268 MB / 25 GB/s = 10.7 ms whole, against 92 MB / 25 GB/s = 3.7 ms plus
the all-gather's 176 MB of ring traffic / 230 GB/s = 0.8 ms, 4.5 ms (2.4x less). When both stages share a node the
share saves ``(p-1)/p`` of the latents' P2P bytes and the all-gather moves as many ring bytes, so it about breaks
even; the runtime does not know the topology, so it always shares.

Each stage runs the model's own forward (:func:`stage_model`: the base model with what the stage lacks set to
``None``); :class:`PipelineChunk` only unpacks and packs the boundary tensors. Precision is the model's and the
caller's (:meth:`Pipeline.configure`): the residual dtype is the model's ``residual_dtype``, the autocast is whatever
``wrap`` puts around each chunk, and every boundary tensor is sent in the ``boundary_dtype`` given (the byte counts
with it); without one, the parameters' dtype, as without a pipeline.

The loss is the single-process one: each micro-batch's vocab-parallel cross-entropy *sum* divided by
the token count of the whole step (all DP replicas), times ``dp_size`` because DDP averages gradients
over DP (``scale_grads=False``, as torchtitan); the reported loss is broadcast from the last stage and
summed over DP, so every rank returns the same value. When the trainer reduces the gradients over DP itself (its
``bf16_params`` precision policy accumulates and all-reduces them in fp32), the chunks are not wrapped in DDP.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .config import MULTI_STAGE_SCHEDULES, ParallelConfig
from .cross_entropy import IGNORE_INDEX, vocab_parallel_causal_lm_loss
from .parts import PartParallelism, data_parallelism, prepare_part
from .primitives import gather_from_tp, split_to_tp
from .sequence_parallel import check_sequence_length


def check_pipeline_model(config, parallel: ParallelConfig) -> None:
    """Raise ``ValueError`` (no collective) naming the fix when ``config`` cannot run as ``parallel``'s pipeline."""
    stages = parallel.num_stages
    if stages > config.num_hidden_layers:
        raise ValueError(
            f"pp_size={parallel.pp_size} x {parallel.stages_per_rank} stage(s) per rank makes {stages} pipeline stages, "
            f"more than the model's {config.num_hidden_layers} decoder layers: lower pp_size or pp_stages_per_rank."
        )
    split = parallel.pp_layer_split
    if split is not None and sum(split) != config.num_hidden_layers:
        raise ValueError(
            f"pp_layer_split {split} holds {sum(split)} layers, the model has {config.num_hidden_layers}: give layer "
            "counts that add up to num_hidden_layers."
        )
    if config.tie_word_embeddings:
        raise ValueError(
            "tie_word_embeddings=True cannot run under pipeline parallelism (the embedding lives on the first stage, the "
            "LM head on the last, and one weight cannot be in both): set tie_word_embeddings=False or use pp_size=1."
        )


def stage_ranks(parallel: ParallelConfig) -> list[int]:
    """The pipeline rank running each stage: looped, stage ``s`` on rank ``s mod pp``."""
    return [s % parallel.pp_size for s in range(parallel.num_stages)]


class StageLayers(nn.ModuleDict):
    """The decoder layers one pipeline rank holds, keyed by their index in the whole model (so parameter
    names stay ``model.layers.{i}...``); iterates over the layers, in order, like the ``nn.ModuleList`` it replaces."""

    def __iter__(self):
        return iter(self.values())

    def __getitem__(self, key: str | slice):
        """A layer by its index in the whole model (``"3"``), or, sliced, the held layers in order (as the model's
        forward slices its ``nn.ModuleList``)."""
        return list(self.values())[key] if isinstance(key, slice) else super().__getitem__(key)


@dataclass(frozen=True)
class Placement:
    """Which stages (and their decoder layers) run on this pipeline rank, and the canonical names of the
    parameters other pipeline ranks hold (``absent``: a checkpoint's tensors this rank does not read)."""

    stages: tuple[int, ...]
    layers: tuple[range, ...]  # per stage of this rank
    num_stages: int
    absent: frozenset[str]


def keep_this_ranks_stages(model: nn.Module, parallel: ParallelConfig, pp_rank: int) -> Placement:
    """Delete from ``model`` (a single-device ``BoostLlamaForCausalLM``, usually a meta skeleton) every
    part no stage of pipeline rank ``pp_rank`` runs; return what it keeps. No communication."""
    every_stage = parallel.stage_layers(model.config.num_hidden_layers)
    stages = tuple(s for s, rank in enumerate(stage_ranks(parallel)) if rank == pp_rank)
    layers = tuple(every_stage[s] for s in stages)
    before = {name for name, _ in model.named_parameters()}
    base = model.model
    base.layers = StageLayers({str(i): base.layers[i] for held in layers for i in held})
    if 0 not in stages:
        base.embed_tokens = None
    if parallel.num_stages - 1 not in stages:
        base.norm = None
        model.lm_head = None
    absent = frozenset(before - {name for name, _ in model.named_parameters()})
    return Placement(stages, layers, parallel.num_stages, absent)


class _ContiguousGradient(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous (it is sent to the previous stage, and gloo
    refuses strided tensors)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def stage_model(model: nn.Module, layers: range, first: bool, last: bool) -> nn.Module:
    """The base model of one stage: a view of this rank's ``model.model`` (a shallow copy of the module, no parameter
    copied) holding these ``layers`` only, its embedding on the first stage and its final norm on the last; ``None``
    where a stage lacks them, so that the model's own forward runs the stage."""
    base = model.model
    view = copy.copy(base)
    view._modules = {
        **base._modules,
        "embed_tokens": base.embed_tokens if first else None,
        "layers": StageLayers({str(i): base.layers[str(i)] for i in layers}),
        "norm": base.norm if last else None,
    }
    return view


class PipelineChunk(nn.Module):
    """One pipeline stage as the engine runs it: ``(input_ids)`` or ``(hidden, [latents])`` in, ``(hidden, [latents])``
    or the vocab-parallel logits ``[mb, S, V/p]`` (last stage) out. An adapter around the model's own forward
    (:func:`stage_model`, then the LM head on the last stage): it unpacks and packs the boundary tensors.

    ``hidden``: the residual as the layout holds it; ``latents``: LaX only, the handed-on latents of the 7
    projections packed ``[rows, 7 r]`` as the layout's :meth:`~boost_hf.parallel.layouts.Layout.stage_boundary`
    says (this rank's share of the replicated latents is taken before sending and all-gathered over TP on
    arrival: :func:`send_latents`, :func:`receive_latents`), in ``boundary_dtype`` (``None``: the residual's).
    """

    def __init__(self, model: nn.Module, stage: int, layers: range, num_stages: int):
        super().__init__()
        self.config, self.plan = model.config, model.plan
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.model = stage_model(model, layers, self.is_first, self.is_last)
        self.lm_head = model.lm_head if self.is_last else None
        self.latent_names = latent_names(model.config)
        self.boundary_dtype: torch.dtype | None = None
        self.param_dtype: torch.dtype | None = None  # the dtype the blocks read their parameters in (None: theirs)

    def _as_computed(self, packed: torch.Tensor) -> torch.Tensor:
        """LaX's latents as the blocks computed them: they cross in the boundary dtype (fp32 beside an fp32 residual
        stream under bf16 parameters), and a block takes them in no wider dtype than the parameters it reads, as
        without a pipeline (exact: bf16 -> fp32 -> bf16; an fp32 latent into bf16 parameters' LayerNorm is an error).
        Under FSDP2 those are the gathered ones (``param_dtype``), not the sharded fp32 masters."""
        computed = self.param_dtype or activation_dtype(self.model)
        return packed.to(computed) if computed.itemsize < packed.dtype.itemsize else packed

    def forward(self, *inputs: torch.Tensor, attention_mask: torch.Tensor | None = None):
        if self.is_first:
            (input_ids,) = inputs
            stage_inputs = {"input_ids": input_ids}
            microbatch, seq = input_ids.shape
        else:
            hidden, *packed = (_ContiguousGradient.apply(x) for x in inputs)
            microbatch, seq = hidden.shape[0], hidden.shape[1] * (self.plan.tp_size if self.plan.residual_split == "tokens" else 1)
            latents = receive_latents(self._as_computed(packed[0]), self._boundary(microbatch, seq), self.latent_names,
                                      microbatch, self.plan.group) if packed else None
            stage_inputs = {"inputs_embeds": hidden, "lax_latents": latents}
        outputs = self.model(**stage_inputs, attention_mask=attention_mask, use_cache=False)
        if self.is_last:
            return self.lm_head(outputs.last_hidden_state)
        hidden = outputs.last_hidden_state
        sent = self.boundary_dtype or hidden.dtype
        if not self.latent_names:
            return (hidden.to(sent).contiguous(),)
        packed = send_latents(outputs.lax_latents, self._boundary(microbatch, seq), self.latent_names, self.plan.group)
        return hidden.to(sent).contiguous(), packed.to(sent)

    def _boundary(self, microbatch: int, seq: int):
        return self.plan.layout.stage_boundary(self.config, microbatch, seq)


def latent_names(config) -> tuple[str, ...]:
    """The LaX latents crossing each stage boundary (none for other models)."""
    from ..modeling_boost_llama import PROJECTIONS

    return PROJECTIONS if config.bottleneck == "lax" else ()


def send_latents(latents: dict[str, torch.Tensor], boundary, names: tuple[str, ...], group) -> torch.Tensor:
    """LaX's handed-on latents ``{name: [mb, S or S/p, r]}`` packed ``[rows, 7 r]`` for the next stage; when
    ``boundary.latents_shared`` (replicated over TP) only this rank's ``1/p`` of the rows, whose gradient is
    all-gathered over TP in backward (every rank then holds the whole replicated gradient again)."""
    packed = torch.cat([latents[name].reshape(-1, latents[name].shape[-1]) for name in names], dim=-1)
    if boundary.latents_shared:
        packed = split_to_tp(packed, 0, group)
    return packed.contiguous()


def receive_latents(packed: torch.Tensor, boundary, names: tuple[str, ...], microbatch: int, group) -> dict[str, torch.Tensor]:
    """The inverse of :func:`send_latents`: ``[rows, 7 r]`` -> ``{name: [mb, rows' / mb, r]}`` (views), the rows
    all-gathered over TP first when ``boundary.latents_shared`` (backward: each rank keeps its share of the
    gradient, the same on every rank, and sends it back)."""
    if boundary.latents_shared:
        packed = gather_from_tp(packed, 0, group)
    return {name: part.view(microbatch, -1, part.shape[-1]) for name, part in zip(names, packed.chunk(len(names), dim=-1))}


def _schedule_class(name: str):
    from torch.distributed import pipelining

    return {
        "1f1b": pipelining.Schedule1F1B,
        "gpipe": pipelining.ScheduleGPipe,
        "interleaved-1f1b": pipelining.ScheduleInterleaved1F1B,
        "looped-bfs": pipelining.ScheduleLoopedBFS,
    }[name]


class Pipeline:
    """This rank's stages of a pipelined model and the schedule running them.

    Built by :func:`~boost_hf.parallel.parallelize.parallelize` when ``pp_size > 1``; the model object keeps
    this rank's parameters under canonical names (``model.pipeline`` is this object). The stages (each
    chunk wrapped in DDP over the DP group when ``dp_size > 1``) and schedules are built at the first step
    (the weights are final by then) and once per micro-batch shape.
    """

    _normaliser = 1.0  # what each micro-batch's loss sum is divided by in the running step

    def __init__(self, model: nn.Module, plan, placement: Placement):
        self.model, self.plan, self.placement = model, plan, placement
        self.parallel: ParallelConfig = plan.parallel
        self.state = plan.state
        self.chunks = [
            PipelineChunk(model, stage, layers, placement.num_stages) for stage, layers in zip(placement.stages, placement.layers)
        ]
        self._wrapped: list[nn.Module] | None = None
        self._schedules: dict[tuple[int, int, torch.dtype], object] = {}
        on_its_own = PartParallelism(data_parallel=data_parallelism(self.state, pipeline=True), dp_group=self.state.dp_group,
                                     ddp_kwargs={"broadcast_buffers": False})
        self._wrap = functools.partial(prepare_part, how=on_its_own)

    def configure(self, *, boundary_dtype: torch.dtype | None = None, param_dtype: torch.dtype | None = None,
                  wrap=None) -> None:
        """Before the first step: send the boundary tensors in ``boundary_dtype`` (``None``: the parameters' dtype);
        the stages read their parameters in ``param_dtype`` (FSDP2's, which casts its sharded masters when it gathers
        them; ``None``: the parameters' own); run each chunk as ``wrap(chunk)`` returns it
        (:func:`~boost_hf.parallel.parts.prepare_part` with the caller's settings; by default each chunk in DDP over
        the DP group, when there is one)."""
        if self._wrapped is not None:
            raise RuntimeError("configure must be called before the pipeline's first step (its stages are built).")
        for chunk in self.chunks:
            chunk.boundary_dtype, chunk.param_dtype = boundary_dtype, param_dtype
        if wrap is not None:
            self._wrap = wrap

    @property
    def boundary_dtype(self) -> torch.dtype:
        """The dtype of the tensors crossing this pipeline's stage boundaries (both ways)."""
        return self.chunks[0].boundary_dtype or activation_dtype(self.model)

    @property
    def holds_last_stage(self) -> bool:
        return self.placement.num_stages - 1 in self.placement.stages

    # ------------------------------------------------------------------ building
    def stage_modules(self) -> list[nn.Module]:
        """The chunks as the schedule runs them, each prepared by :meth:`configure`'s ``wrap`` (built once)."""
        if self._wrapped is None:
            self._wrapped = [self._wrap(chunk) for chunk in self.chunks]
        return self._wrapped

    def _schedule(self, microbatch: int, seq: int, dtype: torch.dtype):
        key = (microbatch, seq, dtype)
        if key not in self._schedules:
            self._schedules[key] = self._build_schedule(microbatch, seq, dtype)
        return self._schedules[key]

    def _build_schedule(self, microbatch: int, seq: int, dtype: torch.dtype):
        from torch.distributed.pipelining import PipelineStage

        config, parallel = self.model.config, self.parallel

        def meta(shape, dtype=dtype):
            return torch.empty(shape, dtype=dtype, device="meta", requires_grad=dtype.is_floating_point)

        boundary = tuple(meta(shape) for shape in self.plan.layout.stage_boundary(config, microbatch, seq).shapes)
        logits = meta((microbatch, seq, config.vocab_size // self.plan.tp_size))
        device = next(self.model.parameters()).device
        stages = []
        for stage, chunk, module in zip(self.placement.stages, self.chunks, self.stage_modules()):
            inputs = (meta((microbatch, seq), torch.long),) if chunk.is_first else boundary
            stages.append(
                PipelineStage(
                    module, stage, self.placement.num_stages, device,
                    input_args=inputs, output_args=logits if chunk.is_last else boundary, group=self.state.pp_group,
                )
            )
        kwargs = dict(n_microbatches=parallel.microbatches, loss_fn=self._loss, scale_grads=False)
        cls = _schedule_class(parallel.pp_schedule)
        if parallel.pp_schedule in MULTI_STAGE_SCHEDULES:
            return cls(stages, **kwargs)
        return cls(stages[0], **kwargs)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One micro-batch's summed vocab-parallel cross-entropy divided by the running step's normaliser (set by
        :meth:`_run`: the schedule calls this with ``(output, target)`` only; its ``loss_kwargs`` arrived in torch 2.13)."""
        return vocab_parallel_causal_lm_loss(logits, labels, group=self.plan.group, num_items_in_batch=self._normaliser)

    # ------------------------------------------------------------------ running
    def _check_batch(self, input_ids: torch.Tensor, labels: torch.Tensor) -> None:
        """On every rank, before any collective: token ids and labels in the vocabulary (as the model checks them),
        the sequence length under sequence parallelism, the batch splitting into the micro-batches."""
        from ..modeling_boost_llama import check_token_ids

        check_token_ids(input_ids, self.model.config.vocab_size)
        check_token_ids(labels, self.model.config.vocab_size, "labels", ignore_index=IGNORE_INDEX)
        batch, m = input_ids.shape[0], self.parallel.microbatches
        if self.parallel.sequence_parallel:  # (at tp_size 1 every length splits)
            check_sequence_length(input_ids.shape[1], self.parallel.tp_size)
        if batch % m != 0:
            raise ValueError(
                f"a pipeline step splits its batch of {batch} sequences into pp_microbatches={m} micro-batches of equal "
                f"size: use a batch size that is a multiple of {m} (per_device_train_batch_size) or change pp_microbatches."
            )

    def _run(self, input_ids, labels, attention_mask, *, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the schedule on this DP replica's batch; returns ``(loss sum over the step, target tokens)``,
        both summed over DP and identical on every rank."""
        self._check_batch(input_ids, labels)
        tokens = count_targets(labels)
        if self.state.dp_group is not None:
            dist.all_reduce(tokens, group=self.state.dp_group)
        dtype = self.boundary_dtype
        schedule = self._schedule(input_ids.shape[0] // self.parallel.microbatches, input_ids.shape[1], dtype)
        losses: list[torch.Tensor] = []
        self._normaliser = float(tokens) / self.state.dp_size if train else 1.0
        args = (input_ids,) if 0 in self.placement.stages else ()
        kwargs = {"attention_mask": attention_mask} if attention_mask is not None else {}
        target = labels if self.holds_last_stage else None
        run = schedule.step if train else schedule.eval
        run(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        total = torch.stack([loss.detach().float() for loss in losses]).sum() if losses else torch.zeros(())
        if train:
            total = total * (1.0 / self.state.dp_size) * float(tokens)  # back to a plain sum of token losses
        if self.state.pp_group is not None:
            last = stage_ranks(self.parallel)[-1]
            dist.broadcast(total, src=dist.get_global_rank(self.state.pp_group, last), group=self.state.pp_group)
        if self.state.dp_group is not None:
            dist.all_reduce(total, group=self.state.dp_group)
        return total, tokens

    def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward of one step through the pipeline (gradients accumulate into this rank's
        parameters, averaged over DP). Returns the token-weighted mean loss over every DP replica's batch,
        the same on every rank."""
        total, tokens = self._run(input_ids, labels, attention_mask, train=True)
        return total / tokens.clamp(min=1)

    @torch.no_grad()
    def eval_step(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward only: ``(sum of token losses, target tokens)`` over every DP replica's batch, on every rank."""
        return self._run(input_ids, labels, attention_mask, train=False)


def activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's floating-point weights (the activations' without a precision policy)."""
    return next(p.dtype for p in model.parameters() if p.dtype.is_floating_point)


def count_targets(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Next-token targets in ``labels [B, S]`` (position t predicts ``labels[t+1]``), as an fp64 scalar."""
    return (labels[..., 1:] != ignore_index).sum().to(torch.float64)


__all__ = [
    "Pipeline",
    "PipelineChunk",
    "Placement",
    "StageLayers",
    "activation_dtype",
    "check_pipeline_model",
    "count_targets",
    "keep_this_ranks_stages",
    "latent_names",
    "receive_latents",
    "send_latents",
    "stage_model",
    "stage_ranks",
]
