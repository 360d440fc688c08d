"""The step engine: what runs the trainer's steps on this rank's part of the model.

:class:`~boost_hf.training.trainer.BoostTrainer` calls one :class:`StepEngine` and never asks which it has:
:class:`ModelEngine` calls the model (one device, TP, DP, DeepSpeed), :class:`PipelineEngine`
runs the pipeline schedule over this rank's stages (:mod:`.pipeline_steps`). Each answers the same questions: the parts of the model it runs
(:meth:`StepEngine.parts`), what the Trainer holds as its wrapped model, one training step, the evaluation sums (and
the full-vocabulary logits for ``compute_metrics``), a greedy sample, the point-to-point bytes of a step.

Parallelism is applied per part, in one place (:func:`~boost_hf.parallel.parts.prepare_part`), in torchtitan's
order: tensor parallelism and activation checkpointing (applied when the model was built:
:func:`~boost_hf.parallel.parallelize`), then ``torch.compile`` (each decoder layer in place), then data parallelism
(:func:`~boost_hf.parallel.parts.data_parallelism` decides which: DDP over the DP group; none where the fp32 master
parameters reduce the gradients, ``bf16_params``; accelerate's own wrapping where it owns the model: DeepSpeed's
engine, or DDP over the world at tp 1). ZeRO-1 shards the optimizer the Trainer creates
(:mod:`boost_hf.training.zero1`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from transformers.trainer_utils import EvalPrediction

from ..evaluation import batch_sums, sums_of_batch
from ..parallel.fully_shard import gradients_unsynchronised, reshard
from ..parallel.parts import PartParallelism, data_parallelism, prepare_part
from ..parallel.state import ParallelState
from .health import poison_nonfinite_loss
from .pipeline_steps import (
    PipelineReplica,
    boundary_bytes_per_step,
    from_last_stage,
    last_stage_logits,
    pipeline_evaluation_sums,
    pipeline_greedy_generate,
)


class HeldAsIs(nn.Module):
    """What the Trainer holds as its wrapped model where no wrapper reduces the gradients (one DP rank of a split
    model, or ``bf16_params``' master parameters): the model, called as it is, so that accelerate does not wrap it in
    DDP over the whole world (which would average over TP ranks)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.module = model

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class HeldSharded(HeldAsIs):
    """What the Trainer holds as its wrapped model under FSDP2 (the model, sharded in place by ``fully_shard``): the
    model called as it is, with the ``no_sync`` the Trainer enters for every micro-batch of a step but the last (as
    accelerate's for FSDP2: the gradients accumulate unsharded and are reduced once, with the last micro-batch)."""

    def no_sync(self):
        return gradients_unsynchronised(self.module)


class StepEngine:
    """The steps of a run on this rank's part of the model (see the module docstring)."""

    def __init__(self, model: nn.Module, state: ParallelState, device: torch.device):
        self.model, self.state, self.device = model, state, device
        self.wrapped: nn.Module | None = None

    def parts(self) -> list[nn.Module]:
        """The parts parallelism is applied to, each by :func:`prepare_part`."""
        raise NotImplementedError

    def wrap(self, how: PartParallelism, *, masters: bool = False, deepspeed: bool = False,
             boundary_dtype: torch.dtype | None = None) -> None:
        """Apply ``how`` to every part (once), under the data parallelism :func:`~boost_hf.parallel.parts.data_parallelism`
        gives this engine (``masters``: the fp32 master parameters reduce the gradients; ``deepspeed``: DeepSpeed's
        engine owns them); :attr:`wrapped` becomes what the Trainer holds as its wrapped model (``None``: accelerate's
        own wrapping). ``boundary_dtype``: what a pipeline sends between its stages."""
        raise NotImplementedError

    def parts_as_run(self) -> list[nn.Module]:
        """The parts as the steps run them, after :meth:`wrap` (the FSDP2 roots under ``--data_parallel fsdp2``)."""
        return self.parts()

    def backward_passes_per_step(self, gradient_accumulation_steps: int) -> int:
        """Backward passes reaching each parameter in one optimizer step."""
        return gradient_accumulation_steps

    def train_step(self, model: nn.Module, inputs: dict, trainer_step) -> torch.Tensor:
        """Forward and backward of one micro-step; the detached loss. ``trainer_step()``: the Trainer's own."""
        raise NotImplementedError

    def p2p_bytes_per_step(self, batch_shape: tuple[int, int]) -> int:
        """Bytes this rank sends to pipeline neighbours in one training step of a ``[B, S]`` batch."""
        return 0

    def evaluate(self, model: nn.Module, batches, tokenizer=None, keep_logits=None) -> torch.Tensor:
        """``float64 [nll sum, tokens, bytes]`` of ``batches`` over every DP rank (forward only); with
        ``keep_logits``, ``keep_logits(logits, labels)`` for each batch's full-vocabulary logits where this rank
        holds them (:attr:`holds_logits`)."""
        raise NotImplementedError

    @property
    def holds_logits(self) -> bool:
        return True

    def user_metrics(self, compute_metrics, predictions: list, label_ids: list, prefix: str) -> dict:
        """``compute_metrics(EvalPrediction)`` on the predictions and labels (kept by :meth:`evaluate`) of every DP rank
        (in DP-rank order, gathered as objects over the DP group), on the ranks holding the logits, sent to every rank;
        keys get ``prefix``. The fully masked rows that pad the DP shards to equal length
        (:class:`~boost_hf.training.data.EvalShard`) are dropped."""
        computed = None
        if self.holds_logits:
            labels = torch.cat(label_ids)
            real = (labels != -100).flatten(1).any(-1)
            local = (torch.cat(predictions)[real].numpy(), labels[real].numpy())
            if self.state.dp_group is not None:
                shards = [None] * self.state.dp_size
                dist.all_gather_object(shards, local, group=self.state.dp_group)
                local = tuple(np.concatenate([shard[i] for shard in shards]) for i in range(2))
            computed = compute_metrics(EvalPrediction(predictions=local[0], label_ids=local[1]))
        computed = self.from_logit_holders(computed)
        return {key if key.startswith(f"{prefix}_") else f"{prefix}_{key}": value for key, value in computed.items()}

    def from_logit_holders(self, value):
        """``value`` as the ranks holding the logits computed it, on every rank."""
        return value

    def generate(self, model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int, tokenizer) -> torch.Tensor:
        """Greedy continuation of ``input_ids [1, S]``; collective (every rank calls it)."""
        raise NotImplementedError

    @property
    def absent_parameters(self) -> frozenset[str]:
        """Canonical names of the parameters other pipeline ranks hold."""
        return frozenset()


class ModelEngine(StepEngine):
    """The model called as it is: the whole model is one part."""

    def parts(self) -> list[nn.Module]:
        return [self.model]

    def wrap(self, how: PartParallelism, *, masters: bool = False, deepspeed: bool = False,
             boundary_dtype: torch.dtype | None = None) -> None:
        if self.wrapped is not None:
            return
        data_parallel = data_parallelism(self.state, masters=masters, deepspeed=deepspeed, fully_shard=how.fully_shard is not None)
        how = dataclasses.replace(how, context=None, data_parallel=data_parallel)  # (the Trainer's autocast surrounds it)
        part = prepare_part(self.model, how)
        if how.data_parallel == "none":
            part = HeldAsIs(part)
        elif how.data_parallel == "fsdp2":  # sharded in place
            part = HeldSharded(part)
        self.wrapped = part if part is not self.model else None

    def train_step(self, model: nn.Module, inputs: dict, trainer_step) -> torch.Tensor:
        return trainer_step()

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches, tokenizer=None, keep_logits=None) -> torch.Tensor:
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)
        full_logits = {"return_logits": True} if hasattr(self.model, "plan") else {}  # TP: gather the vocabulary shards
        for batch in batches:
            if keep_logits is None:
                totals += sums_of_batch(model, batch, tokenizer)
                continue
            outputs = model(**batch, num_items_in_batch=1, **full_logits)
            totals += batch_sums(outputs.loss, batch["labels"], tokenizer)
            keep_logits(outputs.logits, batch["labels"])
        reshard(self.model)  # FSDP2: the units kept gathered after forward hold their shards again
        if self.state.dp_group is not None:
            dist.all_reduce(totals, group=self.state.dp_group)
        return totals

    @torch.no_grad()
    def generate(self, model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int, tokenizer) -> torch.Tensor:
        model.eval()
        output = model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False, use_cache=True,
                                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        reshard(self.model)
        return output


class PipelineEngine(StepEngine):
    """The steps of a pipelined model: each of this rank's stages is a part; every step runs the schedule."""

    def __init__(self, model: nn.Module, state, device: torch.device):
        super().__init__(model, state, device)
        self.pipeline = model.pipeline

    def parts(self) -> list[nn.Module]:
        return list(self.pipeline.chunks)

    def wrap(self, how: PartParallelism, *, masters: bool = False, deepspeed: bool = False,
             boundary_dtype: torch.dtype | None = None) -> None:
        """Each stage prepared by :func:`~boost_hf.parallel.parts.prepare_part` as the pipeline builds it (under
        ``how.context``: the schedule calls the stages), its boundary tensors sent in ``boundary_dtype``; the Trainer
        holds a :class:`PipelineReplica`. Under FSDP2 the stages are prepared at once (``fully_shard`` replaces the
        parameters, which the optimizer created next must hold)."""
        if self.wrapped is not None:
            return
        data_parallel = data_parallelism(self.state, masters=masters, deepspeed=deepspeed, pipeline=True,
                                         fully_shard=how.fully_shard is not None)
        sharded = dataclasses.replace(how.fully_shard, pipeline=True) if how.fully_shard is not None else None
        how = dataclasses.replace(how, data_parallel=data_parallel, ddp_kwargs={"broadcast_buffers": False, **how.ddp_kwargs},
                                  place=None, fully_shard=sharded)
        self.pipeline.configure(boundary_dtype=boundary_dtype, param_dtype=sharded.param_dtype if sharded is not None else None,
                                wrap=functools.partial(prepare_part, how=how))
        if data_parallel == "fsdp2":
            self.pipeline.stage_modules()
        self.wrapped = PipelineReplica(self.model)

    def parts_as_run(self) -> list[nn.Module]:
        return self.pipeline.stage_modules()

    def backward_passes_per_step(self, gradient_accumulation_steps: int) -> int:
        return self.pipeline.parallel.microbatches

    def train_step(self, model: nn.Module, inputs: dict, trainer_step) -> torch.Tensor:
        self.model.train()
        inputs = {name: value.to(self.device) for name, value in inputs.items()}
        loss = self.pipeline.train_step(inputs["input_ids"], inputs["labels"], inputs.get("attention_mask")).detach()
        return poison_nonfinite_loss(loss)

    def p2p_bytes_per_step(self, batch_shape: tuple[int, int]) -> int:
        return boundary_bytes_per_step(self.pipeline, batch_shape)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches, tokenizer=None, keep_logits=None) -> torch.Tensor:
        self.model.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)
        collecting = last_stage_logits(self.pipeline) if keep_logits is not None else contextlib.nullcontext()
        with collecting as outputs:
            for batch in batches:
                totals += pipeline_evaluation_sums(self.pipeline, batch, tokenizer).to(self.device)  # over DP already
                if outputs is None:  # no compute_metrics, or not the last stage: no logits here
                    continue
                rows = batch["labels"].shape[0]  # without the rows that padded it to whole micro-batches
                logits = self.model.lm_head.gather_logits(torch.cat(outputs)[:rows])
                outputs.clear()
                keep_logits(logits, batch["labels"])
        self._reshard()
        return totals

    def _reshard(self) -> None:
        for stage in self.pipeline.stage_modules():
            reshard(stage)

    @property
    def holds_logits(self) -> bool:
        return self.pipeline.holds_last_stage

    def from_logit_holders(self, value):
        return from_last_stage(self.pipeline, value)

    def generate(self, model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int, tokenizer) -> torch.Tensor:
        self.model.eval()
        output = pipeline_greedy_generate(self.pipeline, input_ids, max_new_tokens, tokenizer.eos_token_id)
        self._reshard()
        return output

    @property
    def absent_parameters(self) -> frozenset[str]:
        return self.pipeline.placement.absent


def engine_for(model: nn.Module, state: ParallelState, device: torch.device) -> StepEngine:
    """The engine running ``model``'s steps: the pipeline's when it has one, else the model's own."""
    engine = PipelineEngine if getattr(model, "pipeline", None) is not None else ModelEngine
    return engine(model, state, device)


__all__ = ["HeldAsIs", "HeldSharded", "ModelEngine", "PipelineEngine", "StepEngine", "engine_for"]
