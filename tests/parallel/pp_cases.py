"""Pipeline-parallel cases run inside one launched process group (tests/parallel/test_pipeline.py).

Every rank builds the single-process reference from the same seed and compares what it holds: the loss of
each step, every gradient of the first step and every parameter after two AdamW steps with gradient
clipping by the global norm. The reference accumulates the step's gradient over the same micro-batches (in
DP-rank order), each loss the micro-batch's token sum over the step's token count: the single-process
step in the pipeline's summation order (the full-batch gradient differs from it by fp32 rounding, up to
~1e-5 relative on a LayerNorm weight). Gradients and parameters are compared per tensor in relative L2 norm
(:func:`rel_l2`), as the training tests compare weights: the largest element-wise difference over the largest
element is reported too (``grad_rel_max``): it reached 1.02e-5 on one LayerNorm weight's gradient (vanilla
LaX, first layer after the stage cut), whose relative L2 difference is within the tolerance.
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from boost_hf import BoostLlamaForCausalLM, ParallelConfig
from boost_hf.parallel.sharding import gather_full, shard_spec_of
from boost_hf.training.grad_norm import clip_grad_norm_
from tests.parallel.tp_cases import SEED, rel, shared_temporary_directory, tiny_config

LAYERS = 4
BATCH, SEQ = 4, 8
MAX_NORM = 0.5  # below the initial gradient norm: clipping acts
STEPS = 2


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in L2 norm (fp64)."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def config_of(case: dict):
    return tiny_config(num_hidden_layers=LAYERS, **case.get("model", {}))


def batches():
    """The global batch of each step: ``(input_ids, labels)`` ``[BATCH, SEQ]``, some targets ignored."""
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 128, (BATCH, SEQ), generator=gen)
        labels = ids.clone()
        labels[0, :3] = -100
        labels[-1, 5:] = -100
        out.append((ids, labels))
    return out


def optimizer_of(model):
    """AdamW with ``eps=1e-3``: its update moves by at most ``lr / eps`` times a gradient's fp32 rounding difference
    (two summation orders), instead of up to ``lr / (4 |g|)`` times it for a gradient ``|g|`` near a small ``eps``
    (1e-6 turned 4e-8 gradient differences into 5e-5 relative parameter differences)."""
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, eps=1e-3)


def reference_run(config, pieces: int) -> dict:
    """One process; each step's batch in ``pieces`` micro-batches of consecutive rows, gradients accumulated."""
    torch.manual_seed(SEED)
    model = BoostLlamaForCausalLM(config)
    model.train()
    optimizer = optimizer_of(model)
    losses, norms, grads = [], [], None
    for step, (ids, labels) in enumerate(batches()):
        tokens = int((labels[:, 1:] != -100).sum())
        loss = 0.0
        for part_ids, part_labels in zip(ids.chunk(pieces), labels.chunk(pieces)):
            part = model(part_ids, labels=part_labels, num_items_in_batch=tokens).loss
            part.backward()
            loss += part.detach()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        losses.append(float(loss.detach()))
        optimizer.step()
        optimizer.zero_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "grads": grads, "params": params}


def pipeline_run(config, parallel: ParallelConfig) -> dict:
    torch.manual_seed(SEED)
    model = BoostLlamaForCausalLM(config, parallel_config=parallel)
    model.train()
    state, pipeline = model.plan.state, model.pipeline
    optimizer = optimizer_of(model)
    rows = BATCH // state.dp_size
    losses, norms, grads = [], [], None
    for step, (ids, labels) in enumerate(batches()):
        mine = slice(state.dp_rank * rows, (state.dp_rank + 1) * rows)
        loss = pipeline.train_step(ids[mine], labels[mine])
        norms.append(float(clip_grad_norm_(model.parameters(), MAX_NORM, state.tp_group, state.pp_group)))
        if step == 0:
            grads = {n: gather_full(p.grad, shard_spec_of(p), state.tp_group) for n, p in model.named_parameters()}
        losses.append(float(loss))
        optimizer.step()
        optimizer.zero_grad()
    params = {n: gather_full(p.detach(), shard_spec_of(p), state.tp_group) for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "grads": grads, "params": params}


def parity_case(case: dict) -> dict:
    config = config_of(case)
    parallel = ParallelConfig(**case["parallel"])
    dp_size = dist.get_world_size() // (parallel.tp_size * parallel.pp_size)
    reference = reference_run(config, dp_size * parallel.microbatches)
    ours = pipeline_run(config, parallel)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"losses": ours["losses"], "norms": ours["norms"], "names": sorted(ours["params"])})
    held = set().union(*(set(r["names"]) for r in everyone))
    return {
        "case": case,
        "names_canonical": set(ours["params"]) <= set(reference["params"]) and held == set(reference["params"]),
        "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], reference["losses"])),
        "norm_rel": max(abs(a - b) / abs(b) for a, b in zip(ours["norms"], reference["norms"])),
        "same_on_ranks": all(r["losses"] == ours["losses"] and r["norms"] == ours["norms"] for r in everyone),
        "grad_rel": max(rel_l2(g, reference["grads"][n]) for n, g in ours["grads"].items()),
        "grad_rel_max": max(rel(g, reference["grads"][n]) for n, g in ours["grads"].items()),
        "worst_grad": max(ours["grads"], key=lambda n: rel_l2(ours["grads"][n], reference["grads"][n])),
        "param_rel": max(rel_l2(p, reference["params"][n]) for n, p in ours["params"].items()),
        "worst_param": max(ours["params"], key=lambda n: rel_l2(ours["params"][n], reference["params"][n])),
    }


def pp2_tp2_cases() -> list[dict]:
    """4 processes: PP2 x TP2 for each layout."""
    pp = {"pp_size": 2, "tp_size": 2, "pp_microbatches": 2}
    cases = [{"model": {"bottleneck": None}, "parallel": {**pp, "tp_style": "megatron"}}]
    for bottleneck in ("cola", "svd", "lax"):
        cases.append({"model": {"bottleneck": bottleneck}, "parallel": {**pp, "tp_style": "vanilla"}})
        for rmsnorm in ("online", "sync"):
            for checkpointing in ("none", "lowrank"):
                cases.append({"model": {"bottleneck": bottleneck},
                              "parallel": {**pp, "tp_style": "btp", "rmsnorm": rmsnorm, "activation_checkpointing": checkpointing}})
    return cases


def other_cases() -> list[dict]:
    """4 processes: PP2 x DP2, PP4, interleaved and the other schedules."""
    return [
        {"model": {"bottleneck": "lax"}, "parallel": {"pp_size": 2, "pp_microbatches": 2}},  # PP2 x DP2
        {"model": {"bottleneck": "cola"}, "parallel": {"pp_size": 2, "pp_microbatches": 2, "pp_schedule": "gpipe"}},  # PP2 x DP2
        {"model": {"bottleneck": "lax"}, "parallel": {"pp_size": 4, "pp_microbatches": 4}},  # PP4
        {"model": {"bottleneck": "cola"}, "parallel": {"pp_size": 4, "pp_microbatches": 4, "pp_layer_split": (1, 1, 1, 1)}},
        {"model": {"bottleneck": "lax"}, "parallel": {"pp_size": 2, "pp_schedule": "interleaved-1f1b", "pp_microbatches": 2}},  # x DP2
        {"model": {"bottleneck": "lax"}, "parallel": {"pp_size": 2, "tp_size": 2, "pp_schedule": "interleaved-1f1b", "pp_microbatches": 2}},
    ]


def checkpoint_round_trip(folder: str) -> dict:
    """PP2 x TP2 (BTP, LaX) saves the canonical checkpoint; plain transformers loads it (the single-process model's
    weights), and from_pretrained at PP2 x TP2 reads back this rank's slices of it."""
    config = config_of({"model": {"bottleneck": "lax"}})
    parallel = ParallelConfig(pp_size=2, tp_size=2, pp_microbatches=2)
    torch.manual_seed(SEED)
    reference = BoostLlamaForCausalLM(config)
    torch.manual_seed(SEED)
    model = BoostLlamaForCausalLM(config, parallel_config=parallel)
    model.save_pretrained(folder)
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    plain_rel = max(rel(p.detach(), dict(reference.named_parameters())[n].detach()) for n, p in plain.named_parameters())
    loaded = BoostLlamaForCausalLM.from_pretrained(folder, parallel_config=parallel)
    mine = dict(model.named_parameters())
    loaded_rel = max(rel(p.detach(), mine[n].detach()) for n, p in loaded.named_parameters())
    ids, labels = batches()[0]
    loss = float(loaded.pipeline.eval_step(ids, labels)[0] / loaded.pipeline.eval_step(ids, labels)[1])
    with torch.no_grad():
        ref_loss = float(reference(ids, labels=labels).loss)
    return {"plain_rel": plain_rel, "loaded_rel": loaded_rel, "same_names": sorted(mine) == sorted(n for n, _ in loaded.named_parameters()),
            "eval_loss_rel": abs(loss - ref_loss) / ref_loss}


def bad_configurations() -> dict:
    """Each bad pipeline configuration raises ValueError on every rank before any collective (no hang)."""
    world = dist.get_world_size()
    attempts = {
        "pp_not_dividing_world": lambda: BoostLlamaForCausalLM(config_of({}), parallel_config=ParallelConfig(pp_size=world - 1)),
        "more_stages_than_layers": lambda: BoostLlamaForCausalLM(config_of({}), parallel_config=ParallelConfig(pp_size=2, pp_stages_per_rank=3, pp_schedule="interleaved-1f1b")),
        "layer_split": lambda: BoostLlamaForCausalLM(config_of({}), parallel_config=ParallelConfig(pp_size=2, pp_layer_split=(1, 2))),
        "too_few_microbatches": lambda: ParallelConfig(pp_size=2, pp_microbatches=1),
        "tied": lambda: BoostLlamaForCausalLM(config_of({"model": {"tie_word_embeddings": True}}), parallel_config=ParallelConfig(pp_size=2)),
        "unknown_schedule": lambda: ParallelConfig(pp_size=2, pp_schedule="1f1f"),
        "zero_bubble": lambda: ParallelConfig(pp_size=2, pp_schedule="zbv"),
        "microbatches_not_dividing_batch": lambda: _step(ParallelConfig(pp_size=2, pp_microbatches=3)),
    }
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            messages[name] = None
        except ValueError as err:
            messages[name] = str(err)
    dist.barrier()  # every rank got here: nobody hangs in a collective
    return messages


def _step(parallel):
    ids, labels = batches()[0]
    BoostLlamaForCausalLM(config_of({}), parallel_config=parallel).pipeline.train_step(ids, labels)


def everything() -> dict:
    with shared_temporary_directory() as tmp:
        round_trip = checkpoint_round_trip(tmp + "/ckpt")
    return {
        "round_trip": round_trip,
        "bad": bad_configurations(),
        "parity": [parity_case(case) for case in pp2_tp2_cases() + other_cases()],
    }
