"""The steps of the pipeline engine (:class:`~boost_hf.training.engine.PipelineEngine`), which runs the model's
:class:`~boost_hf.parallel.pipeline.Pipeline` (whose stages live on several ranks) instead of calling the model.

* a training step: the schedule over the batch's micro-batches; the token-weighted mean loss over every DP replica's
  batch (the same on every rank);
* evaluation: ``[nll sum, tokens, bytes]`` of each batch, already summed over DP; a batch that does not split into
  the micro-batches is padded with fully ignored rows (exact: they add nothing); ``compute_metrics``' logits where
  they live (the last stage's ranks), what those ranks computed from them sent to every rank
  (:func:`last_stage_logits`, :func:`from_last_stage`);
* :func:`boundary_bytes_per_step`: the point-to-point bytes this rank sends in one training step;
* :func:`pipeline_greedy_generate`: the end-of-training sample, generated through the pipeline (no rank holds
  more than its stages).

Each stage (:class:`~boost_hf.parallel.pipeline.PipelineChunk`) is a part :func:`~boost_hf.parallel.parts.prepare_part`
prepares (compile, the precision policy's autocast, DDP over the DP group), as the pipeline builds its stages.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..evaluation import target_bytes
from ..parallel.cross_entropy import IGNORE_INDEX
from ..parallel.pipeline import stage_ranks
from ..perf.comm_formula import stage_boundary_communication


class PipelineReplica(nn.Module):
    """What the Trainer holds as its wrapped model under pipeline parallelism: the model (``module``) as it is.
    Accelerate must not wrap it in DDP over the whole world (each rank holds other stages); each stage is wrapped in
    DDP over the DP group (:func:`~boost_hf.training.engine.prepare_part`). Calling it raises: steps run through the
    pipeline."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.module = model

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipelined model runs through model.pipeline (train_step / eval_step), not by calling it")


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


@contextlib.contextmanager
def last_stage_logits(pipeline):
    """Yield a list that collects the logits of every micro-batch the last stage runs while the context is open,
    in micro-batch order: vocab-parallel ``[mb, S, V/tp]`` (the last stage's output, before the loss), on the last
    stage's ranks; elsewhere yield ``None`` (nothing to collect). A forward hook on the last stage's chunk."""
    last = next((chunk for chunk in pipeline.chunks if chunk.is_last), None)
    if last is None:
        yield None
        return
    collected: list[torch.Tensor] = []
    handle = last.register_forward_hook(lambda module, args, output: collected.append(output.detach()))
    try:
        yield collected
    finally:
        handle.remove()


def from_last_stage(pipeline, value):
    """``value`` as the last stage's rank of this rank's pipeline (same ``dp``, ``tp``) holds it, on every rank of
    the pipeline (a picklable object; one ``broadcast_object_list`` over the PP group)."""
    holder = [value]
    source = dist.get_global_rank(pipeline.state.pp_group, stage_ranks(pipeline.parallel)[-1])
    dist.broadcast_object_list(holder, src=source, group=pipeline.state.pp_group)
    return holder[0]


def boundary_bytes_per_step(pipeline, batch_shape: tuple[int, int]) -> int:
    """Bytes this rank sends to its pipeline neighbours in one training step of a ``[B, S]`` batch: per
    micro-batch, each of its stages sends its output forward (all but the last stage) and the gradient of its
    input backward (all but the first), each crossing the tensors of
    :func:`~boost_hf.perf.comm_formula.stage_boundary_communication` in the pipeline's boundary dtype (it receives
    the same amount)."""
    parallel, last = pipeline.parallel, pipeline.placement.num_stages - 1
    rows, seq = batch_shape
    crossing = stage_boundary_communication(pipeline.model.config, parallel, rows // parallel.microbatches * seq)
    crossings = sum(int(stage > 0) + int(stage < last) for stage in pipeline.placement.stages) * parallel.microbatches
    return crossings * crossing.bytes(pipeline.boundary_dtype.itemsize)


@torch.no_grad()
def pipeline_greedy_generate(pipeline, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None) -> torch.Tensor:
    """Greedy continuation of ``input_ids [1, S]`` through the pipeline, as ``generate(do_sample=False)`` of the
    single-device model gives it; collective (every rank of the pipeline calls it), the ids on every rank.

    Each new token is the argmax of the last position's logits of a forward of the whole sequence (no KV cache)
    through the stages (:meth:`~boost_hf.parallel.pipeline.Pipeline.eval_step` on the sequence repeated once per
    micro-batch): the last stage's vocab-parallel logits of that position are gathered over TP, and the token is
    broadcast over the PP group (:func:`from_last_stage`). Stops after ``eos_token_id``."""
    ids = input_ids
    rows = pipeline.parallel.microbatches
    for _ in range(max_new_tokens):
        batch = ids.expand(rows, -1).contiguous()
        with last_stage_logits(pipeline) as outputs:
            pipeline.eval_step(batch, torch.full_like(batch, IGNORE_INDEX))
            token = None if outputs is None else int(pipeline.model.lm_head.gather_logits(outputs[0][:1, -1:])[0, -1].argmax())
        token = from_last_stage(pipeline, token)
        ids = torch.cat([ids, ids.new_tensor([[token]])], dim=-1)
        if token == eos_token_id:
            break
    return ids


__all__ = [
    "PipelineReplica",
    "boundary_bytes_per_step",
    "from_last_stage",
    "last_stage_logits",
    "pipeline_evaluation_sums",
    "pipeline_greedy_generate",
]
