"""The software stack training needs, checked when the training arguments are built.

The core install (torch >= 2.11, transformers >= 5.17) loads and runs models, their tensor and pipeline parallelism
and the performance model. Training adds the ``[train]`` extra, whose transformers and torch floors are higher: the
trainer overrides private ``transformers.Trainer`` methods, reviewed against transformers 5.23 (their hashes are
recorded in ``tests/training/test_reliability.py``), and its runs are tested on torch 2.13 only (on torch 2.11 the
pipeline engine refuses a stage input that gets no gradient, where 2.13 skips it).
"""

from __future__ import annotations

import torch
import transformers
from packaging.version import Version

#: package -> (the lowest version training is tested on, the installed version)
TRAINING_FLOORS = {"transformers": "5.23", "torch": "2.13"}


def check_training_stack() -> None:
    """Refuse, naming the fix, a torch or transformers older than training is tested on."""
    installed = {"transformers": transformers.__version__, "torch": torch.__version__}
    old = {name: installed[name] for name, floor in TRAINING_FLOORS.items() if Version(installed[name]).release < Version(floor).release}
    if old:
        found = ", ".join(f"{name} {version}" for name, version in old.items())
        needed = ", ".join(f"{name}>={TRAINING_FLOORS[name]}" for name in old)
        raise RuntimeError(
            f"Training with boost-hf needs {needed}; this environment has {found}. Install the training extra "
            f"(pip install 'boost-hf[train]', which asks for {', '.join(f'{n}>={v}' for n, v in TRAINING_FLOORS.items())}). "
            "The core install (models, tensor and pipeline parallelism, plan and estimate) works from torch 2.11 and "
            "transformers 5.17."
        )


__all__ = ["TRAINING_FLOORS", "check_training_stack"]
