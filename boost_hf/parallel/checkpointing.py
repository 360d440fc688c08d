"""Activation checkpointing of decoder-layer segments.

Low-rank activation checkpointing (BOOST.md section 5) cuts every block into segments whose only
inputs are r-dim latents (already all-reduced, replicated) and the sharded residual. Each segment is
recomputed in backward from its saved inputs; since under BTP a segment ends *before* its collective
(the collective runs outside, between segments, and its backward is the identity), recomputation
issues no collective. ``"full"`` checkpointing runs the whole layer as one segment and so re-runs
its forward collectives in backward.

Segments run through ``torch.utils.checkpoint`` in its re-entrant form, which saves exactly the
segment's tensor inputs with ``save_for_backward`` (visible to ``saved_tensors_hooks``, so the memory
benchmark and tests can measure what is kept).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint


def run_segment(fn: Callable[..., tuple[torch.Tensor, ...]], *tensors: torch.Tensor, recompute: bool) -> tuple[torch.Tensor, ...]:
    """``fn(*tensors)``; with ``recompute`` (and autograd on) keep only ``tensors`` and recompute in backward."""
    if recompute and torch.is_grad_enabled():
        return checkpoint(fn, *tensors, use_reentrant=True)
    return fn(*tensors)


__all__ = ["run_segment"]
