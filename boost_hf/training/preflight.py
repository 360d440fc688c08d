"""Checks of a training run that fail before any collective, with the same error on every rank.

Each rank checks the same facts (the configuration, the tokenizer, the whole training and validation sets),
so all ranks raise the same error before a collective could hang. Token ids and labels are also checked per batch
(:class:`TokenIdCheckingCollator`, on the CPU before the batch moves to the device) for data that cannot be
checked up front (streams); an out-of-range id on a DP rank then stops that rank with a message naming it. The
check is the model's own (:func:`~boost_hf.modeling_boost_llama.check_token_ids`), so the trainer and the model
raise the same message.
"""

from __future__ import annotations

import torch

from ..configuration_boost_llama import check_int
from ..modeling_boost_llama import IGNORE_INDEX, check_token_ids


def check_model_and_data(config, tokenizer, block_size, parallel=None) -> None:
    """``parallel`` (a ``ParallelConfig``) can hold the model (its own check), ``block_size`` fits the model's
    positions (and, under sequence parallelism, splits evenly over the TP ranks), and every token id of ``tokenizer``
    fits its vocabulary."""
    if parallel is not None:
        parallel.check_model(config)
    check_int("block_size", block_size, minimum=2)
    if parallel is not None and parallel.sequence_parallel and block_size % parallel.tp_size:
        p = parallel.tp_size
        raise ValueError(
            f"block_size ({block_size}) is not divisible by tp_size ({p}), over which sequence_parallel=True splits each "
            f"sequence: choose a multiple of {p} (e.g. {block_size // p * p or p}), or sequence_parallel=False."
        )
    if block_size > config.max_position_embeddings:
        raise ValueError(
            f"block_size ({block_size}) exceeds the model's max_position_embeddings ({config.max_position_embeddings}): "
            "lower block_size or raise max_position_embeddings."
        )
    if len(tokenizer) > config.vocab_size:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {config.vocab_size}: raise "
            "vocab_size (or leave it unset to take the tokenizer's) or use a smaller tokenizer."
        )


def check_dataset(dataset, vocab_size: int, name: str, minimum_blocks: int) -> None:
    """A sized dataset has at least ``minimum_blocks`` rows and, for a ``datasets.Dataset`` with ``input_ids`` (and
    ``labels``), only ids in range (labels may hold the ignore index): :func:`~boost_hf.data.checks.token_id_range`, one vectorised pass over
    each Arrow column, recorded beside its cache file, so each cache is scanned once."""
    if not hasattr(dataset, "__len__"):
        return
    if len(dataset) < minimum_blocks:
        raise ValueError(
            f"the {name} set has {len(dataset)} blocks, fewer than {minimum_blocks} "
            + ("(one global batch: per_device_train_batch_size x data-parallel size x gradient_accumulation_steps)"
               if name == "training" else "(it is empty)")
            + ": add data, lower block_size or the batch size, or raise max_train_blocks / max_eval_blocks."
        )
    from datasets import Dataset

    if not isinstance(dataset, Dataset):
        return
    from ..data.checks import token_id_range

    for column, where, ignore in (("input_ids", f"the {name} set", None), ("labels", f"the {name} set's labels", IGNORE_INDEX)):
        if column not in dataset.column_names:
            continue
        bounds = token_id_range(dataset, column, ignore)
        if bounds is not None:
            check_token_ids(torch.tensor(bounds), vocab_size, where, ignore_index=ignore)


class TokenIdCheckingCollator:
    """Wraps a data collator: every batch's ``input_ids`` must lie in ``[0, vocab_size)``, its ``labels`` too (or be
    the ignore index); checked on the CPU, where the error names the id."""

    def __init__(self, collator, vocab_size: int):
        self.collator, self.vocab_size = collator, vocab_size

    def __call__(self, features):
        batch = self.collator(features)
        check_token_ids(torch.as_tensor(batch["input_ids"]), self.vocab_size, "a batch")
        if batch.get("labels") is not None:
            check_token_ids(torch.as_tensor(batch["labels"]), self.vocab_size, "a batch's labels", ignore_index=IGNORE_INDEX)
        return batch


__all__ = ["check_model_and_data", "check_dataset", "TokenIdCheckingCollator"]
