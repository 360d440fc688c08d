"""``boost-hf plan``'s command runs as printed: the plan of a demo-shaped recipe on 4 CPU processes, its accelerate
config and ``accelerate launch ... boost-hf train RECIPE --field value ...`` line, launched unchanged (the port
excepted: a free one instead of accelerate's default, which other runs on this machine may hold). When written the
plan picks FSDP2 over the 4 processes (``--data_parallel fsdp2``), which the run then trains with. And every command
of many plans (DDP, ZeRO-1, FSDP2, HSDP, pipelines, sequence parallelism, vanilla TP, a LORO recipe, a recipe whose
settings the plan overrides) passes what ``boost-hf train`` checks before any collective, under the environment its
accelerate config gives, without training."""

from __future__ import annotations

import json
import os
import shlex
import sys

import pytest
import torch
import yaml

from boost_hf.cli import main

from .launcher import free_port, run_command
from .test_refusals import accelerate_environment


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


class StandInTokenizer:
    """The vocabulary a plan assumes (the model's), for the checks that read a tokenizer (the recipes' own need the Hub
    or a corpus)."""

    def __init__(self, size: int):
        self.size, self.bos_token_id, self.eos_token_id, self.pad_token_id = size, 1, 2, 0

    def __len__(self) -> int:
        return self.size


OVERRIDDEN_RECIPE = {  # settings the plan decides, set otherwise in the recipe: the command must say the plan's
    "tp_style": "vanilla", "rmsnorm": "sync", "group_linears": False, "pp_stages_per_rank": 3, "data_parallel": "fsdp2",
    "dp_replicate_size": 2, "fsdp_units": "model", "fsdp_reshard_after_forward": "never", "precision_policy": "bf16_params",
    "fp16": True, "activation_checkpointing_mode": "lowrank",
}
PLANS = {  # name -> the plan's arguments (RECIPE: a recipe written in the test)
    "cola-30b on 32 H100: DDP, ZeRO-1, FSDP2, HSDP, pipelines, SP": ["--preset", "cola-30b", "--gpus", "32", "--gpu", "h100"],
    "cola-13b FSDP2 one unit, no resharding": ["--preset", "cola-13b", "--gpus", "8", "--data_parallel", "fsdp2",
                                               "--fsdp_units", "model", "--fsdp_reshard_after_forward", "never"],
    "cola-7b vanilla TP, bf16 gradient reduction": ["--preset", "cola-7b", "--gpus", "16", "--tp_style", "vanilla",
                                                    "--precision_policy", "bf16_params", "--grad-reduce-dtype", "bf16"],
    "cola-1b (2048 positions), ZeRO-1": ["--preset", "cola-1b", "--gpus", "8", "--zero1", "true"],
    "HSDP given": ["--preset", "cola-30b", "--gpus", "64", "--gpu", "h100", "--dp_replicate_size", "2", "--top", "3"],
    "a LORO recipe": ["--recipe", "loro-60m", "--gpus", "8"],
    "a full-rank preset without a recipe": ["--preset", "llama-1b", "--gpus", "8", "--top", "3"],
    "the demo on CPU processes": ["--recipe", "demo", "--gpus", "4", "--gpu", "cpu"],
    "a recipe the plan overrides, on CPU processes": ["--recipe", "RECIPE", "--gpus", "4", "--gpu", "cpu"],
    "a recipe the plan overrides, on GPUs": ["--recipe", "RECIPE", "--gpus", "16", "--gpu", "h100", "--top", "3"],
}


@pytest.fixture
def no_process_group(monkeypatch):
    """The launched workers' environment without their process group: ``WORLD_SIZE`` is what the checks read of the
    launch; setting up the group (``_setup_devices``) is left out, as nothing is trained."""
    from boost_hf.training import BoostTrainingArguments

    for name in list(os.environ):
        if name.startswith(("ACCELERATE_", "PARALLELISM_CONFIG_", "FSDP_")):
            monkeypatch.delenv(name)
    monkeypatch.setattr(BoostTrainingArguments, "_setup_devices", property(lambda self: torch.device("cpu")))
    return monkeypatch


@pytest.mark.parametrize("name", PLANS)
def test_every_command_plan_prints_passes_trainings_own_checks(name, tmp_path, capsys, no_process_group):
    """Each listed command of the plan (the best layouts, the best of each data-parallel family): its training
    arguments go through ``checked_settings`` (what ``boost-hf train`` runs before any collective: the arguments settled
    against the accelerate config's environment, the model config, the layout, the sequence) on its world size, and
    come back as the plan's layout, batch, data parallelism and precision."""
    from boost_hf.data_parallel_config import DataParallelConfig
    from boost_hf.shipped import resolve_recipe
    from boost_hf.training.pretrain import checked_settings

    arguments = list(PLANS[name])
    if "RECIPE" in arguments:  # the demo's model, with settings the plan decides set otherwise
        recipe = yaml.safe_load(open(resolve_recipe("demo")).read())
        recipe["training"].update(OVERRIDDEN_RECIPE)
        if "cpu" not in arguments:
            recipe["model"] = {"preset": "cola-1b"}
            recipe["training"].update(per_device_train_batch_size=32, precision_policy="autocast", grad_reduce_dtype="bf16")
        (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
        arguments[arguments.index("RECIPE")] = str(tmp_path / "recipe.yaml")
    config_path = tmp_path / "plan.yaml"
    assert main(["plan", *arguments, "--json", "--accelerate-config", str(config_path)]) == 0
    layouts = [layout for layout in json.loads(capsys.readouterr().out) if layout["command"]]
    assert {layout["listed"] for layout in layouts} >= {"top"}
    environment = None
    for layout in layouts:
        command = shlex.split(layout["command"])
        launch, train = command[:command.index("-m")], command[command.index("train") + 1:]
        if environment is None:  # what accelerate's own launch code gives the workers of this config
            flags = [flag.replace("$NODE_RANK", "0").replace("$MASTER_ADDR", "127.0.0.1") for flag in launch[4:]]
            environment = accelerate_environment((str(config_path), *flags), tmp_path)
            for variable, value in environment.items():
                no_process_group.setenv(variable, value)
            no_process_group.setenv("WORLD_SIZE", str(layout["tp"] * layout["pp"] * layout["dp"]))
        if train[0] == "RECIPE.yaml":  # the recipe the plan leaves to the user: the preset's model
            (tmp_path / "RECIPE.yaml").write_text(yaml.safe_dump({"model": {"preset": arguments[1]}}))
            train[0] = str(tmp_path / "RECIPE.yaml")
        elif not train[0].endswith(".yaml"):
            train[0] = str(resolve_recipe(train[0]))
        *_, args, _, config, parallel = checked_settings([*train, "--output_dir", str(tmp_path / "out")],
                                                         tokenizer=StandInTokenizer(32000))
        assert (parallel.tp_size, parallel.pp_size, parallel.sequence_parallel, parallel.activation_checkpointing) == (
            layout["tp"], layout["pp"], layout["sequence_parallel"], layout["activation_checkpointing"]), layout["command"]
        if layout["pp"] > 1:
            assert (parallel.pp_schedule, parallel.pp_microbatches) == (layout["pp_schedule"], layout["pp_microbatches"])
        accumulation = 1 if layout["pp"] > 1 else layout["gradient_accumulation_steps"]
        assert args.per_device_train_batch_size * accumulation * layout["dp"] == \
            layout["micro_batch"] * (layout["pp_microbatches"] or layout["gradient_accumulation_steps"]) * layout["dp"]
        sharding = DataParallelConfig.of(args)
        assert (sharding.data_parallel, args.zero1_optimizer) == (layout["data_parallel"], layout["zero1"])
        assert sharding.dp_replicate_size == (layout["dp_replicate_size"] or 1)
        assert args.precision.name == layout["precision"] and config.bottleneck == (None if "llama" in name else config.bottleneck)
    print(f"{name}: {len(layouts)} commands checked")
