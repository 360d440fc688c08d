"""Which data each rank sees: disjoint shards per data-parallel rank, identical batches for TP peers.

Training: ``accelerate`` shards a prepared dataloader over *all* processes. :func:`shard_by_data_parallel_rank`
re-points that sharding to the DP group (``num_processes = dp``, ``process_index = dp_rank``), so that the
ranks of one TP group and the pipeline stages of one replica (same ``dp_rank``) draw the same batches and
different DP ranks draw disjoint ones
(``transformers``' Trainer adjusts the same wrapper for its own rank-aware samplers). Everything else of
accelerate's loader is kept: the seeded sampler (one permutation per epoch on every rank), device placement
and ``skip_first_batches`` on resume. With ``dataloader_drop_last`` (the boost-hf default) every DP rank
takes whole batches and no sample is repeated within an epoch.

Streaming (iterable) training sets under TP: accelerate would split them by global rank (or dispatch
slices of rank 0's batches), so :func:`streaming_loader` splits the stream by DP rank itself
(``datasets.distributed.split_dataset_by_node``) and loads it without accelerate's wrapper.

Evaluation: :class:`EvalShard` gives DP rank ``i`` the samples ``i, i + dp, ...``, padded with fully masked
copies so that every DP rank runs the same number of forward passes (ZeRO-3 gathers parameters in each).
"""

from __future__ import annotations

import torch
from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard
from torch.utils.data import DataLoader, Dataset

from ..parallel.state import ParallelState

IGNORE_INDEX = -100


def shard_by_data_parallel_rank(dataloader: DataLoader, state: ParallelState) -> DataLoader:
    """Make an ``accelerate``-prepared dataloader shard by data-parallel rank instead of global rank."""
    if state.tp_size * state.pp_size == 1:
        return dataloader  # the DP group is the whole world: accelerate's sharding is already right
    shard = getattr(dataloader, "batch_sampler", None)
    if not isinstance(shard, BatchSamplerShard):
        shard = getattr(dataloader, "dataset", None)
    if not isinstance(shard, (BatchSamplerShard, IterableDatasetShard)):
        raise ValueError(
            f"cannot give tensor-parallel peers the same batches with this {type(dataloader).__name__} (accelerate "
            "dispatched the batches or split a streaming dataset by global rank): use a map-style training set "
            "(streaming=False)."
        )
    shard.num_processes, shard.process_index = state.dp_size, state.dp_rank
    return dataloader


def streaming_loader(dataset, state: ParallelState, **loader_kwargs) -> DataLoader:
    """A dataloader over DP rank ``state.dp_rank``'s part of an iterable ``datasets.IterableDataset``."""
    from datasets import IterableDataset as StreamingDataset
    from datasets.distributed import split_dataset_by_node

    if not isinstance(dataset, StreamingDataset):
        raise ValueError(f"tensor parallelism needs a map-style or a datasets.IterableDataset training set, got {type(dataset).__name__}")
    return DataLoader(split_dataset_by_node(dataset, rank=state.dp_rank, world_size=state.dp_size), **loader_kwargs)


class EvalShard(Dataset):
    """DP rank ``dp_rank``'s share of a sized ``dataset``: items ``dp_rank, dp_rank + dp_size, ...``.

    Every rank has ``ceil(len(dataset) / dp_size)`` items; the missing ones are copies of item 0 with all
    ``labels`` set to -100, so they count no token in the loss.
    """

    def __init__(self, dataset, dp_size: int, dp_rank: int):
        if not hasattr(dataset, "__len__"):
            raise ValueError(
                "evaluation needs a sized dataset (every data-parallel rank must run the same number of batches): "
                "build the validation split without streaming, or cap it (max_eval_blocks) and materialise it."
            )
        self.dataset = dataset
        self.indices = list(range(dp_rank, len(dataset), dp_size))
        self.length = -(-len(dataset) // dp_size)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        if not 0 <= i < self.length:
            raise IndexError(i)
        if i < len(self.indices):
            return self.dataset[self.indices[i]]
        item = dict(self.dataset[0])
        item["labels"] = torch.full_like(torch.as_tensor(item["labels"]), IGNORE_INDEX)
        return item


__all__ = ["shard_by_data_parallel_rank", "streaming_loader", "EvalShard"]
