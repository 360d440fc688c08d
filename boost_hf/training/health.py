"""Numerical health of training steps: a non-finite loss or gradient norm is detected on every step.

Detection costs no collective of its own. A micro-batch whose loss is not finite gets a NaN factor
(:func:`poison_nonfinite_loss`), so its gradients are NaN; gradients are averaged over the data-parallel group
and the gradient norm is reduced over the tensor-parallel group (:mod:`boost_hf.training.grad_norm`), so every
rank sees the same non-finite norm at the same step and takes the same decision. With a finite loss the factor
is exactly 1.0: gradients are bit-identical.

Policies (``--nonfinite``): ``stop`` raises :class:`NonFiniteError` naming the step and the last complete
checkpoint (nothing is saved after it); ``skip_step`` drops the step's gradients so the optimizer does not
apply it (moments and weights unchanged; the learning-rate schedule still advances) and counts the skipped
steps in the logs (``nonfinite_skipped_steps``); after ``--nonfinite_max_consecutive_skips`` consecutive skipped
steps (default 10; 0: never) the run has diverged and stops with the same :class:`NonFiniteError`. A logging
window with a non-finite micro-batch loss logs ``loss: nan`` (the Trainer would average it away).
"""

from __future__ import annotations

import math

import torch

NONFINITE_POLICIES = ("stop", "skip_step")


class NonFiniteError(FloatingPointError):
    """Training produced a non-finite loss or gradient norm under ``--nonfinite stop``."""


def poison_nonfinite_loss(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` times 1.0, or times NaN if it is not finite (so that its gradients are NaN). No host sync."""
    finite = torch.isfinite(loss.detach())
    return loss * torch.where(finite, torch.ones_like(loss), torch.full_like(loss, float("nan")))


def is_finite(value) -> bool:
    """Whether a gradient norm (tensor or float) is finite."""
    return math.isfinite(float(value))


def nonfinite_error(step: int, grad_norm, last_checkpoint: str | None, consecutive_skips: int = 0) -> NonFiniteError:
    """The error of ``--nonfinite stop`` at optimizer step ``step`` (1-based), or of ``skip_step`` after
    ``consecutive_skips`` skipped steps in a row."""
    resume = (
        f"the last complete checkpoint is {last_checkpoint!r} (resume with --resume_from_checkpoint {last_checkpoint})"
        if last_checkpoint
        else "no checkpoint was saved before it"
    )
    what = f"non-finite loss or gradient norm ({float(grad_norm)}) at step {step}"
    if consecutive_skips:
        what = (f"{what}: {consecutive_skips} steps in a row skipped by --nonfinite skip_step "
                f"(--nonfinite_max_consecutive_skips {consecutive_skips}), the run has diverged")
        advice = "Lower the learning rate or raise the warm-up, or check the data."
    else:
        advice = "Lower the learning rate or raise the warm-up, check the data, or pass --nonfinite skip_step to skip such steps."
    return NonFiniteError(f"{what}: training stopped and nothing was saved after it; {resume}. {advice}")


class NonfiniteSteps:
    """What each step's gradient norm decides (``--nonfinite``, ``--nonfinite_max_consecutive_skips`` of ``args``);
    ``skipped``: the steps skipped so far (logged as ``nonfinite_skipped_steps``)."""

    def __init__(self, args):
        self.policy = getattr(args, "nonfinite", "stop")
        self.max_consecutive = getattr(args, "nonfinite_max_consecutive_skips", 0)
        self.skipped = self.consecutive = 0

    def check(self, grad_norm, step: int, optimizer, last_checkpoint) -> None:
        """After optimizer step ``step``'s gradients (1-based): a non-finite ``grad_norm`` raises under ``stop`` (naming
        ``last_checkpoint()``) or drops the gradients (``optimizer.zero_grad``: torch optimizers skip a parameter
        without one) under ``skip_step``, raising after too many skips in a row."""
        if is_finite(grad_norm):
            self.consecutive = 0
            return
        if self.policy == "stop":
            raise nonfinite_error(step, grad_norm, last_checkpoint())
        optimizer.zero_grad(set_to_none=True)
        self.skipped += 1
        self.consecutive += 1
        if self.max_consecutive and self.consecutive >= self.max_consecutive:
            raise nonfinite_error(step, grad_norm, last_checkpoint(), consecutive_skips=self.consecutive)


__all__ = ["NONFINITE_POLICIES", "NonFiniteError", "NonfiniteSteps", "poison_nonfinite_loss", "is_finite", "nonfinite_error"]
