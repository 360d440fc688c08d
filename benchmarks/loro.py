"""LORO vs AdamW on an svd model: held-out bits per byte and step time on the demo corpus, and what LORO's exact
step costs next to a training step.

Both optimizers train the demo recipe's model (``recipes/demo.yaml``) with ``--bottleneck svd`` in one process for
the same steps on the same tokens (same seed, data order and global batch): AdamW with the recipe's settings, LORO
with the authors' rate and decay (lr 0.01, no weight decay), an exact step every ``--exact-every`` steps (their K is
500 at 130M scale, shorter here for a run of a few hundred steps) and boost-hf's defaults otherwise (the recipe's
schedule warmed up over 5 steps after each exact step, eps 1e-8 in torch's place, clipping 0.5, CoLA's init; the
``loro-*`` recipes have the authors' own). The exact step's cost is timed
(interleaved medians) on the demo shape and on a 350M-class block, next to a training step (forward, backward,
lazy step); its communication under TP is ``6 r^2`` float64 values per projection, next to a step's from the
communication formula.

    python benchmarks/loro.py             # ~5 min on 2 cores
    python benchmarks/loro.py --quick     # smoke test
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import torch

from common import SHAPES, base_parser, bench_config, parse, save_figure, table, time_interleaved, write_result

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "recipes" / "demo.yaml"


def optimizers(exact_every: int) -> dict[str, list[str]]:
    return {
        "AdamW (recipe: lr 3e-3, wd 0.01)": ["--lowrank_optimizer", "adamw"],
        f"LORO (lr 1e-2, wd 0, K={exact_every}; boost-hf's defaults otherwise)": [
            "--lowrank_optimizer", "loro", "--learning_rate", "1e-2", "--weight_decay", "0", "--loro_exact_every", str(exact_every),
        ],
    }


def train(extra: list[str], steps: int, output_dir: str) -> dict:
    """Train the demo's svd model in this process; its log history and the final held-out metrics."""
    from boost_hf.training import BoostTrainer, build_datasets, build_model, build_tokenizer, parse_recipe

    argv = [str(DEMO), "--bottleneck", "svd", "--tp_size", "1", "--max_steps", str(steps), "--eval_strategy", "steps",
            "--eval_steps", str(max(1, steps // 3)), "--save_strategy", "no", "--report_to", "none",
            "--logging_steps", str(max(1, min(10, steps // 4))),
            "--sample_max_new_tokens", "0", "--disable_tqdm", "true", "--hang_timeout_s", "0", "--output_dir", output_dir, *extra]
    model_args, data_args, training_args = parse_recipe(argv)
    tokenizer = build_tokenizer(data_args)
    datasets = build_datasets(data_args, tokenizer, training_args)
    trainer = BoostTrainer(model=build_model(model_args, training_args, tokenizer), args=training_args,
                           train_dataset=datasets["train"], eval_dataset=datasets["validation"], processing_class=tokenizer)
    trainer.train()
    final = trainer.evaluate()
    history = trainer.state.log_history
    return {
        "train": [(e["step"], e["loss"]) for e in history if "loss" in e],
        "eval": [(e["step"], e["eval_bits_per_byte"]) for e in history if "eval_bits_per_byte" in e],
        "bits_per_byte": final["eval_bits_per_byte"],
        "step_time": statistics.median(e["step_time"] for e in history if "step_time" in e),
        "tokens": steps * training_args.per_device_train_batch_size * data_args.block_size,
    }


def exact_step_cost(config, batch: int, seq: int, reps: int) -> dict[str, float]:
    """Median seconds of a training step (forward, backward, lazy LORO step) and of one exact step alone."""
    from boost_hf import BoostLlamaForCausalLM
    from boost_hf.optim.loro import loro_optimizer

    torch.manual_seed(0)
    model = BoostLlamaForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    lazy = loro_optimizer(model, lr=1e-3, exact_every=10**9)
    exact = loro_optimizer(model, lr=1e-3, exact_every=1)

    def training_step():
        model(ids, labels=ids, use_cache=False).loss.backward()
        lazy.step()

    model(ids, labels=ids, use_cache=False).loss.backward()  # gradients for the exact steps (kept: lazy steps add to them)
    timed = time_interleaved({"step": training_step, "exact": exact.step}, warmup=1, reps=reps)
    return {name: t["median"] for name, t in timed.items()}


def exact_step_traffic(preset: str, tp_size: int, batch: int, seq: int) -> tuple[float, float]:
    """Bytes one TP rank all-reduces: a training step of ``batch x seq`` tokens under BTP (bf16, the communication
    formula) and an exact step (float64 products)."""
    from boost_hf import BoostLlamaConfig, ParallelConfig
    from boost_hf.optim.low_rank_retraction import PRODUCTS
    from boost_hf.perf.comm_formula import model_communication

    config = BoostLlamaConfig.from_preset(preset, bottleneck="svd")
    step = model_communication(config, ParallelConfig(tp_size=tp_size), batch * seq)
    products = PRODUCTS * config.rank**2 * 7 * config.num_hidden_layers
    return (step.forward + step.backward).bytes(2), products * 8


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0], timed=True)
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps of each run (default: 200)")
    parser.add_argument("--exact-every", type=int, default=50, help="LORO's K (default: 50)")
    args, started = parse(parser)
    steps, exact_every, reps = (8, 4, 2) if args.quick else (args.steps, args.exact_every, 5)

    runs = {}
    for name, extra in optimizers(exact_every).items():
        with tempfile.TemporaryDirectory() as tmp:
            runs[name] = train(extra, steps, tmp)
    rows = [[name, f"{r['bits_per_byte']:.4f}", f"{r['train'][-1][1]:.3f}", f"{1e3 * r['step_time']:.0f}", r["tokens"]]
            for name, r in runs.items()]

    demo = bench_config(dict(hidden_size=128, intermediate_size=352, num_attention_heads=4, rank=32, num_hidden_layers=4,
                             vocab_size=4096), "svd", 128)
    shapes = {"demo (d=128, r=32, 4 layers; 8 x 128 tokens)": (demo, 8, 128)}
    if not args.quick:
        big = SHAPES["compute-bound"]
        shapes[f"350M-class block ({big.describe()})"] = (bench_config(big.model, "svd", big.seq), big.batch, big.seq)
    cost_rows = []
    for name, (config, batch, seq) in shapes.items():
        cost = exact_step_cost(config, batch, seq, reps)
        cost_rows.append([name, f"{1e3 * cost['step']:.1f}", f"{1e3 * cost['exact']:.1f}", f"{cost['exact'] / cost['step']:.2f}",
                          f"{100 * cost['exact'] / cost['step'] / 500:.2f} %", f"{100 * cost['exact'] / cost['step'] / exact_every:.2f} %"])
    step_bytes, exact_bytes = exact_step_traffic("cola-7b", 4, 4, 4096)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in runs.items():
        left.plot(*zip(*r["train"]), label=name)
        right.plot(*zip(*r["eval"]), marker="o", label=name)
    left.set(xlabel="step", ylabel="training loss", title="svd model on the demo corpus")
    right.set(xlabel="step", ylabel="held-out bits per byte", title="validation")
    left.legend(fontsize=8)
    figure = save_figure(fig, args.out, "loro")

    body = [
        f"The demo recipe's model with `--bottleneck svd` (d=128, r=32, 4 layers), one process, {steps} steps of "
        f"8 x 128 tokens for each optimizer (same seed and data order). Held-out bits per byte on the demo's "
        "validation split; step time is the median of the logged `step_time` (exact steps included).",
        "",
        *table(["optimizer", "held-out bits/byte", "last training loss", "step time (ms)", "tokens"], rows),
        "",
        figure,
        "",
        "## The exact step's cost (one process, interleaved medians)",
        "",
        "A training step is forward, backward and LORO's lazy step; the exact step alone replaces the lazy step every "
        "K steps. Amortised: exact / step / K.",
        "",
        *table(["shape", "training step (ms)", "exact step (ms)", "exact / step", "amortised at K=500 (authors)",
                f"at K={exact_every} (this run)"], cost_rows),
        "",
        f"Communication under BTP (cola-7b's shape as svd at TP 4, batch 4 x 4096): a training step all-reduces "
        f"{step_bytes / 2**30:.2f} GiB per rank (bf16, the communication formula); an exact step {exact_bytes / 2**20:.0f} MiB "
        f"(6 r^2 float64 values per projection, one all-reduce per 32 MiB bucket), i.e. {exact_bytes / step_bytes:.2%} of one "
        "step, every K steps.",
    ]
    write_result(args.out, "loro", "LORO vs AdamW on an svd model", body, quick=args.quick, started=started)


if __name__ == "__main__":
    main()
