"""Which precision policy to default to: the demo trained in fp32, under autocast and as bf16_params, at two layouts.

The demo recipe (``recipes/demo.yaml``: a 4-layer d=128 CoLA, r=32, on the Wikipedia sample shipped with gensim) on
4 CPU processes (gloo, ``accelerate_configs/cpu-4proc.yaml``), the same global batch (16 x 128 tokens per step), seed
and data order in every run:

* layouts: ``pp 2 x tp 2`` (1F1B, 4 micro-batches of 4 rows) and ``tp 2 x dp 2`` (the demo's own);
* policies: ``fp32`` (``--bf16 false``), ``autocast`` (``--bf16 true``: autocast over fp32 parameters) and
  ``bf16_params`` (``--bf16 true --precision_policy bf16_params``: bf16 parameters, fp32 masters, fp32 gradient
  accumulation and DP reduction).

The six runs go one after another under ``nice``. Each logs its training loss every step and evaluates before and after training
(and every ``--eval-every`` steps); the table gives the last validation loss, the largest per-step gap to the same layout's fp32
loss (absolute and relative), the median logged step time and the counted traffic the trainer logs
(``comm_p2p_bytes_per_step``: pipeline boundary tensors in the boundary dtype; ``comm_dp_grad_bytes_per_step``: the
gradients reduced over DP, in the reduce dtype; ``comm_tp_bytes_per_step``: the TP collectives counted). Loss curves go
to ``precision_evidence.png``, every run's logged values to ``precision_evidence.json``. Not part of ``run_all.py`` (it trains for tens of minutes):

    python benchmarks/precision_evidence.py                 # 600 steps each: hours on a shared 2-core machine
    python benchmarks/precision_evidence.py --steps 200
    python benchmarks/precision_evidence.py --quick         # 6 steps each, smoke test
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import base_parser, parse, save_figure, table, write_result

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "recipes" / "demo.yaml"
ACCELERATE_CONFIG = REPO / "accelerate_configs" / "cpu-4proc.yaml"
GLOBAL_BATCH = 16

LAYOUTS = {
    "pp 2 x tp 2": ["--pp_size", "2", "--tp_size", "2", "--pp_microbatches", "4",
                    "--per_device_train_batch_size", str(GLOBAL_BATCH)],
    "tp 2 x dp 2": ["--tp_size", "2", "--per_device_train_batch_size", str(GLOBAL_BATCH // 2)],
}
POLICIES = {
    "fp32": ["--bf16", "false"],
    "autocast": ["--bf16", "true"],
    "bf16_params": ["--bf16", "true", "--precision_policy", "bf16_params"],
}


def train(layout: list[str], policy: list[str], steps: int, eval_every: int, output_dir: str) -> dict:
    """Run the demo on 4 processes (``nice``); its ``trainer_state.json`` log history and wall seconds."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        "nice", "-n", "10", sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CONFIG),
        "--main_process_port", str(port), str(REPO / "recipes" / "pretrain.py"), str(DEMO), *layout, *policy,
        "--max_steps", str(steps), "--logging_steps", "1",
        *(["--eval_strategy", "steps", "--eval_steps", str(eval_every)] if eval_every else ["--eval_strategy", "no"]),
        "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true", "--sample_max_new_tokens", "0",
        "--hang_timeout_s", "0", "--output_dir", output_dir,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    log = Path(output_dir) / "launch.log"
    with open(log, "w") as out:
        code = subprocess.call(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    if code != 0:
        raise RuntimeError(f"run failed ({code}): {' '.join(command)}\n{log.read_text()[-4000:]}")
    history = json.loads((Path(output_dir) / "trainer_state.json").read_text())["log_history"]
    return {"history": history, "wall": time.perf_counter() - started}


def summarise(history: list[dict]) -> dict:
    last = lambda key: next(e[key] for e in reversed(history) if key in e)  # noqa: E731
    return {
        "loss": {e["step"]: e["loss"] for e in history if "loss" in e},
        "eval": {e["step"]: e["eval_loss"] for e in history if "eval_loss" in e},
        "step_time": statistics.median(e["step_time"] for e in history if "step_time" in e),
        "p2p": last("comm_p2p_bytes_per_step"),
        "dp": last("comm_dp_grad_bytes_per_step"),
        "tp": last("comm_tp_bytes_per_step"),
    }


def load_runs(path: Path) -> dict:
    """The runs a previous invocation wrote to ``precision_evidence.json`` (steps as integers again)."""
    runs = {}
    for key, run in json.loads(path.read_text()).items():
        layout, policy = key.split(" / ")
        runs[layout, policy] = {**run, "loss": {int(s): v for s, v in run["loss"].items()},
                                "eval": {int(s): v for s, v in run["eval"].items()}}
    return runs


def report(runs: dict, steps: int) -> tuple[list[str], object]:
    """The table and the loss curves of ``runs`` (those of the six that ran)."""
    rows = []
    for (layout, policy), r in runs.items():
        fp32 = runs.get((layout, "fp32"))
        final_eval = r["eval"][max(r["eval"])]
        if fp32 is None:
            versus = gap = "(no fp32 run)"
        else:
            deviation = {s: abs(r["loss"][s] - fp32["loss"][s]) for s in fp32["loss"]}
            worst = max(deviation, key=deviation.get)
            versus = f"{final_eval - fp32['eval'][max(fp32['eval'])]:+.1e}"
            gap = f"{deviation[worst]:.4f} ({100 * deviation[worst] / fp32['loss'][worst]:.2f} %, step {worst})"
        rows.append([layout, policy, f"{final_eval:.5f}", versus, gap, f"{r['loss'][steps]:.4f}", f"{r['step_time']:.2f}",
                     f"{r['wall']:.0f}", f"{r['p2p']:.0f}", f"{r['dp']:.0f}", f"{r['tp']:.0f}"])

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, layout in zip(axes, LAYOUTS):
        for policy in POLICIES:
            if (layout, policy) not in runs:
                continue
            r = runs[layout, policy]
            line, = ax.plot(list(r["loss"]), list(r["loss"].values()), label=f"{policy} (training)", linewidth=0.9, alpha=0.8)
            ax.plot(list(r["eval"]), list(r["eval"].values()), marker="o", linestyle="--", color=line.get_color(),
                    label=f"{policy} (validation)")
        ax.set(xlabel="step", title=f"demo, {layout}")
        ax.legend(fontsize=8)
    axes[0].set(ylabel="loss (nats/token)")
    table_lines = table(["layout", "policy", "final validation loss", "vs fp32", "max gap to fp32 (training loss)",
                         "last training loss", "step time (s, loaded)", "wall (s)", "P2P bytes/step", "DP grad bytes/step",
                         "TP bytes/step"], rows)
    return table_lines, fig


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0], timed=True)
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps of every run (default: 600, the demo's)")
    parser.add_argument("--eval-every", type=int, default=200,
                        help="validation every this many steps (default: 200, the demo's; 0: only before and after training)")
    parser.add_argument("--from-json", type=Path, help="no training: the report of the runs a previous invocation wrote")
    args, started = parse(parser)
    steps, eval_every = (6, 0) if args.quick else (args.steps, args.eval_every)

    if args.from_json:
        runs = load_runs(args.from_json)
    else:
        runs = {}
        for layout, layout_args in LAYOUTS.items():
            for policy, policy_args in POLICIES.items():
                with tempfile.TemporaryDirectory() as tmp:
                    result = train(layout_args, policy_args, steps, eval_every, tmp)
                runs[layout, policy] = {**summarise(result["history"]), "wall": result["wall"]}
                print(f"{layout}, {policy}: {result['wall']:.0f} s", flush=True)
                raw = {f"{lay} / {pol}": run for (lay, pol), run in runs.items()}
                (args.out / "precision_evidence.json").write_text(json.dumps(raw, indent=1))  # the curves, run by run
    table_lines, fig = report(runs, steps)
    figure = save_figure(fig, args.out, "precision_evidence")
    missing = [f"{layout} / {policy}" for layout in LAYOUTS for policy in POLICIES if (layout, policy) not in runs]
    body = [
        f"The demo recipe (4-layer d=128 CoLA, r=32) on 4 CPU processes (gloo), **{steps} steps** of {GLOBAL_BATCH} x 128 "
        "tokens per run, same seed and data order; validation on the demo's whole validation split before training, "
        f"after it{f' and every {eval_every} steps' if eval_every else ''}. Gap to fp32: the largest |loss - fp32 loss| over "
        "the per-step training losses of the same layout (relative, and the step). Step time: median of the logged "
        "`step_time`, under `nice` on a shared 2-core machine: **loaded, not a speed measurement** (and this CPU runs "
        "bf16 GEMMs slower than fp32 ones); wall: the whole launch (start-up, tokenization, evaluations). Bytes: counted "
        "per step per rank by the trainer's metrics (P2P: pipeline boundary tensors sent, in the boundary dtype; DP: "
        "gradients reduced over data parallelism, in the reduce dtype; TP: the tensor-parallel collectives counted).",
        "",
        *([f"**Not run** (out of time): {', '.join(missing)}.", ""] if missing else []),
        *table_lines,
        "",
        figure,
    ]
    write_result(args.out, "precision_evidence", "Precision policies on the demo: fp32, autocast, bf16_params", body,
                 quick=args.quick, started=started)


if __name__ == "__main__":
    main()
