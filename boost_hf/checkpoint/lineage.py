"""The lineage of a run: which checkpoints of ``output_dir`` a resume continues, recorded where ``last`` reads it.

A run resumed from an older checkpoint (the usual recovery from a loss spike: checkpoints 800, 900, 1000, resumed
from 800) continues another lineage than the one that wrote 900 and 1000. As Megatron's
``latest_checkpointed_iteration.txt``, global rank 0 records the checkpoint each save commits in
``<output_dir>/last_checkpoint.json`` (``{"checkpoint": "checkpoint-850", "step": 850}``, replaced atomically, before
the checkpoint's folder takes its name: a save killed between the two leaves a record naming a folder that is not
there, and ``last`` takes the newest complete checkpoint before it). ``--resume_from_checkpoint last`` / ``auto``
read it (:func:`~boost_hf.checkpoint.resume_point.last_checkpoint`). Resuming a checkpoint moves the checkpoints of later steps out of the lineage
(:func:`set_aside_later_checkpoints`): each is renamed ``abandoned-checkpoint-<step>``, kept as it was (never deleted
without the user's word) and named in a warning, and so is that lineage's end, ``final/`` and its
``trainer_state.json`` (``abandoned-final``), when it ended past the resumed step. So the ``checkpoint-<step>``
folders are the lineage's, and the rotation of ``--save_total_limit``
(:func:`~boost_hf.training.checkpointing.save_checkpoint`) deletes the lineage's oldest steps, by step, never by
modification time. An output folder without the record (written by an earlier boost-hf version) resumes its newest
complete checkpoint, as before, with a warning saying so.
"""

from __future__ import annotations

import json
import logging
import os
import re

from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

logger = logging.getLogger(__name__)

RECORD_NAME = "last_checkpoint.json"
ABANDONED_PREFIX = "abandoned-"
"""A checkpoint set aside as another lineage's: ``abandoned-checkpoint-<step>`` (not matched by ``checkpoint-*``)."""
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_ABANDONED = re.compile(rf"^{ABANDONED_PREFIX}({PREFIX_CHECKPOINT_DIR}-\d+|final|trainer_state)(-\d+)?(\.json)?$")


def checkpoint_step(folder: str) -> int | None:
    """The step in the name of a ``checkpoint-<step>`` folder, else ``None``."""
    match = _CHECKPOINT.match(os.path.basename(os.path.normpath(folder)))
    return int(match.group(1)) if match else None


def is_abandoned(name: str) -> bool:
    """Whether ``name`` is a checkpoint (or ``final/``, ``trainer_state.json``) set aside by
    :func:`set_aside_later_checkpoints`."""
    return bool(_ABANDONED.match(name))


def record_checkpoint(run_dir: str, checkpoint: str) -> None:
    """Record ``checkpoint`` (a ``checkpoint-<step>`` folder of ``run_dir``) as the lineage's last, atomically (a
    temporary file renamed over the record). Global rank 0 only."""
    name = os.path.basename(os.path.normpath(checkpoint))
    staging = os.path.join(run_dir, f".{RECORD_NAME}.tmp-{os.getpid()}")  # a killed run's: removed with its staging folders
    with open(staging, "w") as f:
        json.dump({"checkpoint": name, "step": checkpoint_step(name)}, f)
    os.replace(staging, os.path.join(run_dir, RECORD_NAME))


def recorded_checkpoint(run_dir: str) -> str | None:
    """The checkpoint ``run_dir``'s record names (a path; the folder may be missing: a save killed before its rename),
    or ``None`` without a record. A damaged record is a ``ValueError`` naming it."""
    path = os.path.join(run_dir, RECORD_NAME)
    try:
        with open(path) as f:
            record = json.load(f)
        name = record["checkpoint"]
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path} is damaged ({type(error).__name__}: {error}): it should name the run's last checkpoint, "
                         f'as {{"checkpoint": "checkpoint-850", "step": 850}}. Write it so, or delete it to resume the newest '
                         "complete checkpoint of the folder.") from None
    if checkpoint_step(name) is None:
        raise ValueError(f"{path} names {name!r}, not a checkpoint-<step> folder: write the run's last checkpoint there, or "
                         "delete it to resume the newest complete checkpoint of the folder.")
    return os.path.join(run_dir, name)


def finished_step(run_dir: str) -> int | None:
    """The step the run in ``run_dir`` ended at: the ``global_step`` of the ``trainer_state.json`` it writes at its end,
    before ``final/`` (``None``: none, or unreadable)."""
    try:
        with open(os.path.join(run_dir, TRAINER_STATE_NAME)) as f:
            return int(json.load(f)["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def set_aside_later_checkpoints(run_dir: str, resumed: str, step: int) -> list[str]:
    """Resuming ``resumed`` (saved at ``step``) into ``run_dir``: rename each ``checkpoint-<s>`` of ``run_dir`` with
    ``s > step`` (another lineage's) to ``abandoned-checkpoint-<s>`` (``-<n>`` added if that name is taken), and the
    end of that lineage, ``final/`` and the ``trainer_state.json`` beside it, if that run ended past ``step``
    (:func:`finished_step`); say so, and record ``resumed`` as the lineage's last if it is a checkpoint of
    ``run_dir``. Return the renames. Global rank 0 only, holding the output folder's lock."""
    if not os.path.isdir(run_dir):
        return []
    inside = os.path.dirname(os.path.abspath(resumed)) == os.path.abspath(run_dir) and checkpoint_step(resumed) is not None
    if inside:  # first: a kill while renaming leaves the record, and what is above it is set aside again
        record_checkpoint(run_dir, resumed)
    steps = {name: checkpoint_step(name) for name in os.listdir(run_dir)}
    later = sorted((name for name, s in steps.items() if s is not None and s > step), key=steps.get)
    if (finished_step(run_dir) or 0) > step:
        later += [name for name in ("final", TRAINER_STATE_NAME) if os.path.exists(os.path.join(run_dir, name))]
    moved = []
    for name in later:
        target, n = ABANDONED_PREFIX + name, 1
        while os.path.exists(os.path.join(run_dir, target)):
            n += 1
            stem, dot, suffix = name.partition(".")
            target = f"{ABANDONED_PREFIX}{stem}-{n}{dot}{suffix}"
        os.rename(os.path.join(run_dir, name), os.path.join(run_dir, target))
        moved.append(f"{name} -> {target}")
    if moved:
        logger.warning("resuming %s sets aside the checkpoints of later steps (another lineage of this run): %s. They are "
                       "kept as they are; delete them when they are no longer wanted, or move one back under its name to "
                       "resume it.", resumed, ", ".join(moved))
    return moved


__all__ = [
    "ABANDONED_PREFIX",
    "RECORD_NAME",
    "checkpoint_step",
    "finished_step",
    "is_abandoned",
    "record_checkpoint",
    "recorded_checkpoint",
    "set_aside_later_checkpoints",
]
