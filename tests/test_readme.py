"""The README's code examples run as written (the model example in-process, the torchrun example on 2 CPU
processes)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_model_example_runs(tmp_path, monkeypatch):
    block = next(b for b in python_blocks() if "BoostLlamaConfig.from_preset" in b and "generate" in b)
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md", "exec"), {})
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()


def test_torchrun_example_runs(tmp_path):
    block = next(b for b in python_blocks() if "dist.init_process_group" in b)
    script = tmp_path / "tp_example.py"
    script.write_text(block)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240, start_new_session=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "forward collectives" in run.stdout
    assert (tmp_path / "ckpt-tp2" / "model.safetensors").is_file()
    # a TP-saved checkpoint ships the single-device remote code too
    config = json.loads((tmp_path / "ckpt-tp2" / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_boost_llama.BoostLlamaForCausalLM"
    assert (tmp_path / "ckpt-tp2" / "modeling_boost_llama.py").is_file() and (tmp_path / "ckpt-tp2" / "configuration_boost_llama.py").is_file()
