"""Batches of packed blocks for a causal LM, with the labels derived rather than stored.

Packed blocks hold ``input_ids`` only (:mod:`boost_hf.data.pipeline`); :func:`causal_lm_collator` stacks a list of
rows like ``transformers.default_data_collator`` and adds ``labels``: the ``input_ids`` themselves (the model shifts
them), ``-100`` where an ``attention_mask`` is 0. Rows that carry their own ``labels`` keep them.
"""

from __future__ import annotations

import torch
from transformers import default_data_collator

IGNORE_INDEX = -100
ID_COLUMNS = ("input_ids", "labels", "attention_mask")


def causal_lm_collator(features: list[dict]) -> dict[str, torch.Tensor]:
    """``[{"input_ids": [S]}, ...]`` -> ``{"input_ids": [B, S], "labels": [B, S], ...}``, every id tensor ``int64``."""
    batch = default_data_collator(features)
    for name in ID_COLUMNS:
        if name in batch:
            batch[name] = batch[name].long()
    if "labels" not in batch:
        labels = batch["input_ids"].clone()
        if "attention_mask" in batch:
            labels[batch["attention_mask"] == 0] = IGNORE_INDEX
        batch["labels"] = labels
    return batch


__all__ = ["causal_lm_collator", "IGNORE_INDEX"]
