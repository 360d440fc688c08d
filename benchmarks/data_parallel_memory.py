"""Peak memory per rank of a training step under DDP, DDP + ZeRO-1, FSDP2 and HSDP, measured beside the memory model.

The demo's model and micro-batch (``recipes/demo.yaml``: a 4-layer d=128 CoLA, r=32, vocabulary 4096; 8 sequences of
128 tokens per data-parallel rank; fp32, as the demo trains on CPU), on 4 gloo ranks at dp 4 and at tp 2 x dp 2
(btp), every variant built the way the trainer's engine builds it (:func:`~boost_hf.parallel.parts.prepare_part`:
DDP over the DP group, or ``fully_shard`` over it, HSDP's 2 x 2 mesh from
:func:`~boost_hf.parallel.state.data_parallel_mesh`; ZeRO-1 as torch's ``ZeroRedundancyOptimizer`` over AdamW with
the Trainer's two parameter groups). Per variant, on every rank:

* **measured peak**: the peak RSS of the third training step (forward, backward, AdamW, gradients set to ``None``)
  above the RSS before the model was built (``VmHWM`` reset through ``/proc/self/clear_refs``; the ranks are spawned
  with glibc unmapping every freed block above 64 KiB, so the RSS follows the live tensors whichever thread frees
  them): the parameters, the optimizer state, DDP's buckets, everything the step allocates, and what the model's
  modules and the process group hold besides (a few MiB). The rank with the largest peak is reported; the process's
  first case runs once more before, unreported (its first step also grows the RSS by what gloo and torch set up
  once). torch's profiler memory events were tried first and dropped: they miss the frees made on other threads
  (gloo's, DDP's reducer callbacks), so its running count only grows;
* **measured static**: the unique storages of the parameters, their gradients, AdamW's state (and DDP's buckets) after
  that step's backward (what ``tests/perf/test_memory_measured.py`` and ``tests/training/test_pipeline_resume.py``
  compare with the model exactly);
* **model**: :func:`boost_hf.perf.memory.memory_per_gpu` for the same layout without the framework allowance (no CUDA
  context, NCCL buffers or caching allocator on CPU), by part: static, FSDP2's working set (gathered parameters,
  unsharded gradients), activations kept and one layer's backward working set.

    python benchmarks/data_parallel_memory.py             # ~1 min on 2 cores
    python benchmarks/data_parallel_memory.py --quick     # 2 layers, d=64: a smoke test
"""

from __future__ import annotations

import gc

import torch

from common import (
    MIB,
    base_parser,
    parse,
    peak_rss_bytes,
    reset_peak_rss,
    returned_to_os_on_free,
    rss_bytes,
    save_figure,
    table,
    write_result,
)

WORLD = 4
LAYOUTS = {"dp 4": {}, "tp 2 x dp 2": {"tp_size": 2, "tp_style": "btp"}}
VARIANTS = {  # name -> (data_parallel, dp_replicate_size, zero1)
    "DDP": ("ddp", 1, False),
    "DDP + ZeRO-1": ("ddp", 1, True),
    "FSDP2": ("fsdp2", 1, False),
    "HSDP 2x2": ("fsdp2", 2, False),
}
QUICK_MODEL = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2, "rank": 16}


def cases() -> list[tuple[str, str]]:
    """(layout, variant): every variant at dp 4, all but HSDP (one replica of two ranks each) at tp 2 x dp 2."""
    return [(layout, variant) for layout in LAYOUTS for variant in VARIANTS if layout == "dp 4" or variant != "HSDP 2x2"]


def _unique_bytes(tensors) -> int:
    from torch.multiprocessing.reductions import StorageWeakRef

    storages = {}
    for tensor in tensors:
        if tensor is not None:
            local = tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor
            storages[StorageWeakRef(local.untyped_storage())] = local.untyped_storage().nbytes()
    return sum(storages.values())


def _build(config, layout: dict, variant: str):
    """The model of ``layout`` as the trainer's engine wraps it for ``variant``, its optimizer, and its DDP module."""
    from boost_hf import BoostLlamaForCausalLM, ParallelConfig
    from boost_hf.parallel.fully_shard import FullyShard
    from boost_hf.parallel.parts import PartParallelism, prepare_part
    from boost_hf.parallel.state import data_parallel_mesh
    from boost_hf.perf.memory import decay_parameter_names
    from boost_hf.training.zero1 import DataParallelShardedOptimizer

    backend, replicas, zero1 = VARIANTS[variant]
    torch.manual_seed(0)
    model = BoostLlamaForCausalLM(config, parallel_config=ParallelConfig(**layout)).train()
    state = model.plan.state
    decays = set(decay_parameter_names(model))
    if backend == "fsdp2":
        how = PartParallelism(data_parallel="fsdp2", fully_shard=FullyShard(mesh=data_parallel_mesh(state, replicas)))
    else:
        how = PartParallelism(data_parallel="ddp", dp_group=state.dp_group)
    wrapped = prepare_part(model, how)
    groups = [{"params": [p for n, p in model.named_parameters() if n in decays], "weight_decay": 0.01},
              {"params": [p for n, p in model.named_parameters() if n not in decays], "weight_decay": 0.0}]
    if zero1:
        optimizer = DataParallelShardedOptimizer(groups, optimizer_class=torch.optim.AdamW, process_group=state.dp_group, lr=1e-3)
    else:
        optimizer = torch.optim.AdamW(groups, lr=1e-3)
    return model, wrapped, optimizer, state


def memory_worker(spec: dict) -> list[dict]:
    """Runs on every rank (spawned with glibc unmapping freed tensors): per case, the peak RSS of the third step above
    the RSS before the model was built, and the static bytes after its backward."""
    from boost_hf import BoostLlamaConfig

    config = BoostLlamaConfig.from_dict(spec["config"])
    out = []
    for layout_name, variant in cases()[:1] + cases():  # the first once more, unreported: the process's first step
        gc.collect()                                     # also grows the RSS by what gloo and torch set up once
        before = rss_bytes()
        model, wrapped, optimizer, state = _build(config, LAYOUTS[layout_name], variant)
        ids = torch.randint(0, config.vocab_size, (spec["batch"], spec["seq"]),
                            generator=torch.Generator().manual_seed(state.dp_rank))
        for step in range(3):
            if step == 2:
                resettable = reset_peak_rss()
            wrapped(ids, labels=ids).loss.backward()
            if step == 2:
                params = list(model.parameters())
                inner = getattr(optimizer, "optim", optimizer)  # ZeRO-1's local optimizer holds the state
                buckets = (wrapped._get_ddp_logging_data()["bucket_sizes"]
                           if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel) else "")
                static = {
                    "parameters": _unique_bytes(params), "gradients": _unique_bytes(p.grad for p in params),
                    "optimizer_states": _unique_bytes(v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)),
                    "gradient_buckets": sum(int(n) for n in str(buckets).split(",") if n.strip()),
                }
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        peak = peak_rss_bytes() - before if resettable else None
        out.append({"layout": layout_name, "variant": variant, "peak": peak, "static": static,
                    "ranks": {"dp": state.dp_rank, "tp": state.tp_rank}, "dp_size": state.dp_size})
        del model, wrapped, optimizer, params, inner
    return out[1:]


def predicted(config, layout: dict, variant: str, dp: int, batch: int, seq: int) -> dict:
    """The memory model's bytes of the fullest rank, by part, without the framework allowance."""
    from boost_hf import ParallelConfig
    from boost_hf.data_parallel_config import DataParallelConfig
    from boost_hf.perf.memory import memory_per_gpu, static_memory

    backend, replicas, zero1 = VARIANTS[variant]
    data_parallel = DataParallelConfig(backend, replicas)
    parallel = ParallelConfig(**layout)
    (rank,) = memory_per_gpu(config, parallel, micro_batch=batch, seq_len=seq, num_micro_batches=1, dp_size=dp,
                             precision="fp32", zero1=zero1, data_parallel=data_parallel)
    statics = static_memory(config, parallel, dp_size=dp, precision="fp32", zero1=zero1, data_parallel=data_parallel)[0]
    return {"peak": rank.total - rank.framework, "static": rank.static, "statics": [s.total for s in statics],
            "gathered": rank.gathered_parameters, "unsharded_gradients": rank.unsharded_gradients,
            "activations": rank.activations + rank.weight_copies, "transient": rank.transient}


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    args, started = parse(parser)
    from boost_hf.perf.launcher import launch
    from boost_hf.perf.planner import plan_inputs

    inputs = plan_inputs(recipe="demo", gpus=WORLD)
    config = inputs.config
    if args.quick:
        config = type(config).from_dict({**config.to_dict(), **QUICK_MODEL})
    batch, seq = 8, inputs.seq_len  # the demo's per_device_train_batch_size and block_size
    spec = {"config": config.to_dict(), "batch": batch, "seq": seq}
    with returned_to_os_on_free():
        ranks = launch(memory_worker, WORLD, spec, timeout=3600)
    rows, results = [], {}
    for i, (layout, variant) in enumerate(cases()):
        measured = [r[i] for r in ranks]
        dp = measured[0]["dp_size"]
        model = predicted(config, LAYOUTS[layout], variant, dp, batch, seq)
        static_measured = [sum(m["static"].values()) for m in measured]
        static_equal = all(s == model["statics"][m["ranks"]["dp"]] for s, m in zip(static_measured, measured))
        fullest = max(range(WORLD), key=lambda rank: measured[rank]["peak"])
        peak, static = measured[fullest]["peak"], static_measured[fullest]
        results[(layout, variant)] = {"peak": peak, "static": static, **{f"model_{k}": v for k, v in model.items()}}
        ddp = results[(layout, "DDP")]
        # FSDP2's working set as measured: what its step holds beyond its static bytes, less what DDP's holds beyond
        # its own (the same activations and backward)
        working = (peak - static) - (ddp["peak"] - ddp["static"])
        rows.append([
            layout, variant,
            f"{static / MIB:.2f}", f"{model['statics'][measured[fullest]['ranks']['dp']] / MIB:.2f}",
            "yes" if static_equal else "**NO**",
            f"{(peak - static) / MIB:.2f}", f"{(model['peak'] - model['static']) / MIB:.2f}",
            f"{working / MIB:.2f}" if VARIANTS[variant][0] == "fsdp2" else "-",
            f"{(model['gathered'] + model['unsharded_gradients']) / MIB:.2f}" if VARIANTS[variant][0] == "fsdp2" else "-",
            f"{peak / MIB:.2f}", f"{model['peak'] / MIB:.2f}", f"{model['peak'] / peak:.2f}",
        ])
    body = [
        f"The demo's model ({config.num_hidden_layers} layers, d={config.hidden_size}, r={config.rank}, vocabulary "
        f"{config.vocab_size}), {batch} sequences of {seq} tokens per DP rank, fp32, {WORLD} gloo ranks. Measured: the "
        "fullest rank's peak RSS of the third step above its RSS before the model was built (freed tensors unmapped at "
        "once) and its static bytes (parameters, gradients, AdamW state, DDP buckets after the step's backward). Model: `boost_hf.perf.memory.memory_per_gpu` without the framework allowance; "
        "'static = model' compares every rank with `static_memory` of its own DP rank. FSDP2's working set as measured: "
        "its peak beyond its static bytes less DDP's peak beyond DDP's (the same activations and backward at the same "
        "layout); on CPU the all-gathers are not issued ahead of the compute, so fewer units are gathered at once than "
        "the model's bound (the running and the prefetched unit) allows for.",
        "",
    ]
    body += table(["layout", "data parallel", "static MiB, measured", "static MiB, model", "static = model",
                   "peak - static MiB, measured", "peak - static MiB, model",
                   "FSDP2 working set MiB, measured (beyond DDP's)", "FSDP2 working set MiB, model (gathered + unsharded grads)",
                   "peak MiB, measured", "peak MiB, model", "model / measured"], rows)
    body += ["", _versus(results), "", _plot(results, args.out), ""]
    write_result(args.out, "data_parallel_memory", "Peak memory per rank: DDP, ZeRO-1, FSDP2 and HSDP (measured and modelled)",
                 body, quick=args.quick, started=started)


def _versus(results: dict) -> str:
    """One line per layout: FSDP2's (and HSDP's) measured peak and static bytes against DDP's and ZeRO-1's."""
    lines = []
    for layout in LAYOUTS:
        ddp, zero1 = results[(layout, "DDP")], results[(layout, "DDP + ZeRO-1")]
        for variant in ("FSDP2", "HSDP 2x2"):
            if (layout, variant) not in results:
                continue
            ours = results[(layout, variant)]
            lines.append(f"- {layout}, {variant}: peak {ours['peak'] / MIB:.2f} MiB measured, {ours['peak'] / ddp['peak'] - 1:+.0%} "
                         f"against DDP, {ours['peak'] / zero1['peak'] - 1:+.0%} against ZeRO-1; static "
                         f"{ours['static'] / MIB:.2f} MiB, {ours['static'] / ddp['static'] - 1:+.0%} against DDP, "
                         f"{ours['static'] / zero1['static'] - 1:+.0%} against ZeRO-1.")
    return "\n".join(lines)


def _plot(results: dict, out) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(LAYOUTS), figsize=(6 * len(LAYOUTS), 3.8), squeeze=False)
    for ax, layout in zip(axes[0], LAYOUTS):
        names = [v for (lay, v) in results if lay == layout]
        x = range(len(names))
        measured = [results[(layout, n)]["peak"] / MIB for n in names]
        model = [results[(layout, n)]["model_peak"] / MIB for n in names]
        static = [results[(layout, n)]["static"] / MIB for n in names]
        ax.bar([i - 0.27 for i in x], static, width=0.27, label="static, measured", color="C2")
        ax.bar(list(x), measured, width=0.27, label="peak, measured", color="C0")
        ax.bar([i + 0.27 for i in x], model, width=0.27, label="peak, model", color="C1")
        ax.set_xticks(list(x), names)
        ax.set_ylabel("MiB per rank")
        ax.set_ylim(0, 1.3 * max(measured + model))
        ax.set_title(f"{layout}: one training step")
        ax.legend(fontsize=8, loc="upper center", ncol=3)
    return save_figure(fig, out, "data_parallel_memory")


if __name__ == "__main__":
    main()
