"""The software stack training needs, checked before anything of it is imported and when a trainer is built.

The core install (torch >= 2.11, transformers >= 5.17) loads and runs models, their tensor and pipeline parallelism
and the performance model. Training adds the ``[train]`` extra: datasets, evaluate and DeepSpeed, and a torch and
transformers range of exactly the releases training is tested on (``make test``'s pinned leg). The range is narrow
because the trainer depends on what is private:

* ``BoostTrainer`` overrides eight private ``transformers.Trainer`` methods (:data:`REVIEWED_TRAINER_INTERNALS`:
  the checkpoint save and load, the gradient clipping and norm, model wrapping, the token count), each reviewed
  against the source of the release named there. :func:`check_trainer_internals` compares their source with the
  reviewed one when a trainer is built, so a release that changes one is refused naming the methods, never run
  silently.
* FSDP2's communication counters wrap torch's private ``_fsdp_collectives`` while they count; the pipeline engine
  relies on ``torch.distributed.pipelining``'s behaviour for a stage input without a gradient (torch 2.11 refuses it).

:func:`check_training_stack` runs first in every training module that imports the extra's packages (and when the
training arguments are built): a core-only install, or a torch or transformers outside the range, is told which
install fixes it instead of failing on an import.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os

import torch
import transformers
from packaging.version import Version

#: package -> (the lowest release training is tested on, the first release it is not): the [train] extra's range
TRAINING_RANGE = {"transformers": ("5.24", "5.25"), "torch": ("2.14.1", "2.15")}
#: the [train] extra's packages that training imports (the module name of each)
TRAINING_PACKAGES = ("datasets", "evaluate")

REVIEWED_TRANSFORMERS = "5.24.0"
#: transformers.Trainer's private methods BoostTrainer overrides -> SHA-256[:16] of their source in REVIEWED_TRANSFORMERS
REVIEWED_TRAINER_INTERNALS = {
    "_clip_grad_norm": "ebfa9dc91d3088ab",
    "_get_grad_norm": "913ba6f52f074d10",
    "_load_from_checkpoint": "a2804e8d93a297e3",
    "_load_optimizer_and_scheduler": "741032f57d6fb802",
    "_save_checkpoint": "a9111e30faa99339",
    "_save_optimizer_and_scheduler": "c5ef974db69ab993",
    "_track_num_input_tokens": "090592fb6618b957",
    "_wrap_model": "317173a8bd8960fc",
}
ALLOW_UNREVIEWED_ENV = "BOOST_HF_ALLOW_UNREVIEWED_TRAINER"


class TrainingStackError(RuntimeError):
    """The installed packages are not the stack training is tested on; the message names the install that fixes it."""


def _install_fix() -> str:
    wanted = ", ".join(f"{name}>={low},<{high}" for name, (low, high) in TRAINING_RANGE.items())
    return f"Install the training extra: pip install 'boost-hf[train]' (which asks for {wanted} and {', '.join(TRAINING_PACKAGES)})."


def check_training_stack() -> None:
    """Refuse, naming the fix, an environment training is not tested on: a torch or transformers outside
    :data:`TRAINING_RANGE`, or a package of the ``[train]`` extra missing. Imports none of them."""
    installed = {"transformers": transformers.__version__, "torch": torch.__version__}
    outside = {name: installed[name] for name, (low, high) in TRAINING_RANGE.items()
               if not Version(low).release <= Version(installed[name]).release < Version(high).release}
    missing = [name for name in TRAINING_PACKAGES if importlib.util.find_spec(name) is None]
    if not outside and not missing:
        return
    found = [f"{name} {version} (training is tested on >={TRAINING_RANGE[name][0]},<{TRAINING_RANGE[name][1]})"
             for name, version in outside.items()]
    found += [f"no {name}" for name in missing]
    raise TrainingStackError(
        f"Training with boost-hf needs the [train] extra; this environment has {'; '.join(found)}. {_install_fix()} "
        "The core install (models, tensor and pipeline parallelism, plan and estimate) works from torch 2.11 and "
        "transformers 5.17."
    )


def unreviewed_trainer_internals(trainer_class=None) -> list[str]:
    """The private ``Trainer`` methods in :data:`REVIEWED_TRAINER_INTERNALS` whose source differs from the reviewed
    release's (or that are gone)."""
    trainer_class = trainer_class or transformers.Trainer
    changed = []
    for name, digest in REVIEWED_TRAINER_INTERNALS.items():
        method = getattr(trainer_class, name, None)
        source = inspect.getsource(method) if method is not None else ""
        if hashlib.sha256(source.encode()).hexdigest()[:16] != digest:
            changed.append(name)
    return changed


def check_trainer_internals() -> None:
    """Refuse a transformers whose ``Trainer`` changed a private method ``BoostTrainer`` overrides (training would
    change without a word); ``BOOST_HF_ALLOW_UNREVIEWED_TRAINER=1`` runs anyway, on the user's word."""
    changed = unreviewed_trainer_internals()
    if changed and os.environ.get(ALLOW_UNREVIEWED_ENV) != "1":
        raise TrainingStackError(
            f"transformers {transformers.__version__} changed Trainer methods that BoostTrainer overrides ({', '.join(changed)}), "
            f"reviewed against transformers {REVIEWED_TRANSFORMERS}: training could differ without a word. {_install_fix()} "
            f"To run anyway at your own risk, set {ALLOW_UNREVIEWED_ENV}=1."
        )


__all__ = ["TrainingStackError", "TRAINING_RANGE", "TRAINING_PACKAGES", "REVIEWED_TRAINER_INTERNALS", "REVIEWED_TRANSFORMERS",
           "check_training_stack", "check_trainer_internals", "unreviewed_trainer_internals"]
