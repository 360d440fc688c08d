"""Fixtures of the training tests: an isolated cache with a small corpus and tokenizer, and a launcher
for training commands (one process, ``torchrun`` or ``accelerate launch``) with a timeout."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY_RECIPE = Path(__file__).with_name("tiny.yaml")


@pytest.fixture(scope="session")
def training_env(tmp_path_factory) -> dict[str, str]:
    """Environment for training subprocesses: offline, a session cache holding the ``bpe-512`` tokenizer,
    and ``CORPUS``, a small saved ``DatasetDict`` (fast to tokenize) for ``--dataset``."""
    from datasets import DatasetDict

    from boost_hf.data import load_tokenizer, load_wikipedia_sample

    cache = tmp_path_factory.mktemp("boost_hf_cache")
    wiki = load_wikipedia_sample(cache)
    load_tokenizer("bpe-512", cache_dir=cache)  # trained once here, read from the cache by every rank
    corpus = cache / "corpus"
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_command(args: list[str], env: dict[str, str], timeout: float) -> str:
    """Run ``args`` in its own session from the repository root; kill the whole group on timeout."""
    proc = subprocess.Popen(
        [str(a) for a in args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"{' '.join(map(str, args))} timed out after {timeout}s:\n{output[-6000:]}")
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, args))} failed ({proc.returncode}):\n{output[-10000:]}")
    return output


def python_command(*args) -> list[str]:
    return [sys.executable, *args]


def torchrun_command(nproc: int, *args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


def accelerate_command(config: str, *args) -> list[str]:
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", REPO / "accelerate_configs" / config,
        "--main_process_port", str(free_port()), *args,
    ]
