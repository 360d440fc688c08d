"""What one tensor-parallel rank's decoder layer costs: counted (any machine, seconds) and measured.

One rank of a ``tp_size``-way layout runs alone under a *fake* process group
(:mod:`boost_hf.perf.fake_group`): every collective returns at once, so the rank does exactly its own compute. A layer's cost is the difference between two models of the same configuration
with ``L1`` and ``L2`` decoder layers, divided by ``L2 - L1``: embedding, LM head and loss cancel
(``L1 >= 1`` also cancels the first block, which differs under LaX).

A training step is what ``transformers.Trainer`` runs: forward with labels and no KV cache
(``TrainingArguments.use_cache`` is ``False``), backward, optimizer.

* :func:`count_rank_layer` counts forward + backward under ``FakeTensorMode``, in either precision large-scale
  training runs: bf16 autocast over fp32 parameters (the default), or bf16 parameters without autocast
  (``param_dtype=torch.bfloat16, autocast_dtype=None``: DeepSpeed's bf16 mode, Megatron-LM's, fp32 master
  weights living in the optimizer). It counts GEMM and attention FLOPs, non-GEMM bytes and ops per aten op (:class:`~boost_hf.perf.op_counter.OpCounter`),
  and collectives (:class:`~boost_hf.parallel.comm_counter.CommCounter`). Fake tensors have no storage,
  so real 7B shapes run on a laptop. The model is built on the ``meta`` device (outside fake mode: setting
  up the process-group mesh reads real values) and its parameters and buffers are then replaced by fake
  tensors of the same shapes, keeping the Python attributes (sharding metadata) and gradient hooks of each parameter and which
  parameters share one storage (:mod:`boost_hf.parallel.shared_storage`).
* :func:`measure_rank_layer` / :func:`measure_rank_layers` time real training steps (forward, backward,
  AdamW) on the local device, eager or with ``torch.compile``-d decoder layers, variants interleaved, medians.

Both need a fake process group whose world size every ``tp_size`` divides: :func:`fake_process_group`
opens one (:func:`count_rank_layer` opens one of ``tp_size`` ranks if none is open).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from contextlib import contextmanager
from unittest import mock
from typing import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from ..parallel.comm_counter import CommCounter
from ..parallel.communication import COLLECTIVE_KINDS
from ..parallel.shared_storage import cast_parameters
from ..parallel.state import reset_parallel_states
from ..parallel.compile import compile_model
from .activation_memory import SavedTensorsProbe
from .fake_group import close_fake_process_group, open_fake_process_group
from .op_counter import DISPATCH_KINDS, DispatchCounter, OpCounter

DEFAULT_LAYERS = (1, 3)


# ---------------------------------------------------------------------------------------------- process group
def _require_fake_process_group(tp_size: int) -> None:
    """Open a fake process group of ``tp_size`` ranks if none is open; refuse a real one or a world size
    ``tp_size`` does not divide."""
    if not dist.is_initialized():
        open_fake_process_group(tp_size)
        return
    backend, world = dist.get_backend(), dist.get_world_size()
    if backend != "fake":
        raise RuntimeError(
            f"A {backend!r} process group is open: one rank's cost is counted under a fake process group only. "
            "Run it in a process of its own."
        )
    if world % tp_size:
        raise ValueError(
            f"The fake process group has {world} ranks, which tp_size={tp_size} does not divide: open it with "
            "`fake_process_group(world_size)` for a world size every TP size divides (e.g. their product)."
        )


@contextmanager
def fake_process_group(world_size: int, *, write_reduce_scatter: bool = True):
    """Open a fake process group of ``world_size`` ranks (this process is rank 0; collectives do nothing)
    and close it on exit, with the process groups cached on it. Every ``tp_size`` counted or measured inside
    must divide ``world_size``. ``write_reduce_scatter=False``: the backend's reduce-scatter without the stand-in
    that writes its output (:func:`~boost_hf.perf.fake_group.open_fake_process_group`), for timings."""
    open_fake_process_group(world_size, write_reduce_scatter=write_reduce_scatter)
    try:
        yield
    finally:
        close_fake_process_group()
        reset_parallel_states()


# ---------------------------------------------------------------------------------------------- models
def _layer_config(config, layers: int, seq: int):
    """``config`` with ``layers`` decoder layers and room for ``seq`` positions."""
    return type(config).from_dict(
        {**config.to_dict(), "num_hidden_layers": layers, "max_position_embeddings": max(seq, config.max_position_embeddings)}
    )


def _build(config, parallel):
    from ..modeling_boost_llama import BoostLlamaForCausalLM

    return BoostLlamaForCausalLM(config, parallel_config=parallel).train()


def build_fake_model(config, parallel, fake_mode, param_dtype: torch.dtype | None = None) -> nn.Module:
    """A ``BoostLlamaForCausalLM`` whose parameters and buffers are CPU fake tensors of ``fake_mode`` (a
    ``FakeTensorMode``), the parameters in ``param_dtype`` (``None``: as built, fp32; buffers keep theirs). Call it
    outside fake mode: the model is first built on ``meta`` (see the module docstring). The parameters' gradient
    hooks (e.g. the all-reduce of a replicated parameter that sees only this rank's tokens under sequence
    parallelism) are registered on their fakes."""
    with torch.device("meta"):
        model = _build(config, parallel)
        if param_dtype is not None:
            cast_parameters(model, param_dtype)
    fakes: dict[int, torch.Tensor] = {}  # tied tensors stay tied
    storages: dict[StorageWeakRef, torch.Tensor] = {}  # parameters stored together stay together
    with fake_mode:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, tensor in table.items():
                    if tensor is None:
                        continue
                    if id(tensor) not in fakes:
                        key = StorageWeakRef(tensor.untyped_storage())
                        if key not in storages:
                            elements = tensor.untyped_storage().nbytes() // tensor.element_size()
                            storages[key] = torch.empty(elements, dtype=tensor.dtype, device="cpu")
                        fake = storages[key].as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())
                        if isinstance(tensor, nn.Parameter):
                            fake = nn.Parameter(fake, requires_grad=tensor.requires_grad)
                            for hook in (tensor._backward_hooks or {}).values():  # e.g. a gradient all-reduce
                                fake.register_hook(hook)
                        fake.__dict__.update(tensor.__dict__)
                        fakes[id(tensor)] = fake
                    table[name] = fakes[id(tensor)]
    return model


# ---------------------------------------------------------------------------------------------- counting
@contextmanager
def _rows_are_unpacked():
    """Without an attention mask or a cache, ``transformers`` looks for packed sequences in ``position_ids``
    (a data-dependent test); on fake tensors it cannot look, assumes packing and builds an explicit
    ``[B, 1, S, S]`` mask, so SDPA would run its masked kernel. The counted batch holds one sequence per row:
    answer as real tensors do (no packing: the causal kernel, no mask)."""
    from transformers import masking_utils

    with mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda position_ids: None):
        yield


def _count_model(config, parallel, micro_batch: int, seq: int, autocast_dtype, param_dtype) -> dict[str, dict[str, int]]:
    """Flat counts ``{"forward" | "backward": {key: value}}`` of one training step of a whole model."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    passes = {}
    fake_mode = FakeTensorMode()
    model = build_fake_model(config, parallel, fake_mode, param_dtype)
    saved = SavedTensorsProbe(model)
    with fake_mode, _rows_are_unpacked():
        input_ids = torch.zeros(micro_batch, seq, dtype=torch.long)
        with OpCounter() as ops, CommCounter() as comm:
            with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
                loss = model(input_ids, labels=input_ids, use_cache=False).loss
        passes["forward"] = {**_flat(ops, comm), "saved_bytes": saved.saved_bytes}
        saved.remove()
        with OpCounter() as ops, CommCounter() as comm:
            loss.backward()
        passes["backward"] = _flat(ops, comm)
    return passes


def _flat(ops: OpCounter, comm: CommCounter) -> dict[str, int]:
    flat = {"gemm_flops": ops.gemm_flops, "attention_flops": ops.attention_flops}
    flat.update({f"bytes/{op}": n for op, n in ops.bytes_by_op.items()})
    flat.update({f"ops/{op}": n for op, n in ops.ops_by_op.items()})
    for kind, record in comm.as_dict().items():
        flat.update({f"{kind}/{field}": n for field, n in record.items()})
    return flat


def _per_layer(more: dict[str, int], fewer: dict[str, int], span: int) -> dict[str, float]:
    """``(more - fewer) / span`` per key (an int when exact), zero differences dropped."""
    out = {}
    for key in more.keys() | fewer.keys():
        diff = more.get(key, 0) - fewer.get(key, 0)
        if diff:
            out[key] = diff // span if diff % span == 0 else diff / span
    return out


def _summary(flat: dict[str, float]) -> dict:
    """The nested per-pass dict of :func:`count_rank_layer` from flat per-layer counts."""
    by_op = {
        key.split("/", 1)[1]: {"bytes": flat.get(key, 0), "ops": flat.get("ops/" + key.split("/", 1)[1], 0)}
        for key in flat
        if key.startswith("bytes/")
    }
    by_op = dict(sorted(by_op.items(), key=lambda item: -item[1]["bytes"]))
    collectives: dict[str, dict] = {}
    for key, n in flat.items():
        kind, _, field = key.partition("/")
        if kind in COLLECTIVE_KINDS:
            collectives.setdefault(kind, {"calls": 0, "elements": 0, "bytes": 0})[field] = n
    return {
        "gemm_flops": flat.get("gemm_flops", 0),
        "attention_flops": flat.get("attention_flops", 0),
        "non_gemm_bytes": sum(v["bytes"] for v in by_op.values()),
        "non_gemm_ops": sum(v["ops"] for v in by_op.values()),
        "non_gemm_by_op": by_op,
        "collectives": dict(sorted(collectives.items())),
        "saved_bytes": flat.get("saved_bytes", 0),
    }


def count_rank_layer(
    config, parallel, micro_batch: int, seq: int, *, layers: tuple[int, int] = DEFAULT_LAYERS,
    autocast_dtype: torch.dtype | None = torch.bfloat16, param_dtype: torch.dtype | None = None,
) -> dict:
    """Counted cost of one decoder layer on one tensor-parallel rank, per training micro-batch.

    Args:
        config: a ``BoostLlamaConfig`` (its ``num_hidden_layers`` is replaced by ``layers``).
        parallel: a ``ParallelConfig``; ``parallel.check_model(config)`` must pass.
        micro_batch, seq: the micro-batch is ``micro_batch x seq`` tokens.
        layers: ``(L1, L2)``, the layer counts of the two models differenced.
        autocast_dtype: CPU autocast dtype of the forward (``None``: no autocast, the parameters' dtype throughout).
        param_dtype: the parameters' dtype (``None``: fp32). bf16 parameters without autocast
            (``param_dtype=torch.bfloat16, autocast_dtype=None``) is how DeepSpeed's bf16 mode and Megatron-LM train.

    Returns ``{"forward", "backward", "total"}``, each a dict with the per-layer ``gemm_flops``,
    ``attention_flops``, ``non_gemm_bytes``, ``non_gemm_ops``, ``non_gemm_by_op`` (``{op: {"bytes",
    "ops"}}``, most bytes first) and ``collectives`` (``{kind: {"calls", "elements", "bytes"}}``, comparable
    with ``comm_formula.layer_communication``) and ``saved_bytes`` (what the forward keeps for backward:
    unique storages, parameters excluded, :class:`~boost_hf.perf.activation_memory.SavedTensorsProbe`; 0 in
    ``"backward"``); plus ``"tokens"`` and ``"layers"``. See
    :mod:`boost_hf.perf.op_counter` for what each count includes.
    """
    parallel.check_model(config)
    _require_fake_process_group(parallel.tp_size)
    fewer, more = (
        _count_model(_layer_config(config, n, seq), parallel, micro_batch, seq, autocast_dtype, param_dtype) for n in layers
    )
    span = layers[1] - layers[0]
    per_pass = {name: _per_layer(more[name], fewer[name], span) for name in ("forward", "backward")}
    forward, backward = per_pass["forward"], per_pass["backward"]
    total = {key: forward.get(key, 0) + backward.get(key, 0) for key in forward.keys() | backward.keys()}
    return {
        "tokens": micro_batch * seq,
        "layers": tuple(layers),
        **{name: _summary(flat) for name, flat in (*per_pass.items(), ("total", total))},
    }


def _dispatches_of_model(config, parallel, micro_batch: int, seq: int, autocast_dtype, param_dtype) -> dict[str, Counter]:
    """``{"forward" | "backward": Counter((kind, op) -> calls)}`` of one training step of a whole model."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode()
    model = build_fake_model(config, parallel, fake_mode, param_dtype)
    with fake_mode, _rows_are_unpacked():
        input_ids = torch.zeros(micro_batch, seq, dtype=torch.long)
        with DispatchCounter() as forward:
            with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
                loss = model(input_ids, labels=input_ids, use_cache=False).loss
        with DispatchCounter() as backward:
            loss.backward()
    return {"forward": forward.by_op, "backward": backward.by_op}


def count_rank_layer_dispatches(
    config, parallel, micro_batch: int = 1, seq: int = 128, *, layers: tuple[int, int] = DEFAULT_LAYERS,
    autocast_dtype: torch.dtype | None = None, param_dtype: torch.dtype | None = torch.bfloat16,
) -> dict:
    """The ops one decoder layer on one tensor-parallel rank dispatches per training step (forward with labels, no KV
    cache; backward), as :class:`~boost_hf.perf.op_counter.DispatchCounter` counts them: the difference of an ``L2``- and
    an ``L1``-layer model over ``L2 - L1`` (fake tensors: any shape, in seconds; the counts do not depend on the sizes,
    only on the model's structure). Default precision: bf16 parameters without autocast (the default training policy).

    Returns ``{"forward", "backward", "total"}``, each ``{"launches", "gemm", "attention", "collective", "other", "view",
    "free", "by_op": {"kind/op": calls}}`` (``launches``: the ops that launch work, :data:`DISPATCH_KINDS`)."""
    parallel.check_model(config)
    _require_fake_process_group(parallel.tp_size)
    fewer, more = (_dispatches_of_model(_layer_config(config, n, seq), parallel, micro_batch, seq, autocast_dtype, param_dtype)
                   for n in layers)
    span = layers[1] - layers[0]
    out = {}
    for name in ("forward", "backward"):
        diff = Counter(more[name])
        diff.subtract(fewer[name])
        out[name] = {f"{kind}/{op}": n / span for (kind, op), n in diff.items() if n}
    out["total"] = dict(Counter(out["forward"]) + Counter(out["backward"]))
    summary = {}
    for name, by_op in out.items():
        kinds = Counter()
        for key, n in by_op.items():
            kinds[key.split("/", 1)[0]] += n
        summary[name] = {"launches": sum(kinds[k] for k in DISPATCH_KINDS), **{k: kinds[k] for k in (*DISPATCH_KINDS, "view", "free")},
                         "by_op": dict(sorted(by_op.items(), key=lambda item: (-item[1], item[0])))}
    return summary


#: REVIEW-2's fit of eager H100 time (bf16 autocast, 7B TP4, N = 8192: five layouts predicted within ~10 %):
#: GEMM FLOPs at the achieved GEMM rate (full-rank shapes / the thinner low-rank shapes), non-GEMM bytes at
#: the achieved memory bandwidth, a launch-and-latency cost per non-GEMM op, and the attention kernels at the
#: rate that gives the review's ~0.5 ms for heads split 4 ways at that shape (206 GFLOP; vanilla's all-head
#: attention, 4x the FLOPs, then gets its measured ~2 ms too).
H100_EAGER_FIT = dict(full_rank_gemm_flops_per_s=650e12, low_rank_gemm_flops_per_s=450e12, bytes_per_s=2.5e12,
                      seconds_per_op=5e-6, attention_flops_per_s=412e12)


def predicted_h100_eager_ms(summary: dict, *, low_rank: bool) -> float:
    """Eager H100 milliseconds of a counted pass (``count_rank_layer(...)["total"]``) by :data:`H100_EAGER_FIT`;
    ``low_rank``: the GEMMs are a bottleneck model's (A's and B's)."""
    fit = H100_EAGER_FIT
    gemm_rate = fit["low_rank_gemm_flops_per_s" if low_rank else "full_rank_gemm_flops_per_s"]
    seconds = (summary["gemm_flops"] / gemm_rate + summary["attention_flops"] / fit["attention_flops_per_s"]
               + summary["non_gemm_bytes"] / fit["bytes_per_s"] + summary["non_gemm_ops"] * fit["seconds_per_op"])
    return 1e3 * seconds


# ---------------------------------------------------------------------------------------------- measuring
def device_name(device: str) -> str:
    """The accelerator's name (``torch.cuda.get_device_name``) or the CPU's model name."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


def _step_fn(model, device: str, micro_batch: int, seq: int, autocast_dtype, compile: bool):
    """A zero-argument training step (forward with labels, backward, AdamW, gradients dropped)."""
    device_type = torch.device(device).type
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device_type == "cuda")
    input_ids = torch.randint(0, model.config.vocab_size, (micro_batch, seq), device=device,
                              generator=torch.Generator(device).manual_seed(0))
    if compile:
        compile_model(model)  # what BoostTrainer --torch_compile does

    def step() -> None:
        with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = model(input_ids, labels=input_ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device_type == "cuda":
            torch.cuda.synchronize(device)

    return step


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:200]


def measure_rank_layers(
    variants: Mapping[str, tuple], micro_batch: int, seq: int, *, device: str = "cpu", compile: bool = False,
    layers: tuple[int, int] = DEFAULT_LAYERS, autocast_dtype: torch.dtype | None = torch.bfloat16,
    param_dtype: torch.dtype | None = None, warmup: int = 2, reps: int = 10,
) -> dict[str, dict]:
    """Measured time of one decoder layer on one tensor-parallel rank, per training step, for each of
    ``variants`` (name -> ``(BoostLlamaConfig, ParallelConfig)``).

    For each variant two models (``L1`` and ``L2`` layers, real weights on ``device``) take training steps
    (forward with labels under autocast, backward, AdamW) round-robin with every other variant's, the
    starting model rotating each round; after ``warmup`` rounds, each of ``reps`` rounds gives
    ``(t(L2) - t(L1)) / (L2 - L1)``. ``param_dtype``: the parameters' dtype (``None``: fp32; AdamW then steps
    them directly, in that dtype). ``compile``: each model's decoder layers are compiled in place, as
    ``BoostTrainer --torch_compile`` does (:func:`~boost_hf.parallel.compile.compile_model`;
    ``warmup`` must be at least 1 to compile outside the timed rounds).

    Returns per variant ``{"ms_per_layer", "ms_per_layer_min", "ms_per_layer_max", "step_ms": {L: median}}``,
    or ``{"error": "compile failed: ..."}`` / ``{"error": "failed: ..."}`` where a model could not run.
    """
    steps: dict[tuple[str, int], object] = {}
    results: dict[str, dict] = {}
    failure = "compile failed" if compile else "failed"
    with torch._dynamo.config.patch(cache_size_limit=64, accumulated_cache_size_limit=1024):
        for name, (config, parallel) in variants.items():
            _require_fake_process_group(parallel.tp_size)
            try:
                for n in layers:
                    torch.manual_seed(0)
                    # drawn on the CPU (each weight from its own CPU generator), then moved: shared storage follows
                    model = _build(_layer_config(config, n, seq), parallel).to(device)
                    if param_dtype is not None:
                        cast_parameters(model, param_dtype)
                    steps[name, n] = _step_fn(model, device, micro_batch, seq, autocast_dtype, compile)
                    for _ in range(warmup):
                        steps[name, n]()
            except Exception as error:  # report the failing variant in the table, time the others
                results[name] = {"error": f"{failure}: {_first_line(error)}"}
                steps = {key: fn for key, fn in steps.items() if key[0] != name}
        times: dict[tuple[str, int], list[float]] = {key: [] for key in steps}
        keys = list(steps)
        for round_ in range(reps):
            start = round_ % max(len(keys), 1)
            for key in keys[start:] + keys[:start]:
                t = time.perf_counter()
                steps[key]()
                times[key].append(time.perf_counter() - t)
    span = layers[1] - layers[0]
    for name in dict.fromkeys(key[0] for key in keys):
        per_layer = [1e3 * (b - a) / span for a, b in zip(times[name, layers[0]], times[name, layers[1]])]
        results[name] = {
            "ms_per_layer": statistics.median(per_layer),
            "ms_per_layer_min": min(per_layer),
            "ms_per_layer_max": max(per_layer),
            "step_ms": {n: 1e3 * statistics.median(times[name, n]) for n in layers},
        }
    return {name: results[name] for name in variants}


def measure_rank_layer(config, parallel, micro_batch: int, seq: int, **kwargs) -> dict:
    """:func:`measure_rank_layers` of one variant: ``{"ms_per_layer", ...}`` or ``{"error": ...}``."""
    return measure_rank_layers({"layer": (config, parallel)}, micro_batch, seq, **kwargs)["layer"]


__all__ = [
    "DEFAULT_LAYERS",
    "H100_EAGER_FIT",
    "predicted_h100_eager_ms",
    "build_fake_model",
    "count_rank_layer",
    "count_rank_layer_dispatches",
    "device_name",
    "fake_process_group",
    "measure_rank_layer",
    "measure_rank_layers",
]
