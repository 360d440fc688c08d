"""``--zero1_optimizer``: ZeRO-1 without DeepSpeed, the optimizer state sharded over the data-parallel group with
``torch.distributed.optim.ZeroRedundancyOptimizer``, at any layout (also under pipeline parallelism, where
DeepSpeed cannot run).

Each DP rank of one (pipeline rank, TP rank) keeps the optimizer state (AdamW's moments) of a share of that rank's
parameters (whole tensors, balanced by size: torch's partition) and updates them; after its step each rank
broadcasts its updated parameters over the DP group (the gradients were all-reduced over DP by DDP before, as
without ZeRO). The update of every parameter is the same AdamW arithmetic as without sharding; the Trainer's
gradient clipping (the global norm over PP x TP, from the full gradients every DP rank holds) and the learning-rate
scheduler (which sets the ``lr`` of the wrapper's parameter groups, copied to the local optimizer at each step)
run unchanged. Memory: a rank keeps about ``1/dp`` of its stage's optimizer state (whole tensors, so the split is
as even as their sizes allow); communication: each step adds one broadcast of every parameter over DP from its
owner.

Checkpoints are the same files as without ZeRO-1: before saving, every DP rank's share is consolidated on DP rank 0
(:meth:`~torch.distributed.optim.ZeroRedundancyOptimizer.consolidate_state_dict`: one object broadcast per DP rank
over the DP group), which writes the whole state dict of its (pipeline, TP) rank; so a run resumes with or without
``--zero1_optimizer`` and at any PP x TP x DP (:mod:`boost_hf.checkpoint.resume`), each rank keeping its share on load.
"""

from __future__ import annotations

from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer

from ..checkpoint.optimizer_state import sharded_over_data_parallel

ZERO1_WITH_DEEPSPEED = (
    "--zero1_optimizer shards the optimizer state with torch's ZeroRedundancyOptimizer, which DeepSpeed's engine "
    "(that owns the optimizer) cannot wrap: use either DeepSpeed's ZeRO (zero_optimization.stage 1-3 in --deepspeed, "
    "pp_size 1 only) or --zero1_optimizer without --deepspeed."
)
ZERO1_WITH_LORO = (
    "--zero1_optimizer with --lowrank_optimizer loro is not supported: ZeRO-1 gives whole parameters to different data-"
    "parallel ranks, and LORO's exact step needs both factors (B and A) of a projection in one optimizer. Use one of them."
)


class DataParallelShardedOptimizer(ZeroRedundancyOptimizer):
    """torch's ``ZeroRedundancyOptimizer`` whose ``state_dict()`` also answers before its first step or load, when
    no rank holds any state yet (the empty state dict: nothing to consolidate). accelerate asks for it when it
    wraps the optimizer (``AcceleratedOptimizer`` moves the state to the device); torch would raise. After a step or
    a load, ``state_dict()`` needs :meth:`consolidate_state_dict` first, as in torch; :meth:`consolidated_state_dict`
    does both."""

    def step(self, closure=None, **kwargs):
        self.holds_state = True
        return super().step(closure, **kwargs)

    def load_state_dict(self, state_dict) -> None:
        self.holds_state = True
        super().load_state_dict(state_dict)

    def state_dict(self):
        if not getattr(self, "holds_state", False) and not self._all_state_dicts:
            return Optimizer.state_dict(self)
        return super().state_dict()

    def consolidated_state_dict(self) -> dict | None:
        """Collective over the DP group: the whole state dict (torch's format, as the unsharded optimizer's) on DP
        rank 0, ``None`` on the others. The gathered shares are dropped afterwards (torch would keep them on DP
        rank 0 until the next consolidation: a second copy of the whole state)."""
        self.consolidate_state_dict(to=0)
        if self.rank != 0:
            return None
        state = self.state_dict()
        self._all_state_dicts = []
        return state


def zero1_class_and_kwargs(optimizer_cls, optimizer_kwargs: dict, dp_group) -> tuple[type, dict]:
    """``(DataParallelShardedOptimizer, kwargs)`` building ``optimizer_cls(params, **optimizer_kwargs)`` sharded over
    ``dp_group`` (for ``Trainer.optimizer_cls_and_kwargs``)."""
    return DataParallelShardedOptimizer, {"optimizer_class": optimizer_cls, "process_group": dp_group, **optimizer_kwargs}


__all__ = ["DataParallelShardedOptimizer", "zero1_class_and_kwargs", "sharded_over_data_parallel"]
