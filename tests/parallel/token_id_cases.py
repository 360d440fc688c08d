"""Token ids and labels outside the vocabulary, given to the model directly (no trainer, no collator), in every
layout at TP 1 and 2 and through the pipeline at PP 2 (run in a launched process group, see
tests/parallel/test_token_ids.py). Labels may hold the ignore index (-100)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from boost_hf import BoostLlamaForCausalLM, ParallelConfig

from .tp_cases import SEED, TINY, tiny_config

LAYOUTS = (("cola", "btp"), ("cola", "vanilla"), (None, "megatron"))


def outcome(run) -> str:
    try:
        run()
    except Exception as error:  # noqa: BLE001 - the type is what is reported
        return f"{type(error).__name__}: {error}"
    return "no error"


def bad_inputs() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{case: (input_ids, labels)}`` of 2 rows: one id == vocab_size, a negative id, labels 300 and -5 (vocab 128),
    and labels holding the ignore index only where they are not targets (no error)."""
    vocab = TINY["vocab_size"]
    ids = torch.full((2, 4), 3)
    return {
        "too_large": (ids.clone().index_fill_(1, torch.tensor([2]), vocab), ids),
        "negative": (ids.clone().index_fill_(1, torch.tensor([1]), -1), ids),
        "label_too_large": (ids, ids.clone().index_fill_(1, torch.tensor([2]), 300)),
        "label_negative": (ids, ids.clone().index_fill_(1, torch.tensor([3]), -5)),
        "label_ignored": (ids, ids.clone().index_fill_(1, torch.tensor([0, 1]), -100)),
    }


def everything(world_size: int) -> dict:
    results = {}
    for bottleneck, style in LAYOUTS:
        for tp in (1, world_size):
            torch.manual_seed(SEED)
            model = BoostLlamaForCausalLM(tiny_config(bottleneck=bottleneck), parallel_config=ParallelConfig(tp_size=tp, tp_style=style))
            for name, (ids, labels) in bad_inputs().items():
                results[f"{style}-tp{tp}-{name}"] = outcome(lambda: model(ids, labels=labels))
            dist.barrier()
    torch.manual_seed(SEED)
    pipelined = BoostLlamaForCausalLM(tiny_config(bottleneck="cola"), parallel_config=ParallelConfig(pp_size=world_size))
    for name, (ids, labels) in bad_inputs().items():
        results[f"pp{world_size}-{name}"] = outcome(lambda: pipelined.pipeline.train_step(ids, labels))
    dist.barrier()  # every rank got here: an error on one rank would leave the other in the pipeline's collectives
    return results
