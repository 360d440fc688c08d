"""FSDP2 (``fully_shard`` over the data-parallel group) cases run inside one launched process group of 4
(tests/parallel/test_fully_shard.py).

Every rank builds the single-process reference from the same seed and compares what it holds after FSDP2 over its DP
group of the TP x PP rank's shards (:mod:`boost_hf.parallel.fully_shard`, applied by
:func:`~boost_hf.parallel.parts.prepare_part` as the trainer's engines apply it): the loss of each of 3 steps, the
global gradient norm (clipped at ``MAX_NORM``, below it), every gradient of the first step after the reduction (each
rank's DP shard gathered over DP, then over TP) and every parameter after 3 AdamW steps, each tensor by the TP suite's
metric (:func:`~tests.parallel.tp_cases.rel`). The reference accumulates each step's gradient over the same
micro-batches in DP-rank order (the single-process step in the parallel run's summation order), AdamW with
``eps=1e-3`` (:func:`~tests.parallel.pp_cases.optimizer_of`).

The second step also counts FSDP2's collectives over the DP mesh (:class:`~boost_hf.parallel.comm_counter.CommCounter`
over the shard and replicate groups) against :func:`~boost_hf.perf.comm_formula.fully_shard_communication`; outside a
counter of those groups (before the first step, after the last, inside a counter of the TP group) every unit runs
torch's own collectives.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from boost_hf import BoostLlamaForCausalLM, ParallelConfig
from boost_hf.parallel.comm_counter import CommCounter
from boost_hf.parallel.fully_shard import FullyShard, fully_sharded_units, units_of
from boost_hf.parallel.parts import PartParallelism, prepare_part
from boost_hf.parallel.sharding import gather_full_many, shard_spec_of
from boost_hf.parallel.state import data_parallel_mesh
from boost_hf.perf.comm_formula import fully_shard_communication
from boost_hf.training.engine import HeldSharded
from boost_hf.training.grad_norm import clip_grad_norm_
from tests.parallel.pp_cases import batches as pipeline_batches
from tests.parallel.pp_cases import optimizer_of
from tests.parallel.pp_cases import reference_run as pipeline_reference_run
from tests.parallel.tp_cases import SEED, rel, tiny_config

LAYERS = 4
BATCH, SEQ = 8, 8
STEPS = 3
MAX_NORM = 0.5


def batches():
    """The global batch of each step: ``(input_ids, labels)`` ``[BATCH, SEQ]``, some targets ignored."""
    return pipeline_batches(SEQ, steps=STEPS, batch=BATCH)


def reference_run(config, pieces: int) -> dict:
    """One process, this file's steps and batch, in ``pieces`` micro-batches (:func:`~tests.parallel.pp_cases.reference_run`)."""
    return pipeline_reference_run(config, pieces, SEQ, steps=STEPS, batch=BATCH)


def canonical(model, tensor_of, tp_group) -> dict[str, torch.Tensor]:
    """``{name: the canonical tensor_of(parameter)}``: each FSDP2 shard gathered over DP (``full_tensor``), then the TP
    shards over TP."""
    names, params = zip(*model.named_parameters())
    local = [tensor_of(p) for p in params]
    local = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in local]
    return dict(zip(names, gather_full_many(local, [shard_spec_of(p) for p in params], tp_group)))


def fully_sharded_parts(model, how: FullyShard) -> list:
    """``model``'s parts (the model, or this rank's pipeline stages) prepared as the trainer's engines prepare them,
    FSDP2 applied as ``how`` says."""
    prepare = functools.partial(prepare_part, how=PartParallelism(data_parallel="fsdp2", fully_shard=how))
    pipeline = getattr(model, "pipeline", None)
    if pipeline is None:
        return [prepare(model)]
    pipeline.configure(wrap=prepare)
    return pipeline.stage_modules()


def runs_torch_collectives(parts) -> bool:
    """Every FSDP2 unit of ``parts`` runs torch's own all-gather and reduce-scatter (no counting hook installed) and
    no all-reduce hook."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    groups = [group for part in parts for unit in fully_sharded_units(part) for group in unit._get_fsdp_state()._fsdp_param_groups]
    return bool(groups) and all(type(g._all_gather_comm) is DefaultAllGather and type(g._reduce_scatter_comm) is DefaultReduceScatter
                                and g._all_reduce_hook is None for g in groups)


def fsdp_run(config, parallel: ParallelConfig, sharding: dict, micro_batches: int, initial: dict) -> dict:
    """The parallel run: the model split by ``parallel`` from the reference's ``initial`` weights (this rank's slices:
    a tied model built at TP does not draw the single-process model's), FSDP2 over its DP group as ``sharding`` says
    (FullyShard's fields but the mesh; ``dp_replicate_size``), ``micro_batches`` per DP rank and step (a pipeline's:
    its own)."""
    torch.manual_seed(SEED)
    model = BoostLlamaForCausalLM(config, parallel_config=parallel)
    model.train()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(shard_spec_of(param).local_slice(initial[name]))
    state = model.plan.state
    sharding = dict(sharding)
    mesh = data_parallel_mesh(state, sharding.pop("dp_replicate_size", 1))
    pipeline = getattr(model, "pipeline", None)
    how = FullyShard(mesh=mesh, pipeline=pipeline is not None, **sharding)
    parts = fully_sharded_parts(model, how)
    held = HeldSharded(model) if pipeline is None else None
    units = [u for part in parts for u in units_of(part, how)]
    optimizer = optimizer_of(model)
    groups = tuple(mesh.get_group(d) for d in range(mesh.ndim))
    rows = BATCH // state.dp_size
    losses, norms, grads, counted = [], [], None, None
    untouched = [runs_torch_collectives(parts)]
    for step, (ids, labels) in enumerate(batches()):
        mine = slice(state.dp_rank * rows, (state.dp_rank + 1) * rows)
        with CommCounter(groups=groups) as counter:
            if pipeline is not None:
                loss = float(pipeline.train_step(ids[mine], labels[mine]))
            else:
                tokens = int((labels[:, 1:] != -100).sum())
                loss = torch.zeros(())
                pieces = list(zip(ids[mine].chunk(micro_batches), labels[mine].chunk(micro_batches)))
                for i, (part_ids, part_labels) in enumerate(pieces):
                    with held.no_sync() if i < len(pieces) - 1 else contextlib.nullcontext():
                        # the mean over DP of (sum / all tokens) x dp: the sum over every DP rank's tokens / all tokens
                        part = held(part_ids, labels=part_labels, num_items_in_batch=tokens).loss * state.dp_size
                        part.backward()
                    loss += part.detach() / state.dp_size
                dist.all_reduce(loss, group=state.dp_group)
                loss = float(loss)
        if step == 1:
            counted = counter.counts()
            with CommCounter(groups=(state.tp_group,)):  # (the trainer's counter: TP's collectives only)
                untouched.append(runs_torch_collectives(parts))
        norms.append(float(clip_grad_norm_(model.parameters(), MAX_NORM, state.tp_group, state.pp_group)))
        if step == 0:
            grads = canonical(model, lambda p: p.grad, state.tp_group)
        losses.append(loss)
        optimizer.step()
        optimizer.zero_grad()
    untouched.append(runs_torch_collectives(parts))
    params = canonical(model, lambda p: p.detach(), state.tp_group)
    dtensors = all(type(p).__name__ == "DTensor" for p in model.parameters())
    attributes_kept = all(hasattr(p, "shard_spec") for p in model.parameters())
    expected = fully_shard_communication(units, how.shard_size, how.replicate_size,
                                         micro_batches=1 if pipeline is not None else micro_batches,
                                         pipeline=pipeline is not None).collectives.to_dict()
    return {"losses": losses, "norms": norms, "grads": grads, "params": params, "dtensors": dtensors,
            "attributes_kept": attributes_kept, "counted": counted, "expected": expected, "untouched": untouched}


def parity_case(case: dict) -> dict:
    config = tiny_config(num_hidden_layers=LAYERS, **case.get("model", {}))
    parallel = ParallelConfig(**case.get("parallel", {}))
    dp = dist.get_world_size() // (parallel.tp_size * parallel.pp_size)
    micro_batches = case.get("micro_batches", 1)
    pieces = dp * (parallel.microbatches if parallel.pp_size > 1 else micro_batches)
    reference = reference_run(config, pieces)
    ours = fsdp_run(config, parallel, case.get("sharding", {}), micro_batches, reference["initial"])
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"losses": ours["losses"], "norms": ours["norms"], "names": sorted(ours["params"])})
    held = set().union(*(set(r["names"]) for r in everyone))
    grads = {n: rel(g, reference["grads"][n]) for n, g in ours["grads"].items()}
    params = {n: rel(p, reference["params"][n]) for n, p in ours["params"].items()}
    return {
        "case": case,
        "every_parameter_held": held == set(reference["params"]),
        "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], reference["losses"])),
        "norm_rel": max(abs(a - b) / abs(b) for a, b in zip(ours["norms"], reference["norms"])),
        "clipped": min(reference["norms"]) > MAX_NORM,
        "same_on_ranks": all(r["losses"] == ours["losses"] and r["norms"] == ours["norms"] for r in everyone),
        "grad_rel": max(grads.values()),
        "worst_grad": max(grads, key=grads.get),
        "param_rel": max(params.values()),
        "worst_param": max(params, key=params.get),
        "dtensors": ours["dtensors"],
        "attributes_kept": ours["attributes_kept"],
        "counted": ours["counted"],
        "expected": ours["expected"],
        "torch_collectives_when_not_counting": ours["untouched"],
    }


def cases() -> list[dict]:
    """4 processes: FSDP2 at dp 4 (an embedding of 130 rows: dim 0 unevenly sharded, padded to 132), and at dp 2 x tp 2
    under each layout (btp and megatron with sequence parallelism, LaX under btp with latent sequence parallelism),
    HSDP 2 x 2, tied embeddings, the tensor train, gradient accumulation, one unit for the whole model; pp 2 x dp 2
    under 1F1B and interleaved 1F1B."""
    tp2 = {"tp_size": 2}
    return [
        {"model": {"bottleneck": "cola", "vocab_size": 130}, "micro_batches": 2},  # dp 4, accumulating without reducing
        {"model": {"bottleneck": "cola"}, "parallel": {**tp2, "tp_style": "btp", "sequence_parallel": True}},
        # LaX's gate and latent norm run on this rank's tokens: their TP reduction is in the forward graph
        {"model": {"bottleneck": "lax"}, "parallel": {**tp2, "tp_style": "btp", "sequence_parallel": True}},
        {"model": {"bottleneck": "lax"}, "parallel": {**tp2, "tp_style": "btp", "activation_checkpointing": "lowrank"}},
        {"model": {"bottleneck": "svd"}, "parallel": {**tp2, "tp_style": "vanilla"}},
        {"model": {"bottleneck": None}, "parallel": {**tp2, "tp_style": "megatron", "sequence_parallel": True}},
        {"model": {"bottleneck": "tt"}, "parallel": {**tp2, "tp_style": "btp"}},
        {"model": {"bottleneck": None, "tie_word_embeddings": True}, "parallel": {**tp2, "tp_style": "megatron"}},
        {"model": {"bottleneck": "cola"}, "sharding": {"dp_replicate_size": 2, "reshard_after_forward": "always"}},  # HSDP
        {"model": {"bottleneck": "cola"}, "sharding": {"layers_apart": False}},  # one unit (accelerate's NO_WRAP)
        {"model": {"bottleneck": "lax"}, "parallel": {"pp_size": 2, "pp_microbatches": 2}},  # pp 2 x dp 2, 1F1B
        {"model": {"bottleneck": "cola"}, "parallel": {"pp_size": 2, "pp_schedule": "interleaved-1f1b", "pp_microbatches": 4,
                                                       "activation_checkpointing": "full"}},
    ]


def folder_record(folder: str) -> dict:
    """What a saved folder says its model is: ``config.json``'s ``architectures`` and ``auto_map``, its Python files."""
    config = json.loads(open(os.path.join(folder, "config.json")).read())
    return {"architectures": config.get("architectures"), "auto_map": config.get("auto_map"),
            "python_files": sorted(name for name in os.listdir(folder) if name.endswith(".py"))}


def saved_under_wrappers(folder: str) -> dict:
    """A CoLA model at dp 4 saved under FSDP2 (``save_pretrained``, collective; and with an explicit whole
    ``state_dict``, by transformers' own ``save_pretrained``), and its files
    (:func:`~boost_hf.checkpoint.export.save_model_files`) under DDP and ``torch.compile``'s ``OptimizedModule``:
    each folder's :func:`folder_record` (rank 0's)."""
    from boost_hf.checkpoint.export import save_model_files

    def model():
        torch.manual_seed(SEED)
        return BoostLlamaForCausalLM(tiny_config(bottleneck="cola"), parallel_config=ParallelConfig())

    wrapped = {"ddp": torch.nn.parallel.DistributedDataParallel(model()), "compile": torch.compile(model())}
    if dist.get_rank() == 0:
        for name, wrapper in wrapped.items():
            os.makedirs(os.path.join(folder, name))
            save_model_files(wrapper, os.path.join(folder, name))
    model = model()
    mesh = data_parallel_mesh(model.plan.state, 1)
    fully_sharded_parts(model, FullyShard(mesh=mesh))
    model.save_pretrained(os.path.join(folder, "fsdp2"))
    whole = {name: t.full_tensor() if isinstance(t, DTensor) else t for name, t in model.state_dict().items()}  # collective
    model.save_pretrained(os.path.join(folder, "fsdp2-state-dict"), state_dict=whole)  # transformers' own, on rank 0
    names = ("fsdp2", "fsdp2-state-dict", *wrapped)
    return {name: folder_record(os.path.join(folder, name)) for name in names} if dist.get_rank() == 0 else {}


def everything(folder: str) -> dict:
    return {"cases": [parity_case(case) for case in cases()], "saved": saved_under_wrappers(folder)}
