"""Each layout setting is declared once, as a field of ``ParallelConfig`` (issue 30): the training arguments, the
``boost-hf estimate`` options and the estimator's ``Workload`` are generated from or carry those fields, with the same
names, defaults, choices and help (but for the differences stated in ``boost_hf.parallel.settings``)."""

from __future__ import annotations

import argparse
import typing
from dataclasses import fields

import pytest
import yaml
from transformers import HfArgumentParser

from boost_hf import ParallelConfig
from boost_hf.training import BoostTrainingArguments

DECLARED = {f.name: f for f in fields(ParallelConfig)}
TYPES = typing.get_type_hints(ParallelConfig)
# The differences the training arguments are allowed (the Trainer owns `activation_checkpointing`; "auto" resolves
# with the model config; an unset tp_size is told from a given 1, to check it against accelerate's parallelism_config,
# an unset checkpointing mode from a given none, to check it against FSDP's and the Trainer's switch): everything else
# must be the declaration itself.
TRAINING_NAME = {"activation_checkpointing": "activation_checkpointing_mode"}
TRAINING_DEFAULT = {"tp_style": "auto", "tp_size": None, "activation_checkpointing": None}
TRAINING_EXTRA_CHOICES = {"tp_style": ("auto",)}


def literal_choices(name: str) -> tuple | None:
    kind = TYPES[name]
    return typing.get_args(kind) if typing.get_origin(kind) is typing.Literal else None


def parser_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """dest -> the action that sets it (the positive one for a boolean with a ``--no_`` twin)."""
    actions = {}
    for action in parser._actions:  # argparse keeps no public list of its actions
        if not isinstance(action, argparse._StoreFalseAction):
            actions.setdefault(action.dest, action)
    return actions


def test_every_field_declares_its_help_type_and_default():
    for name, f in DECLARED.items():
        assert len(f.metadata.get("help", "")) > 20, name
        assert ParallelConfig.help(name) == f.metadata["help"]
        assert ParallelConfig().to_dict()[name] == f.default
    assert "pp_size=1" not in " ".join(f.metadata["help"] for f in DECLARED.values())  # lifted since


def test_training_arguments_are_generated_from_the_fields():
    training = {f.name: f for f in fields(BoostTrainingArguments)}
    actions = parser_actions(HfArgumentParser(BoostTrainingArguments))
    for name, f in DECLARED.items():
        arg = TRAINING_NAME.get(name, name)
        assert arg in training, f"ParallelConfig.{name} is no training argument ({arg})"
        assert training[arg].default == TRAINING_DEFAULT.get(name, f.default), name
        assert training[arg].metadata["help"].startswith(f.metadata["help"]), name
        choices = literal_choices(name)
        if choices is not None:
            assert tuple(actions[arg].choices) == TRAINING_EXTRA_CHOICES.get(name, ()) + choices, name
    # no layout setting declared a second time under another name
    assert not {"tp", "pp", "checkpointing", "microbatches", "stages_per_rank"} & set(training)


def test_training_arguments_make_the_declared_config():
    """Every field reaches the ParallelConfig the run is built with, from the command line as HfArgumentParser reads
    it (pp_layer_split as a comma-separated list)."""
    argv = ["--output_dir", "unused", "--tp_size", "2", "--tp_style", "megatron", "--rmsnorm", "sync", "--group_linears",
            "false", "--activation_checkpointing_mode", "lowrank", "--sequence_parallel", "true", "--pp_size", "2",
            "--pp_schedule", "interleaved-1f1b", "--pp_microbatches", "4", "--pp_stages_per_rank", "3",
            "--pp_layer_split", "1,2,3,1,1,2", "--sample_max_new_tokens", "0"]
    args, = HfArgumentParser(BoostTrainingArguments).parse_args_into_dataclasses(args=argv)
    expected = ParallelConfig(tp_size=2, tp_style="megatron", rmsnorm="sync", group_linears=False,
                              activation_checkpointing="lowrank", sequence_parallel=True, pp_size=2,
                              pp_schedule="interleaved-1f1b", pp_microbatches=4, pp_stages_per_rank=3,
                              pp_layer_split=(1, 2, 3, 1, 1, 2))
    assert {f: v != DECLARED[f].default for f, v in expected.to_dict().items()} == {f: True for f in DECLARED}
    assert args.to_parallel_config() == expected


def test_pp_layer_split_from_a_recipe_and_the_command_line(tmp_path):
    """A recipe's YAML list and the command line's comma-separated list give the run its split (issue 28): the
    ParallelConfig that ``build_model`` builds the model with, and the stages' layers it keeps."""
    from boost_hf import BoostLlamaConfig
    from boost_hf.training.recipe import parse_recipe

    recipe = tmp_path / "split.yaml"
    recipe.write_text(yaml.safe_dump({"training": {"output_dir": str(tmp_path / "out"), "pp_size": 2, "pp_layer_split": [1, 3]}}))
    config = BoostLlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                              num_attention_heads=4, bottleneck="cola", rank=8)
    for argv in ([str(recipe)], [str(recipe), "--pp_layer_split", "3,1"], [str(recipe), "--pp_layer_split", "3", "1"]):
        *_, args = parse_recipe(argv)
        parallel = args.to_parallel_config(config)
        parallel.check_model(config)
        split = (1, 3) if len(argv) == 1 else (3, 1)
        assert parallel.pp_layer_split == split
        assert parallel.stage_layers(4) == [range(0, split[0]), range(split[0], 4)]
    with pytest.raises(ValueError, match="pp_layer_split"):
        parse_recipe([str(recipe), "--pp_layer_split", "1,x"])
    *_, args = parse_recipe([str(recipe), "--pp_layer_split", "2,1"])
    with pytest.raises(ValueError, match=r"pp_layer_split \(2, 1\) holds 3 layers"):
        args.to_parallel_config(config).check_model(config)


def estimate_parser() -> argparse.ArgumentParser:
    from boost_hf.cli import SUBCOMMANDS

    parser = argparse.ArgumentParser()
    SUBCOMMANDS["estimate"][1](parser)
    return parser


def test_estimate_options_are_generated_from_the_fields():
    """``boost-hf estimate`` offers every field but tp_style (its --layouts compares them) as ``--name`` and
    ``--name-with-dashes``, with the declared choices and help; its own default: one micro-batch."""
    actions = parser_actions(estimate_parser())
    for name, f in DECLARED.items():
        if name == "tp_style":
            continue
        action = actions[name]
        assert f"--{name}" in action.option_strings and f"--{name.replace('_', '-')}" in action.option_strings, name
        assert action.help.startswith(f.metadata["help"]), name
        assert action.default == (1 if name == "pp_microbatches" else f.default), name
        if literal_choices(name) is not None:
            assert tuple(action.choices) == literal_choices(name), name


def test_estimate_keeps_its_earlier_spellings():
    """The README's commands (and earlier scripts) still parse, to the fields."""
    parser = estimate_parser()
    args = parser.parse_args("--tp 4 --pp 2 --pp_schedule interleaved-1f1b --stages-per-rank 2 --microbatches 8 "
                             "--checkpointing lowrank --sequence-parallel --no-group-linears --rmsnorm sync".split())
    assert (args.tp_size, args.pp_size, args.pp_schedule, args.pp_stages_per_rank, args.pp_microbatches) == (4, 2, "interleaved-1f1b", 2, 8)
    assert (args.activation_checkpointing, args.sequence_parallel, args.group_linears, args.rmsnorm) == ("lowrank", True, False, "sync")
    args = parser.parse_args("--pp-schedule gpipe --num-micro-batches 3 --pp_stages_per_rank 1 --sequence_parallel "
                             "--pp_layer_split 1,3".split())
    assert (args.pp_schedule, args.pp_microbatches, args.pp_stages_per_rank, args.sequence_parallel, args.pp_layer_split) == (
        "gpipe", 3, 1, True, (1, 3))


def test_workload_carries_a_parallel_config():
    from boost_hf.perf.workload import Workload

    from boost_hf.data_parallel_config import DataParallelConfig

    # the layout, then the workload's own fields (none repeats a ParallelConfig field), then the data parallelism as
    # declared once (DataParallelConfig: none of its fields repeated either)
    assert [f.name for f in fields(Workload)] == ["parallel_config", "micro_batch", "seq_len", "num_micro_batches", "dtype_bytes",
                                                  "dp_size", "zero1_optimizer", "precision", "grad_reduce_dtype",
                                                  "data_parallel"]
    assert Workload().data_parallel == DataParallelConfig()
    with pytest.raises(ValueError, match="zero1_optimizer is refused"):
        Workload(dp_size=4, zero1_optimizer=True, data_parallel=DataParallelConfig("fsdp2"))
    with pytest.raises(ValueError, match="does not divide"):
        Workload(dp_size=4, data_parallel=DataParallelConfig("fsdp2", dp_replicate_size=3))
    parallel = ParallelConfig(tp_size=4, pp_size=2, pp_schedule="interleaved-1f1b", activation_checkpointing="lowrank",
                              sequence_parallel=True, pp_layer_split=(8, 8, 8, 8))
    workload = Workload(parallel, micro_batch=2)
    assert workload.parallel_config == parallel and workload.num_micro_batches == 1
    assert Workload(tp=4, pp=2, pp_schedule="interleaved-1f1b", activation_checkpointing="lowrank", sequence_parallel=True,
                    pp_layer_split=(8, 8, 8, 8), micro_batch=2) == workload  # the keywords are the fields (or short names)
    assert workload.parallel("megatron").activation_checkpointing == "full"
    assert workload.parallel("vanilla").sequence_parallel is False
    # pp_microbatches is the iteration's micro-batches (kept in the workload, which also times what torch refuses)
    with_microbatches = ParallelConfig(pp_size=2, pp_microbatches=4)
    assert Workload(with_microbatches).num_micro_batches == 4
    assert Workload(with_microbatches).parallel_config.pp_microbatches is None
    with pytest.raises(ValueError, match="give one number"):
        Workload(with_microbatches, num_micro_batches=2)


def test_estimate_honours_pp_layer_split():
    from boost_hf import BoostLlamaConfig
    from boost_hf.perf.estimator import estimate
    from boost_hf.perf.workload import Workload

    config = BoostLlamaConfig.from_preset("cola-7b")
    even = estimate(config, Workload(tp=4, pp=2, num_micro_batches=4), "h100", layouts=("btp",)).layouts["btp"]
    layers = config.num_hidden_layers
    uneven = estimate(config, Workload(tp=4, pp=2, num_micro_batches=4, pp_layer_split=(layers // 2 - 4, layers // 2 + 4)),
                      "h100", layouts=("btp",)).layouts["btp"]
    assert uneven.stage_times_s[0] < even.stage_times_s[0] and uneven.stage_times_s[1] > even.stage_times_s[1]


# ---------------------------------------------------------------------------------- precision (issue 35)
def test_precision_is_declared_once_and_generated_everywhere():
    """``PrecisionConfig``'s fields are the training arguments and the options of ``boost-hf plan`` and ``estimate``
    (one flag name, ``--precision_policy``, with the declared choices and help); the memory and time tables of the
    analysis hold one row per declared policy; ``resolve_precision`` validates through the declaration."""
    from boost_hf.cli import SUBCOMMANDS
    from boost_hf.perf.estimator import PRECISION_TRAFFIC
    from boost_hf.perf.memory import PRECISION_BYTES
    from boost_hf.precision_config import PRECISION_POLICIES, PrecisionConfig
    from boost_hf.training.precision import resolve_precision

    declared = {f.name: f for f in fields(PrecisionConfig)}
    training = {f.name: f for f in fields(BoostTrainingArguments)}
    train_actions = parser_actions(HfArgumentParser(BoostTrainingArguments))
    for name, f in declared.items():
        assert training[name].default == f.default and training[name].metadata["help"] == f.metadata["help"], name
    assert tuple(train_actions["precision_policy"].choices) == PRECISION_POLICIES == ("fp32", "autocast", "bf16_params")
    assert tuple(train_actions["grad_reduce_dtype"].choices) == ("fp32", "bf16")
    for command, offered in (("plan", ("precision_policy", "grad_reduce_dtype")), ("estimate", ("precision_policy",))):
        parser = argparse.ArgumentParser()
        SUBCOMMANDS[command][1](parser)
        actions = parser_actions(parser)
        for name in offered:
            assert f"--{name}" in actions[name].option_strings and actions[name].help.startswith(declared[name].metadata["help"])
            assert tuple(actions[name].choices) == tuple(train_actions[name].choices), (command, name)
        assert "precision" not in actions and "fp32_residual" not in actions
    assert tuple(PRECISION_BYTES) == tuple(PRECISION_TRAFFIC) == PRECISION_POLICIES
    with pytest.raises(ValueError, match="precision_policy must be one of fp32, autocast, bf16_params"):
        PrecisionConfig(precision_policy="fp8")
    args = BoostTrainingArguments(output_dir="unused", precision_policy="fp32")
    assert resolve_precision(args).name == "fp32"
    with pytest.raises(ValueError, match="--precision_policy fp32 trains without half precision, but bf16 was asked for"):
        resolve_precision(type("Args", (), {"mixed_precision": "bf16", "precision_policy": "fp32"})())
