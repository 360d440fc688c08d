"""Streamed training data that resumes where it stopped: packed blocks from a document stream, a seeded shuffle
buffer, and a position small enough to save in every checkpoint.

A :class:`BlockStream` defines the data: documents (a ``datasets.IterableDataset``), how they become token ids
(:func:`~boost_hf.data.pipeline.document_token_ids`; ``None``: the rows already are blocks), the block size, the
shuffle buffer and its seed, a cap on the blocks of one pass and the number of *logical streams* it is split into.
Logical stream ``index`` of ``count`` holds the documents ``split_dataset_by_node(documents, index, count)`` gives
(whole shards when ``count`` divides the source's shards, else every ``count``-th document); a :class:`StreamCursor`
reads one of them::

    documents -> ids + eos -> packing (the remainder carried on) -> shuffle buffer -> blocks

Its state (:meth:`StreamCursor.state_dict`) is what continues it exactly: the source's position (``datasets``' own
``IterableDataset.state_dict()``), the packing remainder, the shuffle buffer's blocks and its generator, and the
pass (epoch). Restoring it reads no document again: an Arrow-backed source (a ``save_to_disk`` folder, the shipped
corpus) resumes at its row; ``datasets`` re-parses a JSON, text or CSV file from its start up to the position
(without tokenizing it), which bounds the re-read by one source file.

The shuffle buffer holds ``shuffle_buffer`` blocks: each block given is drawn uniformly from it (a generator seeded by
``(seed, index, count, epoch)``) and replaced by the next packed block; at the end of a pass it drains. Blocks rather
than documents are shuffled, so consecutive blocks of one long document are spread apart too, and the saved buffer
is ``shuffle_buffer x block_size`` ids.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from itertools import islice

import numpy as np
import torch

Block = dict[str, np.ndarray]
"""One row: ``input_ids [block_size]`` (``int64``) and, when the documents had their own, ``labels``."""
MAX_DOCUMENTS_PER_READ = 256


class BlockStream(torch.utils.data.IterableDataset):
    """Packed, optionally shuffled blocks of a stream of documents (see the module docstring).

    Iterating it gives one pass over logical stream 0 of 1 (every document), at most ``max_blocks`` blocks, each a
    :data:`Block`; :meth:`cursor` reads one logical stream of several, resumably. ``logical_streams`` is the split a
    training run uses (``None``: decided by the run, see :mod:`boost_hf.training.data`). When reading the documents
    fails, ``explain_read_error()`` may return the error to raise instead (e.g. naming the damaged file)."""

    def __init__(
        self,
        documents,
        to_ids: Callable[[dict[str, list]], dict[str, list[np.ndarray]]] | None,
        block_size: int,
        *,
        max_blocks: int | None = None,
        shuffle_buffer: int = 0,
        seed: int = 0,
        logical_streams: int | None = None,
        explain_read_error: Callable[[], Exception | None] | None = None,
    ):
        for name, value, minimum in (("shuffle_buffer", shuffle_buffer, 0), ("logical_streams", logical_streams, 1),
                                     ("max_blocks", max_blocks, 0)):
            if value is not None and (not isinstance(value, int) or value < minimum):
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
        self.documents, self.to_ids, self.block_size = documents, to_ids, block_size
        self.max_blocks, self.shuffle_buffer, self.seed, self.logical_streams = max_blocks, shuffle_buffer, seed, logical_streams
        self.explain_read_error = explain_read_error

    def cursor(self, index: int = 0, count: int = 1) -> StreamCursor:
        """A reader of logical stream ``index`` of ``count``, at the start of pass 0."""
        return StreamCursor(self, index, count)

    def definition(self) -> dict:
        """What fixes the sequence of blocks (recorded with a saved position and compared on resume)."""
        return {"block_size": self.block_size, "shuffle_buffer": self.shuffle_buffer, "seed": self.seed,
                "max_blocks": self.max_blocks, "packed": self.to_ids is not None}

    def __iter__(self) -> Iterator[Block]:
        cursor = self.cursor()
        given = 0
        while self.max_blocks is None or given < self.max_blocks:
            blocks = cursor.take(1)
            if not blocks:
                return
            given += 1
            yield blocks[0]


class StreamCursor:
    """The reading position in logical stream ``index`` of ``count`` of a :class:`BlockStream`.

    :meth:`take` gives the next blocks; :meth:`state_dict` / :meth:`load_state_dict` save and restore the position
    exactly; :meth:`restart` begins pass ``epoch``. ``documents_read`` and ``tokens_read`` count the documents this
    cursor took from the source over its life and their tokens (not saved)."""

    def __init__(self, stream: BlockStream, index: int, count: int):
        if not 0 <= index < count:
            raise ValueError(f"logical stream {index} of {count} does not exist")
        self.stream, self.index, self.count = stream, index, count
        self.documents_read = self.tokens_read = 0
        self.restart(0)

    def restart(self, epoch: int) -> None:
        """Go to the start of pass ``epoch``: the source from its beginning (``datasets``' epoch ``epoch``: its shard
        order), no remainder, an empty buffer, the shuffle generator seeded for this pass."""
        from datasets.distributed import split_dataset_by_node

        self.epoch = epoch
        source = self.stream.documents
        if self.count > 1:
            source = split_dataset_by_node(source, rank=self.index, world_size=self.count)
        source.set_epoch(epoch)
        self.source, self._documents, self.exhausted = source, None, False
        self.source_state: dict | None = None  # the position to resume the source at (None: its start)
        self.pending: dict[str, np.ndarray] = {}  # ids (and labels) read but not yet cut into a block
        self.buffer: list[Block] = []
        self.rng = np.random.default_rng([self.stream.seed, self.index, self.count, epoch])
        self._tokens_per_document = 0.0

    # ------------------------------------------------------------------ reading
    def take(self, n: int) -> list[Block]:
        """Up to ``n`` next blocks (fewer only at the end of the pass)."""
        blocks = []
        while len(blocks) < n:
            block = self._next_block()
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _next_block(self) -> Block | None:
        capacity = max(self.stream.shuffle_buffer, 1)  # 1: a block passes straight through
        while len(self.buffer) < capacity and not (self.exhausted and self._pending_tokens() < self.stream.block_size):
            if self._pending_tokens() >= self.stream.block_size:
                self.buffer.append(self._cut())
            else:
                self._read()
        if not self.buffer:
            return None
        i = int(self.rng.integers(len(self.buffer))) if self.stream.shuffle_buffer else 0
        self.buffer[i], self.buffer[-1] = self.buffer[-1], self.buffer[i]
        return self.buffer.pop()

    def _pending_tokens(self) -> int:
        return len(self.pending["input_ids"]) if self.pending else 0

    def _cut(self) -> Block:
        size = self.stream.block_size
        block = {name: tokens[:size] for name, tokens in self.pending.items()}
        self.pending = {name: tokens[size:] for name, tokens in self.pending.items()}
        return block

    def _read(self) -> None:
        """Read about as many documents as the next block needs (estimated from the documents read so far)."""
        if self._documents is None:
            if self.source_state is not None:
                self.source.load_state_dict(self.source_state)
            self._documents = iter(self.source)
        missing = self.stream.block_size - self._pending_tokens()
        count = 1 if not self._tokens_per_document else min(math.ceil(missing / self._tokens_per_document), MAX_DOCUMENTS_PER_READ)
        try:
            documents = list(islice(self._documents, count))
        except Exception as error:
            explained = self.stream.explain_read_error() if self.stream.explain_read_error is not None else None
            if explained is None:
                raise
            raise explained from error
        self.exhausted = len(documents) < count
        if not documents:
            return
        self.documents_read += len(documents)
        columns = {name: [document[name] for document in documents] for name in documents[0]}
        rows = self.stream.to_ids(columns) if self.stream.to_ids is not None else self._as_blocks(columns)
        read = {name: np.concatenate(values) if values else np.zeros(0, np.int64) for name, values in rows.items()}
        if self.pending and sorted(read) != sorted(self.pending):
            raise ValueError(f"the stream's documents changed columns: {sorted(self.pending)} then {sorted(read)}")
        self.pending = {name: np.concatenate([self.pending[name], read[name]]) if self.pending else read[name] for name in read}
        tokens = len(read["input_ids"])
        self.tokens_read += tokens
        self._tokens_per_document = max(tokens / len(documents), 1.0)

    def _as_blocks(self, columns: dict[str, list]) -> dict[str, list[np.ndarray]]:
        """Rows that already are blocks (``to_ids`` is ``None``): each ``block_size`` long, used as they are."""
        rows = {name: [np.asarray(row, dtype=np.int64) for row in columns[name]] for name in ("input_ids", "labels") if name in columns}
        lengths = {len(row) for row in rows["input_ids"]}
        if lengths - {self.stream.block_size}:
            raise ValueError(f"a streamed training set of blocks must have rows of {self.stream.block_size} ids, got lengths {sorted(lengths)}")
        return rows

    # ------------------------------------------------------------------ position
    def state_dict(self) -> dict:
        """The position, as tensors and JSON text (``torch.load(weights_only=True)`` reads it back)."""
        source = self.source.state_dict() if self._documents is not None else self.source_state
        names = sorted(self.pending) or ["input_ids"]
        return {
            "index": self.index,
            "count": self.count,
            "epoch": self.epoch,
            "exhausted": self.exhausted,
            "source": json.dumps(source),
            "rng": json.dumps(self.rng.bit_generator.state),
            "pending": {name: torch.from_numpy(self.pending.get(name, np.zeros(0, np.int64)).copy()) for name in names},
            "buffer": {name: torch.from_numpy(np.stack([block[name] for block in self.buffer]))
                       if self.buffer else torch.zeros(0, self.stream.block_size, dtype=torch.int64) for name in names},
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (:meth:`state_dict` of logical stream ``index`` of ``count``)."""
        if (state["index"], state["count"]) != (self.index, self.count):
            raise ValueError(f"the position of logical stream {state['index']} of {state['count']} cannot continue stream "
                             f"{self.index} of {self.count}")
        self.restart(state["epoch"])
        self.exhausted = state["exhausted"]
        self.source_state = json.loads(state["source"])
        self.rng.bit_generator.state = json.loads(state["rng"])
        pending = {name: tensor.numpy().copy() for name, tensor in state["pending"].items()}
        self.pending = pending if len(pending["input_ids"]) else {}
        rows = len(state["buffer"]["input_ids"])
        self.buffer = [{name: tensor[i].numpy().copy() for name, tensor in state["buffer"].items()} for i in range(rows)]


__all__ = ["Block", "BlockStream", "StreamCursor"]
