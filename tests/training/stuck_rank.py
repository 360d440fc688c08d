"""``torchrun --nproc-per-node 2 tests/training/stuck_rank.py RECIPE.yaml [ARGS]``: ``recipes/pretrain.py`` in which
rank 1, before step 3, gets stuck outside any collective while staying alive (it sleeps for an hour; its hang
watchdog thread keeps beating), as a rank blocked on I/O or in a deadlock would."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
import pretrain  # noqa: E402

from boost_hf.training import BoostTrainer  # noqa: E402

STUCK_BEFORE_STEP = 3
_training_step = BoostTrainer.training_step


def training_step(self, model, inputs, *args, **kwargs):
    if dist.get_rank() == 1 and self.state.global_step + 1 == STUCK_BEFORE_STEP:
        print(f"rank 1 is stuck before step {STUCK_BEFORE_STEP}", flush=True)
        time.sleep(3600)
    return _training_step(self, model, inputs, *args, **kwargs)


BoostTrainer.training_step = training_step

if __name__ == "__main__":
    pretrain.main(sys.argv[1:])
