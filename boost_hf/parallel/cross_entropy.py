"""Vocab-parallel causal-LM cross-entropy: the full ``[N, V]`` logits are never materialised."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..modeling_boost_llama import IGNORE_INDEX
from .primitives import ProcessGroup, all_reduce_max_, group_rank, reduce_from_tp


def vocab_parallel_causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    vocab_size: int | None = None,
    *,
    group: ProcessGroup | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    shift_labels: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """Next-token cross-entropy from this rank's logits ``[B, S, V/p]`` (vocab range
    ``[rank V/p, (rank+1) V/p)``), with the arguments of ``transformers``' ``ForCausalLMLoss``: unshifted
    ``labels [B, S]`` (position t predicts ``labels[t+1]``) or already-shifted ``shift_labels``;
    ``ignore_index`` is skipped; the sum is divided by ``num_items_in_batch`` when given (gradient
    accumulation), else averaged over the targets.

    Communication (forward only): all-reduce-max of ``N`` fp32 values, then one all-reduce of the
    ``[N, 2]`` (sum of exponentials, target logit).
    """
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(logits.device)
    logits = logits.reshape(-1, logits.shape[-1]).float()
    vocab_local = logits.shape[-1]
    with torch.no_grad():
        maxima = all_reduce_max_(logits.max(dim=-1).values, group)
    shifted = logits - maxima.unsqueeze(-1)
    local_targets = targets - group_rank(group) * vocab_local
    here = (local_targets >= 0) & (local_targets < vocab_local)
    picked = shifted.gather(1, local_targets.clamp(0, vocab_local - 1).unsqueeze(1)).squeeze(1) * here
    stats = reduce_from_tp(torch.stack([shifted.exp().sum(dim=-1), picked], dim=-1), group)
    per_token = torch.log(stats[:, 0]) - stats[:, 1]
    valid = targets != ignore_index
    total = (per_token * valid).sum()
    if num_items_in_batch is None:
        return total / valid.sum().clamp(min=1)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


__all__ = ["vocab_parallel_causal_lm_loss", "IGNORE_INDEX"]
