"""What one checkpoint save and one resume cost each rank: bytes written, host memory, time, measured on 4 gloo
ranks at the demo's size and layout (tp 2 x dp 2) and on a 57 M parameter CoLA at pp 2 x tp 2, then taken by formula
to the ``cola-13b`` and ``cola-30b`` recipes.

Each measured case is one ``torchrun`` of ``tests/training/checkpoint_memory_cases.py`` (a training step with AdamW,
a synchronous save, an asynchronous one, a resume at the same layout; every rank reports its own shards, the
bytes of the files it wrote, its peak resident memory above the one before each phase (``VmHWM``), the seconds,
and the bytes it hashed). ``--compare CHECKOUT`` runs the same cases with another checkout's boost-hf (its
synchronous save only), e.g. the code before distributed checkpoints.

    python benchmarks/checkpoint_cost.py                      # ~4 min on 2 cores
    python benchmarks/checkpoint_cost.py --compare ../main    # + the same cases with another checkout
    python benchmarks/checkpoint_cost.py --quick
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import MIB, base_parser, parse, table, write_result

REPO = Path(__file__).resolve().parents[1]
CASES = REPO / "tests" / "training" / "checkpoint_memory_cases.py"
MEASURED_CASES = {  # name -> case arguments
    "demo (cola, d 128, 4 layers, r 32; tp 2 x dp 2)": ["--hidden", "128", "--layers", "4", "--rank", "32", "--vocab", "4096",
                                                         "--pp", "1", "--tp", "2"],
    "cola 57M (d 1024, 8 layers, r 256; pp 2 x tp 2)": [],
}
QUICK_CASES = {"quick (d 64, 2 layers; tp 2 x dp 2)": ["--hidden", "64", "--layers", "2", "--rank", "16", "--vocab", "512",
                                                       "--pp", "1", "--tp", "2"]}
RECIPES = ("cola-13b", "cola-30b")
BYTES_PER_PARAMETER = 4 + 8
"""A checkpoint's bytes per parameter: the fp32 weight and AdamW's two fp32 moments."""


def run_case(arguments: list[str], checkout: Path, legacy: bool) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
               "BOOST_HF_DEEPSPEED_SHM_COMM": "0", "DS_ACCELERATOR": "cpu"}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", str(CASES), out,
                   *arguments, *(["--legacy-code"] if legacy else [])]
        subprocess.run(command, env=env, check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return [json.loads((Path(out) / f"rank{rank}.json").read_text()) for rank in range(4)]


def growth_mib(rank: dict, phase: str) -> float:
    return (rank[phase]["peak_kib"] - rank[phase]["rss_before_kib"]) / 1024


def own_mib(rank: dict) -> float:
    return (rank["own_bytes"]["parameters"] + rank["own_bytes"]["optimizer_state"]) / MIB


def measured_rows(name: str, ranks: list[dict], code: str) -> list[list]:
    rows = []
    for r in ranks:
        async_part = (f"{growth_mib(r, 'save_async'):.0f} / {r['save_async']['blocked_seconds']:.2f} / {r['save_async']['seconds']:.2f}"
                      if "save_async" in r else "-")
        rows.append([name, code, r["rank"], f"{own_mib(r):.1f}", f"{r['written_bytes'] / MIB:.1f}", f"{r['save']['hashed_bytes'] / MIB:.1f}",
                     f"{growth_mib(r, 'save'):.0f} ({growth_mib(r, 'save') / own_mib(r):.2f}x)", f"{r['save']['seconds']:.2f}", async_part,
                     f"{max(growth_mib(r, 'load_model'), growth_mib(r, 'load_optimizer')):.0f}",
                     f"{r['load_model']['seconds'] + r['load_optimizer']['seconds']:.2f}", f"{r['verify']['hashed_bytes'] / MIB:.1f}"])
    return rows


def recipe_rows(write_mib_per_s: float) -> list[list]:
    """The formula at the 13b and 30b recipes' layouts (fp32 weights + AdamW; DCP's deduplication spreads each
    chunk's write over the DP replicas holding it)."""
    from boost_hf import BoostLlamaConfig
    from boost_hf.perf.parameters import parameter_count
    from boost_hf.training.recipe import RECIPES_DIR

    import yaml

    rows = []
    for recipe in RECIPES:
        training = yaml.safe_load((RECIPES_DIR / f"{recipe}.yaml").read_text())["training"]
        tp, pp = training.get("tp_size", 1), training.get("pp_size", 1)
        dp = 32 // (tp * pp)
        parameters = parameter_count(BoostLlamaConfig.from_preset(recipe))
        total = parameters * BYTES_PER_PARAMETER
        own = total / (tp * pp)
        written = own / dp
        rows.append([recipe, f"{parameters / 1e9:.2f} B", f"tp {tp} x pp {pp} x dp {dp} (32 ranks)", f"{total / 2**30:.1f}",
                     f"{own / 2**30:.2f}", f"{written / 2**30:.2f}", f"{own / 2**30:.2f}", f"{written / MIB / write_mib_per_s:.0f}",
                     f"{own / 2**30:.2f}", f"{total / 32 / 2**30:.2f}"])
    return rows


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--compare", type=Path, help="another checkout whose boost-hf to measure the same way (its synchronous save)")
    args, started = parse(parser)
    cases = QUICK_CASES if args.quick else MEASURED_CASES
    rows, rates = [], []
    for name, arguments in cases.items():
        print(f"measuring {name} ...", flush=True)
        ranks = run_case(arguments, REPO, legacy=False)
        rows += measured_rows(name, ranks, "this")
        rates += [r["written_bytes"] / MIB / r["save"]["seconds"] for r in ranks if r["save"]["seconds"] > 0]
        if args.compare:
            print(f"measuring {name} with {args.compare} ...", flush=True)
            rows += measured_rows(name, run_case(arguments, args.compare.resolve(), legacy=True), str(args.compare))
    rate = sorted(rates)[len(rates) // 2]
    body = [
        "Per rank, one save of `checkpoint-<step>` (model + AdamW state + the Trainer's files) and one resume of it at the same",
        "layout, 4 gloo ranks on this machine. *own shards*: the rank's parameters and optimizer state; *written*: the",
        "files named after the rank (its DCP shard file `dcp/__<rank>_0.distcp`, its RNG state); *hashed*: bytes it hashed",
        "for the manifest; *peak growth*: its peak resident memory (`VmHWM`) above the one before the save or load;",
        "async: growth / seconds training was blocked (the copy to host memory) / seconds until the checkpoint was complete.",
        "",
        *table(["case", "code", "rank", "own shards (MiB)", "written (MiB)", "hashed (MiB)", "save: peak growth (MiB)", "save (s)",
                "async: growth (MiB) / blocked (s) / done (s)", "resume: peak growth (MiB)", "resume load (s)", "resume: verified (MiB)"], rows),
        "",
        "## At the 13b and 30b recipes (formula)",
        "",
        "`P` parameters, `12 P` bytes per checkpoint (fp32 weights and AdamW's two moments; `boost_hf.perf.parameters.parameter_count`),",
        "a rank of a `tp x pp x dp` layout holds `12 P / (tp pp)` (ZeRO-1: the moments `/ dp`) and writes `12 P / (tp pp dp)`",
        "(DCP writes each chunk once, spread over the DP replicas); the synchronous save holds one tensor at a time beyond that,",
        "`--save_async` a host copy of the rank's own shards; the manifest's hashing reads `12 P / world` per rank when",
        "saving and when resuming; a resume at the same layout reads `12 P / (tp pp)` per rank (its shards). Time at this",
        f"machine's median write rate per rank while all 4 wrote ({rate:.0f} MiB/s; a cluster's parallel file system",
        "sets its own).",
        "",
        *table(["recipe", "P", "layout", "checkpoint (GiB)", "own shards per rank (GiB)", "written per rank (GiB)",
                "async host copy per rank (GiB)", "write time at this rate (s)", "resume read per rank (GiB)", "hashed per rank (GiB)"],
               recipe_rows(rate)),
    ]
    write_result(args.out, "checkpoint_cost", "Checkpoint save and resume cost per rank", body, quick=args.quick, started=started)


if __name__ == "__main__":
    main()
