"""The LORO authors' learning-rate schedule: ``--scheduler cosine_restart`` of their ``run_c4.py`` (``mzf666/LORO-main``,
``peft_pretraining/training_utils.py``), written anew for ``--loro_schedule authors``.

Notation: ``s`` the index of the optimizer step (0 for the first; a ``LambdaLR`` is at ``s`` while that step runs),
``N`` the training steps, ``W`` the warm-up steps, ``F`` the steps between exact steps (their
``--cosine_restart_freq``, the same ``$freq`` as ``--loro_freq`` in every script), ``R`` the restart warm-up steps
(``--cosine_restart_warmup``, default 5), ``m`` the minimum ratio (``--min_lr_ratio``), ``a`` the shift (their
``--lr_adjust_steps``, ``-W`` in their 60m, 130m and 1b scripts, ``-6000`` with ``W = 2000`` in the 350m one) and
``floor = 1e-6``. With ``cos_(t) = m + (1 - m) (1 + cos(pi (t - W) / (N - W))) / 2`` and
``top = (1 + cos(pi (-a) / (N - W))) / 2`` the multiplier of the peak rate is

* warm-up, ``s < W``: ``m + s / W (top - m)``, a line from ``m`` (not 0) towards ``top`` (not 1, and not ``cos_`` at
  the end of warm-up either: ``top`` lacks the ``m + (1 - m)`` of ``cos_``, so the rate steps up by ``m (1 - top)``
  at ``s = W``); except in the ``R`` steps after each multiple of ``F`` (``s = q F + p``, ``q >= 1``, ``p < R``):
  ``floor + p / R (m + q F / W (top - m) - floor)``, a restart from ``floor`` back to the line;
* after, ``s >= W``, with ``t = s + a``: ``cos_(t)``, a cosine shifted by ``-a`` (its peak 1 at ``s = W - a``:
  ``2 W`` for ``a = -W``) that ends near ``cos_(N + a)`` (0.127 for ``a = -W`` and ``W = N / 10``); except in the
  ``R`` steps after each multiple of ``F`` **of t** (``t = q F + p``, ``q >= 1``, ``p < R``):
  ``floor + p / R (cos_(q F) - floor)``. ``q = 0`` and ``q < 0`` do not restart: the step after the exact step that
  ends at ``t = 0`` runs at the full ``cos_(0)`` (for ``a = -W`` that is ``s = W``, where the exact step coincides
  with the end of warm-up), as do those after the exact steps with ``t < 0`` (``W <= s < -a``: the 350m script's
  steps 2000 to 6000). ``t`` and ``s`` are multiples of ``F`` together only when ``a`` is (every script);
  otherwise the restarts after warm-up fall between exact steps.

An exact step runs at 0-based ``s = k F - 1`` (their ``(update_step + 1) % loro_freq == 0``); a restart's first
step, at the floor, is the one after it.

Their ``max(1, .)`` guards are kept (``W = 0``: no warm-up; ``R = 0``: no restart). Their loop's extra
``scheduler.step()`` when the rate is exactly 0 never fires with ``m > 0``, and is not reproduced.
"""

from __future__ import annotations

import math

from torch.optim.lr_scheduler import LambdaLR

from .loro import RESTART_FLOOR


def check_authors_schedule(*, training_steps: int, warmup_steps: int, restart_every: int, restart_warmup_steps: int,
                           min_ratio: float, shift: int) -> None:
    """Raise ``ValueError`` naming the setting for what their code asserts against (``0 < m <= 1``, ``F > 0``,
    ``a + W < N``) and for a negative warm-up."""
    if not 0 < min_ratio <= 1:
        raise ValueError(f"the LORO authors' schedule needs a minimum ratio in (0, 1] (lr_scheduler_kwargs min_lr_rate), got {min_ratio}.")
    if restart_every < 1:
        raise ValueError(f"the LORO authors' schedule restarts every loro_exact_every steps, which must be >= 1, got {restart_every}.")
    if warmup_steps < 0 or restart_warmup_steps < 0:
        raise ValueError(f"warm-up steps must be >= 0, got warmup_steps={warmup_steps}, loro_restart_warmup_steps={restart_warmup_steps}.")
    if shift + warmup_steps >= training_steps:
        raise ValueError(
            f"loro_schedule_shift ({shift}) + warm-up steps ({warmup_steps}) must be below the training steps ({training_steps}): "
            "the LORO authors' schedule asserts it (their lr_adjust_steps + warmup_steps < num_training_steps)."
        )


def authors_multiplier(step: int, *, training_steps: int, warmup_steps: int, restart_every: int, restart_warmup_steps: int,
                       min_ratio: float, shift: int, floor: float = RESTART_FLOOR) -> float:
    """The multiplier of the peak learning rate at optimizer step ``step`` (0-based) of the LORO authors'
    ``cosine_restart`` schedule (module docstring: ``N = training_steps``, ``W = warmup_steps``, ``F = restart_every``,
    ``R = restart_warmup_steps``, ``m = min_ratio``, ``a = shift``)."""
    decay_steps = max(1, training_steps - warmup_steps)

    def restarted(position: int, target: float) -> float:
        return floor + position / max(1, restart_warmup_steps) * (target - floor)

    if step < warmup_steps:
        top = 0.5 * (1.0 + math.cos(math.pi * -shift / decay_steps))
        period, position = divmod(step, restart_every)
        if period != 0 and position < restart_warmup_steps:
            return restarted(position, min_ratio + period * restart_every / max(1, warmup_steps) * (top - min_ratio))
        return min_ratio + step / max(1, warmup_steps) * (top - min_ratio)

    def cosine(t: int) -> float:
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * (t - warmup_steps) / decay_steps))

    shifted = step + shift
    period, position = divmod(shifted, restart_every)
    if period > 0 and position < restart_warmup_steps:
        return restarted(position, cosine(period * restart_every))
    return cosine(shifted)


def authors_schedule(optimizer, *, training_steps: int, warmup_steps: int, restart_every: int, restart_warmup_steps: int,
                     min_ratio: float, shift: int | None = None) -> LambdaLR:
    """A ``LambdaLR`` over every param group of ``optimizer`` following :func:`authors_multiplier` (``shift`` default
    ``-warmup_steps``). Checks the settings first (:func:`check_authors_schedule`). Like every ``LambdaLR``, its state
    dict holds the step count, not the function: build the same schedule before loading it."""
    shift = -warmup_steps if shift is None else shift
    settings = dict(training_steps=training_steps, warmup_steps=warmup_steps, restart_every=restart_every,
                    restart_warmup_steps=restart_warmup_steps, min_ratio=min_ratio, shift=shift)
    check_authors_schedule(**settings)
    return LambdaLR(optimizer, lambda step: authors_multiplier(step, **settings))


def authors_schedule_shift(args, training_steps: int) -> int:
    """``loro_schedule_shift`` of training arguments ``args``, by default minus the warm-up steps (the authors' 60m,
    130m and 1b scripts)."""
    return -args.get_warmup_steps(training_steps) if args.loro_schedule_shift is None else args.loro_schedule_shift


def schedule_of_arguments(args, optimizer, training_steps: int) -> LambdaLR:
    """The LORO authors' schedule as training arguments ``args`` set it (``--loro_schedule authors``)."""
    return authors_schedule(optimizer, training_steps=training_steps, warmup_steps=args.get_warmup_steps(training_steps),
                            restart_every=args.loro_exact_every, restart_warmup_steps=args.loro_restart_warmup_steps,
                            min_ratio=args.lr_scheduler_kwargs["min_lr_rate"], shift=authors_schedule_shift(args, training_steps))


__all__ = ["authors_multiplier", "authors_schedule", "authors_schedule_shift", "check_authors_schedule", "schedule_of_arguments"]
