"""The trainer's steps under pipeline parallelism: each runs the model's :class:`~boost_hf.parallel.pipeline.Pipeline`
instead of calling the model (whose stages live on several ranks).

* :func:`pipeline_training_step`: one optimizer step's forward and backward, the schedule over the batch's
  micro-batches; returns the token-weighted mean loss over every DP replica's batch (the same on every rank).
* :func:`pipeline_evaluation_sums`: ``[nll sum, tokens, bytes]`` of one evaluation batch, already summed over DP;
  a batch that does not split into the micro-batches is padded with fully ignored rows (exact: they add nothing).
* :func:`on_one_process`: what needs the whole model in one process (the end-of-training sample).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..evaluation import target_bytes
from ..parallel.cross_entropy import IGNORE_INDEX


def pipeline_of(model):
    """The model's :class:`~boost_hf.parallel.pipeline.Pipeline` (``None`` without pipeline parallelism)."""
    return getattr(model, "pipeline", None)


class PipelineReplica(nn.Module):
    """What the Trainer holds as its wrapped model under pipeline parallelism: the model (``module``) as it is.
    Accelerate must not wrap it in DDP over the whole world (each rank holds other stages); the pipeline wraps each
    stage in DDP over the DP group itself. Calling it raises: steps run through the pipeline."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.module = model

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipelined model runs through model.pipeline (train_step / eval_step), not by calling it")


def pipeline_training_step(pipeline, inputs: dict) -> torch.Tensor:
    """Forward and backward of ``inputs`` (``input_ids``, ``labels``, optional ``attention_mask``) through the
    pipeline; the detached mean loss, identical on every rank."""
    return pipeline.train_step(inputs["input_ids"], inputs["labels"], inputs.get("attention_mask")).detach()


def _pad_rows(tensor: torch.Tensor | None, rows: int, value) -> torch.Tensor | None:
    return None if tensor is None or rows == 0 else F.pad(tensor, (0, 0, 0, rows), value=value)


@torch.no_grad()
def pipeline_evaluation_sums(pipeline, batch: dict, tokenizer=None) -> torch.Tensor:
    """``float64 [nll_sum, token_count, byte_count]`` of ``batch`` over every DP replica (forward only)."""
    ids, labels, mask = batch["input_ids"], batch["labels"], batch.get("attention_mask")
    missing = -ids.shape[0] % pipeline.parallel.microbatches
    if missing:
        ids, labels = _pad_rows(ids, missing, 0), _pad_rows(labels, missing, IGNORE_INDEX)
        mask = _pad_rows(mask, missing, 1)
    nll, tokens = pipeline.eval_step(ids, labels, mask)
    size = torch.tensor(float(target_bytes(tokenizer, labels) if tokenizer is not None else 0), dtype=torch.float64)
    if pipeline.state.dp_group is not None:
        dist.all_reduce(size, group=pipeline.state.dp_group)
    return torch.stack([nll.double(), tokens.double(), size])


def on_one_process(model, run):
    """``run(single_device_model)`` on global rank 0, with the whole model gathered from every stage (canonical
    weights, as ``save_pretrained`` gathers them); its result broadcast to every rank. Collective."""
    from ..modeling_boost_llama import BoostLlamaForCausalLM
    from ..parallel.weights_io import canonical_state_dict

    state = model.pipeline.whole_state_dict(canonical_state_dict(model, model.plan.group))
    result = [None]
    if dist.get_rank() == 0:
        single = BoostLlamaForCausalLM(model.config)
        single.load_state_dict(state)
        result[0] = run(single)
    dist.broadcast_object_list(result, src=0)
    return result[0]


__all__ = ["PipelineReplica", "on_one_process", "pipeline_of", "pipeline_training_step", "pipeline_evaluation_sums"]
