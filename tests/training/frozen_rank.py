"""``torchrun --nproc-per-node 2 tests/training/frozen_rank.py PHASE RECIPE.yaml [ARGS]``: ``recipes/pretrain.py`` in which
rank 1 stops itself (SIGSTOP, as a frozen process or a hung machine) at the start of PHASE: ``start-up`` (before its
watchdog starts: it never beats, as a rank frozen while importing), ``process-group`` (just before
``init_process_group``) or ``datasets`` (entering ``build_datasets``)."""

from __future__ import annotations

import os
import signal
import sys

import torch.distributed as dist

from boost_hf.training import pretrain


def freezing(function, phase: str):
    def frozen_on_rank_1(*args, **kwargs):
        if os.environ["RANK"] == "1":
            print(f"rank 1 stops itself during {phase}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        return function(*args, **kwargs)

    return frozen_on_rank_1


if __name__ == "__main__":
    phase, argv = sys.argv[1], sys.argv[2:]
    if phase == "start-up":
        freezing(lambda: None, phase)()
    elif phase == "process-group":
        dist.init_process_group = freezing(dist.init_process_group, phase)
    else:
        pretrain.build_datasets = freezing(pretrain.build_datasets, phase)
    pretrain.main(argv)
