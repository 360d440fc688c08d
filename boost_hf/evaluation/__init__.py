"""Held-out perplexity and bits per byte, through a local ``evaluate`` metric (``bits_per_byte/``).

The same numbers come from ``BoostTrainer``'s evaluation (DP-sharded, sums all-reduced before the metric) and
from ``boost-hf eval CHECKPOINT --data FILE`` (one process, :func:`evaluate_checkpoint`):

* every target token of every packed block is predicted (``labels[..., 1:]``, EOS included);
* ``nll_sum`` is their summed cross-entropy in nats, ``byte_count`` the UTF-8 bytes of their decoded text
  (special tokens such as EOS excluded, :func:`target_bytes`);
* ``bits_per_byte = nll_sum / (ln 2 * byte_count)`` and ``perplexity = exp(nll_sum / tokens)``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from ..checkpoint.integrity import MANIFEST_NAME, CheckpointIntegrityError, verify_manifest

METRIC_PATH = str(Path(__file__).resolve().parent / "bits_per_byte")
"""Folder of the local ``evaluate`` metric: ``evaluate.load(METRIC_PATH)`` works offline."""


def load_metric():
    """The ``bits_per_byte`` metric (in memory: concurrent ranks never share a cache file)."""
    import evaluate

    return evaluate.load(METRIC_PATH, keep_in_memory=True)


def target_bytes(tokenizer, labels: torch.Tensor) -> int:
    """UTF-8 bytes of the text of the predicted tokens ``labels[..., 1:]`` (``-100`` ignored, special tokens
    decode to nothing), summed over the rows of ``labels: [B, S]``."""
    total = 0
    for row in labels[..., 1:].reshape(-1, labels.shape[-1] - 1).tolist():
        ids = [token for token in row if token != -100]
        total += len(tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False).encode("utf-8"))
    return total


def batch_sums(nll: torch.Tensor, labels: torch.Tensor, tokenizer=None) -> torch.Tensor:
    """``float64 [nll_sum, token_count, byte_count]`` of one batch from its summed loss ``nll`` and its ``labels``
    (``byte_count`` 0 without a tokenizer)."""
    count = (labels[..., 1:] != -100).sum()
    size = target_bytes(tokenizer, labels) if tokenizer is not None else 0
    return torch.stack([nll.detach().double(), count.double(), torch.tensor(float(size), dtype=torch.float64, device=nll.device)])


def sums_of_batch(model, batch: dict, tokenizer=None) -> torch.Tensor:
    """:func:`batch_sums` of ``model`` on ``batch`` (the model returns the summed loss when told ``num_items_in_batch=1``)."""
    return batch_sums(model(**batch, num_items_in_batch=1).loss, batch["labels"], tokenizer)


def metrics_from_sums(totals: torch.Tensor, prefix: str = "eval") -> dict[str, float]:
    """``{prefix}_loss``, ``{prefix}_perplexity`` and (when bytes were counted) ``{prefix}_bits_per_byte`` from
    ``[nll_sum, token_count, byte_count]`` (already summed over every process), through the metric."""
    nll, tokens, size = totals.tolist()
    result = load_metric().compute(nll_sum=[nll], token_count=[int(tokens)], byte_count=[int(size)])
    metrics = {f"{prefix}_loss": result["loss"], f"{prefix}_perplexity": math.exp(min(result["loss"], 50.0))}
    if result["bits_per_byte"] is not None:
        metrics[f"{prefix}_bits_per_byte"] = result["bits_per_byte"]
    return metrics


@torch.no_grad()
def evaluate_checkpoint(checkpoint: str, data: str, *, block_size: int | None = None, batch_size: int = 8,
                        text_column: str = "text", max_blocks: int | None = None) -> dict[str, float]:
    """Perplexity and bits per byte of ``checkpoint`` (a saved model folder with its tokenizer) on local text
    files ``data`` (text/JSON/CSV/Parquet, one document per row), packed like training (documents followed by
    EOS, blocks of ``block_size`` tokens, default: the tokenizer's ``model_max_length`` if set, else 256). A folder
    with a ``manifest.json`` is verified first (:class:`~boost_hf.checkpoint.integrity.CheckpointIntegrityError`
    naming a damaged file)."""
    from datasets import load_dataset
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..data.collate import causal_lm_collator
    from ..data.pipeline import pack_documents
    from ..data.sources import builder_for_file

    if not os.path.exists(data):
        raise FileNotFoundError(f"--data: no such file: {data!r}")
    if os.path.isfile(os.path.join(checkpoint, "dcp", ".metadata")):
        raise ValueError(
            f"{checkpoint!r} is a training checkpoint (its model's shards in dcp/): write its Hugging Face folder with "
            f"`boost-hf export {checkpoint} OUT`, then evaluate OUT."
        )
    if os.path.isfile(os.path.join(checkpoint, MANIFEST_NAME)):
        verify_manifest(checkpoint)  # every file's size and SHA-256 (the architecture: from_pretrained)
    try:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    except SafetensorError as error:
        raise CheckpointIntegrityError(
            f"the weights of {checkpoint!r} cannot be read ({error}): a safetensors file is truncated or damaged and the "
            f"folder has no {MANIFEST_NAME} to name it; restore it or evaluate another checkpoint."
        ) from error
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    if block_size is None:
        block_size = tokenizer.model_max_length if tokenizer.model_max_length < 1e9 else 256
    documents = load_dataset(builder_for_file(data), data_files=data, split="train")
    blocks = pack_documents(documents, tokenizer, block_size, text_column=text_column)
    if max_blocks is not None:
        blocks = blocks.select(range(min(max_blocks, len(blocks))))
    if len(blocks) == 0:
        raise ValueError(f"{data!r} has no complete block of {block_size} tokens: add text or lower --block-size.")
    totals = torch.zeros(3, dtype=torch.float64)
    for start in range(0, len(blocks), batch_size):
        batch = causal_lm_collator([blocks[i] for i in range(start, min(start + batch_size, len(blocks)))])
        totals += sums_of_batch(model, batch, tokenizer)
    return {**metrics_from_sums(totals, "eval"), "eval_tokens": int(totals[1]), "eval_bytes": int(totals[2]), "eval_blocks": len(blocks)}


__all__ = ["METRIC_PATH", "load_metric", "target_bytes", "batch_sums", "sums_of_batch", "metrics_from_sums", "evaluate_checkpoint"]
