"""Pipeline-parallel cases run inside one launched process group (tests/parallel/test_pipeline.py).

Every rank builds the single-process reference from the same seed and compares what it holds: the loss of
each step, every gradient of the first step and every parameter after two AdamW steps with gradient
clipping by the global norm, each tensor by the TP suite's metric (:func:`~tests.parallel.tp_cases.rel`: largest
element-wise difference over the largest element). The reference accumulates the step's gradient over the same
micro-batches (in DP-rank order), each loss the micro-batch's token sum over the step's token count: the
single-process step in the pipeline's summation order. AdamW runs with ``eps=1e-3`` (:func:`optimizer_of`).
The worst gradient measured is 6.9e-6 (a B of btp/vanilla cola). An earlier round measured 1.02e-5 on a LaX
latent-LayerNorm weight's gradient (vanilla, the first layer after the stage cut), under the earlier LaX definition:
there the single-process fp32 gradient of that tensor was itself 4.5e-6 from the same step in fp64 (its fp32 floor),
so two fp32 summation orders could differ by twice that; under the authors' definition (now) its floor is 8e-7 and
the worst floor of any LaX gradient 2.7e-6.

The second step also counts what crosses the stage boundaries: the tensors each rank sends point-to-point
(activations forward, gradients backward, through the engine's one send path) against
:func:`~boost_hf.perf.comm_formula.stage_boundary_communication`, and under btp and vanilla the all-gathers over TP
(LaX's shared latents) against the same formula plus the layers' and the last stage's own.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from boost_hf import BoostLlamaForCausalLM, ParallelConfig
from boost_hf.parallel.comm_counter import CommCounter
from boost_hf.parallel.pipeline import stage_ranks
from boost_hf.parallel.sharding import gather_full, shard_spec_of
from boost_hf.perf.comm_formula import layer_communication, outside_layers_communication, stage_boundary_communication
from boost_hf.training.grad_norm import clip_grad_norm_
from tests.parallel.tp_cases import SEED, rel, shared_temporary_directory, tiny_config

LAYERS = 4
BATCH, SEQ = 4, 8
MAX_NORM = 0.5  # below the initial gradient norm: clipping acts
STEPS = 2


def config_of(case: dict):
    return tiny_config(num_hidden_layers=LAYERS, **case.get("model", {}))


def batches(seq: int = SEQ, *, steps: int = STEPS, batch: int = BATCH):
    """The global batch of each of ``steps`` steps: ``(input_ids, labels)`` ``[batch, seq]``, some targets ignored."""
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 128, (batch, seq), generator=gen)
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


def reference_run(config, pieces: int, seq: int = SEQ, *, steps: int = STEPS, batch: int = BATCH) -> dict:
    """One process, ``steps`` steps of :func:`batches`; each step's batch in ``pieces`` micro-batches of consecutive rows,
    gradients accumulated. The initial and final parameters, each step's loss and grad norm, the first step's
    gradients."""
    torch.manual_seed(SEED)
    model = BoostLlamaForCausalLM(config)
    model.train()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = optimizer_of(model)
    losses, norms, grads = [], [], None
    for step, (ids, labels) in enumerate(batches(seq, steps=steps, batch=batch)):
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
    return {"losses": losses, "norms": norms, "grads": grads, "initial": initial, "params": params}


@contextlib.contextmanager
def counting_point_to_point():
    """Record the size of every tensor this rank sends through the pipelining engine's point-to-point path
    (``schedules._batch_p2p``, which every schedule's sends go through)."""
    from torch.distributed.pipelining import schedules

    sent: list[int] = []
    original = schedules._batch_p2p

    def counted(ops, desc=None):
        sent.extend(op.tensor.numel() for op in ops if op.op is dist.isend)
        return original(ops, desc=desc)

    schedules._batch_p2p = counted
    try:
        yield sent
    finally:
        schedules._batch_p2p = original


def pipeline_run(config, parallel: ParallelConfig, seq: int = SEQ) -> dict:
    torch.manual_seed(SEED)
    model = BoostLlamaForCausalLM(config, parallel_config=parallel)
    model.train()
    state, pipeline = model.plan.state, model.pipeline
    optimizer = optimizer_of(model)
    rows = BATCH // state.dp_size
    losses, norms, grads = [], [], None
    for step, (ids, labels) in enumerate(batches(seq)):
        mine = slice(state.dp_rank * rows, (state.dp_rank + 1) * rows)
        with counting_point_to_point() as sent, CommCounter() as collectives:  # (only the second step's are kept)
            loss = pipeline.train_step(ids[mine], labels[mine])
        norms.append(float(clip_grad_norm_(model.parameters(), MAX_NORM, state.tp_group, state.pp_group)))
        if step == 0:
            grads = {n: gather_full(p.grad, shard_spec_of(p), state.tp_group) for n, p in model.named_parameters()}
        if step == 1:  # a step's traffic: the first also initialises the stages (torch 2.11 sends each neighbour 1 element)
            second_step = {"sends": len(sent), "elements": sum(sent), "all_gather": collectives.by_kind["all_gather"].elements}
        losses.append(float(loss))
        optimizer.step()
        optimizer.zero_grad()
    params = {n: gather_full(p.detach(), shard_spec_of(p), state.tp_group) for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "grads": grads, "params": params, "pp_rank": state.pp_rank, **second_step}


def expected_boundary_traffic(config, parallel: ParallelConfig, pp_rank: int, dp_size: int, seq: int) -> dict:
    """What this pipeline rank sends point-to-point in one step by the formula, ``m`` micro-batches: each of its
    stages sends one boundary's tensors forward (all but the last) and one backward (all but the first); and,
    under btp and vanilla (whose all-gathers outside the layers, if any, are the last stage's), the elements its
    all-gathers over TP move: the boundary's shared latents (the receiving stage forward, the sending stage
    backward), the layers' it holds and the last stage's."""
    m = parallel.microbatches
    tokens = BATCH // dp_size // m * seq
    boundary = stage_boundary_communication(config, parallel, tokens)
    stages = [s for s, rank in enumerate(stage_ranks(parallel)) if rank == pp_rank]
    crossings = sum(int(s < parallel.num_stages - 1) + int(s > 0) for s in stages)
    layers = [i for s in stages for i in parallel.stage_layers(config.num_hidden_layers)[s]]
    gathered = crossings * boundary.tp_collectives["all_gather"].elements
    for i in layers:
        layer = layer_communication(config, parallel, tokens, i)
        gathered += layer.forward["all_gather"].elements + layer.backward["all_gather"].elements
    if parallel.num_stages - 1 in stages:
        outside = outside_layers_communication(config, parallel, tokens)
        gathered += outside.forward["all_gather"].elements + outside.backward["all_gather"].elements
    return {"sends": m * crossings * boundary.sends, "elements": m * crossings * boundary.elements, "all_gather": m * gathered}


def parity_case(case: dict) -> dict:
    config = config_of(case)
    parallel = ParallelConfig(**case["parallel"])
    dp_size = dist.get_world_size() // (parallel.tp_size * parallel.pp_size)
    seq = case.get("seq", SEQ)
    reference = reference_run(config, dp_size * parallel.microbatches, seq)
    ours = pipeline_run(config, parallel, seq)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"losses": ours["losses"], "norms": ours["norms"], "names": sorted(ours["params"])})
    held = set().union(*(set(r["names"]) for r in everyone))
    grads = {n: rel(g, reference["grads"][n]) for n, g in ours["grads"].items()}
    params = {n: rel(p, reference["params"][n]) for n, p in ours["params"].items()}
    expected = expected_boundary_traffic(config, parallel, ours["pp_rank"], dp_size, seq)
    counted_gathers = parallel.tp_style != "megatron"  # megatron's outside all-gathers sit on both end stages
    return {
        "case": case,
        "names_canonical": set(ours["params"]) <= set(reference["params"]) and held == set(reference["params"]),
        "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], reference["losses"])),
        "norm_rel": max(abs(a - b) / abs(b) for a, b in zip(ours["norms"], reference["norms"])),
        "same_on_ranks": all(r["losses"] == ours["losses"] and r["norms"] == ours["norms"] for r in everyone),
        "grad_rel": max(grads.values()),
        "worst_grad": max(grads, key=grads.get),
        "param_rel": max(params.values()),
        "worst_param": max(params, key=params.get),
        "p2p": {"counted": (ours["sends"], ours["elements"]), "formula": (expected["sends"], expected["elements"])},
        "tp_all_gather": {"counted": ours["all_gather"] if counted_gathers else None,
                          "formula": expected["all_gather"] if counted_gathers else None},
    }


def pp2_tp2_cases() -> list[dict]:
    """4 processes: PP2 x TP2 for each layout, with sequence parallelism for megatron and btp (cola, and LaX with
    low-rank checkpointing); the tensor train under btp with low-rank checkpointing."""
    pp = {"pp_size": 2, "tp_size": 2, "pp_microbatches": 2}
    sequence_parallel = {**pp, "sequence_parallel": True}
    cases = [
        {"model": {"bottleneck": None}, "parallel": {**pp, "tp_style": "megatron"}},
        {"model": {"bottleneck": None}, "parallel": {**sequence_parallel, "tp_style": "megatron"}},
        {"model": {"bottleneck": "cola"}, "parallel": {**sequence_parallel, "tp_style": "btp", "rmsnorm": "online"}},
        {"model": {"bottleneck": "lax"}, "parallel": {**sequence_parallel, "tp_style": "btp", "activation_checkpointing": "lowrank"}},
        {"model": {"bottleneck": "tt"}, "parallel": {**pp, "tp_style": "btp", "activation_checkpointing": "lowrank"}},
    ]
    for bottleneck in ("cola", "svd", "lax"):
        cases.append({"model": {"bottleneck": bottleneck}, "parallel": {**pp, "tp_style": "vanilla"}})
        for rmsnorm in ("online", "sync"):
            for checkpointing in ("none", "lowrank"):
                cases.append({"model": {"bottleneck": bottleneck},
                              "parallel": {**pp, "tp_style": "btp", "rmsnorm": rmsnorm, "activation_checkpointing": checkpointing}})
    return cases


def other_cases() -> list[dict]:
    """4 processes: PP2 x DP2, PP4, interleaved and the other schedules; LaX latents that cannot be shared."""
    return [
        {"model": {"bottleneck": "lax"}, "parallel": {"pp_size": 2, "pp_microbatches": 2}},  # PP2 x DP2
        {"model": {"bottleneck": "cola"}, "parallel": {"pp_size": 2, "pp_microbatches": 2, "pp_schedule": "gpipe"}},  # PP2 x DP2
        {"model": {"bottleneck": "lax"}, "parallel": {"pp_size": 4, "pp_microbatches": 4}},  # PP4
        {"model": {"bottleneck": "cola"}, "parallel": {"pp_size": 4, "pp_microbatches": 4, "pp_layer_split": (1, 1, 1, 1)}},
        {"model": {"bottleneck": "lax"}, "parallel": {"pp_size": 2, "pp_schedule": "interleaved-1f1b", "pp_microbatches": 2}},  # x DP2
        {"model": {"bottleneck": "lax"}, "parallel": {"pp_size": 2, "tp_size": 2, "pp_schedule": "interleaved-1f1b", "pp_microbatches": 2}},
        # micro-batches of 1 x 7 tokens: TP2 does not divide them, so every TP rank sends LaX's latents whole
        {"model": {"bottleneck": "lax"}, "parallel": {"pp_size": 2, "tp_size": 2, "pp_microbatches": 4}, "seq": 7},
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
