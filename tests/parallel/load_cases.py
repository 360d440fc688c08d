"""``from_pretrained(..., parallel_config=...)`` returns the saved weights in every layout (run in a launched
process group, see tests/parallel/test_load_pretrained.py).

The saved model's weights are its initial values *perturbed*, and every load happens under another global
seed: a loader that re-draws the initial weights (instead of reading the checkpoint) cannot match.
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from boost_hf import BoostLlamaForCausalLM, ParallelConfig

from .tp_cases import SEED, batch, rel, shared_temporary_directory, tiny_config

# (model fields, the TP styles that hold it at tp_size > 1)
MODELS = (
    ({"bottleneck": "cola"}, ("btp", "vanilla")),
    ({"bottleneck": "svd"}, ("btp", "vanilla")),
    ({"bottleneck": "lax", "lax_base": "svd"}, ("btp", "vanilla")),
    ({"bottleneck": None}, ("megatron",)),
)
CHECKPOINTING = ("none", "full", "lowrank")


def perturbed_model(fields: dict) -> BoostLlamaForCausalLM:
    """The single-device model at seed ``SEED``, every parameter moved by N(0, 0.05^2) noise (the same on every rank)."""
    torch.manual_seed(SEED)
    model = BoostLlamaForCausalLM(tiny_config(**fields))
    noise = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=noise))
    return model.eval()


def load_matrix(folder: str) -> dict:
    """``{case: max relative logits difference to the saved model}``, ``"refused: ..."`` for layouts that
    cannot hold a model (a ``ValueError`` before any collective, the same on every rank)."""
    ids, _ = batch()
    results = {}
    for index, (fields, styles) in enumerate(MODELS):
        path = f"{folder}/model{index}"
        saved = perturbed_model(fields)
        with torch.no_grad():
            expected = saved(ids).logits
        if dist.get_rank() == 0:
            saved.save_pretrained(path)
        dist.barrier()
        torch.manual_seed(SEED + 1)  # a loader that re-draws would now even draw other initial values
        plain = BoostLlamaForCausalLM.from_pretrained(path)
        with torch.no_grad():
            results[f"{fields}-plain"] = rel(plain(ids).logits, expected)
        for tp in (1, dist.get_world_size()):
            for style in styles:
                for checkpointing in CHECKPOINTING:
                    name = f"{fields}-tp{tp}-{style}-{checkpointing}"
                    parallel = ParallelConfig(tp_size=tp, tp_style=style, activation_checkpointing=checkpointing)
                    try:
                        loaded = BoostLlamaForCausalLM.from_pretrained(path, parallel_config=parallel)
                    except ValueError as error:
                        results[name] = f"refused: {error}"
                        continue
                    with torch.no_grad():
                        results[name] = rel(loaded.eval()(ids).logits, expected)
    return results


def everything(world_size: int) -> dict:
    with shared_temporary_directory() as tmp:
        results = load_matrix(tmp)
    return results
