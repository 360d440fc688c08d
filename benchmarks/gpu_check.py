"""`make gpu-check`: what only a GPU can show, in one command (CUDA only; elsewhere a message and exit 0).

On one CUDA device, in order, each in its own process (one failure does not stop the others), with its output under
``benchmarks/results/gpu/`` (``--out``):

1. **Training steps** (``gpu_check.md``): a bf16 training step (forward with labels, backward, AdamW) of every
   architecture (llama, svd, cola, lax) in every layout that holds it: at tp 1 (the single-device model) and, as
   one rank of tp 4 under a fake process group (collectives do nothing: the rank's own kernels, not the model's
   function), megatron with and without sequence parallelism for llama, btp with and without latent sequence
   parallelism and vanilla for the low-rank models. Each in both precisions (bf16 autocast over fp32 parameters;
   bf16 parameters without autocast, fp32 masters as DeepSpeed's bf16 mode keeps them in the optimizer), eager and
   with every decoder layer compiled (``torch.compile``, as ``BoostTrainer --torch_compile``). Checked: the loss is
   finite, every GEMM and attention kernel of the eager step reads bf16, the parameters' gradients are finite, and
   the compiled step's loss is the eager step's within ``2^-5`` relative (inductor keeps fused element-wise chains in
   fp32 where eager rounds each op's output to bf16). Step milliseconds and peak memory are recorded, not checked.
2. **Norm kernels**: ``pytest tests/parallel/test_bf16_norms.py tests/parallel/test_latent_op.py -k cuda``: the
   fused RMSNorm custom ops are PyTorch's ``_fused_rms_norm`` kernels on CUDA (bit for bit), and they, the sync and
   the online norm are within bf16 rounding of the fp32 norm on upcast inputs (fp32: within fp32 rounding), forward
   and backward; every layout's layer with bf16 parameters writes no full-width fp32 tensor; the online norm's
   latent scale fused with the latent SiLU (inductor-compiled on CUDA) equals the unfused arithmetic and is one
   kernel each way.
3. ``benchmarks/rank_cost.py --device cuda --compile``: one rank's layer counted and measured at 7B TP4, both
   precisions (``rank_cost.{md,png}``).
4. ``benchmarks/gpu_throughput.py``, eager and ``--compile`` (``gpu_throughput*.md``).

``gpu_check.md`` names the GPU, torch, CUDA and the date, and lists each part's result and time; the exit status
is non-zero if any check failed. About 10-20 minutes on an H100 (estimated: not yet run on one).

On the lent GPU machine (``/work/.library/device``'s tool, torch there, no registry) nothing else is needed: this
script, the training steps and the norm tests import neither ``datasets`` nor ``deepspeed``; ``matplotlib`` and
``pytest`` are in that image. Run it from the repository root with the image's ``python3`` and the repository on
``PYTHONPATH`` (what ``make gpu-check`` does)::

    make gpu-check                              # = PYTHONPATH=. python3 benchmarks/gpu_check.py
    python3 benchmarks/gpu_check.py --only steps norms   # some parts
    python3 benchmarks/gpu_check.py --list      # the training-step cases, no GPU needed
    python3 benchmarks/gpu_check.py --device cpu --cases "cola btp"   # the training steps' code path on a CPU
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results" / "gpu"

ARCHITECTURES = ("llama", "svd", "cola", "lax")
PRECISIONS = ("autocast", "bf16-params")
FAKE_TP = 4
COMPILED_LOSS_RTOL = 2.0 ** -5
PARTS = ("steps", "norms", "rank_cost", "throughput")
GEMM_OPS = ("mm", "addmm", "bmm", "baddbmm")


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


# ---------------------------------------------------------------------------------------------- 1. training steps
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


def training_steps(seq: int, batch: int, steps: int, device: str, selected: list[Case]) -> tuple[list[str], bool]:
    """Part 1: the ``selected`` cases in both precisions, eager and compiled, on ``device``; Markdown lines and whether
    all passed."""
    from boost_hf.perf.rank_cost import fake_process_group

    rows, ok = [], True
    with torch._dynamo.config.patch(cache_size_limit=256, accumulated_cache_size_limit=4096):
        with fake_process_group(FAKE_TP):
            for case in selected:
                for precision in PRECISIONS:
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
                    ok &= not problems
                    cell = lambda r, key, fmt: fmt.format(r[key]) if r else "-"  # noqa: E731
                    rows.append([case.name, precision, cell(eager, "loss", "{:.4f}"), cell(compiled, "loss", "{:.4f}"),
                                 cell(eager, "step_ms", "{:.1f}"), cell(compiled, "step_ms", "{:.1f}"),
                                 cell(eager, "peak_gib", "{:.2f}"), "ok" if not problems else "**FAILED**: " + "; ".join(problems)])
                    print(f"steps: {rows[-1]}", flush=True)
    from common import table

    lines = [
        "## 1. Training steps",
        "",
        f"60m presets with 2 decoder layers, micro-batch {batch} x seq {seq}; tp 1 (the single-device model) or one rank of "
        f"tp {FAKE_TP} under a fake process group (collectives do nothing: losses are not the model's); AdamW, lr 1e-4 "
        "(bf16-params: on fp32 masters, the parameters cast back after each step). Loss of the first step; step ms: "
        f"median of {steps} steps after it; compiled: every decoder layer `torch.compile`-d, its loss within "
        f"{COMPILED_LOSS_RTOL:g} relative of eager's; eager: every GEMM and attention operand bf16, gradients finite.",
        "",
        *table(["case", "precision", "eager loss", "compiled loss", "eager step ms", "compiled step ms", "peak GiB (eager)", "check"], rows),
        "",
    ]
    return lines, ok


# ---------------------------------------------------------------------------------------------- 2-4. subprocesses
def _subprocess(command: list[str], log: Path, timeout: float) -> tuple[bool, float]:
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    with open(log, "w") as f:
        try:
            rc = subprocess.run(command, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\ngpu_check: timed out after {timeout:.0f} s\n")
            rc = None
    return rc == 0, time.perf_counter() - start


def other_parts(out: Path, parts: list[str], quick: bool) -> tuple[list[str], bool]:
    python = sys.executable
    commands = {
        "norms": [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/parallel/test_bf16_norms.py",
                  "tests/parallel/test_latent_op.py", "-k", "cuda"],
        "rank_cost": [python, "benchmarks/rank_cost.py", "--device", "cuda", "--compile", "--wait-quiet", "0", "--out", str(out),
                      *(["--quick"] if quick else [])],
        "throughput": [python, "benchmarks/gpu_throughput.py", "--out", str(out), *(["--quick"] if quick else [])],
        "throughput-compiled": [python, "benchmarks/gpu_throughput.py", "--compile", "--out", str(out), *(["--quick"] if quick else [])],
    }
    selected = [name for name in commands if name.split("-")[0] in parts]
    rows, ok = [], True
    for name in selected:
        log = out / f"gpu_check_{name}.log"
        passed, seconds = _subprocess(commands[name], log, timeout=1800)
        ok &= passed
        rows.append([name, f"`{' '.join(Path(c).name if c == python else c for c in commands[name])}`", f"{seconds:.0f}",
                     "ok" if passed else f"**FAILED** (see `{log.name}`)"])
        print(f"{name}: {'ok' if passed else 'FAILED'} in {seconds:.0f} s", flush=True)
    from common import table

    return ["## 2-4. Norm kernels, rank cost, throughput", "", *table(["part", "command", "seconds", "result"], rows), ""], ok


# ---------------------------------------------------------------------------------------------- main
def header() -> list[str]:
    props = torch.cuda.get_device_properties(0)
    return [
        "# GPU check (`make gpu-check`)",
        "",
        f"- GPU: **{torch.cuda.get_device_name(0)}**, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs",
        f"- torch {torch.__version__}, CUDA {torch.version.cuda}, Python {sys.version.split()[0]}",
        f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}",
        f"- command: `python {' '.join(sys.argv)}`",
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"folder for the readings (default: {RESULTS})")
    parser.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS), help="parts to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="short sequences and few steps, the benchmarks' --quick")
    parser.add_argument("--cases", nargs="+", metavar="NAME", help="training-step cases by name, e.g. 'cola btp' (default: all)")
    parser.add_argument("--list", action="store_true", help="print the training-step cases and exit")
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu only to check the code path of the training steps")
    args = parser.parse_args(argv)
    selected = [case for case in cases() if args.cases is None or case.name in args.cases]
    if args.list:
        for case in selected:
            print(f"{case.name}: tp {case.tp} {case.fields}")
        return 0
    if args.device == "cpu":  # the training steps' code path on this machine: nothing written
        _, passed = training_steps(16, 1, 1, "cpu", selected)
        return 0 if passed else 1
    if not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device found (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); "
              "nothing checked, nothing written.")
        return 0
    sys.path.insert(0, str(HERE))  # benchmarks/common.py
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    lines, ok = header(), True
    if "steps" in args.only:
        seq, batch, steps = (128, 2, 2) if args.quick else (512, 4, 5)
        section, passed = training_steps(seq, batch, steps, "cuda", selected)
        lines += section
        ok &= passed
    rest = [p for p in args.only if p != "steps"]
    if rest:
        section, passed = other_parts(args.out, rest, args.quick)
        lines += section
        ok &= passed
    lines += [f"Total: {time.perf_counter() - started:.0f} s; **{'all checks passed' if ok else 'SOME CHECKS FAILED'}**.", ""]
    (args.out / "gpu_check.md").write_text("\n".join(lines))
    print(f"wrote {args.out / 'gpu_check.md'}: {'all checks passed' if ok else 'SOME CHECKS FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
