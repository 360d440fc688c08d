"""Data-parallel gradient reduction: DDP against the ``bf16_params`` reducer, at dp 2 on gloo.

``--precision_policy bf16_params`` cannot use DDP (it would accumulate and all-reduce the bf16 gradients in bf16);
:class:`~boost_hf.training.precision.MasterParameters` adds each micro-batch's gradient into an fp32 buffer from
post-accumulate-grad hooks and all-reduces that buffer over DP in 25 MiB buckets, each started as soon as the last
micro-batch's backward has produced all of its gradients. This measures what that costs against DDP, on the same
arithmetic: the reducer run with fp32 parameters (``masters fp32``) does exactly DDP's fp32 work (the losses of the
two are equal, ``tests/training/test_precision.py``), with and without starting buckets during backward.

Variants, one model each, timed round-robin in one process group (median of ``--reps`` rounds after ``--warmup``);
a step is forward + backward of 2 micro-batches, the reduction, AdamW:

* ``ddp fp32``: fp32 parameters in DDP (25 MiB buckets, reduced during the last micro-batch's backward);
* ``masters fp32, overlapped``: the bf16_params machinery with fp32 parameters, buckets started during backward;
* ``masters fp32, at the step``: the same, every bucket started after backward.

(bf16 parameters are not timed here: this CPU runs bf16 GEMMs several times slower than fp32 ones.) Not part of
``run_all.py``:

    python benchmarks/dp_reduction.py            # compute-bound shape (d=1024), ~3 min on 2 idle cores
    python benchmarks/dp_reduction.py --quick
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from common import QUICK, SHAPES, base_parser, bench_config, parse, ratio, table, time_interleaved, write_result

VARIANTS = ("ddp fp32", "masters fp32, overlapped", "masters fp32, at the step")
MICROBATCHES = 2


def _variant(name: str, shape: dict, seq: int):
    """``(model, step)`` of one variant: ``step(batches)`` trains one optimizer step."""
    from boost_hf import BoostLlamaForCausalLM
    from boost_hf.training.precision import MasterParameters, PrecisionPolicy

    torch.manual_seed(0)
    model = BoostLlamaForCausalLM(bench_config(shape, "cola", seq)).train()
    group = dist.new_group(list(range(dist.get_world_size())))
    if name == "ddp fp32":
        wrapped = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step(batches):
            for i, ids in enumerate(batches):
                with wrapped.no_sync() if i < len(batches) - 1 else contextlib.nullcontext():
                    wrapped(ids, labels=ids, use_cache=False).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step
    policy = PrecisionPolicy("bf16_params")  # the machinery, in fp32
    masters = MasterParameters(model, policy, dp_group=group, dp_size=dist.get_world_size(), overlap=name != "masters fp32, at the step")
    masters.accumulations_per_step = MICROBATCHES
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step(batches):
        for ids in batches:
            model(ids, labels=ids, use_cache=False).loss.backward()
        masters.gradients_ready()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        masters.step_done()

    return step


def worker(spec: dict) -> dict:
    shape = spec["shape"]
    steps = {name: _variant(name, shape["fields"], shape["seq"]) for name in VARIANTS}
    generator = torch.Generator().manual_seed(dist.get_rank())
    vocab = shape["fields"]["vocab_size"]
    batches = [torch.randint(0, vocab, (shape["batch"], shape["seq"]), generator=generator) for _ in range(MICROBATCHES)]
    measured = time_interleaved({name: (lambda s=step: s(batches)) for name, step in steps.items()},
                                warmup=spec["warmup"], reps=spec["reps"], sync=dist.barrier)
    return {name: {k: v for k, v in m.items() if k != "times"} for name, m in measured.items()}


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0], timed=True)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=8)
    args, started = parse(parser)
    shape = QUICK if args.quick else SHAPES["compute-bound"]
    warmup, reps = (1, 1) if args.quick else (args.warmup, args.reps)
    from boost_hf.perf.launcher import launch

    spec = dict(shape={"fields": shape.model, "seq": shape.seq, "batch": shape.batch}, warmup=warmup, reps=reps)
    per_rank = launch(worker, 2, spec, timeout=1800)
    step = {name: max(rank[name]["median"] for rank in per_rank) for name in VARIANTS}
    fastest = {name: max(rank[name]["min"] for rank in per_rank) for name in VARIANTS}
    rows = [[name, f"{1e3 * step[name]:.0f}", f"{1e3 * fastest[name]:.0f}", ratio(step[name], step["ddp fp32"])] for name in VARIANTS]
    body = [
        f"Shape `{shape.name}` (CoLA, {shape.describe()}), "
        f"{MICROBATCHES} micro-batches of {shape.batch} x {shape.seq} tokens per step and rank, dp 2 (gloo, one thread "
        f"per rank), {reps} rounds after {warmup} of warm-up; the slower rank's median (fastest) step.",
        "",
        *table(["variant", "step ms, median", "fastest", "vs ddp fp32"], rows),
        "",
        "`masters fp32` does DDP's arithmetic (fp32 gradients averaged over DP) through the bf16_params machinery: "
        "the difference to `ddp fp32` is the cost of the machinery (hooks adding each gradient into the fp32 buffer, "
        "the swap of the masters around the step, the cast back) and of its bucketing; `at the step` shows what starting "
        "the buckets during backward saves.",
    ]
    write_result(args.out, "dp_reduction", "DP gradient reduction: DDP vs the bf16_params reducer", body, quick=args.quick, started=started)


if __name__ == "__main__":
    main()
