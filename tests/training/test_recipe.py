"""Recipes: YAML + command line -> arguments, model configuration, CoLA defaults."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from boost_hf import BoostLlamaConfig
from boost_hf.training import BoostTrainingArguments
from boost_hf.training.recipe import build_config, parse_recipe, recipe_to_argv

from .launcher import REPO


def test_yaml_values_come_first_and_the_command_line_wins(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "model: {preset: cola-130m, num_hidden_layers: 3}\n"
        "data: {block_size: 64}\n"
        "training: {output_dir: out, learning_rate: 6e-3, report_to: [tensorboard], lr_scheduler_kwargs: {min_lr_rate: 0.2}}\n"
    )
    model, data, training = parse_recipe([str(recipe), "--learning_rate", "1e-3", "--hidden_size", "256"])
    assert (model.preset, model.num_hidden_layers, model.hidden_size) == ("cola-130m", 3, 256)
    assert data.block_size == 64
    assert training.learning_rate == 1e-3 and training.report_to == ["tensorboard"]
    assert training.lr_scheduler_kwargs == {"min_lr_rate": 0.2}


@pytest.mark.parametrize(
    "recipe, message",
    [({"optimizer": {}}, "unknown recipe section 'optimizer'"), ({"model": {"hidden": 3}}, "unknown key 'hidden'")],
)
def test_recipe_errors_name_the_problem(recipe, message):
    with pytest.raises(ValueError, match=message):
        recipe_to_argv(recipe)


def test_every_shipped_recipe_parses():
    for path in sorted((REPO / "recipes").glob("*.yaml")):
        model, data, training = parse_recipe([str(path)])
        assert training.output_dir, path


def test_train_help_lists_every_recipe_field(capsys):
    """``boost-hf train --help`` lists each section's fields, generated from its dataclass, with their help."""
    from dataclasses import fields

    from boost_hf import cli
    from boost_hf.training.recipe import SECTIONS

    with pytest.raises(SystemExit) as exit:
        cli.main(["train", "--help"])
    assert exit.value.code == 0
    shown = capsys.readouterr().out
    for section, arguments in SECTIONS.items():
        assert f"recipe section {section!r}" in shown
        for f in fields(arguments):
            if f.init:
                assert f"--{f.name} " in shown or f"--{f.name}\n" in shown, f"{section}.{f.name}"
    assert "--tp_size" in shown and "--rank" in shown and "Tokens per training sequence." in shown  # names and their help


@pytest.mark.parametrize("name, lr, warmup, steps, block, sequences", [("tt-60m", 6e-3, 2200, 11000, 256, 512), ("tt-1b", 1e-3, 1200, 6000, 4096, 4096)])
def test_tensor_train_recipes_are_the_releases(name, lr, warmup, steps, block, sequences):
    """The BOOST release's settings (config_tt_llama_60m_seq_256.yaml; config_tt_llama_1b.yaml and its launch script):
    learning rate, linear warm-up steps, cosine to 1e-5, AdamW beta2 0.95, weight decay 0.01, clipping 0.5, sequences
    per step on 8 GPUs."""
    model, data, training = parse_recipe([str(REPO / "recipes" / f"{name}.yaml")])
    assert model.preset == name and data.block_size == block and data.tokenizer == "meta-llama/Llama-2-7b-hf"
    assert (training.learning_rate, training.warmup_steps, training.max_steps) == (lr, warmup, steps)
    assert training.lr_scheduler_type == "cosine_with_min_lr" and training.lr_scheduler_kwargs == {"min_lr": 1e-5}
    assert (training.adam_beta1, training.adam_beta2, training.adam_epsilon, training.weight_decay, training.max_grad_norm) == (0.9, 0.95, 1e-8, 0.01, 0.5)
    assert training.per_device_train_batch_size * training.gradient_accumulation_steps * 8 == sequences
    assert training.tp_size == 1 and training.bf16


def test_every_accelerate_config_loads():
    from accelerate.commands.config.config_args import load_config_from_file

    configs = sorted((REPO / "accelerate_configs").glob("*.yaml"))
    assert len(configs) >= 9
    for path in configs:
        config = load_config_from_file(str(path))
        assert config.num_processes >= 2, path
        assert not (config.distributed_type == "DEEPSPEED" and config.use_cpu), f"{path}: accelerate drops DeepSpeed with use_cpu"


def test_demo_command_runs_the_demo_recipe_under_accelerate():
    from argparse import Namespace

    from boost_hf.training.demo import command

    from boost_hf.training.recipe import ACCELERATE_CONFIGS_DIR, RECIPES_DIR

    cmd = command(Namespace(num_processes=4, tp_size=2, max_steps=5, output_dir="outputs/demo"), port=1234)
    assert cmd[1:3] == ["-m", "accelerate.commands.launch"]
    assert str(ACCELERATE_CONFIGS_DIR / "cpu-4proc.yaml") in cmd and str(RECIPES_DIR / "demo.yaml") in cmd  # package data
    assert cmd[cmd.index("train") - 2:cmd.index("train") + 1] == ["-m", "boost_hf.cli", "train"]  # runs in the caller's directory
    assert cmd[cmd.index("--tp_size") + 1] == "2" and cmd[cmd.index("--max_steps") + 1] == "5"


def test_cola_recipe_defaults():
    args = BoostTrainingArguments(output_dir="unused")
    assert (args.weight_decay, args.max_grad_norm, args.warmup_steps) == (0.01, 0.5, 0.1)
    assert args.lr_scheduler_type == "cosine_with_min_lr" and args.lr_scheduler_kwargs == {"min_lr_rate": 0.1}
    assert args.optim.value.startswith("adamw")


def test_parallel_config_from_arguments():
    args = BoostTrainingArguments(output_dir="unused", rmsnorm="sync", group_linears=False, activation_checkpointing_mode="lowrank")
    parallel = args.to_parallel_config(SimpleNamespace(bottleneck="cola"))
    assert (parallel.tp_style, parallel.rmsnorm, parallel.group_linears, parallel.activation_checkpointing) == (
        "btp", "sync", False, "lowrank"
    )
    assert args.to_parallel_config(SimpleNamespace(bottleneck=None)).tp_style == "megatron"
    with pytest.raises(ValueError, match="rmsnorm"):
        BoostTrainingArguments(output_dir="unused", rmsnorm="exact")


def test_sequence_parallel_argument_and_its_refusals():
    _, _, args = parse_recipe(["--tp_size", "2", "--sequence_parallel", "true", "--sample_max_new_tokens", "0", "--output_dir", "unused"])
    for bottleneck, style in (("cola", "btp"), (None, "megatron")):
        parallel = args.to_parallel_config(SimpleNamespace(bottleneck=bottleneck))
        assert parallel.tp_style == style and parallel.sequence_parallel and parallel.tp_size == 2
    fields = dict(output_dir="unused", tp_size=2, sequence_parallel=True)
    with pytest.raises(ValueError, match="cannot generate the end-of-training sample .* Pass --sample_max_new_tokens 0"):
        BoostTrainingArguments(**fields)
    with pytest.raises(ValueError, match="not supported by tp_style='vanilla'"):
        BoostTrainingArguments(**fields, sample_max_new_tokens=0, tp_style="vanilla")
    pipelined = BoostTrainingArguments(**fields, sample_max_new_tokens=0, pp_size=2).to_parallel_config(SimpleNamespace(bottleneck=None))
    assert pipelined.pp_size == 2 and pipelined.sequence_parallel and pipelined.tp_size == 2  # stages send their N/p-token shards
    assert BoostTrainingArguments(output_dir="unused", sequence_parallel=True).sample_max_new_tokens > 0  # tp 1: nothing split

    from boost_hf.training.preflight import check_model_and_data

    config = BoostLlamaConfig.from_preset("cola-60m", vocab_size=512)
    tokenizer = type("Tokenizer", (), {"__len__": lambda self: 512})()
    with pytest.raises(ValueError, match=r"block_size \(33\) is not divisible by tp_size \(2\), over which sequence_parallel"):
        check_model_and_data(config, tokenizer, 33, args.to_parallel_config(config))
    check_model_and_data(config, tokenizer, 33, BoostTrainingArguments(output_dir="unused", tp_size=2).to_parallel_config(config))


def test_trainer_activation_checkpointing_flag_selects_full_recompute():
    """The Trainer's own switch (activation_checkpointing from transformers 5.23, gradient_checkpointing before)."""
    from dataclasses import fields

    switch = "activation_checkpointing" if "activation_checkpointing" in {f.name for f in fields(BoostTrainingArguments)} else "gradient_checkpointing"
    args = BoostTrainingArguments(output_dir="unused", **{switch: True})
    assert args.activation_checkpointing_mode == "full" and not getattr(args, switch)


def test_model_config_takes_the_tokenizer_vocabulary_padded():
    tokenizer = type("Tokenizer", (), {"__len__": lambda self: 4100, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3})()
    model, _, _ = parse_recipe(["--preset", "cola-60m", "--num_attention_heads", "4", "--hidden_size", "128"])
    config = build_config(model, tokenizer)
    assert config.vocab_size == 4160 and config.pad_token_id == 3
    assert config.num_key_value_heads == 4 and config.rank == 128  # the preset's rank is kept unless overridden


def test_tt_rank_against_a_recipes_rank_names_where_each_comes_from_and_the_fix():
    """``--bottleneck tt --tt_rank 16`` on the demo recipe (``rank: 32``): refused naming the recipe's rank, the
    command line's tt_rank and ``--rank 16``, which then builds; a preset's own rank (a low-rank r, no tensor
    train's) gives way to tt_rank."""
    tokenizer = type("Tokenizer", (), {"__len__": lambda self: 512, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3})()
    demo = str(REPO / "recipes" / "demo.yaml")
    model, _, _ = parse_recipe([demo, "--bottleneck", "tt", "--tt_rank", "16"])
    with pytest.raises(ValueError, match=rf"rank=32 \(rank: 32 in the recipe {demo}\) and tt_rank=16 \(--tt_rank 16 on the "
                                         r"command line\) disagree: .*Pass --rank 16 to keep tt_rank=16 \(or remove rank "
                                         r"from the recipe\)"):
        build_config(model, tokenizer)
    model, _, _ = parse_recipe([demo, "--bottleneck", "tt", "--tt_rank=16", "--rank", "16"])
    assert build_config(model, tokenizer).rank == 16
    model, _, _ = parse_recipe(["--preset", "cola-60m", "--bottleneck", "tt", "--tt_rank", "16"])
    assert build_config(model, tokenizer).rank == 16
