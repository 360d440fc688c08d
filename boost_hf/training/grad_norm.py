"""The true global gradient norm of a tensor-parallel model, and clipping by it.

A parameter flagged ``tensor_model_parallel`` (:mod:`boost_hf.parallel.sharding`) holds a different
shard on each TP rank: its squared norm is summed over the TP group. A replicated parameter (norms
that are not split, LaX gates, the final norm, ...) holds the same gradient on every TP rank and is
counted once. Gradients must already be averaged over the data-parallel group, so every rank of the
world gets the same norm and the same clipping factor. Under pipeline parallelism each pipeline rank holds
other parameters: the squared norms are then summed over the pipeline group as well.

Under FSDP2 (:mod:`boost_hf.parallel.fully_shard`) each gradient is a ``DTensor`` whose local tensor is this rank's
dim-0 shard of the TP-local gradient: the squared norms of the local shards are first summed over the mesh dimensions
the gradients are sharded on (the DP shard group; HSDP's replicas hold the same shards and are not summed), then as
above: the norm is the whole model's, over DP x TP x PP.

Communication: one all-reduce of a single fp32 scalar in the TP group (and one in the pipeline group); under FSDP2 one
more, of two, in the DP shard group.
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


def _fully_sharded_groups(grad: torch.Tensor) -> tuple:
    """The process groups ``grad`` (a ``DTensor``) is sharded over; ``()`` for a plain tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(grad, DTensor):
        return ()
    return tuple(grad.device_mesh.get_group(dim) for dim, placement in enumerate(grad.placements) if placement.is_shard())


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if hasattr(grad, "to_local") else grad


def global_grad_norm(
    parameters: Iterable[torch.Tensor], tp_group: dist.ProcessGroup | None, pp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """L2 norm of the gradients of the whole (unsharded) model, identical on every rank."""
    with_grad = [p for p in parameters if p.grad is not None]
    device = _local(with_grad[0].grad).device if with_grad else torch.device("cpu")
    over_tp = [bool(getattr(p, "tensor_model_parallel", False)) for p in with_grad]
    over_dp = [_fully_sharded_groups(p.grad) for p in with_grad]

    def squares(fully_sharded: bool) -> torch.Tensor:
        """[TP-sharded, TP-replicated] sums of squares of the (FSDP2-sharded or plain) gradients."""
        return torch.stack([_sum_of_squares([_local(p.grad) for p, tp, dp in zip(with_grad, over_tp, over_dp)
                                             if tp == split and bool(dp) == fully_sharded], device) for split in (True, False)])

    total = squares(False)
    dp_groups = next((groups for groups in over_dp if groups), ())  # FSDP2's gradients share one mesh
    if dp_groups:
        fully_sharded = squares(True)
        for group in dp_groups:
            dist.all_reduce(fully_sharded, group=group)
        total = total + fully_sharded
    sharded, replicated = total[0].clone(), total[1]
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
