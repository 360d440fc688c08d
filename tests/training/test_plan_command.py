"""``boost-hf plan``'s command runs as printed: the plan of a demo-shaped recipe on 4 CPU processes, its accelerate
config and ``accelerate launch ... boost-hf train RECIPE --field value ...`` line, launched unchanged (the port
excepted: a free one instead of accelerate's default, which other runs on this machine may hold). When written the
plan picks FSDP2 over the 4 processes (``--data_parallel fsdp2``), which the run then trains with."""

from __future__ import annotations

import json
import shlex
import sys

import yaml

from boost_hf.cli import main

from .launcher import free_port, run_command


def test_plans_command_trains_the_demo_model_on_4_cpu_processes(training_env, tmp_path, capsys):
    from boost_hf.shipped import RECIPES_DIR

    recipe = yaml.safe_load((RECIPES_DIR / "demo.yaml").read_text())
    recipe["model"].update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, rank=16,
                           max_position_embeddings=64)
    recipe["data"] = {"tokenizer": "bpe-512", "block_size": 32, "dataset": training_env["CORPUS"], "max_train_blocks": 256}
    recipe["training"].update(output_dir=str(tmp_path / "out"), max_steps=2, eval_strategy="no", save_strategy="no",
                              sample_max_new_tokens=4, report_to="none", disable_tqdm=True, logging_steps=1)
    path = tmp_path / "tiny-demo.yaml"
    path.write_text(yaml.safe_dump(recipe))
    config_path = tmp_path / "plan-accelerate.yaml"

    assert main(["plan", "--recipe", str(path), "--gpus", "4", "--gpu", "cpu", "--accelerate-config", str(config_path),
                 "--json"]) == 0
    layouts = json.loads(capsys.readouterr().out)
    best = layouts[0]
    assert best["fits"] and best["tp"] * best["pp"] * best["dp"] == 4 and best["precision"] == "fp32"
    assert yaml.safe_load(config_path.read_text())["num_processes"] == 4
    command = shlex.split(best["command"])
    assert ("--data_parallel" in command) == (best["data_parallel"] == "fsdp2")
    assert command[:4] == ["accelerate", "launch", "--config_file", str(config_path)]
    assert command[4:8] == ["-m", "boost_hf.cli", "train", str(path)]
    argv = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port()), *command[2:]]
    output = run_command(argv, training_env, timeout=600)
    assert f"model and tokenizer saved to {tmp_path / 'out' / 'final'}" in output
    assert "comm_tp_calls_per_step': '0'" in output if best["tp"] == 1 else "comm_tp_calls_per_step': '0'" not in output
