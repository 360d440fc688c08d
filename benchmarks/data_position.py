"""What the training data costs at scale: bytes per cached token, what a streamed resume reads, and what one reader
per DP replica sends instead of every rank re-reading.

1. **Packed cache**: the Wikipedia sample (as JSONL, so ``datasets`` writes cache files) with the demo's ``bpe-4096``
   tokenizer, packed into blocks of 128 and 256: the bytes of the cache file per token, next to the same blocks
   written in the layout of boost-hf <= round 5 (``int32`` ids beside ``int64`` labels).
2. **Resume**: a streamed run (the sample, ``bpe-4096``, 128-token blocks, global batch 8, a 64-block shuffle buffer,
   a 1-layer d=32 model) saved at step ``--steps`` and resumed twice: from its data position, and from the same
   checkpoint without it, which re-reads and re-tokenizes the stream up to the step (what ``skip_first_batches`` did).
   Documents and tokens read before the first resumed step, and the seconds to it.
3. **Reading per DP replica**: this CPU's tokenizer throughput; per step, the tokens a replica's ranks tokenized
   when each of them read (tp x pp times) against one reader and the bytes it sends (``B x S x 4`` per micro-batch and
   receiving rank), at the demo's shape and at cola-13b's (tp 4 x pp 2 x dp 4, 128 x 256 tokens per rank and step).

    python benchmarks/data_position.py            # ~3 min on 2 cores
    python benchmarks/data_position.py --quick    # smoke test
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path


from common import base_parser, parse, table, write_result


def cache_bytes(block_sizes: list[int], work: Path) -> list[list]:
    from datasets import Dataset, Features, List, Value

    from boost_hf.data import build_lm_datasets, cleaned_corpus_path, load_tokenizer

    tokenizer = load_tokenizer("bpe-4096")
    rows = []
    for block in block_sizes:
        train = build_lm_datasets(str(cleaned_corpus_path()), tokenizer, block, datasets_cache_dir=work / f"hf-{block}")["train"]
        tokens = len(train) * block
        now = sum(os.path.getsize(entry["filename"]) for entry in train.cache_files)
        ids = train["input_ids"]
        before = Dataset.from_dict({"input_ids": ids, "labels": ids},
                                   features=Features({"input_ids": List(Value("int32")), "labels": List(Value("int64"))}))
        before.save_to_disk(work / f"before-{block}")
        old = sum(p.stat().st_size for p in (work / f"before-{block}").glob("*.arrow"))
        rows.append([block, f"{tokens:,}", f"{old / tokens:.2f}", f"{now / tokens:.2f}", f"{old / now:.1f}x"])
    return rows


def streamed_trainer(output_dir: Path, stream, steps: int):
    import torch

    from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM
    from boost_hf.training import BoostTrainer, BoostTrainingArguments

    torch.manual_seed(0)
    config = BoostLlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              bottleneck="cola", rank=8, max_position_embeddings=128)
    args = BoostTrainingArguments(output_dir=str(output_dir), max_steps=steps + 2, per_device_train_batch_size=8, learning_rate=1e-3,
                                  logging_steps=1, save_strategy="steps", save_steps=steps, report_to="none", disable_tqdm=True,
                                  sample_max_new_tokens=0, warmup_steps=0, hang_timeout_s=0)
    return BoostTrainer(model=BoostLlamaForCausalLM(config), args=args, train_dataset=stream,
                        eval_dataset=[{"input_ids": [0] * 128}])


def resume_cost(steps: int, work: Path) -> tuple[list[list], dict]:
    from boost_hf.checkpoint.integrity import write_manifest
    from boost_hf.data import build_lm_datasets, load_tokenizer
    from boost_hf.training import BoostTrainer
    from boost_hf.training.data import DATA_POSITION_DIR

    tokenizer = load_tokenizer("bpe-4096")
    stream = build_lm_datasets(None, tokenizer, 128, streaming=True, shuffle_buffer=64, max_eval_blocks=1)["train"]
    first: dict[str, tuple] = {}
    original = BoostTrainer.training_step

    def record_first_step(self, *args, **kwargs):
        first.setdefault("at", (self.train_loader.documents_read, self.train_loader.tokens_read, time.perf_counter()))
        return original(self, *args, **kwargs)

    BoostTrainer.training_step = record_first_step
    try:
        whole = streamed_trainer(work / "whole", stream, steps)
        whole.train()
        whole.run.release()
        checkpoint = work / "whole" / f"checkpoint-{steps}"
        read_by_then = {"documents": whole.train_loader.documents_read, "tokens": whole.train_loader.tokens_read}
        without = work / "without-position" / checkpoint.name
        shutil.copytree(checkpoint, without)
        shutil.rmtree(without / DATA_POSITION_DIR)
        write_manifest(str(without), whole.model.config)
        rows, losses = [], {}
        for name, folder in (("from its data position (this round)", checkpoint), ("re-reading the stream (before)", without)):
            first.clear()
            resumed = streamed_trainer(work / f"resumed-{len(rows)}", stream, steps)
            started = time.perf_counter()
            resumed.train(resume_from_checkpoint=str(folder))
            resumed.run.release()
            documents, tokens, at = first["at"]
            rows.append([name, documents, f"{tokens:,}", f"{at - started:.2f}"])
            losses[name] = [log["loss"] for log in resumed.state.log_history if "loss" in log and log["step"] > steps]
    finally:
        BoostTrainer.training_step = original
    whole_losses = [log["loss"] for log in whole.state.log_history if "loss" in log and log["step"] > steps]
    return rows, {**read_by_then, "losses equal": {k: v == whole_losses for k, v in losses.items()}}


def tokenizer_throughput() -> float:
    from boost_hf.data import load_tokenizer, load_wikipedia_sample

    tokenizer = load_tokenizer("bpe-4096")
    texts = load_wikipedia_sample()["train"]["text"][:40]
    started = time.perf_counter()
    tokens = sum(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
    return tokens / (time.perf_counter() - started)


def replica_rows(tokens_per_second: float) -> list[list]:
    rows = []
    for name, tp, pp, micro_batch, accumulation, seq in (("demo (tp 2 x pp 2)", 2, 2, 8, 1, 128),
                                                          ("cola-13b (tp 4 x pp 2 x dp 4)", 4, 2, 128, 1, 256)):
        tokens = micro_batch * accumulation * seq
        receivers = tp * pp - 1
        sent = accumulation * micro_batch * seq * 4 * receivers
        rows.append([name, f"{tokens:,}", f"{tokens * tp * pp:,} ({tp * pp}x)", f"{tokens:,} (1x)",
                     f"{sent / 1024:.0f} KiB to {receivers} ranks", f"{1e3 * tokens * (tp * pp - 1) / tokens_per_second:.0f} ms"])
    return rows


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="the step the streamed run is saved and resumed at")
    args, started = parse(parser)
    steps = 6 if args.quick else args.steps
    work = Path(tempfile.mkdtemp(prefix="data-position-"))
    try:
        cache = cache_bytes([128] if args.quick else [128, 256], work)
        resume, facts = resume_cost(steps, work)
        speed = tokenizer_throughput()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    body = ["## 1. Bytes per token of the packed cache (Wikipedia sample, bpe-4096)", "",
            *table(["block", "tokens", "before: int32 ids + int64 labels", "now: uint16 ids", "smaller"], cache), "",
            "Before, the tokenized documents were cached too (one more file of the corpus's tokens); now tokenizing and "
            "packing are one `datasets.map` with one cache file.", "",
            f"## 2. Resuming a stream at step {steps} (global batch 8 x 128 tokens, 64-block shuffle buffer)", "",
            f"By step {steps} the uninterrupted run had read {facts['documents']} documents ({facts['tokens']:,} tokens, "
            "64 blocks of them still in its shuffle buffer).", "",
            *table(["resumed", "documents read before the first step", "their tokens", "seconds to the first step"], resume), "",
            f"Steps after the resume equal the uninterrupted run's losses: {json.dumps(facts['losses equal'])}.", "",
            "## 3. Reading per DP replica, per training step", "",
            f"This CPU's tokenizer (bpe-4096, one process): {speed:,.0f} tokens/s.", "",
            *table(["layout", "tokens per replica", "tokenized before (each rank read)", "tokenized now (one reader)",
                    "sent by the reader (int32)", "tokenizing time saved per step here"], replica_rows(speed)), "",
            "At cola-13b's step 100k a resume that re-reads would tokenize 100,000 x 512 x 256 = 13.1 B tokens on every "
            f"rank ({13.1e9 / speed / 3600:,.0f} hours at this CPU's rate); from its data position it reads about one global "
            "batch."]
    write_result(args.out, "data_position", "Training data at scale: cache size, resume, reading per replica", body,
                 quick=args.quick, started=started)


if __name__ == "__main__":
    main()
