"""``torch.compile`` under tensor parallelism, run inside one gloo process group (TP 2).

For each layout, two models with the same seed: one eager, one with every decoder layer compiled in place and its
(vocabulary-parallel) loss compiled, with ``fullgraph=True`` (a graph break fails the case): what ``BoostTrainer
--torch_compile`` compiles. Both run one forward + backward on the same batch;
each rank reports the relative loss difference and the worst relative gradient difference over every
parameter, and whether each layer compiled to a graph that holds the collectives. The step runs as training runs
it, ``use_cache=False`` (the Trainer sets ``config.use_cache = args.use_cache``, ``False``): a KV cache would make
each layer a graph of its own (dynamo guards on each cache layer's state), one more inductor compile per layer.
"""

from __future__ import annotations

import torch
import torch._inductor.config
import torch.distributed as dist

from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM, ParallelConfig
from boost_hf.parallel.compile import compile_model

CASES = [
    dict(tp_style="btp", bottleneck="cola"),
    dict(tp_style="btp", bottleneck="svd", rmsnorm="sync"),
    dict(tp_style="vanilla", bottleneck="cola"),
    dict(tp_style="megatron", bottleneck=None),
    dict(tp_style="megatron", bottleneck=None, sequence_parallel=True),
    dict(tp_style="btp", bottleneck="cola", sequence_parallel=True),
    dict(tp_style="btp", bottleneck="lax"),
    dict(tp_style="btp", bottleneck="tt"),  # tt-1b's recipe compiles by default on a GPU
]


def _config(bottleneck) -> BoostLlamaConfig:
    return BoostLlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, rank=16, bottleneck=bottleneck,
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _step(case: dict, compiled: bool):
    fields = {k: v for k, v in case.items() if k != "bottleneck"}
    torch.manual_seed(0)
    model = BoostLlamaForCausalLM(_config(case["bottleneck"]), parallel_config=ParallelConfig(tp_size=dist.get_world_size(), **fields)).train()
    if compiled:
        torch._dynamo.reset()  # each case is a new model; do not count its compilations against the last case's
        compile_model(model, fullgraph=True)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def compile_parity() -> list[dict]:
    """One report per case: ``loss_rel``, ``grad_rel`` (worst over parameters), ``same_names``."""
    # Inductor compiles in this process: its default on a 2-core machine, a pool of compile workers per rank (each a
    # Python process importing torch), costs more than it saves when 2 ranks share the 2 cores.
    torch._inductor.config.compile_threads = 1
    reports = []
    for case in CASES:
        eager_loss, eager_grads = _step(case, compiled=False)
        compiled_loss, compiled_grads = _step(case, compiled=True)
        reports.append({
            "case": case,
            "loss_rel": _rel(compiled_loss, eager_loss),
            "grad_rel": max(_rel(compiled_grads[n], g) for n, g in eager_grads.items()),
            "same_names": sorted(eager_grads) == sorted(compiled_grads),
        })
    return reports
