"""`make gpu-check`: what only a GPU can show, in parts ordered by value, inside a time budget.

Built for the GPU machine a session may be lent (one H100 or H200, 15 minutes in all, at most 10 per command, its own
torch 2.11 / transformers 5.17, no ``datasets``/``deepspeed``/``evaluate``, nothing installable): it runs with that
machine's ``python3`` as it is, from the repository root, and writes at most 8 files.

Parts, in order (``--only`` picks some; each runs in a process of its own and writes its file as it goes, so a part
that fails or runs out of budget keeps what it measured):

1. ``layer`` (``gpu_layer.md``, ``gpu_layer.json``): one rank's decoder layer at 7B, TP 4, micro-batch 2 x 4096, under a
   fake process group (collectives are no-ops: the rank's own kernels), bf16 parameters, for megatron, megatron + SP,
   vanilla, btp and btp + latent SP; eager (interleaved), then compiled one layout at a time. Milliseconds per layer
   (forward + backward + AdamW, ``(t(3 layers) - t(1 layer)) / 2``) beside the estimator's model of the same rank
   (:func:`boost_hf.perf.estimator.modelled_layer_seconds` on the GPU's preset). ``gpu_layer.json`` is what
   ``boost-hf estimate --measured`` reads.
2. ``throughput`` (``gpu_throughput.md``): one GPU, the 24-layer llama-1b against cola-1b at micro-batch 4 x 4096 (the
   BOOST release's 1B row: 0.85 s full rank, 0.59 s BOOST per iteration on an A100), bf16 autocast, eager then compiled:
   step seconds, tokens/s, MFU, peak memory.
3. ``steps`` (``gpu_steps.md``): a training step of every architecture in every layout that holds it (tp 1, and one
   rank of tp 4 under the fake process group), both precisions, eager and compiled: the loss is finite, every GEMM
   and attention kernel of the eager step reads bf16, the gradients are finite, the compiled loss is the eager one
   within ``2^-5`` relative.
4. ``norms`` (``gpu_norms.md``): ``pytest tests/parallel/test_bf16_norms.py tests/parallel/test_latent_op.py -k cuda``.

``gpu_check.md`` (and ``gpu_check.json``, which a later run in the same ``--out`` folder adds its parts to) names the
GPU, torch, CUDA and the date, and each part's predicted and measured seconds and result; ``gpu_check.log`` holds
every part's output. Before it starts it prints each part's predicted time. ``--budget-s`` bounds the whole run: the
parts still to run share what is left in proportion to their predictions (what one leaves unused goes to the next),
a part starts only with at least ``MIN_PART_S`` left, stops between its cases when the next would pass its share
(``incomplete``, keeping what it measured), and is stopped ``GRACE_S`` after it. Exit status 0 only if every part that ran passed. Elsewhere than on a CUDA machine
it says so and exits 0 (``--device cpu`` runs the parts' code paths at small shapes, for the tests).

    make gpu-check                                   # = python3 benchmarks/gpu_check.py, every part
    python3 benchmarks/gpu_check.py --budget-s 440 --out $OUT       # the lent machine's first command
    python3 benchmarks/gpu_check.py --only steps norms --budget-s 300 --out $OUT
    python3 benchmarks/gpu_check.py --gather RUN1 RUN2   # one summary of two runs' folders, no GPU needed
    python3 benchmarks/gpu_check.py --list           # the training-step cases, no GPU needed
    python3 benchmarks/gpu_check.py --device cpu --only steps        # the training steps' code path on a CPU
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results" / "gpu"
sys.path.insert(0, str(HERE))  # common.py, rank_cost.py, gpu_throughput.py

ARCHITECTURES = ("llama", "svd", "cola", "lax")
PRECISIONS = ("autocast", "bf16-params")
FAKE_TP = 4
COMPILED_LOSS_RTOL = 2.0 ** -5
GEMM_OPS = ("mm", "addmm", "bmm", "baddbmm")
PARTS = ("layer", "throughput", "steps", "norms")  # in order of value
#: Seconds each part is predicted to take on one H100 (the machine started): the first GPU run (an H200, torch 2.11,
#: 2026-11-28, `benchmarks/results/gpu/gpu_check.md`) took layer 111, throughput 72, steps 333 and norms 43 s; an H100
#: has 30 % less memory bandwidth and the same compiler, so these allow ~15 % more.
PREDICTED_S = {"layer": 130, "throughput": 85, "steps": 380, "norms": 50}
MIN_PART_S = 30  # a part starts only with this much budget left
GRACE_S = 30  # a part still running this long after the deadline is stopped
OK, FAILED, INCOMPLETE = 0, 1, 3  # a part's exit status


@dataclass(frozen=True)
class Case:
    """One training-step case: a preset family, a TP size (``FAKE_TP`` under a fake process group) and the
    ``ParallelConfig`` fields of its layout."""

    architecture: str
    tp: int
    fields: dict = field(default_factory=dict)

    @property
    def layout(self) -> str:
        """``tp1`` (the single-device model) or the layout name, ``+sp`` with sequence parallelism."""
        if self.tp == 1:
            return "tp1"
        return self.fields["tp_style"] + ("+sp" if self.fields.get("sequence_parallel") else "")

    @property
    def name(self) -> str:
        return f"{self.architecture} {self.layout}"


def cases() -> list[Case]:
    """Every architecture at tp 1, and at ``FAKE_TP`` in every layout (with and without sequence parallelism) whose
    ``check`` accepts it: megatron for llama, btp and vanilla for the low-rank models."""
    from boost_hf import BoostLlamaConfig, ParallelConfig
    from boost_hf.parallel.layouts import LAYOUTS

    found = []
    for architecture in ARCHITECTURES:
        found.append(Case(architecture, 1))
        config = BoostLlamaConfig.from_preset(f"{architecture}-60m")
        for style in LAYOUTS:
            for sequence_parallel in (False, True):
                fields = dict(tp_style=style, sequence_parallel=sequence_parallel)
                try:
                    ParallelConfig(tp_size=FAKE_TP, **fields).check_model(config)
                except ValueError:
                    continue
                found.append(Case(architecture, FAKE_TP, fields))
    return found


# ---------------------------------------------------------------------------------------------- reports
def device_line(device: str) -> str:
    """The device, torch, CUDA and Python versions, in one line."""
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(0)
        name = f"**{torch.cuda.get_device_name(0)}**, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs"
    else:
        name = "CPU (code-path check at small shapes, not a GPU result)"
    import transformers

    return (f"{name}; torch {torch.__version__}, CUDA {torch.version.cuda or '-'}, transformers {transformers.__version__}, "
            f"Python {sys.version.split()[0]}")


class Report:
    """A part's Markdown file, rewritten whole at each :meth:`write` (what is done is on disk at every moment)."""

    def __init__(self, out: Path, stem: str, title: str, device: str):
        self.path = out / f"{stem}.md"
        self.header = [f"# {title}", "", f"- device: {device_line(device)}",
                       f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}",
                       f"- command: `python {' '.join(sys.argv)}`", ""]
        self.started = time.perf_counter()

    def write(self, body: list[str], status: str = "running") -> None:
        elapsed = f"{time.perf_counter() - self.started:.0f} s"
        self.path.write_text("\n".join([*self.header, f"- status: **{status}** after {elapsed}", "", *body]).rstrip() + "\n")


def past(deadline: float, margin: float = 0.0) -> bool:
    return time.time() + margin > deadline


# ---------------------------------------------------------------------------------------------- 1. layer
LAYER_VARIANTS = ("megatron", "megatron sp", "vanilla", "btp online grouped", "btp online grouped sp")


def hardware_preset(device: str) -> str:
    """The estimator's GPU preset of the device (by name; ``h100`` elsewhere)."""
    name = torch.cuda.get_device_name(0).upper() if torch.device(device).type == "cuda" else ""
    return "h200" if "H200" in name else "a100" if "A100" in name else "h100"


def part_layer(args, deadline: float) -> int:
    from rank_cost import variant_case
    from common import table

    from boost_hf.perf.estimator import modelled_layer_seconds
    from boost_hf.perf.hardware import get_hardware
    from boost_hf.perf.measured import MeasuredLayer, MeasuredRun
    from boost_hf.perf.rank_cost import fake_process_group, measure_rank_layers
    from boost_hf.perf.workload import Workload

    small = args.device == "cpu"
    size, batch, seq, layers, reps = ("60m", 1, 64, (1, 2), 2) if small else ("7b", 2, 4096, (1, 3), 10)
    overrides = dict(vocab_size=1024) if small else {}
    built = {name: variant_case(name, size, "cola", FAKE_TP, "none", **overrides) for name in LAYER_VARIANTS}
    presets = {name: preset for name, (preset, _, _) in built.items()}
    cases = {name: (config, parallel) for name, (_, config, parallel) in built.items()}
    preset = hardware_preset(args.device)
    hardware = get_hardware(preset)
    modelled = {name: modelled_layer_seconds(c, p, Workload(p, micro_batch=batch, seq_len=seq), hardware)
                for name, (c, p) in cases.items()}
    report = Report(args.out, "gpu_layer", "One rank's decoder layer on the GPU, beside the estimator", args.device)
    timing = dict(device=args.device, layers=layers, autocast_dtype=None, param_dtype=torch.bfloat16, warmup=2, reps=reps)
    measured: dict[str, dict] = {"eager": {}, "compiled": {}}

    def ms(result) -> str:
        if result is None:
            return "-"
        if "error" in result:
            return result["error"][:120]
        return f"{result['ms_per_layer']:.2f} [{result['ms_per_layer_min']:.2f}, {result['ms_per_layer_max']:.2f}]"

    def body() -> list[str]:
        rows = []
        for name in cases:
            model = modelled[name]
            model_ms = 1e3 * (model["compute"] + model["optimizer"])
            cells = [measured[mode].get(name) for mode in ("eager", "compiled")]
            ratios = [f"{c['ms_per_layer'] / model_ms:.2f}" if c and "ms_per_layer" in c else "-" for c in cells]
            rows.append([name, presets[name], ms(cells[0]), ms(cells[1]), f"{model_ms:.2f} ({1e3 * model['compute']:.2f} + {1e3 * model['optimizer']:.2f})",
                         *ratios])
        lines = [
            f"{size} presets (megatron: llama, the others: cola), TP {FAKE_TP} (one rank, fake process group: collectives are "
            f"no-ops), micro-batch {batch} x seq {seq}, bf16 parameters (no autocast; AdamW on them), SDPA. Per layer = "
            f"(t({layers[1]} layers) - t({layers[0]} layer)) / {layers[1] - layers[0]} of a training step (forward with "
            f"labels, backward, AdamW), median [min, max] of {reps} rounds after 2 warm-up rounds; eager: all layouts "
            "interleaved; compiled: every decoder layer `torch.compile`-d, one layout at a time. Estimator: "
            f"`modelled_layer_seconds` on the `{preset}` preset (GEMM + attention + element-wise time of the layer's forward "
            "and backward, + its parameters' AdamW step at 28 bytes per parameter), which a measured time replaces in "
            "`boost-hf estimate --measured`.",
            "",
            *table(["layout", "model", "eager ms per layer", "compiled ms per layer", "estimator ms (compute + AdamW)",
                    "eager / estimator", "compiled / estimator"], rows),
            "",
        ]
        for mode in ("eager", "compiled"):
            a, b = measured[mode].get("megatron sp"), measured[mode].get("btp online grouped sp")
            if a and b and "ms_per_layer" in a and "ms_per_layer" in b:
                lines.append(f"- {mode}: btp + latent SP {b['ms_per_layer']:.2f} ms vs megatron + SP {a['ms_per_layer']:.2f} ms "
                             f"per layer: **{a['ms_per_layer'] / b['ms_per_layer']:.2f}x** (compute alone; collectives not timed)")
        return lines

    def save(status: str) -> None:
        report.write(body(), status)
        run = MeasuredRun(f"{torch.cuda.get_device_name(0) if not small else 'cpu'} ({args.device}), bf16 parameters",
                          FAKE_TP, batch, seq, "none", tuple(
            MeasuredLayer(presets[name], parallel.tp_style, parallel.rmsnorm,
                          parallel.group_linears, parallel.sequence_parallel,
                          eager_ms=(measured["eager"].get(name) or {}).get("ms_per_layer"),
                          compiled_ms=(measured["compiled"].get(name) or {}).get("ms_per_layer"))
            for name, (_, parallel) in cases.items() if name in measured["eager"]))
        run.save(args.out / "gpu_layer.json")

    complete = True
    with fake_process_group(FAKE_TP):
        measured["eager"] = measure_rank_layers(cases, batch, seq, **timing)
        save("eager measured; compiling")
        last = 20.0  # seconds the previous layout took: the next one starts only if as much is left
        for name in cases:
            if past(deadline, margin=last):
                complete = False
                break
            started = time.time()
            measured["compiled"][name] = measure_rank_layers({name: cases[name]}, batch, seq, compile=True, **timing)[name]
            torch._dynamo.reset()
            last = time.time() - started
            save(f"compiled {len(measured['compiled'])} of {len(cases)}")
    failed = [n for mode in measured.values() for n, r in mode.items() if "error" in r]
    status = "failed: " + ", ".join(failed) if failed else "done" if complete else "incomplete: stopped at the budget"
    save(status)
    return FAILED if failed else OK if complete else INCOMPLETE


# ---------------------------------------------------------------------------------------------- 2. throughput
def part_throughput(args, deadline: float) -> int:
    from common import table
    from gpu_throughput import HEADERS, PRESETS, build, device_peak_tflops, result_rows, time_models

    from boost_hf.parallel.compile import compile_decoder_layers

    small = args.device == "cpu"
    layers, batch, seq, warmup, reps = (2, 1, 64, 1, 2) if small else (24, 4, 4096, 2, 5)
    peak = None if small else device_peak_tflops(torch.cuda.get_device_name(0))
    report = Report(args.out, "gpu_throughput", "One GPU: full-rank LLaMA-1B against CoLA-1B", args.device)
    sections: list[str] = []
    problems: list[str] = []

    def write(status: str) -> None:
        report.write([
            f"{', '.join(PRESETS)} with {layers} layers, micro-batch {batch} x seq {seq} = {batch * seq} tokens per step (the "
            "BOOST release's 1B row: micro-batch 4 x 4096 on one A100, 0.85 s per iteration full rank, 0.59 s BOOST = 1.44x); "
            "bf16 autocast over fp32 parameters, fused AdamW, SDPA, no KV cache; median of "
            f"{reps} interleaved steps after {warmup}. MFU: model FLOPs (`training_flops_per_token`) over the dense bf16 peak "
            f"({f'{peak:.0f} TFLOP/s' if peak else 'unknown'}).",
            "", *sections, *(f"- problem: {p}" for p in problems)], status)

    models = build(PRESETS, layers, seq, args.device)
    complete = True
    for mode in ("eager", "compiled"):
        if past(deadline, margin=30):
            complete = False
            break
        if mode == "compiled":
            for model, _ in models.values():
                compile_decoder_layers(model)
        try:
            result = time_models(models, batch, seq, warmup, reps)
        except torch.OutOfMemoryError as error:  # an 80 GB card may not hold 16k tokens of llama-1b uncheckpointed
            for model, optimizer in models.values():
                model.zero_grad(set_to_none=True)
                optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            if batch == 1:
                problems.append(f"{mode}: out of memory at micro-batch 1 x {seq}: {str(error).splitlines()[0][:160]}")
                write(f"{mode} failed")
                break
            sections += [f"- {mode}: out of memory at micro-batch {batch} x {seq}; measured at {batch // 2} x {seq}", ""]
            batch //= 2
            result = time_models(models, batch, seq, warmup, reps)
        rows, tps = result_rows(result, batch * seq, peak)
        steps = {p: result["timing"][p]["median"] for p in PRESETS}
        sections += [f"## {mode}, micro-batch {batch} x {seq}", "", *table(HEADERS, rows), "",
                     f"CoLA vs full rank, {mode}: {tps['cola-1b'] / tps['llama-1b']:.2f}x the tokens/s "
                     f"({steps['llama-1b']:.2f} s vs {steps['cola-1b']:.2f} s per step; the release on an A100: 0.85 s vs 0.59 s).", ""]
        write(f"{mode} measured")
    status = "failed" if problems else "done" if complete else "incomplete: stopped at the budget"
    write(status)
    return FAILED if problems else OK if complete else INCOMPLETE


# ---------------------------------------------------------------------------------------------- 3. training steps
class _GemmDtypes(TorchDispatchMode):
    """The dtypes of the matrix operands of every GEMM and attention kernel run inside it."""

    def __init__(self):
        super().__init__()
        self.dtypes: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if name in GEMM_OPS:
            operands = args[1:3] if name in ("addmm", "baddbmm") else args[:2]
            self.dtypes.update(str(t.dtype) for t in operands)
        elif name.startswith("_scaled_dot_product") and not name.endswith("backward"):
            self.dtypes.update(str(t.dtype) for t in args[:3])
        return func(*args, **(kwargs or {}))


def _model(case: Case, seq: int, precision: str, device: str):
    from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM, ParallelConfig
    from boost_hf.parallel.shared_storage import cast_parameters

    config = BoostLlamaConfig.from_preset(f"{case.architecture}-60m", num_hidden_layers=2, max_position_embeddings=seq)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    # built on the CPU (each weight from its own CPU generator), then moved: shared storage follows
    model = BoostLlamaForCausalLM(config, parallel_config=ParallelConfig(tp_size=case.tp, **case.fields)).to(device).train()
    if precision == "bf16-params":
        cast_parameters(model, torch.bfloat16)
    return model


def _step(model, ids, precision: str, masters: list | None, optimizer) -> float:
    """One training step; with bf16 parameters AdamW steps fp32 masters and the parameters are cast back."""
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=precision == "autocast"):
        loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not all(torch.isfinite(g).all() for g in grads):
        raise FloatingPointError("a parameter's gradient is not finite")
    if masters is not None:
        for param, master in zip(model.parameters(), masters):
            master.grad = None if param.grad is None else param.grad.float()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    if masters is not None:
        with torch.no_grad():
            for param, master in zip(model.parameters(), masters):
                param.copy_(master)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return loss.item()


def _run(case: Case, precision: str, compile: bool, seq: int, batch: int, steps: int, device: str) -> dict:
    from boost_hf.parallel.compile import compile_decoder_layers

    cuda = torch.device(device).type == "cuda"
    model = _model(case, seq, precision, device)
    masters = [p.detach().float().clone() for p in model.parameters()] if precision == "bf16-params" else None
    optimizer = torch.optim.AdamW(masters if masters is not None else model.parameters(), lr=1e-4, fused=cuda)
    if compile:
        compile_decoder_layers(model)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    gemm = _GemmDtypes()
    with gemm if not compile else contextlib.nullcontext():
        first = _step(model, ids, precision, masters, optimizer)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        _step(model, ids, precision, masters, optimizer)
        times.append(1e3 * (time.perf_counter() - start))
    return {"loss": first, "gemm_dtypes": sorted(gemm.dtypes), "step_ms": sorted(times)[len(times) // 2],
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")}


def check_case(case: Case, precision: str, seq: int, batch: int, steps: int, device: str) -> tuple[list[str], list[str]]:
    """One case in one precision, eager and compiled: its table row and its problems (none: passed)."""
    problems, results = [], {}
    for compile in (False, True):
        try:
            results[compile] = _run(case, precision, compile, seq, batch, steps, device)
        except Exception as error:  # recorded in the table; the other cases still run
            problems.append(f"{'compiled' if compile else 'eager'}: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
        torch._dynamo.reset()
    eager, compiled = results.get(False), results.get(True)
    if eager is not None:
        if not math.isfinite(eager["loss"]):
            problems.append(f"eager loss {eager['loss']}")
        if eager["gemm_dtypes"] != ["torch.bfloat16"]:
            problems.append(f"GEMM operands {eager['gemm_dtypes']}")
    if eager is not None and compiled is not None:
        if not abs(compiled["loss"] - eager["loss"]) <= COMPILED_LOSS_RTOL * abs(eager["loss"]):
            problems.append(f"compiled loss {compiled['loss']:.5f} vs eager {eager['loss']:.5f}")
    cell = lambda r, key, fmt: fmt.format(r[key]) if r else "-"  # noqa: E731
    row = [case.name, precision, cell(eager, "loss", "{:.4f}"), cell(compiled, "loss", "{:.4f}"), cell(eager, "step_ms", "{:.1f}"),
           cell(compiled, "step_ms", "{:.1f}"), cell(eager, "peak_gib", "{:.2f}"), "ok" if not problems else "**FAILED**: " + "; ".join(problems)]
    return row, problems


def part_steps(args, deadline: float) -> int:
    from common import table

    from boost_hf.perf.rank_cost import fake_process_group

    selected = [case for case in cases() if args.cases is None or case.name in args.cases]
    seq, batch, steps = (16, 1, 1) if args.device == "cpu" else (512, 4, 5)
    report = Report(args.out, "gpu_steps", "Training steps of every architecture and layout", args.device)
    rows, failed, complete = [], False, True
    intro = [
        f"60m presets with 2 decoder layers, micro-batch {batch} x seq {seq}; tp 1 (the single-device model) or one rank of "
        f"tp {FAKE_TP} under a fake process group (collectives move no data: losses are not the model's); AdamW, lr 1e-4 "
        "(bf16-params: on fp32 masters, the parameters cast back after each step). Loss of the first step; step ms: "
        f"median of {steps} steps after it; compiled: every decoder layer `torch.compile`-d, its loss within "
        f"{COMPILED_LOSS_RTOL:g} relative of eager's; eager: every GEMM and attention operand bf16, gradients finite.",
        "",
    ]
    headers = ["case", "precision", "eager loss", "compiled loss", "eager step ms", "compiled step ms", "peak GiB (eager)", "check"]
    with torch._dynamo.config.patch(cache_size_limit=256, accumulated_cache_size_limit=4096):
        with fake_process_group(FAKE_TP):
            last = 10.0  # seconds the previous case took: the next one starts only if as much is left
            for case in selected:
                for precision in PRECISIONS:
                    if past(deadline, margin=last):
                        complete = False
                        break
                    started = time.time()
                    row, problems = check_case(case, precision, seq, batch, steps, args.device)
                    last = time.time() - started
                    rows.append(row)
                    failed |= bool(problems)
                    print(f"steps: {row}", flush=True)
                    report.write([*intro, *table(headers, rows)], f"{len(rows)} of {2 * len(selected)} checked")
    done = f"{len(rows)} of {2 * len(selected)} checked"
    status = "failed" if failed else "done" if complete else "incomplete: stopped at the budget"
    report.write([*intro, *table(headers, rows)], f"{status} ({done})")
    return FAILED if failed else OK if complete else INCOMPLETE


# ---------------------------------------------------------------------------------------------- 4. norms
def part_norms(args, deadline: float) -> int:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/parallel/test_bf16_norms.py",
               "tests/parallel/test_latent_op.py", "-k", "cuda"]
    report = Report(args.out, "gpu_norms", "Fused norm kernels on the GPU", args.device)
    report.write([f"`{' '.join(command[1:])}`"])
    try:
        completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=max(deadline - time.time(), 1))
    except subprocess.TimeoutExpired:
        report.write([f"`{' '.join(command[1:])}`: stopped at the budget"], "incomplete: stopped at the budget")
        return INCOMPLETE
    print(completed.stdout + completed.stderr, flush=True)
    summary = [line for line in completed.stdout.splitlines() if line.startswith(("FAILED", "ERROR", "SKIPPED"))]
    last = (completed.stdout.strip().splitlines() or ["(no output)"])[-1]
    report.write([f"`{' '.join(command[1:])}`", "", f"- {last}", *(f"- {line}" for line in summary)],
                 "done" if completed.returncode == 0 else "failed")
    return OK if completed.returncode == 0 else FAILED


PART_FUNCTIONS = {"layer": part_layer, "throughput": part_throughput, "steps": part_steps, "norms": part_norms}
STATUS = {OK: "ok", FAILED: "**FAILED**", INCOMPLETE: "incomplete (budget)"}


# ---------------------------------------------------------------------------------------------- the whole check
def run_part(name: str, args, deadline: float, log) -> tuple[str, float]:
    """Run part ``name`` in a process of its own, its output echoed and logged; its status and seconds."""
    command = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--out", str(args.out), "--device", args.device,
               "--deadline", f"{deadline:.0f}", *(["--cases", *args.cases] if args.cases else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stopper = threading.Timer(max(deadline + GRACE_S - time.time(), 1), process.kill)  # a part silent past the deadline
    stopper.start()
    try:
        for line in process.stdout:
            log.write(line)
            log.flush()
            if line.startswith(("steps:", "wrote", "Traceback")) or "Error" in line:
                print(f"  [{name}] {line.rstrip()[:300]}", flush=True)
        process.wait()
    finally:
        stopper.cancel()
    killed = process.returncode < 0
    seconds = time.perf_counter() - started
    if killed:
        return "incomplete (stopped at the budget)", seconds
    return STATUS.get(process.returncode, f"**FAILED** (exit {process.returncode})"), seconds


def write_summary(out: Path, rows: dict, device: str | None = None, note: str = "") -> bool:
    """Add ``rows`` (part -> status and seconds) to ``out/gpu_check.json`` and write ``gpu_check.md`` from it; whether
    every part of ``rows`` passed. ``device``: its line (default: the json's, else this machine's)."""
    path = out / "gpu_check.json"
    summary = json.loads(path.read_text()) if path.exists() else {"parts": {}}
    summary["device"] = device or summary.get("device") or device_line("cuda" if torch.cuda.is_available() else "cpu")
    summary["parts"].update(rows)
    path.write_text(json.dumps(summary, indent=2) + "\n")
    from common import table

    parts = summary["parts"]
    lines = [
        "# GPU check (`make gpu-check`)", "", f"- device: {summary['device']}",
        f"- written: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}{note}", "",
        *table(["part", "file", "predicted s", "measured s", "result"],
               [[p, f"`gpu_{p}.md`", PREDICTED_S[p], parts[p]["seconds"], parts[p]["status"]] for p in PARTS if p in parts]), "",
    ]
    (out / "gpu_check.md").write_text("\n".join(lines))
    return all(rows[p]["status"] in ("ok", "not started (budget)") for p in rows)


def gather(folders: list[Path], out: Path) -> None:
    """One summary of several runs (a lent machine's two commands): each folder's parts and files into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    for folder in folders:
        summary = json.loads((folder / "gpu_check.json").read_text())
        for part in summary["parts"]:
            for name in (f"gpu_{part}.md", f"gpu_{part}.json"):
                if (folder / name).exists():
                    (out / name).write_text((folder / name).read_text())
        with open(out / "gpu_check.log", "a") as log:
            log.write((folder / "gpu_check.log").read_text())
        write_summary(out, summary["parts"], summary["device"], note=f"; gathered from {len(folders)} runs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"folder for the readings (default: {RESULTS})")
    parser.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS), help="parts to run, in this order (default: all)")
    parser.add_argument("--budget-s", type=float, default=sum(PREDICTED_S.values()) * 1.5,
                        help="seconds for the whole run; parts stop cleanly at it and keep what they measured")
    parser.add_argument("--cases", nargs="+", metavar="NAME", help="training-step cases by name, e.g. 'cola btp' (default: all)")
    parser.add_argument("--list", action="store_true", help="print the training-step cases and exit")
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu runs the parts' code paths at small shapes")
    parser.add_argument("--gather", nargs="+", type=Path, metavar="FOLDER",
                        help="write one summary in --out of the runs whose --out folders these are (no GPU needed)")
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # one part, in this process
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.gather:
        gather(args.gather, args.out)
        print((args.out / "gpu_check.md").read_text())
        return 0
    if args.list:
        for case in cases():
            if args.cases is None or case.name in args.cases:
                print(f"{case.name}: tp {case.tp} {case.fields}")
        return 0
    if args.device != "cpu" and not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device found (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); "
              "nothing checked, nothing written.")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part:
        return PART_FUNCTIONS[args.part](args, args.deadline or time.time() + args.budget_s)

    deadline = time.time() + args.budget_s
    note = f"; budget {args.budget_s:.0f} s for {', '.join(args.only)}"
    plan = ", ".join(f"{p} {PREDICTED_S[p]} s" for p in args.only)
    print(f"gpu-check on {device_line(args.device)}\npredicted (one H100): {plan}; total "
          f"{sum(PREDICTED_S[p] for p in args.only)} s; budget {args.budget_s:.0f} s", flush=True)
    rows = {}
    with open(args.out / "gpu_check.log", "a") as log:
        for i, name in enumerate(args.only):
            left = deadline - time.time()
            if left < MIN_PART_S:
                rows[name] = {"status": "not started (budget)", "seconds": 0}
                continue
            # the parts still to run share what is left in proportion to their predictions; what one leaves, the next gets
            share = left * PREDICTED_S[name] / sum(PREDICTED_S[p] for p in args.only[i:])
            print(f"{name}: starting with {share:.0f} of the {left:.0f} s left (predicted {PREDICTED_S[name]} s)", flush=True)
            log.write(f"\n===== {name} =====\n")
            status, seconds = run_part(name, args, time.time() + share, log)
            rows[name] = {"status": status, "seconds": round(seconds)}
            print(f"{name}: {status} in {seconds:.0f} s", flush=True)
            write_summary(args.out, rows, device_line(args.device), note)
    passed = write_summary(args.out, rows, device_line(args.device), note)
    print((args.out / "gpu_check.md").read_text())
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
