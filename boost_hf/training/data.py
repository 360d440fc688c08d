"""Which data each rank sees, and where a resumed run's data continues.

**Map-style training sets** (a packed ``datasets.Dataset``): ``accelerate`` shards a prepared dataloader over *all*
processes; :func:`shard_by_data_parallel_rank` re-points that sharding to the DP group (``num_processes = dp``,
``process_index = dp_rank``), so that the ranks of one TP group and the pipeline stages of one replica (same
``dp_rank``) draw the same batches and different DP ranks draw disjoint ones. Everything else of accelerate's loader
is kept: the seeded sampler (one permutation per epoch on every rank), device placement and, on resume, the
Trainer's ``skip_first_batches``, which skips *indices* of the sampler (no row is read). Each rank of a replica
indexes the same memory-mapped Arrow cache (no tokenization at training time). The global batch of step ``k`` is
samples ``k G .. (k + 1) G - 1`` of the epoch's permutation whatever the DP size, so a resume at another DP size
trains the same samples at each step.

**Streams** (a :class:`~boost_hf.data.stream.BlockStream`): :class:`StreamLoader`. The stream is split into ``L``
logical streams (``stream_shards``; default: the DP size of the run that starts it), each with its own packing
remainder and shuffle buffer. Step ``k``'s global batch of ``G`` blocks is the next ``G / L`` blocks of every
logical stream, in stream order; DP rank ``r`` reads logical streams ``r L / dp .. (r + 1) L / dp - 1`` and cuts
its ``G / dp`` rows into the micro-batches of its gradient accumulation. The sequence of global batches therefore
depends on ``L``, never on the layout: any pp x tp x dp with ``dp | L`` and ``L | G`` trains the same rows at every
step (what "the same samples" means for a resume at another DP size). One rank per DP replica reads and tokenizes
(tp rank 0 of pipeline stage 0, the *reader*); its TP peers receive each micro-batch by a broadcast over the TP
group and later pipeline stages over their PP group (``input_ids`` as ``int32``, ``B x S x 4`` bytes per
micro-batch and receiving rank; ``labels`` only when they are not the ``input_ids``, ``attention_mask`` when
present; a 40-byte header before). The readers agree on every step with one 3-number all-reduce over their DP group:
the pass ends for every replica at the first step some logical stream cannot fill; that step is dropped
(``dataloader_drop_last``, the default) or trained with its missing rows padded by fully ignored ones (labels
-100: the loss and gradients of the rows present, as one process trains a short last batch); the next pass begins
(the source from its start, in ``datasets``' shard order of that epoch). A reader that fails (e.g. an out-of-range
token id) makes every rank raise its message instead of waiting.

**Position**: :func:`save_data_position` writes ``data_position/`` into a checkpoint (``position.json`` by global
rank 0; a stream's ``stream-<index>.pt`` per logical stream, by its reader: the source position, remainder, shuffle
buffer and generator), :func:`restore_data_position` continues from it: a stream reads no document again (no
batch is skipped by the Trainer, see ``BoostTrainer.train``), at any layout whose DP size divides ``L``; a map-style
run checks that the training set and its seed are the saved ones. ``position.json`` also records the training data's
fingerprint (:mod:`boost_hf.data.fingerprint`: each source file's size, modification time and sampled content; a
map-style set's sampled blocks), and a resume on data whose fingerprint differs is refused naming both
(:func:`check_same_data`; ``--resume_on_changed_data`` continues at the saved position on the new data).

**Evaluation**: :class:`EvalShard` gives DP rank ``i`` the samples ``i, i + dp, ...``, padded with fully masked
copies so that every DP rank runs the same number of forward passes (ZeRO-3 gathers parameters in each).
"""

from __future__ import annotations

import json
import logging
import os

import torch
import torch.distributed as dist
from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard
from torch.utils.data import DataLoader, Dataset
from transformers.trainer import TRAINER_STATE_NAME

from ..data.collate import IGNORE_INDEX
from ..data.fingerprint import describe_fingerprint, fingerprint_differences, sampled_rows_sha256, sources_of
from ..data.stream import Block, BlockStream
from ..parallel.state import ParallelState
from ..checkpoint.decisions import decided_on_rank_zero

logger = logging.getLogger(__name__)

DATA_POSITION_DIR = "data_position"
POSITION_NAME = "position.json"
HEADER_BATCH, HEADER_END, HEADER_ERROR = 1, 0, -1


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
            "dispatched the batches or split a streaming dataset by global rank): use a map-style training set, a "
            "datasets.IterableDataset or a boost_hf BlockStream (streaming=True)."
        )
    shard.num_processes, shard.process_index = state.dp_size, state.dp_rank
    return dataloader


def check_logical_streams(logical_streams: int, dp_size: int, global_batch: int) -> None:
    """``ValueError`` naming the fix unless ``dp_size`` divides ``logical_streams`` and that divides ``global_batch``."""
    if logical_streams % dp_size:
        raise ValueError(
            f"the training stream is split into {logical_streams} logical streams (stream_shards), which data-parallel "
            f"size {dp_size} does not divide: each DP replica reads whole logical streams. Run at a DP size that divides "
            f"{logical_streams}, or (for a new run) set stream_shards to a multiple of every DP size you will resume at."
        )
    if global_batch % logical_streams:
        raise ValueError(
            f"the global batch of {global_batch} blocks (per_device_train_batch_size x dp x gradient_accumulation_steps) "
            f"does not split over the {logical_streams} logical streams of the training stream (stream_shards): each step "
            f"takes the same number of blocks from each. Choose a global batch that is a multiple of {logical_streams}."
        )


class DataReaderError(RuntimeError):
    """The training data failed on a reader rank; raised on every rank with its message."""


class StreamLoader:
    """The training micro-batches of a :class:`~boost_hf.data.stream.BlockStream` on this rank (see the module
    docstring): an iterable over one pass (the Trainer's "epoch"), each item a batch dict of ``[micro_batch, S]``
    ``int64`` tensors on ``device`` with ``labels``. Collective over the replica (broadcasts) and, on readers, over
    their DP group (one small all-reduce per step)."""

    def __init__(self, stream: BlockStream, state: ParallelState, *, micro_batch: int, accumulation: int, drop_last: bool,
                 collate, device, logical_streams: int | None = None):
        self.stream, self.state, self.collate, self.device = stream, state, collate, torch.device(device)
        self.micro_batch, self.drop_last = micro_batch, drop_last
        self.global_batch = micro_batch * state.dp_size * accumulation
        self.is_reader = state.tp_rank == 0 and state.pp_rank == 0
        self.hops = self._hops(state)
        self.split(logical_streams or stream.logical_streams or state.dp_size)

    def split(self, logical_streams: int) -> None:
        """Read ``logical_streams`` logical streams (this replica's share of them), from the start of pass 0."""
        check_logical_streams(logical_streams, self.state.dp_size, self.global_batch)
        self.logical_streams, self.per_stream = logical_streams, self.global_batch // logical_streams
        owned = logical_streams // self.state.dp_size
        first = self.state.dp_rank * owned
        self.cursors = [self.stream.cursor(index, logical_streams) for index in range(first, first + owned)] if self.is_reader else []
        self.epoch, self.steps_in_pass, self.pass_over = 0, 0, False

    @property
    def documents_read(self) -> int:
        """Documents this rank took from the source (0 on a rank that is not its replica's reader)."""
        return sum(cursor.documents_read for cursor in self.cursors)

    @property
    def tokens_read(self) -> int:
        """The tokens of those documents."""
        return sum(cursor.tokens_read for cursor in self.cursors)

    # ------------------------------------------------------------------ iteration
    def __iter__(self):
        if not self.is_reader:
            while (batch := self._share(None)) is not None:
                yield batch
            return
        if self.pass_over:
            self._begin_pass(self.epoch + 1)
        while not self.pass_over:
            for batch in self._next_step():
                yield self._share(batch)
        if self.steps_in_pass == 0:  # the same on every reader: the pass's end was agreed
            self._fail(ValueError(
                f"the training stream gave no whole global batch in a pass: one takes {self.global_batch} blocks "
                f"(per_device_train_batch_size x dp x gradient_accumulation_steps; {self.per_stream} from each of its "
                f"{self.logical_streams} logical streams) and a logical stream ran out first (max_train_blocks="
                f"{self.stream.max_blocks}). Add data, lower the batch size, block_size or stream_shards, or pass "
                "--dataloader_drop_last false to train the short batch."))
        self._share(None)

    def _begin_pass(self, epoch: int) -> None:
        for cursor in self.cursors:
            cursor.restart(epoch)
        self.epoch, self.steps_in_pass, self.pass_over = epoch, 0, False

    def _quotas(self) -> list[int]:
        """Blocks to take from each of this reader's logical streams for the next step (fewer than ``per_stream`` when
        ``max_blocks`` ends the pass inside the step: the first blocks of the global order are kept)."""
        if self.stream.max_blocks is None:
            return [self.per_stream] * len(self.cursors)
        left = self.stream.max_blocks - self.steps_in_pass * self.global_batch
        return [min(max(left - cursor.index * self.per_stream, 0), self.per_stream) for cursor in self.cursors]

    def _next_step(self) -> list[dict]:
        """The micro-batches of this replica's next step ([] when the pass ended without one). Readers only."""
        batches, short, rows, error = [], False, 0, None
        try:
            blocks = []
            for cursor, quota in zip(self.cursors, self._quotas()):
                taken = cursor.take(quota)
                short |= len(taken) < self.per_stream
                blocks += taken
            rows = len(blocks)
            batches = self._micro_batches(blocks)
        except Exception as failure:  # noqa: BLE001 (shared with every rank below, then re-raised)
            error = failure
        short, rows, failed = self._agree(short, rows, error is not None)
        if failed:
            self._fail(error)
        if short:
            self.pass_over = True
            if self.drop_last or rows == 0:
                return []
        self.steps_in_pass += 1
        return batches

    def _micro_batches(self, blocks: list[Block]) -> list[dict]:
        """This reader's rows of one step, padded with fully ignored rows to ``G / dp``, collated per micro-batch."""
        rows = self.global_batch // self.state.dp_size
        features = [dict(block) for block in blocks]
        if len(features) < rows:
            for feature in features:
                feature.setdefault("labels", feature["input_ids"])
            pad = {"input_ids": torch.zeros(self.stream.block_size, dtype=torch.int64),
                   "labels": torch.full((self.stream.block_size,), IGNORE_INDEX, dtype=torch.int64)}
            features += [{name: value.numpy() for name, value in pad.items()}] * (rows - len(features))
        return [self.collate(features[i : i + self.micro_batch]) for i in range(0, rows, self.micro_batch)]

    def _agree(self, short: bool, rows: int, failed: bool) -> tuple[bool, int, bool]:
        """Over the readers' DP group: whether any logical stream ran short, the rows read, whether any reader failed."""
        if self.state.dp_group is None:
            return short, rows, failed
        votes = torch.tensor([int(short), rows, int(failed)], dtype=torch.int64, device=self.device)
        dist.all_reduce(votes, group=self.state.dp_group)
        return bool(votes[0]), int(votes[1]), bool(votes[2])

    def _fail(self, error: Exception | None):
        """Every reader learns the first failing reader's message, sends it to its replica and raises."""
        message = f"{type(error).__name__}: {error}" if error is not None else None
        if self.state.dp_group is not None:
            messages = [None] * self.state.dp_size
            dist.all_gather_object(messages, message, group=self.state.dp_group)
            message = next(m for m in messages if m is not None)
        self._share(message)
        if error is not None:
            raise error
        raise DataReaderError(f"the training data failed on another data-parallel replica's reader: {message}")

    # ------------------------------------------------------------------ replica broadcast
    @staticmethod
    def _hops(state: ParallelState) -> list[tuple]:
        """The broadcasts that carry the reader's batch to this rank's replica: over the TP group on stage 0 (from tp
        rank 0), then over the PP group (from stage 0); ``(group, source global rank)`` for those this rank is in."""
        hops = []
        if state.tp_group is not None and state.pp_rank == 0:
            hops.append((state.tp_group, dist.get_global_rank(state.tp_group, 0)))
        if state.pp_group is not None:
            hops.append((state.pp_group, dist.get_global_rank(state.pp_group, 0)))
        return hops

    def _share(self, item: dict | str | None) -> dict | None:
        """Reader: send ``item`` (a batch, ``None`` for the end of the pass, or a failure's message) to its replica and
        return it; other ranks: receive and return it (raise :class:`DataReaderError` for a message)."""
        if not self.hops:
            return item if not isinstance(item, str) else None
        header = torch.zeros(5, dtype=torch.int64, device=self.device)  # [status, rows, seq, has labels, has mask]
        payload = None
        if self.is_reader:
            if isinstance(item, dict):
                item = {name: value.to(self.device) for name, value in item.items()}
                ids, labels, mask = item["input_ids"], item["labels"], item.get("attention_mask")
                sent = [ids] + ([labels] if not torch.equal(labels, ids) else []) + ([mask] if mask is not None else [])
                payload = torch.stack(sent).to(torch.int32)
                header.copy_(torch.tensor([HEADER_BATCH, *ids.shape, len(sent) - 1 - (mask is not None), int(mask is not None)]))
            else:
                header[0] = HEADER_END if item is None else HEADER_ERROR
        message = [item if isinstance(item, str) else None]
        for group, source in self.hops:
            dist.broadcast(header, src=source, group=group)
            status, rows, seq, has_labels, has_mask = header.tolist()
            if status == HEADER_ERROR:
                dist.broadcast_object_list(message, src=source, group=group)
            elif status == HEADER_BATCH:
                if payload is None:
                    payload = torch.empty(1 + has_labels + has_mask, rows, seq, dtype=torch.int32, device=self.device)
                dist.broadcast(payload, src=source, group=group)
        if self.is_reader:
            return item if isinstance(item, dict) else None
        if status == HEADER_ERROR:
            raise DataReaderError(f"the training data failed on the reader of this data-parallel replica: {message[0]}")
        if status == HEADER_END:
            return None
        tensors = payload.long().unbind(0)
        batch = {"input_ids": tensors[0], "labels": tensors[1] if has_labels else tensors[0].clone()}
        if has_mask:
            batch["attention_mask"] = tensors[-1]
        return batch

    # ------------------------------------------------------------------ position
    def position(self) -> dict:
        """The loader's part of ``position.json`` (the same on every reader)."""
        return {"kind": "stream", "logical_streams": self.logical_streams, "global_batch": self.global_batch,
                "epoch": self.epoch, "steps_in_pass": self.steps_in_pass, "pass_over": self.pass_over,
                "drop_last": self.drop_last, "stream": self.stream.definition()}

    def skip_steps(self, steps: int) -> None:
        """Read and discard ``steps`` steps (a checkpoint without a data position). Readers only."""
        skipped = passes_without_a_step = 0
        while skipped < steps and passes_without_a_step < 2:
            if self.pass_over:
                self._begin_pass(self.epoch + 1)
                passes_without_a_step += 1
            if self._next_step():
                skipped, passes_without_a_step = skipped + 1, 0


def _stream_file(index: int) -> str:
    return f"stream-{index:05d}.pt"


def save_data_position(folder: str, train_dataset, loader, args) -> None:
    """Write the training data's position into the checkpoint ``folder`` (``data_position/``): a stream's readers
    write their logical streams' cursors, global rank 0 ``position.json``. No collective."""
    path = os.path.join(folder, DATA_POSITION_DIR)
    if isinstance(loader, StreamLoader):
        record = loader.position()
        if loader.is_reader:
            os.makedirs(path, exist_ok=True)
            for cursor in loader.cursors:
                torch.save(cursor.state_dict(), os.path.join(path, _stream_file(cursor.index)))
    elif hasattr(train_dataset, "__len__"):
        record = {"kind": "map", "blocks": len(train_dataset), "seed": args.data_seed if args.data_seed is not None else args.seed}
    else:
        return  # another iterable: the Trainer skips batches on resume
    if args.should_save:
        fingerprint = data_fingerprint(train_dataset, loader)
        if fingerprint is not None:
            record["fingerprint"] = fingerprint
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, POSITION_NAME), "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)


def read_data_position(checkpoint: str) -> dict | None:
    """The ``position.json`` of ``checkpoint`` (``None``: saved before data positions were recorded)."""
    path = os.path.join(checkpoint, DATA_POSITION_DIR, POSITION_NAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def data_fingerprint(train_dataset, loader) -> dict | None:
    """The training data's fingerprint (:mod:`boost_hf.data.fingerprint`): its sources' (``None``: unknown, the set
    was not built by :func:`~boost_hf.data.build_lm_datasets`) and, for a map-style set of blocks, its sampled rows."""
    sources = sources_of(loader.stream if isinstance(loader, StreamLoader) else train_dataset)
    fingerprint = dict(sources.fingerprint()) if sources is not None else {}
    if not isinstance(loader, StreamLoader) and "input_ids" in (getattr(train_dataset, "column_names", None) or ()):
        fingerprint["sampled_rows_sha256"] = sampled_rows_sha256(train_dataset)
    return fingerprint or None


def check_same_data(checkpoint: str, record: dict | None, train_dataset, loader, args) -> None:
    """Collective when launched (global rank 0 compares, every rank raises): ``ValueError`` naming what differs and
    both fingerprints when this run's training data is not the data ``checkpoint`` was saved with (a file added,
    removed, resized, rewritten or touched; other packed blocks), unless ``args.resume_on_changed_data`` (then a
    warning). Nothing for a checkpoint without a fingerprint (saved before boost-hf recorded it)."""

    def differences() -> str | None:
        saved = (record or {}).get("fingerprint")
        if saved is None:
            return None
        now = data_fingerprint(train_dataset, loader) or {}
        found = fingerprint_differences(saved, now)
        if not found:
            return None
        return (f"the training data is not the data {checkpoint!r} was saved with: {'; '.join(found)}. Saved: "
                f"{describe_fingerprint(saved)}; now: {describe_fingerprint(now)}. The run would continue on other "
                "samples than the saved run's.")

    found = decided_on_rank_zero(differences)
    if found is None:
        return
    if getattr(args, "resume_on_changed_data", False):
        logger.warning("%s Continuing at the saved position on this data (--resume_on_changed_data).", found)
        return
    raise ValueError(
        f"{found} Resume with the data the run was saved with, or pass --resume_on_changed_data true to continue at the "
        "saved position on this data (or --ignore_data_skip true to start it from its first batch, or start a new run "
        "from its weights with --init_from)."
    )


def restore_data_position(checkpoint: str, train_dataset, loader, args) -> None:
    """Continue the training data where ``checkpoint`` left it: a :class:`StreamLoader` loads its logical streams'
    positions (split as saved); a map-style training set must be the saved one (the Trainer then skips sampler
    indices), and the data's fingerprint the saved one (:func:`check_same_data`). ``ValueError`` naming the
    difference otherwise, on every rank (each reads the same record; the fingerprint is compared on rank 0).
    Collective when launched."""
    record = read_data_position(checkpoint)
    _restore_position(checkpoint, record, train_dataset, loader, args)
    check_same_data(checkpoint, record, train_dataset, loader, args)


def _restore_position(checkpoint: str, record: dict | None, train_dataset, loader, args) -> None:
    """:func:`restore_data_position` but the fingerprint: the position loaded, the layout and definition checked."""
    if not isinstance(loader, StreamLoader):
        if record is not None and record["kind"] == "stream":
            raise ValueError(f"{checkpoint!r} was trained on a stream, this run on a map-style training set: resume with "
                             "streaming=True, or pass --ignore_data_skip true to start this training set from its first batch.")
        if record is None:
            return
        seed = args.data_seed if args.data_seed is not None else args.seed
        if (record["blocks"], record["seed"]) != (len(train_dataset), seed):
            raise ValueError(
                f"{checkpoint!r} was trained on {record['blocks']} blocks drawn with data seed {record['seed']}; this run "
                f"has {len(train_dataset)} blocks and seed {seed}, so it would train other samples than the saved run. "
                "Resume with the same data, block_size and seed, or pass --ignore_data_skip true to start this training "
                "set from its first batch (or start a new run from its weights with --init_from)."
            )
        return
    if record is None:
        with open(os.path.join(checkpoint, TRAINER_STATE_NAME)) as f:
            global_step = json.load(f)["global_step"]
        logger.warning("%s holds no data position (saved before boost-hf recorded it): re-reading the stream to skip "
                       "%d steps; the samples after it may differ from the saved run's.", checkpoint, global_step)
        if loader.is_reader:
            loader.skip_steps(global_step)
        return
    saved, asked = record["stream"], loader.stream.definition()
    if record["kind"] != "stream" or saved != asked:
        raise ValueError(
            f"{checkpoint!r} saved the position of a training stream defined as {saved if record['kind'] == 'stream' else 'a map-style set'}; "
            f"this run's is {asked}: resume with the same data arguments (block_size, shuffle_buffer, seed, max_train_blocks), "
            "or pass --ignore_data_skip true to start the stream from its beginning."
        )
    if loader.stream.logical_streams not in (None, record["logical_streams"]):
        raise ValueError(
            f"stream_shards={loader.stream.logical_streams}, but {checkpoint!r} was saved with the stream split into "
            f"{record['logical_streams']} logical streams: resume with stream_shards={record['logical_streams']} (or unset)."
        )
    loader.split(record["logical_streams"])
    loader.epoch, loader.steps_in_pass, loader.pass_over = record["epoch"], record["steps_in_pass"], record["pass_over"]
    for cursor in loader.cursors:
        state = torch.load(os.path.join(checkpoint, DATA_POSITION_DIR, _stream_file(cursor.index)), weights_only=True)
        cursor.load_state_dict(state)


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
        item["labels"] = torch.full_like(torch.as_tensor(item["input_ids"]), IGNORE_INDEX)
        return item


__all__ = [
    "DATA_POSITION_DIR",
    "check_same_data",
    "data_fingerprint",
    "DataReaderError",
    "EvalShard",
    "StreamLoader",
    "check_logical_streams",
    "read_data_position",
    "restore_data_position",
    "save_data_position",
    "shard_by_data_parallel_rank",
]
