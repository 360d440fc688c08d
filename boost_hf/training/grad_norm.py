"""The true global gradient norm of a tensor-parallel model, and clipping by it.

A parameter flagged ``tensor_model_parallel`` (:mod:`boost_hf.parallel.sharding`) holds a different
shard on each TP rank: its squared norm is summed over the TP group. A replicated parameter (norms
that are not split, LaX gates, the final norm, ...) holds the same gradient on every TP rank and is
counted once. Gradients must already be averaged over the data-parallel group, so every rank of the
world gets the same norm and the same clipping factor. Under pipeline parallelism each pipeline rank holds
other parameters: the squared norms are then summed over the pipeline group as well.

Communication: one all-reduce of a single fp32 scalar in the TP group (and one in the pipeline group).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.nn.utils import clip_grads_with_norm_


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum()


def global_grad_norm(
    parameters: Iterable[torch.Tensor], tp_group: dist.ProcessGroup | None, pp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """L2 norm of the gradients of the whole (unsharded) model, identical on every rank."""
    with_grad = [p for p in parameters if p.grad is not None]
    device = with_grad[0].grad.device if with_grad else torch.device("cpu")
    sharded = _sum_of_squares([p.grad for p in with_grad if getattr(p, "tensor_model_parallel", False)], device)
    replicated = _sum_of_squares([p.grad for p in with_grad if not getattr(p, "tensor_model_parallel", False)], device)
    if tp_group is not None:
        dist.all_reduce(sharded, group=tp_group)
    total = sharded + replicated
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, tp_group: dist.ProcessGroup | None, pp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Scale the gradients in place so that their global norm is at most ``max_norm``; return the norm before."""
    parameters = [p for p in parameters if p.grad is not None]
    total = global_grad_norm(parameters, tp_group, pp_group)
    if max_norm != float("inf") and parameters:
        clip_grads_with_norm_(parameters, max_norm, total)
    return total


__all__ = ["global_grad_norm", "clip_grad_norm_"]
