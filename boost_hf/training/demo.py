"""``boost-hf demo``: the tiny CoLA demo with bottleneck-aware TP x DP on local CPU processes.

Runs the shipped demo recipe under the shipped accelerate configuration (package data, so it works from an
installed package), in the current working directory::

    accelerate launch --config_file <boost_hf>/accelerate_configs/cpu-4proc.yaml -m boost_hf.cli train <boost_hf>/recipes/demo.yaml

i.e. 4 processes = tp 2 x dp 2 on the Wikipedia sample shipped with gensim: validation perplexity before and
after training, a greedy sample, and the model with its tokenizer in ``./outputs/demo/final``.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

from ..shipped import ACCELERATE_CONFIGS_DIR, RECIPES_DIR

RECIPE = RECIPES_DIR / "demo.yaml"
ACCELERATE_CONFIG = ACCELERATE_CONFIGS_DIR / "cpu-4proc.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-processes", type=int, default=4, help="CPU processes, tp x dp (default: 4)")
    parser.add_argument("--tp-size", type=int, default=2, help="tensor-parallel size (default: 2)")
    parser.add_argument("--max-steps", type=int, help="optimizer steps (default: the recipe's)")
    parser.add_argument("--output-dir", default="outputs/demo",
                        help="default: outputs/demo in the current directory (the model goes to <dir>/final)")


def command(args: argparse.Namespace, port: int) -> list[str]:
    """The ``accelerate launch`` command line of the demo."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CONFIG),
              "--num_processes", str(args.num_processes), "--main_process_port", str(port)]
    recipe = ["-m", "boost_hf.cli", "train", str(RECIPE), "--tp_size", str(args.tp_size), "--output_dir", args.output_dir]
    if args.max_steps is not None:
        recipe += ["--max_steps", str(args.max_steps)]
    return launch + recipe


def run(args: argparse.Namespace) -> int:
    if not RECIPE.is_file() or not ACCELERATE_CONFIG.is_file():
        raise ValueError(f"boost-hf demo: {RECIPE} or {ACCELERATE_CONFIG} is missing from the installed package; reinstall boost-hf.")
    if args.num_processes % args.tp_size != 0:
        raise ValueError(f"--num-processes ({args.num_processes}) must be a multiple of --tp-size ({args.tp_size}).")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = command(args, port)
    print("boost-hf demo:", " ".join(cmd[1:]), flush=True)
    return subprocess.call(cmd, env=env)  # in the current working directory: outputs go there


__all__ = ["add_arguments", "command", "run"]
