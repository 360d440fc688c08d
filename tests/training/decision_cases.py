"""Run on 2 gloo ranks by ``test_decisions.py``: each rank sees its own listing of the run folder (rank 1's is stale,
as a shared file system's may be); the decisions are rank 0's on both."""

from __future__ import annotations

import os

import torch.distributed as dist


def stale_listings(run_dir: str) -> dict:
    from boost_hf.checkpoint import decisions, lineage
    from boost_hf.checkpoint import folders as checkpoint

    rank = dist.get_rank()
    if rank == 1:  # a stale listing: the newest checkpoint is not there yet
        def stale(run, skipped=None):
            return [os.path.join(run, "checkpoint-2")] if os.path.isdir(run) else []

        checkpoint.completed_checkpoints = stale
        lineage.last_checkpoint = lambda run: stale(run)[-1]
    outcome = {"last": decisions.resume_checkpoint(run_dir, True), "auto": decisions.resume_checkpoint(run_dir, "auto"),
               "complete": decisions.checkpoint_is_complete(os.path.join(run_dir, "checkpoint-4"))}
    try:
        decisions.resume_checkpoint(os.path.join(run_dir, "empty"), "last")
    except FileNotFoundError as error:
        outcome["error"] = str(error)
    return outcome
