"""Every refusal, however the setting is made: the flag (``BoostTrainingArguments(...)``, as ``--flag`` on the command
line), the recipe (a YAML file through ``parse_recipe``), the accelerate config (turned into the workers' environment
by accelerate's own launch code, in this process) and the environment. Each case builds the training arguments in one
process: the refusals are raised there, on every rank, before the process group exists. One launched case checks the
report's example end to end (``accelerate launch`` with ``cpu-4proc-zero2.yaml`` and ``--pp_size 2``).

To add a refusal: one row in ``REFUSALS`` (the setting refused, what it is refused with, the message); every entry
point of the feature it is refused with is then tried.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, fields
from types import SimpleNamespace

import pytest
import torch
import yaml

from boost_hf.training import BoostTrainingArguments, parse_recipe
from boost_hf.training.compatibility import without_accelerate_parallelism, layout_from_parallelism_config

from .launcher import DEMO_RECIPE, REPO, TINY, accelerate_command, run_command, start_command

PARALLELISM = {  # accelerate's ParallelismConfig sizes: its tp_size honoured, the others refused
    "parallelism tp 2": {"tp_size": 2},
    "parallelism dp_shard 2": {"dp_shard_size": 2},
    "parallelism cp 2": {"cp_size": 2},
    "parallelism sp 2": {"sp_size": 2},
    "parallelism dp_replicate 2": {"dp_replicate_size": 2},
    "parallelism dp_shard 2 x dp_replicate 2": {"dp_shard_size": 2, "dp_replicate_size": 2},
}
ZERO2 = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
ZERO2_ACCUMULATION_4 = {**ZERO2, "gradient_accumulation_steps": 4}
ACCELERATE_CONFIGS = {
    "deepspeed": REPO / "accelerate_configs" / "cpu-4proc-zero2.yaml",
    "cpu": ({"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "num_processes": 2}, "--cpu"),
    "fsdp1": {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "num_processes": 2,
              "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD"}},
    "fsdp2": {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "num_processes": 2,
              "fsdp_config": {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                              "fsdp_reshard_after_forward": False}},
    "fsdp2 offload": {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "num_processes": 2,
                      "fsdp_config": {"fsdp_version": 2, "fsdp_offload_params": True}},
    **{name: {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "num_processes": 4,
              "parallelism_config": {f"parallelism_config_{size}": value for size, value in sizes.items()}}
       for name, sizes in PARALLELISM.items()},
    "honoured": {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "num_processes": 2,
                 "mixed_precision": "bf16", "dynamo_config": {"dynamo_backend": "INDUCTOR"}},
    "fsdp2 shipped": REPO / "accelerate_configs" / "cpu-4proc-fsdp2.yaml",  # reshard_after_forward: true
    "fsdp2 checkpointing": {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "num_processes": 2,
                            "fsdp_config": {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                            "fsdp_activation_checkpointing": True}},
    "bf16": {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "num_processes": 2,
             "mixed_precision": "bf16"},
    "fp8": {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "num_processes": 2,
            "mixed_precision": "fp8"},
    "inductor": {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "num_processes": 2,
                 "dynamo_config": {"dynamo_backend": "INDUCTOR"}},
    "fullgraph": {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "num_processes": 2,
                  "dynamo_config": {"dynamo_backend": "INDUCTOR", "dynamo_use_fullgraph": True}},
    "deepspeed accumulation 4": {"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED",
                                 "num_processes": 2, "deepspeed_config": {"zero_stage": 2, "gradient_accumulation_steps": 4}},
}
ENVIRONMENT = {
    "deepspeed": {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"},
    "cpu": {"ACCELERATE_USE_CPU": "true"},
    "fsdp1": {"ACCELERATE_USE_FSDP": "true"},  # accelerate's default version: 1
    "fsdp2": {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
              "FSDP_RESHARD_AFTER_FORWARD": "false"},
    "fsdp2 offload": {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "true"},
    **{name: {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", **{f"PARALLELISM_CONFIG_{size.upper()}": str(value)
                                                             for size, value in sizes.items()}}
       for name, sizes in PARALLELISM.items()},
    "fsdp2 shipped": {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
                      "FSDP_RESHARD_AFTER_FORWARD": "true"},
    "fsdp2 checkpointing": {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_ACTIVATION_CHECKPOINTING": "true",
                            "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP"},
    "bf16": {"ACCELERATE_MIXED_PRECISION": "bf16"},
    "fp8": {"ACCELERATE_MIXED_PRECISION": "fp8"},
    "inductor": {"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"},
    "fullgraph": {"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR", "ACCELERATE_DYNAMO_USE_FULLGRAPH": "True"},
    "deepspeed accumulation 4": {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
                                 "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"},
}
FLAGS = {  # the feature as training arguments (a recipe holds the same, but parallelism_config, a Python object)
    "deepspeed": {"deepspeed": "ZERO2_JSON"},
    "fsdp1": {"fsdp": "full_shard", "fsdp_config": {"version": 1}},
    "fsdp2": {"fsdp": "shard_grad_op", "fsdp_config": {"version": 2}},  # transformers' names; shard_grad_op: no reshard
    "fsdp2 offload": {"fsdp": "full_shard offload"},  # (transformers' default version: 2)
    **{name: {"parallelism_config": sizes} for name, sizes in PARALLELISM.items()},  # ParallelismConfig(**sizes)
    "fsdp2 shipped": {"fsdp": "full_shard", "fsdp_config": {"version": 2}},  # transformers' reshard_after_forward: true
    "fsdp2 checkpointing": {"fsdp": "full_shard", "fsdp_config": {"version": 2, "activation_checkpointing": True}},
    "deepspeed accumulation 4": {"deepspeed": "ZERO2_ACCUMULATION_4_JSON"},
}


PARALLELISM_ROUTES = ("flag", "accelerate config", "environment")  # "flag": parallelism_config=ParallelismConfig(...)
TRAINER_SWITCH = next(name for name in ("activation_checkpointing", "gradient_checkpointing")
                      if name in {f.name for f in fields(BoostTrainingArguments)})


@dataclass(frozen=True)
class Refusal:
    name: str
    settings: dict  # training arguments (flag or recipe)
    match: str
    feature: str | None = None  # the other side, tried through every entry point it has; None: ``settings`` alone
    routes: tuple[str, ...] = field(default=("flag", "recipe", "accelerate config", "environment"))


REFUSALS = [
    Refusal("pp_size x DeepSpeed", {"pp_size": 2}, r"DeepSpeed cannot run with pp_size=2: the pipeline schedule", "deepspeed"),
    Refusal("zero1_optimizer x DeepSpeed", {"zero1_optimizer": True}, r"--zero1_optimizer shards the optimizer state with "
            r"torch's ZeroRedundancyOptimizer, which DeepSpeed's engine .* cannot wrap", "deepspeed"),
    Refusal("LORO x DeepSpeed", {"lowrank_optimizer": "loro"}, r"--lowrank_optimizer loro does not run under DeepSpeed", "deepspeed"),
    Refusal("nonfinite skip_step x DeepSpeed", {"nonfinite": "skip_step"}, r"--nonfinite skip_step is not supported with DeepSpeed",
            "deepspeed"),
    Refusal("DeepSpeed x use_cpu", {"deepspeed": "ZERO2_JSON"}, r"DeepSpeed is requested \(--deepspeed\) but ACCELERATE_USE_CPU is "
            r"set .* accelerate drops DeepSpeed silently", "cpu", routes=("accelerate config", "environment")),
    Refusal("FSDP version 1", {}, r"FSDP version 1 \(.*\) is not supported: FSDP1 .* flattens the parameters.* Use FSDP2",
            "fsdp1"),
    Refusal("FSDP2 x DeepSpeed", {"data_parallel": "fsdp2"}, r"--data_parallel fsdp2 \(FSDP2, however asked for\) cannot "
            r"run with DeepSpeed", "deepspeed"),
    Refusal("FSDP2 x zero1_optimizer", {"zero1_optimizer": True}, r"--zero1_optimizer with --data_parallel fsdp2: FSDP2 "
            r"shards the optimizer state .* Drop --zero1_optimizer", "fsdp2"),
    Refusal("FSDP2 x LORO", {"lowrank_optimizer": "loro"}, r"--lowrank_optimizer loro with --data_parallel fsdp2 is not "
            r"supported", "fsdp2"),
    Refusal("FSDP2 x CPU offload", {}, r"FSDP \(.*\) asks for CPU offload .* which boost-hf's FSDP2 does not apply",
            "fsdp2 offload"),
    Refusal("FSDP2 reshard x the flag", {"fsdp_reshard_after_forward": "always"}, r"sets fsdp_reshard_after_forward='never' "
            r"but the flag or the recipe sets fsdp_reshard_after_forward='always'", "fsdp2",
            routes=("accelerate config", "environment")),
    Refusal("FSDP2 x fp16", {"fp16": True}, r"fp16 autocast needs a gradient scaler that unscales FSDP2's sharded "
            r"gradients.* use --bf16 true", "fsdp2"),
    Refusal("dp_replicate_size x ddp", {"dp_replicate_size": 2}, r"dp_replicate_size=2 is HSDP's .* add --data_parallel fsdp2",
            routes=("flag", "recipe")),
    Refusal("parallelism_config cp_size", {}, r"parallelism_config .*sets cp_size=2: context parallelism .* is not supported "
            r"by boost-hf. The nearest is --sequence_parallel with --tp_size > 1, which is not the same", "parallelism cp 2",
            routes=PARALLELISM_ROUTES),
    Refusal("parallelism_config sp_size", {}, r"parallelism_config .*sets sp_size=2: accelerate's sequence parallelism "
            r"\(DeepSpeed's ALST/Ulysses.* The nearest is --sequence_parallel", "parallelism sp 2", routes=PARALLELISM_ROUTES),
    Refusal("parallelism_config tp_size x tp_size", {"tp_size": 4}, r"parallelism_config .*sets tp_size=2 but the flag or the "
            r"recipe sets tp_size=4 \(--tp_size, tp_size: in the recipe\)", "parallelism tp 2", routes=PARALLELISM_ROUTES),
    Refusal("parallelism_config tp_size x tp_size 1", {"tp_size": 1}, r"parallelism_config .*sets tp_size=2 but the flag or "
            r"the recipe sets tp_size=1 \(--tp_size, tp_size: in the recipe\)", "parallelism tp 2", routes=PARALLELISM_ROUTES),
    Refusal("parallelism_config dp_replicate_size x world", {}, r"parallelism_config .*sets dp_replicate_size=2, which with "
            r"tp_size=1 x pp_size=1 needs 2 processes, but 1 are launched \(WORLD_SIZE\)", "parallelism dp_replicate 2",
            routes=PARALLELISM_ROUTES),
    # one source per setting (issue 42 item 4): a value given, the default's included, is told from none
    Refusal("FSDP2 x --data_parallel ddp", {"data_parallel": "ddp"}, r"sets data_parallel='fsdp2' but the flag or the "
            r"recipe sets data_parallel='ddp' \(--data_parallel, data_parallel: in the recipe\): one setting, written "
            r"twice, differently", "fsdp2 shipped"),
    Refusal("parallelism_config dp_shard_size x --data_parallel ddp", {"data_parallel": "ddp"}, r"parallelism_config .*sets "
            r"data_parallel='fsdp2' but the flag or the recipe sets data_parallel='ddp'", "parallelism dp_shard 2",
            routes=PARALLELISM_ROUTES),
    Refusal("parallelism_config dp_replicate_size x --data_parallel fsdp2", {"data_parallel": "fsdp2"},
            r"parallelism_config .*sets dp_replicate_size=2 and no dp_shard_size: 2 whole replicas .* but the flag or the "
            r"recipe sets data_parallel='fsdp2', which shards the model: the replicas would be dropped. Set dp_shard_size",
            "parallelism dp_replicate 2", routes=PARALLELISM_ROUTES),
    Refusal("parallelism_config HSDP x --dp_replicate_size", {"data_parallel": "fsdp2", "dp_replicate_size": 1},
            r"parallelism_config .*sets dp_replicate_size=2 but the flag or the recipe sets dp_replicate_size=1",
            "parallelism dp_shard 2 x dp_replicate 2", routes=PARALLELISM_ROUTES),
    Refusal("FSDP reshard_after_forward true x never", {"fsdp_reshard_after_forward": "never"}, r"sets "
            r"fsdp_reshard_after_forward='default' but the flag or the recipe sets fsdp_reshard_after_forward='never'",
            "fsdp2 shipped"),
    Refusal("FSDP activation_checkpointing x mode none", {"activation_checkpointing_mode": "none"}, r"sets "
            r"activation_checkpointing_mode='full' but the flag or the recipe sets activation_checkpointing_mode='none'",
            "fsdp2 checkpointing"),
    Refusal("the Trainer's activation_checkpointing x mode none", {"activation_checkpointing_mode": "none",
            "ACTIVATION_SWITCH": True}, r"the Trainer's --\w+_checkpointing sets activation_checkpointing_mode='full' but "
            r"the flag or the recipe sets activation_checkpointing_mode='none'", routes=("flag", "recipe")),
    Refusal("mixed_precision bf16 x --bf16 false", {"bf16": False}, r"the accelerate config's mixed_precision: bf16 "
            r"\(ACCELERATE_MIXED_PRECISION\) sets bf16=True but the flag or the recipe sets bf16=False", "bf16",
            routes=("accelerate config", "environment")),
    Refusal("mixed_precision bf16 x --fp16", {"fp16": True}, r"mixed_precision: bf16 .* sets fp16=False but the flag or "
            r"the recipe sets fp16=True", "bf16", routes=("accelerate config", "environment")),
    Refusal("mixed_precision fp8", {}, r"mixed_precision: fp8 \(ACCELERATE_MIXED_PRECISION\) is not supported by "
            r"boost-hf", "fp8", routes=("environment",)),  # accelerate launch itself refuses fp8 without its backends
    Refusal("dynamo_backend x --torch_compile_backend", {"torch_compile_backend": "eager"}, r"dynamo_backend: inductor "
            r"\(ACCELERATE_DYNAMO_BACKEND\) sets torch_compile_backend='inductor' but the flag or the recipe sets "
            r"torch_compile_backend='eager'", "inductor", routes=("accelerate config", "environment")),
    Refusal("dynamo_backend x --torch_compile false", {"torch_compile": False}, r"sets torch_compile=True but the flag "
            r"or the recipe sets torch_compile=False", "inductor", routes=("accelerate config", "environment")),
    Refusal("dynamo_use_fullgraph", {}, r"dynamo_use_fullgraph: true \(ACCELERATE_DYNAMO_USE_FULLGRAPH\) is not applied "
            r"by boost-hf", "fullgraph", routes=("accelerate config", "environment")),
    Refusal("DeepSpeed gradient_accumulation_steps x the flag", {}, r"sets gradient_accumulation_steps=4 but "
            r"--gradient_accumulation_steps \(the flag, the recipe or its default\) is 1: one setting, written twice, "
            r"differently. Set gradient_accumulation_steps to \"auto\"", "deepspeed accumulation 4"),
    Refusal("zero1_optimizer x LORO", {"zero1_optimizer": True, "lowrank_optimizer": "loro"},
            r"--zero1_optimizer with --lowrank_optimizer loro is not supported", routes=("flag", "recipe")),
    Refusal("gradient accumulation x PP", {"pp_size": 2, "gradient_accumulation_steps": 2},
            r"gradient_accumulation_steps=2 with pp_size=2", routes=("flag", "recipe")),
]
ACCELERATE_HINT = "Here DeepSpeed is on because ACCELERATE_USE_DEEPSPEED=true"


def accelerate_environment(config, tmp_path) -> dict[str, str]:
    """The environment ``accelerate launch --config_file config [launch flag]`` gives its workers (accelerate's own
    code); ``config``: a path, a dict, or ``(dict, launch flag)``."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    config, *flags = config if isinstance(config, tuple) else (config,)
    if isinstance(config, dict):
        path = tmp_path / "accelerate.yaml"
        path.write_text(yaml.safe_dump(config))
        config = path
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(config), *flags, "train.py"]))
    if args.cpu:  # the launcher accelerate's launch_command picks
        environment = prepare_simple_launcher_cmd_env(args)[1]
    elif args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ""
        environment = prepare_deepspeed_cmd_env(args)[1]
    else:
        environment = prepare_multi_gpu_env(args)
    return {k: v for k, v in environment.items() if k.startswith(("ACCELERATE_", "PARALLELISM_CONFIG_", "FSDP_"))}


def entry(feature: str | None, route: str, tmp_path) -> tuple[dict, dict]:
    """``(training arguments, environment)`` turning ``feature`` on through ``route``."""
    if feature is None:
        return {}, {}
    if route in ("flag", "recipe"):
        return dict(FLAGS[feature]), {}
    if route == "accelerate config":
        return {}, accelerate_environment(ACCELERATE_CONFIGS[feature], tmp_path)
    return {}, ENVIRONMENT[feature]


def build_arguments(route: str, settings: dict, tmp_path) -> BoostTrainingArguments:
    for name, config in (("ZERO2_JSON", ZERO2), ("ZERO2_ACCUMULATION_4_JSON", ZERO2_ACCUMULATION_4)):
        if settings.get("deepspeed") == name:
            (tmp_path / f"{name.lower()}.json").write_text(json.dumps(config))
            settings = {**settings, "deepspeed": str(tmp_path / f"{name.lower()}.json")}
    if isinstance(settings.get("parallelism_config"), dict):  # made here, under the test's environment
        from accelerate import ParallelismConfig

        settings = {**settings, "parallelism_config": ParallelismConfig(**settings["parallelism_config"])}
    settings = dict(settings)
    if settings.pop("ACTIVATION_SWITCH", False):  # the Trainer's own switch, under its name in this transformers
        settings[TRAINER_SWITCH] = True
    if route != "recipe":
        return BoostTrainingArguments(output_dir=str(tmp_path / "out"), **settings)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"training": {"output_dir": str(tmp_path / "out"), **settings}}))
    return parse_recipe([str(recipe)])[2]


@pytest.fixture
def clean_environment(monkeypatch):
    """No accelerate setting inherited from the test's own environment."""
    for name in list(os.environ):
        if name.startswith(("ACCELERATE_", "PARALLELISM_CONFIG_", "FSDP_")):
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize("refusal, route", [(r, route) for r in REFUSALS for route in r.routes],
                         ids=[f"{r.name} via {route}" for r in REFUSALS for route in r.routes])
def test_each_refusal_however_the_setting_is_made(refusal, route, tmp_path, clean_environment):
    arguments, environment = entry(refusal.feature, route, tmp_path)
    for name, value in environment.items():
        clean_environment.setenv(name, value)
    with pytest.raises(ValueError, match=refusal.match) as error:
        build_arguments(route, {**refusal.settings, **arguments}, tmp_path)
    if refusal.feature == "deepspeed":  # the fix named is the entry point's own
        assert (ACCELERATE_HINT in str(error.value)) == (route in ("accelerate config", "environment")), str(error.value)


@pytest.mark.parametrize("route", ["flag", "recipe", "accelerate config", "environment"])
def test_each_deepspeed_entry_point_really_turns_deepspeed_on(route, tmp_path, clean_environment):
    """The control of the rows above: without the refused setting, each entry point gives transformers' DeepSpeed plugin
    (so the matrix cannot pass because a route does nothing)."""
    arguments, environment = entry("deepspeed", route, tmp_path)
    for name, value in environment.items():
        clean_environment.setenv(name, value)
    assert build_arguments(route, arguments, tmp_path).deepspeed_plugin is not None


def test_what_the_accelerate_config_sets_and_boost_hf_honours_reaches_the_arguments(tmp_path, clean_environment):
    """mixed_precision and dynamo_backend of an accelerate config become --bf16 and --torch_compile (per decoder layer),
    so boost-hf's own code reads them where it reads the flags."""
    for name, value in accelerate_environment(ACCELERATE_CONFIGS["honoured"], tmp_path).items():
        clean_environment.setenv(name, value)
    args = BoostTrainingArguments(output_dir=str(tmp_path / "out"))
    assert args.bf16 and args.mixed_precision == "bf16"
    assert args.torch_compile and args.torch_compile_backend == "inductor"
    agreeing = BoostTrainingArguments(output_dir=str(tmp_path / "out"), bf16=True, torch_compile=True,
                                      torch_compile_backend="inductor")
    assert agreeing.bf16 and agreeing.torch_compile_backend == "inductor"  # the same value from both: one setting
    with pytest.raises(ValueError, match=r"sets torch_compile_backend='inductor' but the flag or the recipe sets "
                                         r"torch_compile_backend='eager'"):  # no longer the flag winning silently
        BoostTrainingArguments(output_dir=str(tmp_path / "out"), torch_compile=True, torch_compile_backend="eager")
    # an explicit false is a value too, not "unset" (before, false was the field's default: accelerate's dynamo_backend
    # turned compilation on over --torch_compile false)
    with pytest.raises(ValueError, match=r"torch_compile"):
        BoostTrainingArguments(output_dir=str(tmp_path / "out"), torch_compile=False)


def test_torch_compile_unset_compiles_on_cuda_only(tmp_path, clean_environment, monkeypatch):
    """``--torch_compile`` unset: eager on the CPU (this machine), compiled where CUDA is there (resolved on the same
    arguments with CUDA reported available); ``false`` stays false and ``true`` true either way; the recipes and the
    CLI parse ``--torch_compile false``, ``true`` and a bare ``--torch_compile``."""
    from types import SimpleNamespace

    from boost_hf.training.compatibility import resolve_torch_compile
    from boost_hf.training.recipe import parse_recipe

    args = BoostTrainingArguments(output_dir=str(tmp_path / "out"))
    assert args.torch_compile is False and not args.torch_compile_explicit
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for given, expected in ((None, True), (False, False), (True, True)):
        on_gpu = SimpleNamespace(torch_compile=given, use_cpu=False)
        resolve_torch_compile(on_gpu)
        assert on_gpu.torch_compile is expected
    monkeypatch.undo()
    for extra, expected in (([], False), (["--torch_compile", "false"], False), (["--torch_compile", "true"], True),
                            (["--torch_compile"], True)):
        *_, parsed = parse_recipe([str(DEMO_RECIPE), "--output_dir", str(tmp_path / "recipe"), "--tp_size", "1", *extra])
        assert parsed.torch_compile is expected and parsed.torch_compile_explicit == bool(extra), extra


def parallelism_arguments(feature: str, route: str, settings: dict, tmp_path, monkeypatch) -> BoostTrainingArguments:
    arguments, environment = entry(feature, route, tmp_path)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    return build_arguments(route, {**settings, **arguments}, tmp_path)


@pytest.mark.parametrize("route", PARALLELISM_ROUTES)
def test_parallelism_config_tp_size_becomes_the_layout(route, tmp_path, clean_environment):
    """accelerate's tp_size is boost-hf's --tp_size (every route); a flag or a recipe giving the same value agrees (the
    recipe's conflict: below); accelerate does not apply parallelism_config again (the argument is cleared, the variable
    hidden while the trainer creates its Accelerator)."""
    args = parallelism_arguments("parallelism tp 2", route, {}, tmp_path, clean_environment)
    assert args.tp_size == 2 and args.to_parallel_config().tp_size == 2 and args.parallelism_config is None
    assert parallelism_arguments("parallelism tp 2", route, {"tp_size": 2}, tmp_path, clean_environment).tp_size == 2
    if route == "flag":
        return
    assert build_arguments("recipe", {"tp_size": 2}, tmp_path).tp_size == 2  # the environment's tp_size 2 and the recipe's
    with pytest.raises(ValueError, match=r"sets tp_size=2 but the flag or the recipe sets tp_size=4"):
        build_arguments("recipe", {"tp_size": 4}, tmp_path)
    with without_accelerate_parallelism():
        assert "ACCELERATE_USE_PARALLELISM_CONFIG" not in os.environ
    assert os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"


@pytest.mark.parametrize("route", ["flag", "recipe", "accelerate config", "environment"])
def test_fsdp2_however_asked_for_becomes_data_parallel_fsdp2(route, tmp_path, clean_environment):
    """The control of the FSDP2 rows: transformers' --fsdp shard_grad_op with fsdp_config version 2, an accelerate config
    with fsdp_version 2 and fsdp_reshard_after_forward false, its variables: each becomes --data_parallel fsdp2 without
    resharding after forward, per decoder layer (TRANSFORMER_BASED_WRAP); transformers builds no FSDP plugin of its own
    and the trainer hides accelerate's variable while it creates its Accelerator (else accelerate would fully_shard the
    model over the whole world)."""
    arguments, environment = entry("fsdp2", route, tmp_path)
    for name, value in environment.items():
        clean_environment.setenv(name, value)
    args = build_arguments(route, arguments, tmp_path)
    assert (args.data_parallel, args.fsdp_reshard_after_forward, args.fsdp_units) == ("fsdp2", "never", "decoder_layers")
    assert not args.fsdp and args.fsdp_plugin_args is None
    if route in ("accelerate config", "environment"):
        with without_accelerate_parallelism():
            assert "ACCELERATE_USE_FSDP" not in os.environ
        assert os.environ["ACCELERATE_USE_FSDP"] == "true"
    one_unit = dict(environment, FSDP_AUTO_WRAP_POLICY="NO_WRAP", FSDP_RESHARD_AFTER_FORWARD="true")
    if route == "environment":  # accelerate's NO_WRAP: the whole model one unit; reshard_after_forward true: torchtitan's
        for name, value in one_unit.items():
            clean_environment.setenv(name, value)
        args = build_arguments(route, {}, tmp_path)
        assert (args.data_parallel, args.fsdp_reshard_after_forward, args.fsdp_units) == ("fsdp2", "default", "model")


@pytest.mark.parametrize("route", PARALLELISM_ROUTES)
def test_parallelism_config_dp_shard_size_becomes_fsdp2_and_with_dp_replicate_size_hsdp(route, tmp_path, clean_environment):
    """dp_shard_size 2 x dp_replicate_size 2 on 4 processes: --data_parallel fsdp2 with --dp_replicate_size 2 (HSDP), the
    replicas x shards checked to be the data parallelism. Accepted, the arguments would set up the 4-process group:
    the check alone is run on them, as above."""
    clean_environment.setenv("WORLD_SIZE", "4")
    arguments, environment = entry("parallelism dp_shard 2 x dp_replicate 2", route, tmp_path)
    for name, value in environment.items():
        clean_environment.setenv(name, value)
    given = arguments.get("parallelism_config")
    if given is not None:
        from accelerate import ParallelismConfig

        given = ParallelismConfig(**given)
    args = SimpleNamespace(tp_size=1, pp_size=1, parallelism_config=given, data_parallel=None, dp_replicate_size=None)
    layout_from_parallelism_config(args)
    assert (args.data_parallel, args.dp_replicate_size, args.tp_size, args.parallelism_config) == ("fsdp2", 2, 1, None)
    with pytest.raises(ValueError, match=r"sets dp_replicate_size=2 x dp_shard_size=2, which with tp_size=2 x pp_size=1 "
                                         r"needs 8 processes, but 4 are launched"):
        parallelism_arguments("parallelism dp_shard 2 x dp_replicate 2", route, {"tp_size": 2}, tmp_path, clean_environment)


def test_parallelism_config_dp_replicate_size_is_what_is_left_of_the_world(tmp_path, clean_environment):
    """dp_replicate_size x tp_size x pp_size must be the world (WORLD_SIZE, which the launcher sets before the process
    group exists). Accepted, the arguments would set up the 4-process group: the check alone is run on them."""
    clean_environment.setenv("WORLD_SIZE", "4")
    clean_environment.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    for name, value in ENVIRONMENT["parallelism dp_replicate 2"].items():
        clean_environment.setenv(name, value)
    args = SimpleNamespace(tp_size=None, pp_size=1, parallelism_config=None, data_parallel=None)  # --tp_size not given
    layout_from_parallelism_config(args)
    assert (args.tp_size, args.pp_size) == (2, 1)  # dp 2 = 4 / (2 x 1)
    with pytest.raises(ValueError, match=r"sets dp_replicate_size=2, which with tp_size=2 x pp_size=2 needs 8 processes, "
                                         r"but 4 are launched \(WORLD_SIZE\)"):
        build_arguments("flag", {"pp_size": 2}, tmp_path)


@pytest.mark.parametrize("route", ["flag", "recipe", "accelerate config", "environment"])
def test_accelerates_reshard_after_forward_true_is_torchtitans_default_and_always_is_asked_by_name(route, tmp_path,
                                                                                                     clean_environment):
    """The shipped FSDP2 configs' ``fsdp_reshard_after_forward: true`` (transformers' ``--fsdp full_shard``, its
    default) is boost-hf's ``default`` (torchtitan's: every layer but the last, none under PP), not ``always`` (every
    unit gathered again for each micro-batch under PP); ``--fsdp_reshard_after_forward always`` asks for that by name,
    and a true allows it."""
    arguments, environment = entry("fsdp2 shipped", route, tmp_path)
    for name, value in environment.items():
        clean_environment.setenv(name, value)
    assert build_arguments(route, arguments, tmp_path).fsdp_reshard_after_forward == "default"
    always = build_arguments(route, {**arguments, "fsdp_reshard_after_forward": "always"}, tmp_path)
    assert (always.data_parallel, always.fsdp_reshard_after_forward) == ("fsdp2", "always")


def test_two_sources_of_one_setting_that_disagree_are_refused_naming_both(tmp_path, clean_environment):
    """Settings two ecosystem sources make without a flag: transformers' ``--fsdp`` and an accelerate FSDP config;
    ``parallelism_config=`` and the accelerate config's parallelism_config; ``--deepspeed FILE`` and an accelerate
    DeepSpeed config. Agreeing, they are one setting; disagreeing, refused naming both (accelerate would take one
    silently)."""
    from accelerate import ParallelismConfig

    for name, value in ENVIRONMENT["fsdp2"].items():  # reshard_after_forward false
        clean_environment.setenv(name, value)
    assert build_arguments("flag", dict(FLAGS["fsdp2"]), tmp_path).fsdp_reshard_after_forward == "never"  # shard_grad_op
    with pytest.raises(ValueError, match=r"the accelerate config's FSDP settings .* sets fsdp_reshard_after_forward='never' "
                                         r"but transformers' --fsdp full_shard with --fsdp_config sets "
                                         r"fsdp_reshard_after_forward='default'"):
        build_arguments("flag", dict(FLAGS["fsdp2 shipped"]), tmp_path)
    for name in ENVIRONMENT["fsdp2"]:
        clean_environment.delenv(name)

    for name, value in ENVIRONMENT["parallelism tp 2"].items():
        clean_environment.setenv(name, value)
    assert build_arguments("flag", {"parallelism_config": ParallelismConfig()}, tmp_path).tp_size == 2  # it reads them
    with pytest.raises(ValueError, match=r"parallelism_config \(the training argument\) sets tp_size=1 but the accelerate "
                                         r"config's parallelism_config .* sets tp_size=2"):
        build_arguments("flag", {"parallelism_config": ParallelismConfig(tp_size=1)}, tmp_path)
    for name in ENVIRONMENT["parallelism tp 2"]:
        clean_environment.delenv(name)

    for name, value in {**ENVIRONMENT["deepspeed"], "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}.items():
        clean_environment.setenv(name, value)
    with pytest.raises(ValueError, match=r"the accelerate config's DeepSpeed settings \(ACCELERATE_DEEPSPEED_ZERO_STAGE=3\) "
                                         r"set zero_optimization.stage=3 but the DeepSpeed config .*zero2_json.json sets "
                                         r"zero_optimization.stage=2"):
        build_arguments("flag", dict(FLAGS["deepspeed"]), tmp_path)
    clean_environment.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    assert build_arguments("flag", dict(FLAGS["deepspeed"]), tmp_path).deepspeed_plugin is not None


def test_deepspeed_from_the_accelerate_config_with_pp_is_refused_before_training(training_env, tmp_path):
    """The report's case: ``accelerate launch --config_file cpu-4proc-zero2.yaml ... --pp_size 2`` used to build
    everything and die at the first step in ``health.is_finite`` (``float() argument must be ... not 'NoneType'``). The
    first rank to raise makes the launcher stop the other, so only the in-process cases above show that every rank
    raises it (the check reads no rank)."""
    args = [*TINY, "--dataset", training_env["CORPUS"], "--pp_size", "2", "--per_device_train_batch_size", "4",
            "--output_dir", tmp_path / "run"]
    command = accelerate_command("cpu-4proc-zero2.yaml", "--num_processes", "2", "recipes/pretrain.py", DEMO_RECIPE, *args)
    started = time.monotonic()
    proc = start_command(command, training_env)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0
    assert "ValueError: DeepSpeed cannot run with pp_size=2" in output and ACCELERATE_HINT in output, output[-4000:]
    assert "Tokenizing" not in output and "is_finite" not in output  # refused before the datasets, the model, a step
    print(f"refused after {time.monotonic() - started:.0f} s")


def test_accelerate_config_with_parallelism_config_trains_at_its_tp_size(training_env, tmp_path):
    """``accelerate launch`` with ``cpu-4proc.yaml`` plus ``parallelism_config: {parallelism_config_tp_size: 2}`` and no
    ``--tp_size`` trains (one step) at tp 2 x dp 2, and the checkpoint's training_layout.json records it. Without the
    trainer hiding the variable, accelerate would build its own 2-rank mesh on 4 processes and stop."""
    config = yaml.safe_load((REPO / "accelerate_configs" / "cpu-4proc.yaml").read_text())
    (tmp_path / "accelerate.yaml").write_text(yaml.safe_dump({**config, "parallelism_config": {"parallelism_config_tp_size": 2}}))
    args = [*TINY, "--dataset", training_env["CORPUS"], "--per_device_train_batch_size", "4", "--max_steps", "1",
            "--save_strategy", "steps", "--save_steps", "1", "--sample_max_new_tokens", "0", "--output_dir", tmp_path / "run"]
    run_command(accelerate_command(tmp_path / "accelerate.yaml", "recipes/pretrain.py", DEMO_RECIPE, *args), training_env, timeout=600)
    layout = json.loads((tmp_path / "run" / "checkpoint-1" / "training_layout.json").read_text())
    assert (layout["tp_size"], layout["dp_size"], layout["pp_size"], layout["global_batch_size"]) == (2, 2, 1, 8)
