"""Launch training commands (one process, ``torchrun`` or ``accelerate launch``) from the repository root,
in their own session, killed as a group on timeout."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEMO_RECIPE = REPO / "recipes" / "demo.yaml"
# The demo recipe shrunk to seconds per run: a 2-layer d=64 CoLA model, 32-token blocks, 6 steps.
TINY = [
    "--hidden_size", "64", "--intermediate_size", "128", "--num_hidden_layers", "2", "--num_attention_heads", "4",
    "--rank", "16", "--max_position_embeddings", "64",
    "--tokenizer", "bpe-512", "--block_size", "32", "--max_train_blocks", "256", "--max_eval_blocks", "24",
    "--max_steps", "6", "--per_device_eval_batch_size", "8", "--learning_rate", "1e-2", "--logging_steps", "1",
    "--eval_strategy", "no", "--save_strategy", "no", "--sample_max_new_tokens", "4", "--disable_tqdm", "true",
    "--report_to", "none",
]


def training_environment(cache: Path) -> dict[str, str]:
    """Environment for training subprocesses: offline, ``cache`` holding the ``bpe-512`` tokenizer, and ``CORPUS``, a
    small saved ``DatasetDict`` (fast to tokenize) for ``--dataset``; built in ``cache`` unless it is there."""
    from datasets import DatasetDict

    from boost_hf.data import load_tokenizer, load_wikipedia_sample

    corpus = cache / "corpus"
    if not (corpus / "dataset_dict.json").exists():
        wiki = load_wikipedia_sample(cache)
        load_tokenizer("bpe-512", cache_dir=cache)  # trained once here, read from the cache by every rank
        DatasetDict({"train": wiki["train"].select(range(24)), "validation": wiki["validation"]}).save_to_disk(corpus)
    return {
        **os.environ,
        "BOOST_HF_CACHE": str(cache),
        "CORPUS": str(corpus),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "BOOST_HF_DEEPSPEED_SHM_COMM": "0",
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
    }


def every_rank(value) -> list:
    """``value`` of every rank, in rank order (one ``all_gather_object``; ``[value]`` without a process group). For
    the case scripts that run inside a launch."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [value]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_command(args: list[str], env: dict[str, str], log: Path | None = None) -> subprocess.Popen:
    """Start ``args`` in its own session (a process group to kill) from the repository root, output piped, or written
    into ``log``."""
    if log is None:
        return subprocess.Popen(
            [str(a) for a in args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )
    with open(log, "w") as output:
        return subprocess.Popen([str(a) for a in args], cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT,
                                start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_commands(commands: list[list[str]], env: dict[str, str], timeout: float) -> list[str]:
    """Run ``commands`` at the same time (e.g. the nodes of one launch), each in its own session; kill every group
    when one fails or on timeout."""
    procs = [start_command(args, env) for args in commands]
    outputs = []
    try:
        for args, proc in zip(commands, procs):
            try:
                output, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_group(proc)
                output, _ = proc.communicate()
                raise AssertionError(f"{' '.join(map(str, args))} timed out after {timeout}s:\n{output[-6000:]}")
            if proc.returncode != 0:
                rank0 = "\n".join(line for line in output.splitlines() if line.startswith("[rank0]"))
                raise AssertionError(f"{' '.join(map(str, args))} failed ({proc.returncode}):\n{rank0[-8000:] or output[-8000:]}")
            outputs.append(output)
    finally:
        for proc in procs:
            kill_group(proc)
    return outputs


def run_command(args: list[str], env: dict[str, str], timeout: float) -> str:
    """Run ``args`` in its own session from the repository root; kill the whole group on timeout."""
    return run_commands([args], env, timeout)[0]


def python_command(*args) -> list[str]:
    return [sys.executable, *args]


def torchrun_command(nproc: int, *args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


def torchrun_node_commands(nnodes: int, nproc: int, *args) -> list[str]:
    """One ``torchrun`` per "node" of a multi-node launch on this machine (static rendezvous on 127.0.0.1)."""
    port = free_port()
    return [
        [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={rank}", f"--nproc-per-node={nproc}",
         "--master-addr=127.0.0.1", f"--master-port={port}", *args]
        for rank in range(nnodes)
    ]


def accelerate_command(config: str, *args) -> list[str]:
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", REPO / "accelerate_configs" / config,
        "--main_process_port", str(free_port()), *args,
    ]
