"""`make gpu-check`: what only a GPU can show, measured as the BOOST release measures, in commands that fit a lent GPU.

Built for the GPU machine a session may be lent (one H100 or H200, 15 minutes in all including its start, at most 10 per
command, its own torch 2.11 / transformers 5.17, no ``datasets``/``deepspeed``/``evaluate``, nothing installable): it
runs with that machine's ``python3`` as it is, from the repository root, and each command writes at most 7 files.

**How it measures.** Every measurement runs one model in one layout in a process of its own (eager first, then the
same layout compiled, on fresh models, in that process; no other model alive); the default training precision: bf16
parameters with fp32 master weights and fp32 gradient accumulation (:class:`~boost_hf.training.precision.MasterParameters`,
what ``bf16_params`` trains with), fused AdamW on the masters, SDPA, no KV cache. Each step is timed with CUDA events
in two parts, forward + backward, then the optimizer (the masters' gradients, AdamW, the cast back), after 3 warm-up
steps, over ``STEPS`` = 20 timed steps: median and p10 / p90. GPU clocks, power and temperature are sampled while it runs
(``pynvml``, else ``nvidia-smi``, else said). *One rank's layer* (parts ``layer*``): one rank of a TP 4 layout under a
fake process group (its collectives are no-ops: the rank's own compute), per layer = ``(t(3 layers) - t(1 layer)) / 2``
step by step (embedding, head, loss cancel). The SP rows run the fake backend's own reduce-scatter, without the stand-in
that writes its output on torch 2.11 (:mod:`boost_hf.perf.fake_group`): there it writes nothing and costs nothing; from
torch 2.13 it copies this rank's block (one output-sized copy, as a real reduce-scatter writes its output); the report
says which. MFU in two conventions, each named: ``MFU (causal at half)`` counts causal attention's FLOPs at half (what a
causal kernel computes; :mod:`boost_hf.perf.flops`), ``MFU (torchtitan)`` counts it whole, over the GPU's dense bf16 peak.
Each row names its model (``llama-7b``: full rank, ``cola-7b``: CoLA's low rank) apart from its layout.

**The plan** (most valuable first; seconds predicted on an H200 from the first readings in
``benchmarks/results/gpu/2026-11-28-h200/``: a process start with the imports ~8 s, a 7B TP4 layer's compile ~15-20 s,
eager llama-1b 0.95 s and cola-1b 0.48 s per 16k-token step, compiled 0.32 / 0.21 s, a 60m training-step case ~6 s
eager + compiled; an H100 is ~15 % slower). Commands 1 and 2 fit one lent machine (15 minutes: its start, ~1.5 min,
and two commands of at most ``COMMAND_BUDGET_S`` + ``GRACE_S`` = 6.5 min); command 3 is for a later session:

=======  ==============  ======================================================================================  =====
command  part            what                                                                                    s
=======  ==============  ======================================================================================  =====
1        ``layer``       7B TP4, micro-batch 4 x 4096 (the release's): llama-7b megatron, cola-7b vanilla,         120
                         cola-7b btp; eager and compiled; ``gpu_layer.json`` for ``boost-hf estimate --measured``
1        ``layer-13b``   13B TP4, micro-batch 1 x 4096 (the release's): megatron, vanilla, btp                      140
1        ``layer-sp``    7B TP4 micro-batch 4: llama-7b megatron + SP, cola-7b btp + latent SP (collectives         80
                         without the stand-in)
2        ``throughput``  one GPU, 24 layers, micro-batch 4 x 4096 (the release's 1B row): our llama-1b,             230
                         transformers' ``LlamaForCausalLM`` at its shape, our cola-1b; eager and compiled
2        ``kernels``     the fused ops' CUDA tests (one kernel each), and each layout's CUDA kernels per layer      50
                         against the ops it dispatches (``benchmarks/op_count.py``'s count)
2        ``steps``       correctness: a training step of 6 architecture x layout cases (``--cases all``: all 15),   75
                         both precisions: finite, bf16 GEMM operands, compiled = eager after 3 steps (1e-3)
3        ``layer-ckpt``  7B TP4 micro-batch 4 with activation checkpointing: cola-7b btp low-rank and full,          160
                         vanilla low-rank (the release's vanilla runs with recompute), llama-7b megatron full
=======  ==============  ======================================================================================  =====

Each command is given ``--budget-s`` 360 by default (predicted: 340, 355 and 160 s): the parts still to run share what
is left in proportion to their predictions (what one leaves unused goes to the next), a part starts only with
``MIN_PART_S`` left, stops between its cases when the next would pass its share (``incomplete``, keeping what it
measured: every part rewrites its file after each case), and is stopped ``GRACE_S`` after it. Exit status 0 only if
every part that ran passed. Elsewhere than on a CUDA machine it says so and exits 0; ``--device cpu`` runs every part's
code path at tiny shapes (the tests do).

    make gpu-check                                          # = commands 1, 2 and 3, in order
    python3 benchmarks/gpu_check.py --command 1 --out $OUT  # on the lent machine: at most 6.5 min
    python3 benchmarks/gpu_check.py --command 2 --out $OUT  # at most 6.5 min
    python3 benchmarks/gpu_check.py --command 3 --out $OUT  # a later session
    python benchmarks/gpu_check.py --gather RUN1 RUN2 --out benchmarks/results/gpu   # here, no GPU: one summary
    python benchmarks/gpu_check.py --list                   # the measurements and the training-step cases, no GPU
    python benchmarks/gpu_check.py --device cpu             # every part's code path on a CPU
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import statistics
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
sys.path.insert(0, str(HERE))  # common.py

ARCHITECTURES = ("llama", "svd", "cola", "lax")
PRECISIONS = ("bf16-params", "autocast")
FAKE_TP = 4
STEPS, WARMUP = 20, 3  # timed steps (median, p10, p90) after the warm-up ones, per model and mode
COMPILED_LOSS_RTOL = 1e-3  # compiled vs eager, the loss after 3 training steps
CHECK_STEPS = 3
GEMM_OPS = ("mm", "addmm", "bmm", "baddbmm")
COMMANDS = {1: ("layer", "layer-13b", "layer-sp"), 2: ("throughput", "kernels", "steps"), 3: ("layer-ckpt",)}
PARTS = tuple(part for parts in COMMANDS.values() for part in parts)  # in order of value
#: Seconds each part is predicted to take on an H200, the machine started (the module docstring's plan)
PREDICTED_S = {"layer": 120, "layer-13b": 140, "layer-sp": 80, "throughput": 230, "kernels": 50, "steps": 75, "layer-ckpt": 160}
COMMAND_BUDGET_S = 360  # two commands of at most COMMAND_BUDGET_S + GRACE_S and the machine's start fit 15 minutes
MIN_PART_S = 30  # a part starts only with this much budget left
GRACE_S = 30  # a part still running this long after the deadline is stopped
OK, FAILED, INCOMPLETE = 0, 1, 3  # a part's exit status
STOPPED = "stopped at the budget"  # a measurement's error when its process ran out of the part's time
FILES = {"layer": "gpu_layer", "throughput": "gpu_throughput", "layer-sp": "gpu_layer_sp", "layer-13b": "gpu_layer_13b",
         "kernels": "gpu_kernels", "steps": "gpu_steps", "layer-ckpt": "gpu_layer_ckpt"}
#: the training-step cases the ``steps`` part checks on a GPU by default (``--cases all``: every case)
GPU_STEP_CASES = ("llama tp1", "cola tp1", "llama megatron", "cola vanilla", "cola btp", "cola btp+sp")


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

    def __init__(self, out: Path, part: str, title: str, device: str):
        self.path = out / f"{FILES[part]}.md"
        self.header = [f"# {title}", "", f"- device: {device_line(device)}",
                       f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}",
                       f"- command: `python {' '.join(sys.argv)}`", ""]
        self.started = time.perf_counter()

    def write(self, body: list[str], status: str = "running") -> None:
        elapsed = f"{time.perf_counter() - self.started:.0f} s"
        self.path.write_text("\n".join([*self.header, f"- status: **{status}** after {elapsed}", "", *body]).rstrip() + "\n")


def past(deadline: float, margin: float = 0.0) -> bool:
    return time.time() + margin > deadline


def spread(values: list[float]) -> dict:
    """``{"median", "p10", "p90", "n"}`` of ``values``."""
    if len(values) < 2:
        v = values[0] if values else float("nan")
        return {"median": v, "p10": v, "p90": v, "n": len(values)}
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return {"median": statistics.median(values), "p10": deciles[0], "p90": deciles[-1], "n": len(values)}


def ms(stats: dict | None) -> str:
    return "-" if not stats else f"{stats['median']:.2f} [{stats['p10']:.2f}, {stats['p90']:.2f}]"


class GpuMonitor:
    """Samples the GPU's SM and memory clocks, power and temperature every 0.25 s while inside (``pynvml``; else
    ``nvidia-smi`` once at each end; else nothing, said by :meth:`summary`)."""

    def __init__(self, device: str):
        self.samples: list[tuple[float, float, float, float]] = []
        self.source, self._stop, self._thread = None, threading.Event(), None
        self.cuda = torch.device(device).type == "cuda"

    def _read_nvml(self, nvml, handle) -> tuple[float, float, float, float]:
        return (nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM), nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM),
                nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0, nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))

    def _read_smi(self) -> tuple[float, float, float, float] | None:
        try:
            out = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10).stdout
            return tuple(float(v) for v in out.strip().splitlines()[0].split(","))
        except (OSError, ValueError, IndexError, subprocess.SubprocessError):
            return None

    def __enter__(self):
        if not self.cuda:
            return self
        try:
            import pynvml as nvml

            nvml.nvmlInit()
            handle = nvml.nvmlDeviceGetHandleByIndex(0)
            self._read_nvml(nvml, handle)
            self.source = "pynvml"

            def sample():
                while not self._stop.wait(0.25):
                    with contextlib.suppress(Exception):
                        self.samples.append(self._read_nvml(nvml, handle))

            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        except Exception:  # no pynvml, or no NVML: nvidia-smi at both ends
            first = self._read_smi()
            if first is not None:
                self.source = "nvidia-smi"
                self.samples.append(first)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        elif self.source == "nvidia-smi":
            last = self._read_smi()
            if last is not None:
                self.samples.append(last)

    def summary(self) -> dict:
        if not self.cuda:
            return {"readable": False, "text": "CPU: no GPU clocks"}
        if not self.samples:
            return {"readable": False, "text": "clocks and power not readable (no pynvml, no nvidia-smi)"}
        sm, mem, power, temp = zip(*self.samples)
        return {"readable": True, "source": self.source, "samples": len(self.samples),
                "sm_mhz": statistics.median(sm), "sm_mhz_min": min(sm), "mem_mhz": statistics.median(mem),
                "power_w": statistics.median(power), "power_w_max": max(power), "temp_c": max(temp),
                "text": f"SM {statistics.median(sm):.0f} MHz (min {min(sm):.0f}), memory {statistics.median(mem):.0f} MHz, "
                        f"{statistics.median(power):.0f} W (max {max(power):.0f}), {max(temp):.0f} C ({self.source}, "
                        f"{len(self.samples)} samples)"}


# ---------------------------------------------------------------------------------------------- measurements
@dataclass(frozen=True)
class Measurement:
    """One model in one layout, measured in a process of its own (eager, then compiled).

    ``kind``: ``"layer"`` (one rank's decoder layer under a fake TP group, ``(t(3) - t(1)) / 2``) or ``"model"`` (a
    whole model on one GPU). ``model``: a boost-hf preset; ``implementation``: ``"boost-hf"`` or ``"transformers"``
    (``LlamaForCausalLM`` at the preset's shape, full rank only)."""

    kind: str
    model: str
    layout: str = "one GPU"
    fields: dict = field(default_factory=dict)
    micro_batch: int = 4
    seq: int = 4096
    layers: int = 24
    implementation: str = "boost-hf"

    @property
    def checkpointing(self) -> str:
        return self.fields.get("activation_checkpointing", "none")

    @property
    def name(self) -> str:
        """``model / implementation / layout[ / checkpointing]``: the model apart from the layout."""
        return " / ".join([self.model, self.implementation, self.layout]
                          + ([f"checkpointing {self.checkpointing}"] if self.checkpointing != "none" else []))

    def cells(self, small: bool) -> list[str]:
        """The table's model, implementation, layout and checkpointing cells."""
        model = f"{self.model} (on the CPU: its 60m preset)" if small else self.model
        implementation = "transformers `LlamaForCausalLM`" if self.implementation == "transformers" else "boost-hf"
        return [model, implementation, self.layout, self.checkpointing]


def _layer(model: str, layout: str, fields: dict, micro_batch: int, **more) -> Measurement:
    return Measurement("layer", model, layout, {"tp_size": FAKE_TP, **fields}, micro_batch, **more)


MEGATRON, VANILLA, BTP = dict(tp_style="megatron"), dict(tp_style="vanilla"), dict(tp_style="btp")


def measurements(part: str) -> list[Measurement]:
    """The measurements of a part, in order."""
    if part == "layer":
        return [_layer("llama-7b", "megatron", MEGATRON, 4), _layer("cola-7b", "vanilla", VANILLA, 4),
                _layer("cola-7b", "btp", BTP, 4)]
    if part == "layer-sp":
        return [_layer("llama-7b", "megatron + SP", {**MEGATRON, "sequence_parallel": True}, 4),
                _layer("cola-7b", "btp + latent SP", {**BTP, "sequence_parallel": True}, 4)]
    if part == "layer-13b":
        return [_layer("llama-13b", "megatron", MEGATRON, 1), _layer("cola-13b", "vanilla", VANILLA, 1),
                _layer("cola-13b", "btp", BTP, 1)]
    if part == "layer-ckpt":
        return [_layer("cola-7b", "btp", {**BTP, "activation_checkpointing": "lowrank"}, 4),
                _layer("cola-7b", "btp", {**BTP, "activation_checkpointing": "full"}, 4),
                _layer("cola-7b", "vanilla", {**VANILLA, "activation_checkpointing": "lowrank"}, 4),
                _layer("llama-7b", "megatron", {**MEGATRON, "activation_checkpointing": "full"}, 4)]
    if part == "throughput":
        return [Measurement("model", "llama-1b"), Measurement("model", "llama-1b", implementation="transformers"),
                Measurement("model", "cola-1b")]
    return []


def _config(spec: Measurement, layers: int, small: bool):
    from boost_hf import BoostLlamaConfig

    overrides = dict(vocab_size=1024) if small else {}
    preset = spec.model.replace("-7b", "-60m").replace("-13b", "-60m").replace("-1b", "-60m") if small else spec.model
    config = BoostLlamaConfig.from_preset(preset, num_hidden_layers=layers, max_position_embeddings=max(spec_seq(spec, small), 2048),
                                          **overrides)
    config._attn_implementation = "sdpa"
    return config


def spec_seq(spec: Measurement, small: bool) -> int:
    return 64 if small else spec.seq


def _build(spec: Measurement, layers: int, device: str, small: bool):
    """The model (on ``device``, train mode) and its bf16-params training state: fp32 masters, fused AdamW."""
    from boost_hf import BoostLlamaForCausalLM, ParallelConfig
    from boost_hf.training.precision import MasterParameters, PrecisionPolicy

    config = _config(spec, layers, small)
    torch.manual_seed(0)
    if spec.implementation == "transformers":
        from transformers import LlamaConfig, LlamaForCausalLM

        fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "tie_word_embeddings")
        model = LlamaForCausalLM(LlamaConfig(**{name: getattr(config, name) for name in fields}, attn_implementation="sdpa"))
    else:
        parallel = ParallelConfig(**spec.fields) if spec.fields else None
        # built on the CPU (each weight from its own CPU generator), then moved: shared storage follows
        model = BoostLlamaForCausalLM(config, parallel_config=parallel)
    model = model.to(device).train()
    policy = PrecisionPolicy("bf16_params", compute_dtype=torch.bfloat16, param_dtype=torch.bfloat16,
                             residual_dtype=torch.bfloat16)
    masters = MasterParameters(model, policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=torch.device(device).type == "cuda")
    return model, masters, optimizer


class _Clock:
    """Marks in a step: CUDA events on a GPU (read after the last step), ``perf_counter`` on a CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else 1e3 * (end - start)


def _step(model, masters, optimizer, ids, clock: _Clock):
    """One training step: ``(start, after forward + backward, after the optimizer)`` marks."""
    start = clock.mark()
    loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    middle = clock.mark()
    masters.gradients_ready()
    optimizer.step()
    masters.step_done()
    return start, middle, clock.mark()


def _time_mode(spec: Measurement, mode: str, device: str, small: bool) -> dict:
    from boost_hf.parallel.compile import compile_decoder_layers, compile_model

    cuda = torch.device(device).type == "cuda"
    layer_counts = (1, 3) if spec.kind == "layer" else (2 if small else spec.layers,)
    built = {n: _build(spec, n, device, small) for n in layer_counts}
    if mode == "compiled":
        for model, _, _ in built.values():
            # one rank's layer: the decoder layers only (the loss cancels in the difference); a whole model: as trained
            (compile_decoder_layers if spec.kind == "layer" else compile_model)(model)
    batch, seq = (1, spec_seq(spec, small)) if small else (spec.micro_batch, spec.seq)
    vocab = next(iter(built.values()))[0].config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    clock = _Clock(cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for _ in range(WARMUP if not small else 1):
        for model, masters, optimizer in built.values():
            _step(model, masters, optimizer, ids, clock)
    if cuda:
        torch.cuda.synchronize()
    warmup_s = time.perf_counter() - started
    marks = {n: [] for n in built}
    with GpuMonitor(device) as monitor:
        for _ in range(STEPS if not small else 2):
            for n, (model, masters, optimizer) in built.items():  # alternating: each pair sees the same clocks
                marks[n].append(_step(model, masters, optimizer, ids, clock))
        if cuda:
            torch.cuda.synchronize()
    times = {n: ([clock.ms(a, b) for a, b, _ in m], [clock.ms(b, c) for _, b, c in m]) for n, m in marks.items()}
    result = {"warmup_s": warmup_s, "gpu": monitor.summary(),
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
    if spec.kind == "layer":
        (f1, o1), (f3, o3) = times[1], times[3]
        span = layer_counts[1] - layer_counts[0]
        result["forward_backward_ms"] = spread([(b - a) / span for a, b in zip(f1, f3)])
        result["optimizer_ms"] = spread([(b - a) / span for a, b in zip(o1, o3)])
        result["step_ms"] = spread([(b + d - a - c) / span for a, b, c, d in zip(f1, f3, o1, o3)])
    else:
        ((fb, opt),) = times.values()
        result["forward_backward_ms"], result["optimizer_ms"] = spread(fb), spread(opt)
        result["step_ms"] = spread([a + b for a, b in zip(fb, opt)])
    result["params"] = sum(p.numel() for p in next(iter(built.values()))[0].parameters())
    del built
    if cuda:
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    return result


def measure(spec: Measurement, device: str, modes=("eager", "compiled")) -> dict:
    """Eager, then compiled (``modes``), in this process (the case's own); ``{mode: result or {"error": ...}}`` plus what
    the layer ran under (the reduce-scatter the fake group ran)."""
    from boost_hf.perf.fake_group import reduce_scatter_writes_output
    from boost_hf.perf.rank_cost import fake_process_group

    small = torch.device(device).type != "cuda"
    out = {}
    group = fake_process_group(FAKE_TP, write_reduce_scatter=False) if spec.kind == "layer" else contextlib.nullcontext()
    with torch._dynamo.config.patch(cache_size_limit=64, accumulated_cache_size_limit=1024), group:
        if spec.kind == "layer" and spec.fields.get("sequence_parallel"):
            out["reduce_scatter"] = ("the fake backend's own: copies this rank's block (one output-sized copy)"
                                     if reduce_scatter_writes_output() else "the fake backend's own: writes nothing, costs nothing")
        for mode in modes:
            try:
                out[mode] = _time_mode(spec, mode, device, small)
            except Exception as error:  # recorded in the table; the other mode still runs
                out[mode] = {"error": f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200] if str(error).strip() else ''}"}
                if torch.device(device).type == "cuda":
                    torch.cuda.empty_cache()
    return out


def run_measurement(spec: Measurement, device: str, deadline: float, modes=("eager", "compiled")) -> dict:
    """:func:`measure` in a process of its own (this script with ``--measure``), stopped at ``deadline``."""
    command = [sys.executable, str(Path(__file__).resolve()), "--measure", json.dumps(spec.__dict__), "--device", device,
               "--modes", *modes]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    try:
        completed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                                   timeout=max(deadline - time.time(), 1))
    except subprocess.TimeoutExpired:
        return {mode: {"error": STOPPED} for mode in modes}
    lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        tail = (completed.stderr.strip().splitlines() or ["(no output)"])[-1][:200]
        return {"eager": {"error": f"exit {completed.returncode}: {tail}"}, "compiled": {"error": f"exit {completed.returncode}"}}
    return json.loads(lines[-1][len("RESULT "):])


def _peak_tflops(device: str) -> float | None:
    from boost_hf.perf.hardware import get_hardware

    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(0).upper()
    for key in ("H200", "H100", "A100"):
        if key in name:
            return get_hardware(key.lower()).peak_tflops
    return None


def model_flops(spec: Measurement, small: bool) -> dict[str, float]:
    """Training FLOPs of what one measured step computes, per convention: one rank's layer (``1/tp`` of the layer's
    model FLOPs: vanilla's repeated attention is not model work) or the whole model."""
    from boost_hf.perf.flops import attention_flops_per_token, linear_flops_per_token, training_flops_per_token

    config = _config(spec, spec.layers if spec.kind == "model" else 3, small)
    seq = spec_seq(spec, small)
    tokens = (1 if small else spec.micro_batch) * seq
    out = {}
    for convention, causal in (("causal at half", True), ("torchtitan", False)):
        if spec.kind == "layer":
            per_token = 3 * (linear_flops_per_token(config) + attention_flops_per_token(config, seq, causal=causal)) / FAKE_TP
        else:
            per_token = training_flops_per_token(config, seq, causal=causal)
        out[convention] = per_token * tokens
    return out


def measurement_row(spec: Measurement, result: dict, small: bool, peak: float | None) -> list:
    """The table rows of one measurement (one per mode run): model, implementation, layout, checkpointing, mode,
    forward + backward, optimizer, step (ms), [tokens/s], MFU in both conventions, peak memory, the GPU's clocks."""
    rows = []
    flops = model_flops(spec, small)
    for mode in ("eager", "compiled"):
        r = result.get(mode)
        if r is None:
            continue
        if "error" in r:
            rows.append([*spec.cells(small), mode, r["error"][:160], "-", "-", *(["-"] if spec.kind == "model" else []), "-", "-", "-", "-"])
            continue
        step_s = r["step_ms"]["median"] / 1e3
        mfu = [f"{100 * flops[c] / step_s / (peak * 1e12):.1f} %" if peak and step_s > 0 else "-" for c in ("causal at half", "torchtitan")]
        extra = [f"{(1 if small else spec.micro_batch) * spec_seq(spec, small) / step_s:,.0f}"] if spec.kind == "model" else []
        rows.append([*spec.cells(small), mode, ms(r["forward_backward_ms"]), ms(r["optimizer_ms"]), ms(r["step_ms"]), *extra, *mfu,
                     f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "-", r["gpu"]["text"]])
    return rows


def part_measurements(part: str, args, deadline: float) -> int:
    """Every measurement of ``part``, each in its own process; the report rewritten after each."""
    from common import table

    small = args.device == "cpu"
    specs = measurements(part)
    peak = _peak_tflops(args.device)
    titles = {"layer": "One rank's decoder layer at the BOOST release's 7B TP4 shape", "layer-sp": "One rank's layer with sequence parallelism (7B TP4)",
              "layer-13b": "One rank's decoder layer at the release's 13B TP4 shape", "layer-ckpt": "One rank's layer with activation checkpointing (7B TP4)",
              "throughput": "One GPU, 1B models: boost-hf's LLaMA and CoLA beside transformers' LlamaForCausalLM"}
    report = Report(args.out, part, titles[part], args.device)
    results: dict[str, dict] = {}
    spec0 = specs[0]
    timing = (f"{STEPS} steps timed with CUDA events after {WARMUP} warm-up steps" if not small
              else "2 steps timed with perf_counter after 1 warm-up step (CPU)")
    if spec0.kind == "layer":
        shape = (f"micro-batch {spec0.micro_batch} x seq {spec0.seq} = {spec0.micro_batch * spec0.seq} tokens" if not small
                 else "CPU: 60m presets, 1 x 64 tokens")
        intro = [
            f"One rank of TP {FAKE_TP} under a fake process group (collectives are no-ops: the rank's own compute), {shape}; per "
            "layer = `(t(3 layers) - t(1 layer)) / 2` of each pair of steps; bf16 parameters, fp32 masters and AdamW on them "
            f"(what `bf16_params` trains), SDPA, no KV cache; median [p10, p90] of {timing}; each model and layout in a "
            "process of its own, eager then compiled (its decoder layers "
            "`torch.compile`-d). Megatron splits the full-rank LLaMA (it refuses a low-rank model); vanilla and btp the same "
            "CoLA model. MFU: this rank's share (1/4) of the layer's model FLOPs over the step, two conventions: causal "
            "attention counted at half (`MFU (causal at half)`) or whole (`MFU (torchtitan)`).",
            ""]
        headers = ["model", "implementation", "layout", "activation checkpointing", "mode", "forward + backward ms per layer",
                   "optimizer ms per layer", "step ms per layer", "MFU (causal at half)", "MFU (torchtitan)",
                   "peak GiB (1 + 3 layers)", "GPU while timed"]
    else:
        intro = [
            f"One GPU, {spec0.layers} decoder layers, micro-batch {spec0.micro_batch} x seq {spec0.seq} = {spec0.micro_batch * spec0.seq} "
            "tokens per step (the BOOST release's 1B row: 0.85 s per iteration full rank, 0.59 s BOOST on an A100); bf16 "
            "parameters, fp32 masters and AdamW on them, SDPA, no KV cache; transformers' `LlamaForCausalLM` at llama-1b's "
            "shape (its own modelling code) beside boost-hf's full-rank model (the same function: tests/test_modeling.py) "
            f"and CoLA; median [p10, p90] of {timing}; each model in a process of its "
            "own, eager then compiled (every decoder layer and the loss, as `--torch_compile`). MFU over the dense bf16 peak "
            f"({f'{peak:.0f} TFLOP/s' if peak else 'unknown'}), causal attention counted at half, or whole (torchtitan).",
            ""]
        headers = ["model", "implementation", "layout", "activation checkpointing", "mode", "forward + backward ms",
                   "optimizer ms", "step ms", "tokens/s", "MFU (causal at half)", "MFU (torchtitan)", "peak GiB", "GPU while timed"]

    def body() -> list[str]:
        rows = [row for spec in specs if spec.name in results for row in measurement_row(spec, results[spec.name], small, peak)]
        lines = [*intro, *table(headers, rows), ""]
        notes = sorted({r["reduce_scatter"] for r in results.values() if "reduce_scatter" in r})
        lines += [f"- SP rows: reduce-scatter: {note}." for note in notes]
        lines += ratio_lines(part, specs, results)
        return lines

    complete, failed = True, False
    last = 60.0  # seconds the previous measurement took: the next starts only if as much is left
    for spec in specs:
        if past(deadline, margin=last):
            complete = False
            break
        started = time.time()
        results[spec.name] = run_measurement(spec, args.device, deadline + GRACE_S / 2, args.modes)
        last = time.time() - started
        errors = [results[spec.name].get(mode, {"error": "not run"}).get("error") for mode in args.modes]
        complete &= STOPPED not in errors
        failed |= any(error not in (None, STOPPED) for error in errors)
        print(f"{part}: {spec.name}: {json.dumps({m: results[spec.name].get(m, {}).get('step_ms', results[spec.name].get(m)) for m in ('eager', 'compiled')})[:300]}", flush=True)
        report.write(body(), f"{len(results)} of {len(specs)} measured")
        save_results(args.out, part, {name: {"spec": s.__dict__, **results[name]} for s in specs for name in [s.name] if name in results})
    if part == "layer":
        save_measured_run(args, specs, results, small)
    status = "failed" if failed else "done" if complete else "incomplete: stopped at the budget"
    report.write(body(), status)
    return FAILED if failed else OK if complete else INCOMPLETE


def ratio_lines(part: str, specs: list[Measurement], results: dict) -> list[str]:
    """The comparisons each part exists for, model and layout named, per mode."""
    def step(model, layout, mode, implementation="boost-hf"):
        for spec in specs:
            if spec.model == model and spec.layout == layout and spec.implementation == implementation and spec.name in results:
                r = results[spec.name].get(mode, {})
                return r.get("step_ms", {}).get("median")
        return None

    pairs = {
        "layer": [(("cola-7b", "btp"), ("cola-7b", "vanilla"), "the layout's own gain, same CoLA-7B (target: >= 1.6x compiled, >= 1.3x eager)"),
                  (("cola-7b", "btp"), ("llama-7b", "megatron"), "model and layout together (CoLA-7B's 2.27x fewer FLOPs included)")],
        "layer-13b": [(("cola-13b", "btp"), ("cola-13b", "vanilla"), "the layout's own gain, same CoLA-13B"),
                      (("cola-13b", "btp"), ("llama-13b", "megatron"), "model and layout together")],
        "layer-sp": [(("cola-7b", "btp + latent SP"), ("llama-7b", "megatron + SP"), "model and layout together, both with SP (target: >= 1.5x compiled)")],
        "throughput": [(("cola-1b", "one GPU"), ("llama-1b", "one GPU"), "CoLA-1B vs boost-hf's LLaMA-1B (target: >= 1.6x compiled)")],
    }.get(part, [])
    lines = []
    for (a_model, a_layout), (b_model, b_layout), what in pairs:
        for mode in ("eager", "compiled"):
            a, b = step(a_model, a_layout, mode), step(b_model, b_layout, mode)
            if a and b:
                lines.append(f"- {mode}: {a_model} {a_layout} {a:.2f} ms vs {b_model} {b_layout} {b:.2f} ms per step: **{b / a:.2f}x** ({what})")
    if part == "throughput":
        for mode in ("eager", "compiled"):
            ours, theirs = step("llama-1b", "one GPU", mode), step("llama-1b", "one GPU", mode, "transformers")
            if ours and theirs:
                lines.append(f"- {mode}: boost-hf llama-1b {ours:.1f} ms vs transformers LlamaForCausalLM {theirs:.1f} ms: boost-hf at "
                             f"**{theirs / ours:.2f}x** transformers' speed (target: >= 0.9x eager)")
    return lines


def save_results(out: Path, part: str, results: dict) -> None:
    """This part's raw results into ``gpu_check.json`` (``"results"``), beside the parts' statuses."""
    path = out / "gpu_check.json"
    summary = json.loads(path.read_text()) if path.exists() else {"parts": {}}
    summary.setdefault("results", {})[part] = results
    path.write_text(json.dumps(summary, indent=2) + "\n")


def save_measured_run(args, specs: list[Measurement], results: dict, small: bool) -> None:
    """``gpu_layer.json``: the 7B TP4 layers as ``boost-hf estimate --measured`` reads them (ms per layer per step:
    forward + backward + the layer's optimizer step)."""
    from boost_hf import ParallelConfig
    from boost_hf.perf.measured import MeasuredLayer, MeasuredRun

    layers = []
    for spec in specs:
        if spec.name not in results:
            continue
        parallel = ParallelConfig(**spec.fields)
        timed = {mode: results[spec.name].get(mode, {}).get("step_ms", {}).get("median") for mode in ("eager", "compiled")}
        layers.append(MeasuredLayer(spec.model, parallel.tp_style, parallel.rmsnorm, parallel.group_linears, parallel.sequence_parallel,
                                    eager_ms=timed["eager"], compiled_ms=timed["compiled"]))
    device = torch.cuda.get_device_name(0) if not small else "cpu"
    spec = specs[0]
    MeasuredRun(f"{device} ({args.device}), bf16 parameters, fp32 masters", FAKE_TP, 1 if small else spec.micro_batch,
                spec_seq(spec, small), "none", tuple(layers)).save(args.out / "gpu_layer.json")


# ---------------------------------------------------------------------------------------------- kernels
def _cuda_kernels_per_layer(config, parallel, device: str, seq: int) -> float | None:
    """CUDA kernels one decoder layer launches per training step (eager, bf16 parameters): the profiler's kernels of a
    3-layer and a 1-layer model's step, differenced; ``None`` on a CPU."""
    from boost_hf import BoostLlamaForCausalLM
    from boost_hf.parallel.shared_storage import cast_parameters

    if torch.device(device).type != "cuda":
        return None
    counts = {}
    for layers in (1, 3):
        layer_config = type(config).from_dict({**config.to_dict(), "num_hidden_layers": layers})
        layer_config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = BoostLlamaForCausalLM(layer_config, parallel_config=parallel).to(device).train()
        cast_parameters(model, torch.bfloat16)
        ids = torch.randint(0, config.vocab_size, (1, seq), device=device)
        for profiled in (False, True):  # the first step allocates and compiles the fused ops' kernels
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) if profiled else contextlib.nullcontext() as prof:
                model(ids, labels=ids, use_cache=False).loss.backward()
                torch.cuda.synchronize()
        counts[layers] = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        del model
    return (counts[3] - counts[1]) / 2


def part_kernels(args, deadline: float) -> int:
    from common import table

    from boost_hf import BoostLlamaConfig, ParallelConfig
    from boost_hf.perf.rank_cost import count_rank_layer_dispatches, fake_process_group

    small = args.device == "cpu"
    report = Report(args.out, "kernels", "CUDA kernels: the fused ops, and each layout's layer", args.device)
    tests = ["tests/parallel/test_bf16_norms.py", "tests/parallel/test_latent_op.py", "tests/parallel/test_statistics_op.py"]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests, "-k", "cuda or generated_kernel"]
    lines: list[str] = []
    failed = False
    try:
        completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=max(deadline - time.time() - 30, 1))
        print(completed.stdout[-4000:] + completed.stderr[-2000:], flush=True)
        summary = [line for line in completed.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
        last = (completed.stdout.strip().splitlines() or ["(no output)"])[-1]
        lines += [f"`{' '.join(command[3:])}`", "", f"- {last}", *(f"- {line}" for line in summary), ""]
        failed |= completed.returncode not in (0, 5)
    except subprocess.TimeoutExpired:
        lines += [f"`{' '.join(command[3:])}`: stopped at the budget", ""]
    report.write(lines)
    variants = [("llama-7b", "megatron", MEGATRON), ("llama-7b", "megatron + SP", {**MEGATRON, "sequence_parallel": True}),
                ("cola-7b", "vanilla", VANILLA), ("cola-7b", "btp", BTP), ("cola-7b", "btp + latent SP", {**BTP, "sequence_parallel": True})]
    seq = 64 if small else 512
    rows = []
    headers = ["model", "layout", "ops dispatched per layer (forward + backward)", "of which collectives (no kernel here)",
               "CUDA kernels per layer"]
    intro = [f"One rank of TP {FAKE_TP} (fake process group), 1 x {seq} tokens, bf16 parameters, eager: the ops the layer "
             "dispatches (`count_rank_layer_dispatches`, as `benchmarks/op_count.py`) against the CUDA kernels the profiler "
             "sees it launch (a 3-layer model's step minus a 1-layer one's, over 2). Equal but for the collectives (no kernel "
             "under the fake group) when every op is one kernel.", ""]
    complete = True
    with fake_process_group(FAKE_TP):
        for preset, layout, fields in variants:
            if past(deadline, margin=20):
                complete = False
                break
            run = preset.replace("-7b", "-60m") if small else preset
            config = BoostLlamaConfig.from_preset(run, **(dict(vocab_size=1024) if small else {}))
            parallel = ParallelConfig(tp_size=FAKE_TP, **fields)
            counted = count_rank_layer_dispatches(config, parallel, 1, seq)["total"]
            try:
                kernels = _cuda_kernels_per_layer(config, parallel, args.device, seq)
            except Exception as error:
                kernels, failed = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}", True
            rows.append([run, layout, f"{counted['launches']:g}", f"{counted['collective']:g}", "-" if kernels is None else f"{kernels:g}"
                         if isinstance(kernels, float) else kernels])
            report.write([*lines, *intro, *table(headers, rows)], f"{len(rows)} of {len(variants)} layouts")
    status = "failed" if failed else "done" if complete else "incomplete: stopped at the budget"
    report.write([*lines, *intro, *table(headers, rows)], status)
    return FAILED if failed else OK if complete else INCOMPLETE


# ---------------------------------------------------------------------------------------------- training steps
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
    """The case's model on ``device`` and its training state: bf16 parameters with fp32 masters (``bf16-params``) or
    fp32 parameters under autocast; AdamW."""
    from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM, ParallelConfig
    from boost_hf.training.precision import MasterParameters, PrecisionPolicy

    config = BoostLlamaConfig.from_preset(f"{case.architecture}-60m", num_hidden_layers=2, max_position_embeddings=seq)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    # built on the CPU (each weight from its own CPU generator), then moved: shared storage follows
    model = BoostLlamaForCausalLM(config, parallel_config=ParallelConfig(tp_size=case.tp, **case.fields)).to(device).train()
    masters = None
    if precision == "bf16-params":
        masters = MasterParameters(model, PrecisionPolicy("bf16_params", compute_dtype=torch.bfloat16, param_dtype=torch.bfloat16,
                                                          residual_dtype=torch.bfloat16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=torch.device(device).type == "cuda")
    return model, masters, optimizer


def _train_step(model, ids, precision: str, masters, optimizer) -> float:
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=precision == "autocast"):
        loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    if masters is not None:
        masters.gradients_ready()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not all(torch.isfinite(g).all() for g in grads):
        raise FloatingPointError("a parameter's gradient is not finite")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if masters is not None:
        masters.step_done()
    return loss.item()


def _run(case: Case, precision: str, compile: bool, seq: int, batch: int, device: str) -> dict:
    """``CHECK_STEPS`` training steps, then the loss of the next batch (no update): what eager and compiled compare."""
    from boost_hf.parallel.compile import compile_model

    model, masters, optimizer = _model(case, seq, precision, device)
    if compile:
        compile_model(model)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    gemm = _GemmDtypes()
    with gemm if not compile else contextlib.nullcontext():
        first = _train_step(model, ids, precision, masters, optimizer)
    for _ in range(CHECK_STEPS - 1):
        _train_step(model, ids, precision, masters, optimizer)
    with torch.no_grad(), torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=precision == "autocast"):
        after = model(ids, labels=ids, use_cache=False).loss.item()
    return {"loss": first, "loss_after": after, "gemm_dtypes": sorted(gemm.dtypes)}


def check_case(case: Case, precision: str, seq: int, batch: int, device: str) -> tuple[list[str], list[str]]:
    """One case in one precision, eager and compiled: its table row and its problems (none: passed)."""
    problems, results = [], {}
    for compile in (False, True):
        try:
            results[compile] = _run(case, precision, compile, seq, batch, device)
        except Exception as error:  # recorded in the table; the other cases still run
            problems.append(f"{'compiled' if compile else 'eager'}: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
        torch._dynamo.reset()
    eager, compiled = results.get(False), results.get(True)
    if eager is not None:
        if not (math.isfinite(eager["loss"]) and math.isfinite(eager["loss_after"])):
            problems.append(f"eager loss {eager['loss']} / {eager['loss_after']}")
        if eager["gemm_dtypes"] != ["torch.bfloat16"]:
            problems.append(f"GEMM operands {eager['gemm_dtypes']}")
    if eager is not None and compiled is not None:
        if not abs(compiled["loss_after"] - eager["loss_after"]) <= COMPILED_LOSS_RTOL * abs(eager["loss_after"]):
            problems.append(f"compiled loss after {CHECK_STEPS} steps {compiled['loss_after']:.6f} vs eager {eager['loss_after']:.6f}")
    cell = lambda r, key: f"{r[key]:.5f}" if r else "-"  # noqa: E731
    rel = (f"{abs(compiled['loss_after'] - eager['loss_after']) / abs(eager['loss_after']):.1e}" if eager and compiled else "-")
    row = [case.name, precision, cell(eager, "loss"), cell(eager, "loss_after"), cell(compiled, "loss_after"), rel,
           "ok" if not problems else "**FAILED**: " + "; ".join(problems)]
    return row, problems


def step_cases(args) -> list[Case]:
    every = cases()
    if args.cases == ["all"] or (args.cases is None and args.device == "cpu"):
        return every
    wanted = args.cases or GPU_STEP_CASES
    return [case for case in every if case.name in wanted]


def part_steps(args, deadline: float) -> int:
    from common import table

    from boost_hf.perf.rank_cost import fake_process_group

    selected = step_cases(args)
    seq, batch = (16, 1) if args.device == "cpu" else (512, 4)
    report = Report(args.out, "steps", "Training steps of every architecture and layout", args.device)
    rows, failed, complete = [], False, True
    intro = [
        f"60m presets with 2 decoder layers, micro-batch {batch} x seq {seq}; tp 1 (the single-device model) or one rank of "
        f"tp {FAKE_TP} under a fake process group (collectives move no data: losses are not the model's); AdamW, lr 1e-4: "
        "bf16-params (bf16 parameters, fp32 masters, as `bf16_params` trains) or autocast (fp32 parameters). Checked: the "
        "eager first step's GEMM and attention operands are bf16, every gradient finite; the loss after "
        f"{CHECK_STEPS} training steps of the compiled model (every decoder layer and the loss) within {COMPILED_LOSS_RTOL:g} "
        "relative of eager's. A correctness check: no time is measured here.",
        "",
    ]
    headers = ["case", "precision", "eager loss, step 1", f"eager loss after {CHECK_STEPS} steps",
               f"compiled loss after {CHECK_STEPS} steps", "relative difference", "check"]
    with torch._dynamo.config.patch(cache_size_limit=256, accumulated_cache_size_limit=4096):
        with fake_process_group(FAKE_TP):
            last = 10.0  # seconds the previous case took: the next one starts only if as much is left
            for case in selected:
                for precision in PRECISIONS:
                    if past(deadline, margin=last):
                        complete = False
                        break
                    started = time.time()
                    row, problems = check_case(case, precision, seq, batch, args.device)
                    last = time.time() - started
                    rows.append(row)
                    failed |= bool(problems)
                    print(f"steps: {row}", flush=True)
                    report.write([*intro, *table(headers, rows)], f"{len(rows)} of {2 * len(selected)} checked")
    done = f"{len(rows)} of {2 * len(selected)} checked"
    status = "failed" if failed else "done" if complete else "incomplete: stopped at the budget"
    report.write([*intro, *table(headers, rows)], f"{status} ({done})")
    return FAILED if failed else OK if complete else INCOMPLETE


def run_one_part(name: str, args, deadline: float) -> int:
    if name == "kernels":
        return part_kernels(args, deadline)
    if name == "steps":
        return part_steps(args, deadline)
    return part_measurements(name, args, deadline)


STATUS = {OK: "ok", FAILED: "**FAILED**", INCOMPLETE: "incomplete (budget)"}


# ---------------------------------------------------------------------------------------------- the whole check
def run_part(name: str, args, deadline: float, log) -> tuple[str, float]:
    """Run part ``name`` in a process of its own, its output echoed and logged; its status and seconds."""
    command = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--out", str(args.out), "--device", args.device,
               "--deadline", f"{deadline:.0f}", "--modes", *args.modes, *(["--cases", *args.cases] if args.cases else [])]
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
            if line.startswith((f"{name}:", "steps:", "wrote", "Traceback")) or "Error" in line:
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
    summary.setdefault("parts", {}).update(rows)
    path.write_text(json.dumps(summary, indent=2) + "\n")
    from common import table

    parts = summary["parts"]
    lines = [
        "# GPU check (`make gpu-check`)", "", f"- device: {summary['device']}",
        f"- written: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}{note}", "",
        *table(["part", "command", "file", "predicted s (H200)", "measured s", "result"],
               [[p, next(c for c, ps in COMMANDS.items() if p in ps), f"`{FILES[p]}.md`", PREDICTED_S[p], parts[p]["seconds"],
                 parts[p]["status"]] for p in PARTS if p in parts]), "",
    ]
    (out / "gpu_check.md").write_text("\n".join(lines))
    return all(rows[p]["status"] in ("ok", "not started (budget)") for p in rows)


def gather(folders: list[Path], out: Path) -> None:
    """One summary of several runs (a lent machine's commands): each folder's parts and files into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for folder in folders:
        summary = json.loads((folder / "gpu_check.json").read_text())
        results.update(summary.get("results", {}))
        for part in summary["parts"]:
            for suffix in (".md", ".json"):
                name = FILES[part] + suffix
                if (folder / name).exists():
                    (out / name).write_text((folder / name).read_text())
        with open(out / "gpu_check.log", "a") as log:
            log.write((folder / "gpu_check.log").read_text())
        write_summary(out, summary["parts"], summary["device"], note=f"; gathered from {len(folders)} runs")
    path = out / "gpu_check.json"
    merged = json.loads(path.read_text())
    merged["results"] = results
    path.write_text(json.dumps(merged, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"folder for the readings (default: {RESULTS})")
    parser.add_argument("--command", type=int, choices=sorted(COMMANDS), help="the parts of one command of the plan")
    parser.add_argument("--only", nargs="+", choices=PARTS, help="parts to run, in this order (default: both commands')")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"seconds for the whole run (default: {COMMAND_BUDGET_S} per command); parts stop cleanly at it")
    parser.add_argument("--cases", nargs="+", metavar="NAME", help="training-step cases by name, e.g. 'cola btp', or 'all' "
                                                                    "(default on a GPU: GPU_STEP_CASES; on a CPU: all)")
    parser.add_argument("--list", action="store_true", help="print the measurements and the training-step cases and exit")
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu runs the parts' code paths at small shapes")
    parser.add_argument("--modes", nargs="+", choices=("eager", "compiled"), default=["eager", "compiled"],
                        help="the modes each measurement runs (default both, eager first)")
    parser.add_argument("--gather", nargs="+", type=Path, metavar="FOLDER",
                        help="write one summary in --out of the runs whose --out folders these are (no GPU needed)")
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # one part, in this process
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # one measurement (JSON), in this process
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.gather:
        gather(args.gather, args.out)
        print((args.out / "gpu_check.md").read_text())
        return 0
    if args.list:
        for part in PARTS:
            for spec in measurements(part):
                print(f"measure {part}: {spec.name}")
        for case in cases():
            if args.cases is None or case.name in args.cases:
                print(f"{case.name}: tp {case.tp} {case.fields}")
        return 0
    if args.device != "cpu" and not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device found (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); "
              "nothing checked, nothing written.")
        return 0
    if args.measure:
        spec = json.loads(args.measure)
        print("RESULT " + json.dumps(measure(Measurement(**spec), args.device, args.modes)), flush=True)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part:
        return run_one_part(args.part, args, args.deadline or time.time() + (args.budget_s or COMMAND_BUDGET_S))

    selected = list(args.only or (COMMANDS[args.command] if args.command else PARTS))
    commands = 1 if (args.only or args.command) else len(COMMANDS)
    budget = args.budget_s or COMMAND_BUDGET_S * commands
    deadline = time.time() + budget
    note = f"; budget {budget:.0f} s for {', '.join(selected)}"
    plan = ", ".join(f"{p} {PREDICTED_S[p]} s" for p in selected)
    print(f"gpu-check on {device_line(args.device)}\npredicted (one H200): {plan}; total "
          f"{sum(PREDICTED_S[p] for p in selected)} s; budget {budget:.0f} s", flush=True)
    rows = {}
    with open(args.out / "gpu_check.log", "a") as log:
        for i, name in enumerate(selected):
            left = deadline - time.time()
            if left < MIN_PART_S:
                rows[name] = {"status": "not started (budget)", "seconds": 0}
                continue
            # the parts still to run share what is left in proportion to their predictions; what one leaves, the next gets
            share = left * PREDICTED_S[name] / sum(PREDICTED_S[p] for p in selected[i:])
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
