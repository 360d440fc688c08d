"""Rounding or a bug? The exactness matrix's rounding floor, measured against a float64 truth.

For each case (the eight trained LaX cases the matrix found beyond its counted gradient bounds, round 9): the case on
4 gloo processes (P), and its twins: the same at ``--precision_policy fp32`` (a missing or doubled reduction shows in
fp32 too) and on LaX's base bottleneck (cola or svd: is LaX's floor simply higher?); the one-process run of each (R,
the matrix's reference) and the float64 truth (T: the fp32 reference's model cast to float64, through bf16 under
``bf16_params``, ``tests/matrix/matrix_cases.as_float64``). Per run, over every parameter's first-step gradient, each
relative to its tensor's scale (``tests/tolerances.scaled_error``): the largest ``P-T``, ``R-T``, ``P-R`` and the
ratio of the largest ``P-T`` to the largest ``R-T`` (what ``tests/matrix/test_matrix.py`` bounds by ``TRUTH_FACTOR``),
and the median over tensors of each tensor's ``P-T / R-T``. Rounding: the parallel run about as far from the truth
as one process (``P-R`` then up to ~2x the floor); a bug: much farther, and in fp32 too.

``--bisect``: c016 (the one case farther from the truth than 3x) with one setting changed at a time, on its own
layout and on its svd base without the pipeline (tp 2 x dp 2).

    python benchmarks/matrix_rounding_floor.py [--cases c000,c052] [--bisect] [--out DIR]   # ~5 min, --bisect ~5 more

Runs through the matrix's own launcher (``tests/matrix``); writes ``results/matrix_rounding_floor.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.matrix import factors  # noqa: E402
from tests.matrix.covering import INACTIVE  # noqa: E402
from tests.matrix.test_matrix import fp32_twin, launch_all, load_tensors, plan_entry, run_one_process, truth_key  # noqa: E402
from tests.tolerances import scaled_error  # noqa: E402
from tests.training.launcher import accelerate_command  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
_LAX = {"tp_style": "btp", "rmsnorm": "online", "group_linears": True, "activation_checkpointing": "none",
        "sequence_parallel": False, "pp_schedule": INACTIVE, "dp_backend": INACTIVE, "fsdp_reshard_after_forward": INACTIVE,
        "fsdp_units": INACTIVE, "grad_reduce_dtype": INACTIVE, "fp32_residual": INACTIVE, "gradient_accumulation_steps": 1,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "num_key_value_heads": 4,
        "bottleneck": "lax", "lax_gate": "kronecker", "lax_latent_norm": True, "lax_base": "cola", "only_lr_act": True,
        "factor_init": "cola"}
#: the eight cases, by their settings (the matrix's names at 211ef87: the index, then every setting not its default)
CASES = {
    "c000": {**_LAX, "layout": "tp2-pp1-dp2", "rmsnorm": "sync", "group_linears": False, "dp_backend": "fsdp2",
             "fsdp_reshard_after_forward": "never", "fsdp_units": "model", "precision_policy": "bf16_params",
             "grad_reduce_dtype": "bf16", "fp32_residual": False, "mlp_bias": True, "num_key_value_heads": 2,
             "only_lr_act": False, "factor_init": "xavier"},
    "c016": {**_LAX, "layout": "tp2-pp2-dp1", "group_linears": False, "activation_checkpointing": "full",
             "sequence_parallel": True, "pp_schedule": "interleaved-1f1b", "precision_policy": "bf16_params",
             "grad_reduce_dtype": "bf16", "fp32_residual": True, "attention_bias": True, "mlp_bias": True,
             "num_key_value_heads": 2, "lax_gate": "dense", "lax_base": "svd", "only_lr_act": INACTIVE, "factor_init": "xavier"},
    "c017": {**_LAX, "layout": "tp2-pp1-dp2", "tp_style": "vanilla", "rmsnorm": INACTIVE, "group_linears": False,
             "activation_checkpointing": "full", "dp_backend": "hsdp", "fsdp_reshard_after_forward": "default",
             "fsdp_units": "decoder_layers", "precision_policy": "autocast", "gradient_accumulation_steps": 2,
             "tie_word_embeddings": True, "mlp_bias": True, "num_key_value_heads": 2, "only_lr_act": False,
             "factor_init": "xavier"},
    "c027": {**_LAX, "layout": "tp2-pp2-dp1", "rmsnorm": "sync", "activation_checkpointing": "lowrank",
             "pp_schedule": "interleaved-1f1b", "precision_policy": "autocast", "lax_latent_norm": False, "only_lr_act": False},
    "c043": {**_LAX, "layout": "tp2-pp1-dp2", "rmsnorm": "sync", "group_linears": False, "activation_checkpointing": "lowrank",
             "sequence_parallel": True, "dp_backend": "zero1", "precision_policy": "autocast", "gradient_accumulation_steps": 2,
             "attention_bias": True, "mlp_bias": True, "num_key_value_heads": 2, "lax_base": "svd", "only_lr_act": INACTIVE,
             "factor_init": "xavier"},
    "c049": {**_LAX, "layout": "tp4-pp1-dp1", "precision_policy": "bf16_params", "grad_reduce_dtype": "bf16",
             "fp32_residual": False, "lax_latent_norm": False},
    "c052": {**_LAX, "layout": "tp2-pp1-dp2", "dp_backend": "deepspeed-zero1", "precision_policy": "fp32",
             "lax_latent_norm": False, "lax_base": "svd", "only_lr_act": INACTIVE},
    "c079": {**_LAX, "layout": "tp1-pp2-dp2", "sequence_parallel": INACTIVE, "pp_schedule": "gpipe", "dp_backend": "ddp",
             "precision_policy": "bf16_params", "grad_reduce_dtype": "fp32", "fp32_residual": True},
}


def base_twin(case: dict) -> dict:
    """``case`` on LaX's base bottleneck (cola or svd), LaX's own settings inactive."""
    base = case["lax_base"]
    return {**case, "bottleneck": base, "lax_gate": INACTIVE, "lax_latent_norm": INACTIVE, "lax_base": INACTIVE,
            "only_lr_act": case["only_lr_act"] if base == "cola" else INACTIVE}


def runs_of(names: list[str]) -> dict[str, dict]:
    runs = {}
    for name in names:
        case = CASES[name]
        runs[f"{name}"] = case
        runs[f"{name} base"] = base_twin(case)
        if case["precision_policy"] != "fp32":
            runs[f"{name} fp32"] = fp32_twin(case)
            runs[f"{name} base fp32"] = fp32_twin(base_twin(case))
    return runs


def bisect_runs() -> dict[str, dict]:
    case = CASES["c016"]
    base = {**base_twin(case), "layout": "tp2-pp1-dp2", "pp_schedule": INACTIVE, "dp_backend": "ddp"}
    return {
        "c016": case, "c016 fp32_residual false": {**case, "fp32_residual": False},
        "c016 no checkpointing": {**case, "activation_checkpointing": "none"}, "c016 gpipe": {**case, "pp_schedule": "gpipe"},
        "c016 no SP": {**case, "sequence_parallel": False}, "c016 grad_reduce fp32": {**case, "grad_reduce_dtype": "fp32"},
        "c016 tp2 x dp2 (no pipeline)": {**case, "layout": "tp2-pp1-dp2", "pp_schedule": INACTIVE, "dp_backend": "ddp"},
        "c016 tp1 x pp2 x dp2": {**case, "layout": "tp1-pp2-dp2", "sequence_parallel": INACTIVE, "dp_backend": "ddp"},
        "svd base, tp2 x dp2": base, "... no biases": {**base, "attention_bias": False, "mlp_bias": False},
        "... grouped": {**base, "group_linears": True}, "... rmsnorm sync": {**base, "rmsnorm": "sync"},
        "... factor_init cola": {**base, "factor_init": "cola"}, "... no GQA": {**base, "num_key_value_heads": 4},
        "... autocast": {**base, "precision_policy": "autocast", "grad_reduce_dtype": INACTIVE, "fp32_residual": INACTIVE},
        "... cola base": {**base, "bottleneck": "cola", "only_lr_act": True},
    }


def environment(folder: Path) -> dict:
    """The matrix's environment (``tests/training/conftest.py``): offline, a small corpus and ``bpe-512``."""
    from datasets import DatasetDict

    from boost_hf.data import load_tokenizer, load_wikipedia_sample

    cache, corpus = folder / "cache", folder / "cache" / "corpus"
    wiki = load_wikipedia_sample(cache)
    load_tokenizer("bpe-512", cache_dir=cache)
    DatasetDict({"train": wiki["train"].select(range(24)), "validation": wiki["validation"]}).save_to_disk(corpus)
    return {**os.environ, "BOOST_HF_CACHE": str(cache), "CORPUS": str(corpus), "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "BOOST_HF_DEEPSPEED_SHM_COMM": "0",
            "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def measure(runs: dict[str, dict], out: Path, env: dict) -> list[dict]:
    """Every run of ``runs`` (4 processes), its reference and its truth (one process); the distances."""
    folder = {label: f"run-{i:02d}" for i, label in enumerate(runs)}
    references, truths = {}, {}
    for case in runs.values():
        references.setdefault(factors.reference_key(case), (f"reference-{len(references):02d}", case))
        truths.setdefault(truth_key(case), (f"truth-{len(truths):02d}", case))
    corpus = env["CORPUS"]
    out.mkdir(parents=True)
    entries = [plan_entry(folder[label], factors.training_arguments(c), factors.deepspeed_stage(c), corpus) for label, c in runs.items()]
    entries.sort(key=lambda e: (e["deepspeed"] is not None, e["name"]))
    launch_all(entries, out, env, factors.WORLD,
               lambda plan: accelerate_command("cpu-4proc.yaml", "tests/matrix/matrix_cases.py", "cases", out, plan))
    one_process = [plan_entry(name, factors.reference_arguments(c), None, corpus) for name, c in references.values()]
    one_process += [{**plan_entry(name, factors.reference_arguments(fp32_twin(c)), None, corpus),
                     "float64": {"through_bf16": key[1]}} for key, (name, c) in truths.items()]
    run_one_process(one_process, out, env, "one-process")
    rows = []
    for label, case in runs.items():
        if not (out / folder[label] / "run.json").exists():
            message = json.loads((out / folder[label] / "done-rank0.json").read_text()).get("message", "crashed")
            rows.append({"run": label, "refused": message[:120]})
            continue
        p, r, t = (load_tensors(out / f, "grads") for f in (folder[label], references[factors.reference_key(case)][0],
                                                               truths[truth_key(case)][0]))
        pt, rt = {n: scaled_error(p[n], t[n]) for n in t}, {n: scaled_error(r[n], t[n]) for n in t}
        pr = {n: scaled_error(p[n], r[n]) for n in r}
        rows.append({"run": label, "precision": case["precision_policy"], "P-T": max(pt.values()), "R-T": max(rt.values()),
                     "P-R": max(pr.values()), "worst P-R": max(pr, key=pr.get),
                     "ratio": max(pt.values()) / max(rt.values()),
                     "median ratio": statistics.median(pt[n] / rt[n] for n in t if rt[n] > 0)})
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = ["| run | precision | max P-T | max R-T | max P-R (its tensor) | max P-T / max R-T | median of P-T / R-T |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        if "refused" in row:
            lines.append(f"| {row['run']} | refused: {row['refused']} | | | | | |")
        else:
            lines.append(f"| {row['run']} | {row['precision']} | {row['P-T']:.3g} | {row['R-T']:.3g} | {row['P-R']:.3g} "
                         f"(`{row['worst P-R']}`) | {row['ratio']:.2f} | {row['median ratio']:.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, of " + ", ".join(CASES))
    parser.add_argument("--bisect", action="store_true", help="also c016 with one setting changed at a time")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="matrix-floor-") as folder:
        lines = report(args, Path(folder))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "matrix_rounding_floor.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def report(args, work: Path) -> list[str]:
    env = environment(work)
    lines = ["# The exactness matrix's rounding floor (benchmarks/matrix_rounding_floor.py)", "",
             "P: the case on 4 gloo processes; R: its one-process reference (the matrix's); T: the float64 truth. Each "
             "number: the largest over every parameter's first-step gradient of `scaled_error` (max |a - b| / max |b|); "
             "the last column: the median over tensors of each tensor's P-T / R-T.", "",
             *table(measure(runs_of(args.cases.split(",")), work / "cases", env))]
    if args.bisect:
        lines += ["", "## c016, one setting at a time", "", *table(measure(bisect_runs(), work / "bisect", env))]
    return lines


if __name__ == "__main__":
    main()
