"""Recomputation of decoder-layer steps (activation checkpointing).

Low-rank activation checkpointing (BOOST.md section 5) cuts every block into steps whose inputs are
r-dim latents (already reduced) and the residual. Each step is recomputed in backward from its saved
inputs; under BTP a step ends *before* its collective (the collective runs between steps and its
backward is the identity), so recomputation issues no collective. ``"full"`` checkpointing runs the
whole layer as one step and so re-runs its forward collectives in backward.

Steps run through ``torch.utils.checkpoint`` in its re-entrant form, which keeps exactly the step's
tensor inputs with ``save_for_backward`` (visible to ``saved_tensors_hooks``, so the memory tests and
benchmarks measure what is kept). Inputs and outputs may be nested (tuples, dicts of LaX latents,
``None``): they are flattened so that every tensor is a direct input or output of the checkpoint.
Context that needs no gradient (rotary tables, masks, caches) is bound into ``step`` instead.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint as torch_checkpoint

REENTRANT = partial(torch_checkpoint, use_reentrant=True)


def run_step(step: Callable[..., Any], *inputs: Any, recompute: bool, checkpoint: Callable[..., Any] = REENTRANT) -> Any:
    """``step(*inputs)``; with ``recompute`` (and autograd on) keep only the tensors of ``inputs`` and
    run ``step`` again in backward, through ``checkpoint(function, *tensors)`` (default: ``torch.utils.checkpoint``,
    re-entrant; transformers' ``_gradient_checkpointing_func`` is another)."""
    if not (recompute and torch.is_grad_enabled()):
        return step(*inputs)
    leaves, in_spec = pytree.tree_flatten(inputs)
    out_spec: list[pytree.TreeSpec] = []

    def flat_step(*flat):
        out_leaves, spec = pytree.tree_flatten(step(*pytree.tree_unflatten(list(flat), in_spec)))
        out_spec[:] = [spec]
        return tuple(out_leaves)

    outputs = checkpoint(flat_step, *leaves)
    return pytree.tree_unflatten(list(outputs), out_spec[0])


__all__ = ["run_step"]
