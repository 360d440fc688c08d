"""Tensor parallelism applied from outside: :func:`parallelize` turns a single-device
:class:`~boost_hf.modeling_boost_llama.BoostLlamaForCausalLM` into this rank's shard.

In a fixed order (torchtitan's lesson): check the layout against the config and the launched world,
build the process groups, cut this rank's pipeline stages, apply the :class:`~boost_hf.parallel.layouts.Layout`'s
plan (:meth:`~boost_hf.parallel.layouts.Layout.module_plan`: what each module path becomes, the embedding, rotary
tables, decoder layers, final norm and LM head included, the paths this rank does not hold skipped), then fill the
shards: a single-device model built on the
meta device is initialised by name (each rank draws the full tensor from the same seeded generator and
keeps its slice), a materialised one is sliced. Parameter names never change, so canonical
checkpoints load at any TP size and hooks registered on the single-device modules keep firing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .config import ParallelConfig
from .cross_entropy import vocab_parallel_causal_lm_loss
from .layouts import Layout, layout_for
from .modules import adopt, parallel_class, shard_parameter
from .pipeline import Pipeline, check_pipeline_model, keep_this_ranks_stages
from .primitives import split_to_tp
from .sequence_parallel import check_sequence_length
from .sharding import shard_spec_of
from .state import ParallelState, check_world, get_parallel_state


@dataclass(frozen=True)
class TensorParallelPlan:
    """How a parallelized model is laid out: its :class:`ParallelConfig`, :class:`Layout` and groups."""

    parallel: ParallelConfig
    layout: Layout
    state: ParallelState

    @property
    def tp_size(self) -> int:
        return self.state.tp_size

    @property
    def tp_rank(self) -> int:
        return self.state.tp_rank

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self.state.tp_group

    @property
    def sequence_parallel(self) -> bool:
        """Sequence parallelism in effect (:attr:`Layout.sequence_parallel <boost_hf.parallel.layouts.Layout.sequence_parallel>`)."""
        return self.layout.sequence_parallel

    @property
    def residual_split(self) -> str | None:
        """How this rank holds the residual stream: ``"hidden"`` (its ``[..., d/p]`` slice, BTP), ``"tokens"`` (its
        ``N/p`` tokens, Megatron's sequence parallelism) or ``None`` (whole)."""
        if self.layout.residual_sharded and self.tp_size > 1:
            return "hidden"
        return "tokens" if self.sequence_parallel else None


def checked_layout(config, parallel: ParallelConfig) -> Layout:
    """The :class:`Layout` running ``config`` under ``parallel``, after checking that ``config`` fits it and, under
    pipeline parallelism, its stages; raises ``ValueError`` naming the field to change (no collective)."""
    layout = layout_for(config, parallel)
    if parallel.pp_size > 1:
        check_pipeline_model(config, parallel)
    return layout


def parallelize(model: nn.Module, parallel: ParallelConfig, *, initialize: bool = True) -> nn.Module:
    """Shard ``model`` (a ``BoostLlamaForCausalLM``) in place for this rank of ``parallel``'s layout.

    Raises ``ValueError`` on every rank, before any collective, when the layout cannot hold the model or
    ``tp_size`` does not fit the launched world. A materialised model (e.g. one loaded by
    ``from_pretrained``) keeps its values: each parameter becomes its slice. A model built on the meta device
    is drawn from the shared seed when ``initialize`` (otherwise left uninitialised for a checkpoint loader).
    """
    config = model.config
    on_meta = [name for name, param in model.named_parameters() if param.is_meta]
    if on_meta and len(on_meta) != len(list(model.parameters())):
        raise ValueError(
            f"parallelize needs a model built entirely on the meta device or entirely materialised; {on_meta[:3]} are on "
            "the meta device and others are not: build it with BoostLlamaForCausalLM(config, parallel_config=...) or load it."
        )
    check_world(parallel.tp_size, parallel.pp_size)
    layout = checked_layout(config, parallel)
    plan = TensorParallelPlan(parallel, layout, get_parallel_state(parallel.tp_size, parallel.pp_size))
    seed = _shared_seed()
    placement = None
    if parallel.pp_size > 1:  # cut before sharding: this rank keeps its stages' parts only
        placement = keep_this_ranks_stages(model, parallel, plan.state.pp_rank)
    base = model.model
    for path, place in layout.module_plan(model, plan).items():
        for module in held_modules(model, path):
            place(module)
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not hasattr(param, "shard_spec"):
                shard_parameter(module, name, None, plan)  # replicated: materialise and mark
        if any(buffer.is_meta for buffer in module.buffers(recurse=False)):
            module.to_empty(device="cpu", recurse=False)
            with torch.device("cpu"):  # even inside a caller's meta-device context
                model._init_weights(module)  # rotary tables
    for module, mixin in ((base, TensorParallelBaseModel), (model, TensorParallelCausalLM)):
        _keep_class_identity(mixin, type(module))
        adopt(module, mixin, plan=plan)
    model.loss_function = functools.partial(vocab_parallel_causal_lm_loss, group=plan.group)
    if initialize and on_meta:
        initialize_shards(model, seed)
    if placement is not None:
        model.pipeline = Pipeline(model, plan, placement)
    return model


def held_modules(model: nn.Module, path: str) -> list[nn.Module]:
    """The modules at ``path`` in ``model`` that this rank holds (``parent.*``: each child of ``parent``, in order);
    none where a module on the way is absent or ``None`` (a pipeline stage's)."""
    names = path.split(".")
    every = names[-1] == "*"
    module = model
    for name in names[:-1] if every else names:
        module = getattr(module, name, None)
        if module is None:
            return []
    return list(module.children()) if every else [module]


def _shared_seed() -> int:
    """``torch.initial_seed()`` of global rank 0 (every rank draws the same initial weights)."""
    seed = [torch.initial_seed()]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(seed, src=0)
    return seed[0]


@torch.no_grad()
def initialize_shards(model: nn.Module, seed: int) -> None:
    """Fill every shard with its slice of the single-device initial value (drawn at full shape from
    ``(seed, canonical name)``, one tensor at a time)."""
    from ..weights_boost_llama import name_seed

    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            spec = shard_spec_of(param)
            generator = torch.Generator().manual_seed(name_seed(seed, model.parameter_name(module, name)))
            full = model.initial_value(module, name, spec.full_shape, generator)
            if full is None:
                continue
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                full[module.padding_idx] = 0.0
            param.copy_(spec.local_slice(full))


class TensorParallelBaseModel:
    """The base model under a layout (its forward checks the token ids before any collective:
    :func:`~boost_hf.modeling_boost_llama.check_token_ids`); under sequence parallelism the sequence length is checked
    first (before any collective); under BTP, ``inputs_embeds: [B, S, d]`` are split to this rank's ``[B, S, d/p]``
    (backward: all-gather of their gradient).

    Without its embedding (a pipeline stage after the first) it takes the residual stream as the layout holds it
    (``[B, S, d/p]`` under BTP, the ``[B, S/p, d]`` token shard under Megatron's sequence parallelism), as the
    previous stage handed it on: nothing is split, and the mask and positions are those of the whole sequence."""

    plan: TensorParallelPlan

    def forward(self, *args, **kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        holds_embedding = self.embed_tokens is not None
        if self.plan.sequence_parallel and holds_embedding:
            tokens = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
            if tokens is not None:  # neither: the single-device model's own error
                check_sequence_length(tokens.shape[1], self.plan.tp_size)
        if self.plan.residual_split == "hidden" and holds_embedding and kwargs.get("inputs_embeds") is not None:
            kwargs["inputs_embeds"] = split_to_tp(kwargs["inputs_embeds"], -1, self.plan.group)
        return super().forward(*args, **kwargs)

    def sequence_of(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is None and self.plan.residual_split == "tokens":  # a stage's input: this rank's S/p tokens
            return inputs_embeds.new_empty((inputs_embeds.shape[0], inputs_embeds.shape[1] * self.plan.tp_size, 0))
        return inputs_embeds


class TensorParallelCausalLM:
    """The causal LM under a layout (its class and module names stay the single-device model's, so a
    saved checkpoint's ``architectures`` and remote code name that class).

    * ``loss``: vocab-parallel cross-entropy on this rank's logits (the ``[N, V]`` logits are never
      gathered for it); the same value on every rank.
    * ``logits``: the full ``[B, S, V]`` (one all-gather) when no labels are given (``generate`` works),
      at ``tp_size=1`` or when ``return_logits=True``; otherwise ``None``.
    * ``save_pretrained``: call on every rank; the canonical safetensors files are written from every rank's
      shards, one output file per rank at a time (:mod:`boost_hf.checkpoint.export`): nothing is gathered.
    """

    plan: TensorParallelPlan

    @property
    def parallel_config(self) -> ParallelConfig:
        return self.plan.parallel

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        return_logits: bool | None = None,
        return_dict: bool | None = None,
        past_key_values=None,
        **kwargs,
    ):
        outputs = super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            return_dict=True,
            **kwargs,
        )
        if self.lm_head is not None:  # (without one, a pipeline stage before the last: hidden states out)
            if return_logits is None:
                return_logits = labels is None or self.plan.tp_size == 1
            fields = {name: value for name, value in outputs.items() if name != "logits"}
            outputs = type(outputs)(**fields, logits=self.lm_head.gather_logits(outputs.logits) if return_logits else None)
        if return_dict is False or (return_dict is None and not self.config.return_dict):
            return outputs.to_tuple()
        return outputs

    def save_pretrained(self, save_directory, *args, is_main_process: bool | None = None, state_dict=None,
                        max_shard_size: int | str | None = None, **kwargs):
        """Collective: the single-device model's folder (canonical safetensors files of at most ``max_shard_size``,
        default 5GB, config, remote code), written from every rank's shards without gathering them
        (:func:`~boost_hf.checkpoint.export.save_sharded_pretrained`). With an explicit ``state_dict`` (whole
        tensors), transformers' own ``save_pretrained`` on the main process, the folder then naming the model's own
        class where FSDP2 swapped it (transformers names the class it is given and copies its module's file:
        :func:`~boost_hf.checkpoint.remote_code.refresh_remote_code` puts the model's own names and code back)."""
        if is_main_process is None:
            is_main_process = not dist.is_initialized() or dist.get_rank() == 0
        if state_dict is not None:
            if is_main_process:
                super().save_pretrained(save_directory, *args, is_main_process=True, state_dict=state_dict,
                                        **({"max_shard_size": max_shard_size} if max_shard_size else {}), **kwargs)
                from ..checkpoint.export import own_class
                from ..checkpoint.remote_code import refresh_remote_code

                if own_class(self) is not type(self):
                    refresh_remote_code(str(save_directory))
            if dist.is_initialized():
                dist.barrier()
            return
        unsupported = sorted(k for k, v in kwargs.items() if v and k not in ("safe_serialization", "token"))
        if args or unsupported:
            raise ValueError(
                f"save_pretrained of a parallel model writes the canonical safetensors from every rank's shards and takes "
                f"max_shard_size only; got {unsupported or args}: save, then upload the folder (huggingface_hub.upload_folder)."
            )
        self.plan.parallel.save_pretrained(self, str(save_directory), is_main_process=is_main_process, max_shard_size=max_shard_size)


def _keep_class_identity(mixin: type, cls: type) -> type:
    """The adopted class keeps ``cls``'s name and module (checkpoints record and ship ``cls``)."""
    adopted = parallel_class(mixin, cls)
    adopted.__name__, adopted.__qualname__, adopted.__module__ = cls.__name__, cls.__qualname__, cls.__module__
    return adopted


__all__ = ["parallelize", "checked_layout", "initialize_shards", "TensorParallelPlan"]
