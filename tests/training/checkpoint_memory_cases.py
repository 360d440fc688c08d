"""What one checkpoint save and one resume cost each rank, measured, for ``test_checkpoint_memory.py`` and
``benchmarks/checkpoint_cost.py``:

    torchrun --nproc-per-node 4 tests/training/checkpoint_memory_cases.py OUT [--legacy-code]
        [--hidden 1024 --layers 8 --rank 256 --vocab 8192] [--pp 2 --tp 2]

Builds a CoLA model (by default 1024 wide, 8 layers, rank 256, vocabulary 8192: 57 M parameters) at pp x tp (x dp
over the rest of the 4 processes), trains one step with AdamW on random tokens and saves ``checkpoint-1`` (``save``;
again with ``--save_async``: ``save_async``), then resumes the first at the same layout (``load_model``,
``load_optimizer``, ``verify``). Around each save (``BoostTrainer._save_checkpoint``, waiting for a background
write) and each load, each rank resets its peak resident memory (``/proc/self/clear_refs``) and reads it back
(``VmHWM``). Every rank writes ``OUT/rank<r>.json``: its own shards' bytes (parameters and optimizer state), per phase
the RSS before, the peak, the seconds (``blocked_seconds``: until training could go on) and the bytes it
hashed, and the bytes of the files named after it that it
wrote. ``--legacy-code`` runs one synchronous save only (an earlier boost-hf, without ``--save_async``, to measure it).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from datasets import Dataset

import boost_hf.checkpoint.integrity as integrity
from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM
from boost_hf.training import BoostTrainer, BoostTrainingArguments

MEASURED: dict = {}
HASHED = [0]


def resident_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def reset_peak() -> int:
    """Reset this process's peak RSS to its current RSS; return that (KiB)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return resident_kib("VmRSS")


_sha256 = integrity._sha256


_HASHED_LOCK = threading.Lock()


def _counting_sha256(path: str) -> str:
    with _HASHED_LOCK:  # files are hashed by several threads at a time
        HASHED[0] += os.path.getsize(path)
    return _sha256(path)


integrity._sha256 = _counting_sha256


def measured(phase: str, run):
    def wrapper(self, *args, **kwargs):
        before, hashed, start = reset_peak(), HASHED[0], time.perf_counter()
        result = run(self, *args, **kwargs)
        blocked = time.perf_counter() - start  # training waited this long
        saver = getattr(getattr(self, "run", None), "saver", None)
        if saver is not None:
            saver.wait()  # an asynchronous save is complete
        if dist.is_initialized():
            dist.barrier()
        MEASURED[phase] = {"rss_before_kib": before, "peak_kib": resident_kib("VmHWM"), "blocked_seconds": blocked,
                           "seconds": time.perf_counter() - start, "hashed_bytes": HASHED[0] - hashed}
        return result

    return wrapper


def counted(phase: str, run):
    """``run`` with the bytes this rank hashes during it recorded under ``phase``."""
    def wrapper(*args, **kwargs):
        hashed = HASHED[0]
        result = run(*args, **kwargs)
        MEASURED[phase] = {"hashed_bytes": HASHED[0] - hashed}
        return result

    return wrapper


def own_bytes(trainer) -> dict[str, int]:
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    local = getattr(optimizer, "optim", optimizer)  # ZeRO-1: this rank's share
    state = sum(v.numel() * v.element_size() for entry in local.state.values() for v in entry.values() if torch.is_tensor(v))
    params = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    return {"parameters": params, "optimizer_state": state}


def build_trainer(options, config, data, output_dir: Path, **fields) -> BoostTrainer:
    args = BoostTrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=2, pp_size=options.pp, tp_size=options.tp, pp_microbatches=2,
        learning_rate=1e-3, logging_steps=1, report_to="none", disable_tqdm=True, sample_max_new_tokens=0, warmup_steps=0, **fields)
    torch.manual_seed(0)
    model = BoostLlamaForCausalLM(config, args.to_parallel_config(config))
    return BoostTrainer(model=model, args=args, train_dataset=data, eval_dataset=data)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--legacy-code", action="store_true", help="an earlier boost-hf: no --save_async")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    options = parser.parse_args()
    out = Path(options.out)
    import boost_hf.checkpoint.run_folder as run_folder_module

    run_folder_module.verify_checkpoint_once = counted("verify", run_folder_module.verify_checkpoint_once)
    BoostTrainer._load_from_checkpoint = measured("load_model", BoostTrainer._load_from_checkpoint)
    BoostTrainer._load_optimizer_and_scheduler = measured("load_optimizer", BoostTrainer._load_optimizer_and_scheduler)
    save = BoostTrainer._save_checkpoint
    config = BoostLlamaConfig(vocab_size=options.vocab, hidden_size=options.hidden, intermediate_size=int(options.hidden * 2.75),
                              num_hidden_layers=options.layers, num_attention_heads=options.hidden // 64, bottleneck="cola",
                              rank=options.rank, max_position_embeddings=64, tie_word_embeddings=False)
    ids = torch.randint(0, options.vocab, (16, 32), generator=torch.Generator().manual_seed(0)).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    saves = [("save", {})] if options.legacy_code else [("save", {"save_async": False}), ("save_async", {"save_async": True})]
    for phase, fields in saves:
        BoostTrainer._save_checkpoint = measured(phase, save)
        trainer = build_trainer(options, config, data, out / phase, max_steps=1, save_strategy="steps", save_steps=1, **fields)
        trainer.train()
        shards = own_bytes(trainer)
        del trainer
    build_trainer(options, config, data, out / "resumed", max_steps=2, save_strategy="no").train(
        resume_from_checkpoint=str(out / "save" / "checkpoint-1"))
    rank = dist.get_rank()
    checkpoint = out / "save" / "checkpoint-1"
    files = [p for p in checkpoint.rglob("*") if p.is_file()]
    (out / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "world": dist.get_world_size(), "own_bytes": shards,
        "written_bytes": sum(p.stat().st_size for p in files if re.fullmatch(rf"__{rank}_\d+\.distcp|rng_state_{rank}\.pth", p.name)),
        "checkpoint_bytes": sum(p.stat().st_size for p in files), **MEASURED,
    }, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
