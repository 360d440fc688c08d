"""Token ids outside the vocabulary, given to the model directly (no trainer, no collator), in every layout at
TP 1 and 2 (run in a launched process group, see tests/parallel/test_token_ids.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from boost_hf import BoostLlamaForCausalLM, ParallelConfig

from .tp_cases import SEED, TINY, tiny_config

LAYOUTS = (("cola", "btp"), ("cola", "vanilla"), (None, "megatron"))


def outcome(model, ids) -> str:
    try:
        model(ids, labels=ids)
    except Exception as error:  # noqa: BLE001 - the type is what is reported
        return f"{type(error).__name__}: {error}"
    return "no error"


def everything(world_size: int) -> dict:
    vocab = TINY["vocab_size"]
    too_large = torch.full((1, 4), 3).index_fill_(1, torch.tensor([2]), vocab)  # one id == vocab_size
    negative = torch.full((1, 4), 3).index_fill_(1, torch.tensor([1]), -1)
    results = {}
    for bottleneck, style in LAYOUTS:
        for tp in (1, world_size):
            torch.manual_seed(SEED)
            model = BoostLlamaForCausalLM(tiny_config(bottleneck=bottleneck), parallel_config=ParallelConfig(tp_size=tp, tp_style=style))
            for name, ids in (("too_large", too_large), ("negative", negative)):
                results[f"{style}-tp{tp}-{name}"] = outcome(model, ids)
            dist.barrier()
    return results
