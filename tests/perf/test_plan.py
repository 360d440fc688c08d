"""``boost-hf plan``: the search, its memory model and its output (nothing is built or run)."""

from __future__ import annotations

import json
import re

import pytest

from boost_hf import BoostLlamaConfig
from boost_hf.cli import main
from boost_hf.data_parallel_config import DataParallelConfig
from boost_hf.perf.hardware import get_hardware
from boost_hf.perf.memory import GIB
from boost_hf.perf.planner import Cluster, plan

JSON_KEYS = {"listed", "tp", "pp", "dp", "pp_schedule", "pp_microbatches", "sequence_parallel", "activation_checkpointing",
             "zero1", "precision", "data_parallel", "data_parallel_family", "dp_replicate_size", "dp_shard_size",
             "memory_gb_per_gpu", "fits", "step_s", "command"}


def test_json_for_30b_on_32_h100(tmp_path, capsys):
    """cola-30b on 4 nodes of 8 H100: layouts that fit, best first, each with its memory and the multi-node command,
    then the best of each data-parallel family (DDP, ZeRO-1, FSDP2, HSDP) not among them, then the least memory of each
    tp x pp that fits nowhere; the search evaluates a bounded number of layouts (4888 when written, FSDP2 and HSDP
    included; ``plan --json`` takes seconds)."""
    config_path = tmp_path / "accelerate.yaml"
    assert main(["plan", "--preset", "cola-30b", "--gpus", "32", "--gpu", "h100", "--accelerate-config", str(config_path),
                 "--json", "--top", "4"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert all(JSON_KEYS <= set(layout) for layout in listed)
    layouts = [layout for layout in listed if layout["fits"]]
    assert [layout["listed"] for layout in listed[:4]] == ["top"] * 4 and listed[:len(layouts)] == layouts  # fitting first
    assert all(layout["memory_gb_per_gpu"] <= 80 for layout in layouts)
    assert {layout["data_parallel_family"] for layout in layouts} == {"ddp", "zero1", "fsdp2", "hsdp"}
    assert all(layout["listed"] == f"best {layout['data_parallel_family']}" for layout in layouts[4:])
    for never in listed[len(layouts):]:  # the best of a tp x pp that fits nowhere: what it needs
        assert never["memory_gb_per_gpu"] > 80 and never["step_s"] is None and never["command"] is None and never["reason"]
    assert [layout["step_s"] for layout in layouts[:4]] == sorted(layout["step_s"] for layout in layouts)[:4]
    for layout in layouts:
        assert layout["tp"] * layout["pp"] * layout["dp"] == 32 and layout["tp"] <= 8
        assert sum(v for k, v in layout["memory_breakdown_gb"].items() if k != "total") == pytest.approx(layout["memory_gb_per_gpu"], abs=0.05)
        command = layout["command"].split()
        assert command[command.index("--num_machines") + 1] == "4" and "$NODE_RANK" in command
        assert command[command.index("--tp_size") + 1] == str(layout["tp"])
    assert "num_machines: 4" in config_path.read_text()

    cluster = Cluster(32, get_hardware("h100"), 80 * GIB)
    result = plan(BoostLlamaConfig.from_preset("cola-30b"), cluster, seq_len=4096, global_batch=512,
                  precisions=("autocast", "bf16_params"))
    assert result.tried == 4888 and round(result.ranked[0].step_s, 4) == layouts[0]["step_s"]


def test_fsdp2_and_hsdp_are_searched_each_with_its_memory_and_a_command_training_accepts(tmp_path, capsys, monkeypatch):
    """cola-30b on 32 H100, ``--json --all``: every evaluated layout (FSDP2 and HSDP among them, fitting or not) with
    its memory by part; the best FSDP2 and HSDP layouts' commands parse with the training arguments into the same
    data-parallel settings and pass training's checks at 32 processes; the text says how they compare with the best
    DDP / ZeRO-1 layout."""
    from boost_hf.shipped import resolve_recipe
    from boost_hf.training.compatibility import check_settings
    from boost_hf.training.recipe import parse_recipe

    argv = ["plan", "--preset", "cola-30b", "--gpus", "32", "--gpu", "h100", "--accelerate-config", str(tmp_path / "a.yaml")]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert main([*argv, "--json", "--all"]) == 0
    listed = json.loads(capsys.readouterr().out)
    evaluated = int(re.search(r"(\d+) layouts evaluated", text).group(1))
    assert len(listed) == evaluated and all(JSON_KEYS <= set(layout) for layout in listed)
    for family in ("fsdp2", "hsdp"):
        ours = [layout for layout in listed if layout["data_parallel_family"] == family]
        assert any(layout["fits"] for layout in ours) and not all(layout["fits"] for layout in ours)
        for layout in ours:
            parts = layout["memory_breakdown_gb"]
            assert layout["memory_gb_per_gpu"] > 0 and parts["gathered_parameters"] > 0 and parts["masters"] == 0
            assert parts["gradient_buckets"] == 0 and layout["zero1"] is False and layout["data_parallel"] == "fsdp2"
            assert layout["dp_shard_size"] * layout["dp_replicate_size"] == layout["dp"]
            assert (layout["dp_replicate_size"] > 1) == (family == "hsdp")
            assert (layout["step_s"] is not None) == layout["fits"] == (layout["command"] is not None)
        best = min((layout for layout in ours if layout["fits"]), key=lambda layout: layout["step_s"])
        command = best["command"].split()
        train = command[command.index("train") + 1:]
        *_, args = parse_recipe([str(resolve_recipe(train[0])), *train[1:]])
        with monkeypatch.context() as launched:  # what check_settings reads of the launch (set after the parsing,
            launched.setenv("WORLD_SIZE", "32")  # which would start accelerate's process group from it)
            check_settings(args)
        assert DataParallelConfig.of(args) == DataParallelConfig("fsdp2", best["dp_replicate_size"])
        assert (args.tp_size, args.pp_size, args.zero1_optimizer) == (best["tp"], best["pp"], False)
    comparison = text[text.index("FSDP2 / HSDP against the best"):]
    assert re.search(r"best FSDP2: .*: \d+\.\d+ s \([+-]\d+\.\d%\), \d+\.\d GiB per GPU \([+-]\d+\.\d GiB\)", comparison)
    assert re.search(r"best HSDP: .*HSDP \dx\d.*GiB\)", comparison)


def test_hsdp_is_tried_with_one_replica_per_node_the_dp_group_spans():
    from boost_hf.parallel.config import ParallelConfig
    from boost_hf.perf.planner import data_parallel_options, replica_sizes

    cluster = Cluster(32, get_hardware("h100"), 80 * GIB)
    assert replica_sizes(ParallelConfig(tp_size=2), 8, cluster) == [1, 2]  # 16 GPUs: 2 nodes, 4 shard ranks in each
    assert replica_sizes(ParallelConfig(tp_size=1), 8, cluster) == [1]  # one node
    assert replica_sizes(ParallelConfig(tp_size=8), 4, cluster) == [1]  # one DP rank per node: nothing to shard in it
    assert replica_sizes(ParallelConfig(tp_size=1), 32, cluster) == [1, 4]
    assert replica_sizes(ParallelConfig(tp_size=1), 32, cluster, given=8) == [8]
    assert replica_sizes(ParallelConfig(tp_size=1), 12, cluster, given=8) == []
    options = data_parallel_options(ParallelConfig(tp_size=2), 8, cluster, {}, None)
    assert [(o.data_parallel, o.dp_replicate_size, zero1) for o, zero1 in options] == [
        ("ddp", 1, False), ("ddp", 1, True), ("fsdp2", 1, False), ("fsdp2", 2, False)]
    assert [o.data_parallel for o, _ in data_parallel_options(ParallelConfig(), 1, cluster, {}, None)] == ["ddp"]
    assert data_parallel_options(ParallelConfig(tp_size=2), 8, cluster, {"data_parallel": ("fsdp2",)}, None)[0][0] == \
        DataParallelConfig("fsdp2")
    # under PP a unit that reshards after forward gathers as the schedule interleaves: not modelled, not proposed
    assert not data_parallel_options(ParallelConfig(pp_size=2), 8, cluster,
                                     {"data_parallel": ("fsdp2",), "fsdp_reshard_after_forward": "always"}, None)


def test_plans_data_parallel_options_are_the_declared_fields():
    """``boost-hf plan``'s ``--data_parallel`` (several), ``--dp_replicate_size`` (searched unless given) and FSDP2's
    settings are :class:`DataParallelConfig`'s fields, with their help and choices."""
    import argparse
    from dataclasses import fields

    from boost_hf.cli import SUBCOMMANDS

    parser = argparse.ArgumentParser()
    SUBCOMMANDS["plan"][1](parser)
    actions = {action.dest: action for action in parser._actions}
    for f in fields(DataParallelConfig):
        assert actions[f.name].help.startswith(f.metadata["help"].replace("%", "%%")), f.name
    assert actions["data_parallel"].nargs == "+" and tuple(actions["data_parallel"].choices) == ("ddp", "fsdp2")
    assert actions["data_parallel"].default is None and actions["dp_replicate_size"].default is None


def test_13b_on_8_a100_shows_the_papers_layout(tmp_path, capsys):
    """The paper's tp 4 x pp 2 is either picked or listed with what makes it slower."""
    assert main(["plan", "--preset", "cola-13b", "--gpus", "8", "--gpu", "a100-nvswitch", "--global-batch", "64",
                 "--accelerate-config", str(tmp_path / "a.yaml")]) == 0
    out = capsys.readouterr().out
    winner = out.splitlines()[4]
    papers = [line for line in out.splitlines() if line.strip().startswith("tp 4, pp 2")]
    assert winner.startswith(" 1  tp 4, pp 2") or (papers and "%" in papers[0] and "ms" in papers[0]), out


def test_nothing_fits_says_the_memory_needed(tmp_path, capsys):
    """cola-7b on one 24 GiB GPU: nothing fits; the smallest layout's need is printed, and ``--json`` lists it with
    ``fits`` false and the reason."""
    argv = ["plan", "--preset", "cola-7b", "--gpus", "1", "--gpu", "a100", "--gpu-memory-gb", "24",
            "--accelerate-config", str(tmp_path / "a.yaml")]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "nothing fits in 24 GiB per GPU. The smallest needs" in out
    assert main([*argv, "--json"]) == 1
    (smallest,) = json.loads(capsys.readouterr().out)
    assert smallest["fits"] is False and smallest["memory_gb_per_gpu"] > 24 and "needs" in smallest["reason"]
    assert not (tmp_path / "a.yaml").exists()


def test_a_given_setting_is_kept(tmp_path, capsys):
    assert main(["plan", "--preset", "cola-7b", "--gpus", "8", "--gpu", "a100-nvswitch", "--tp_size", "4",
                 "--activation_checkpointing", "lowrank", "--zero1", "false", "--precision_policy", "autocast", "--json",
                 "--accelerate-config", str(tmp_path / "a.yaml")]) == 0
    layouts = json.loads(capsys.readouterr().out)
    assert {(x["tp"], x["activation_checkpointing"], x["zero1"], x["precision"]) for x in layouts} == {(4, "lowrank", False, "autocast")}


def test_bf16_gradient_reduction_halves_the_dp_bytes(tmp_path, capsys):
    """``--grad_reduce_dtype bf16`` (bf16_params only): the DP all-reduce moves 2 bytes per gradient element, which
    the estimator times and the command passes on; other policies refuse it."""
    from boost_hf.perf.estimator import estimate_layout
    from boost_hf.perf.workload import Workload
    from boost_hf.perf.memory import precision_bytes

    assert precision_bytes("bf16_params", "bf16").reduce == 2 and precision_bytes("bf16_params").reduce == 4
    with pytest.raises(ValueError, match="needs the bf16_params precision policy"):
        precision_bytes("autocast", "bf16")
    config, hardware = BoostLlamaConfig.from_preset("cola-7b"), get_hardware("a100")

    def dp_seconds(reduce):  # across nodes (tp 4 x dp 8 > 4 per node): the all-reduce is exposed
        workload = Workload(tp=4, micro_batch=1, num_micro_batches=1, dp_size=8, precision="bf16_params",
                            grad_reduce_dtype=reduce)
        return estimate_layout(config, "btp", workload, hardware).breakdown_s["dp_comm"]

    assert 0 < dp_seconds("bf16") < dp_seconds("fp32")
    assert main(["plan", "--preset", "cola-7b", "--gpus", "16", "--gpu", "a100", "--precision_policy", "bf16_params",
                 "--grad-reduce-dtype", "bf16", "--json", "--top", "2", "--accelerate-config", str(tmp_path / "a.yaml")]) == 0
    best = json.loads(capsys.readouterr().out)[0]
    assert best["grad_reduce_dtype"] == ("bf16" if best["dp"] > 1 else None)
    assert ("--grad_reduce_dtype bf16" in best["command"]) == (best["dp"] > 1)


@pytest.mark.parametrize("arguments, message", [
    (["--gpus", "3", "--gpus-per-node", "2"], r"3 GPUs do not fill nodes of 2 evenly: .* \(--gpus 2 or 4\), or 1 GPU on each "
                                              r"of 3 nodes \(--gpus-per-node 1\)"),
    (["--gpus", "12", "--gpus-per-node", "8"], r"\(--gpus 8 or 16\), or 6 GPUs on each of 2 nodes \(--gpus-per-node 6\)"),
    (["--gpus", "8", "--seq", "0"], r"--seq-len must be positive, got 0"),
    (["--gpus", "8", "--global-batch", "0"], r"--global-batch must be positive, got 0"),
    (["--gpus", "8", "--global-batch", "-4"], r"--global-batch must be positive, got -4"),
    (["--gpus", "0"], r"--gpus must be positive, got 0"),
    (["--gpus", "8", "--gpus-per-node", "0"], r"--gpus-per-node must be positive, got 0"),
    (["--gpus", "8", "--tp_size", "0"], r"--tp-size must be positive, got 0"),
    (["--gpus", "8", "--pp_size", "-1"], r"--pp-size must be positive, got -1"),
    (["--gpus", "8", "--pp_microbatches", "0"], r"--pp-microbatches must be positive, got 0"),
    (["--gpus", "8", "--top", "0"], r"--top must be positive, got 0"),
    # issue 44 item 7: refused naming why, not "nothing fits", and never searched for minutes
    (["--gpus", "4", "--data_parallel", "fsdp2", "--dp_replicate_size", "3"], r"--dp_replicate_size 3 divides the "
     r"data-parallel size of no layout of 4 GPUs \(dp = GPUs / \(tp x pp\): 1, 2, 4\): HSDP's replicas each shard"),
    (["--gpus", "8", "--data_parallel", "ddp", "--dp_replicate_size", "2"], r"--dp_replicate_size 2 sets how FSDP2 "
     r"shards, but --data_parallel ddp searches no FSDP2 layout"),
    (["--gpus", "8", "--data_parallel", "fsdp2", "--zero1", "true"], r"--zero1 true keeps --zero1_optimizer, which "
     r"training refuses with --data_parallel fsdp2"),
    (["--gpus", "1000000"], r"the global batch of 512 sequences does not split over the data-parallel ranks of any "
     r"layout of 1000000 GPUs \(dp = GPUs / \(tp x pp\): 50000, 62500, .*: give a global batch that one of them divides"),
    (["--gpus", "8", "--seq-len", "4096"], r"sequences of 4096 tokens \(--seq-len\) are longer than the model's "
     r"max_position_embeddings \(2048\), and training refuses a block_size above it"),
])
def test_a_plan_that_cannot_launch_or_sizes_nothing_is_refused(tmp_path, capsys, arguments, message):
    """No command accelerate cannot launch as printed (an uneven count of processes per node), no size of zero read as
    the default: each refused with the fix, exit 2, no accelerate config written."""
    with pytest.raises(SystemExit) as stopped:
        main(["plan", "--preset", "cola-1b", "--accelerate-config", str(tmp_path / "a.yaml"), *arguments])
    assert stopped.value.code == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "a.yaml").exists()


@pytest.mark.parametrize("section, name, value", [
    ("training", "tp_size", 0), ("training", "pp_size", -2), ("training", "per_device_train_batch_size", 0),
    ("training", "gradient_accumulation_steps", 1.5), ("data", "block_size", 0),
])
def test_a_recipe_size_that_sizes_nothing_is_refused_naming_the_recipe_field(tmp_path, capsys, section, name, value):
    """A recipe's layout or batch size of zero, below it or not whole (a ZeroDivisionError for tp_size 0 before): refused
    naming the recipe, the field and the fix, exit 2, no accelerate config written."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  preset: cola-60m\n{section}:\n  {name}: {value}\n")
    with pytest.raises(SystemExit) as stopped:
        main(["plan", "--recipe", str(recipe), "--gpus", "4", "--accelerate-config", str(tmp_path / "a.yaml")])
    assert stopped.value.code == 2
    assert f"sets {section}.{name}: {value!r}, which must be a positive whole number" in capsys.readouterr().err
    assert not (tmp_path / "a.yaml").exists()


def test_a_plan_of_any_size_answers_with_bounded_work(monkeypatch, tmp_path, capsys):
    """``plan --recipe demo --gpus 1000000`` (a global batch that grows with the GPUs: dp up to 500,000) answered
    after more than 240 s: each layout's memory listed every DP rank. Counted here: the per-rank static bytes the memory
    model builds (``StaticMemory``) stay within a few per layout evaluated, whatever the data parallelism (every DP
    rank used to be built: 10^5-10^6 per layout), and the layouts evaluated within :data:`MAX_LAYOUTS` times the
    options of each. A search larger than that (cola-30b on 32 H100 for 720,720 sequences per step: 6,331 layouts,
    each with up to 240 micro-batch splits) is refused before any layout's memory is modelled, and so is a size above
    2^31 - 1."""
    from boost_hf.perf import memory, planner
    from boost_hf.perf.planner import MAX_LAYOUTS, check_positive

    built, modelled = [0], [0]
    original_init, original_memory = memory.StaticMemory.__init__, planner.memory_per_gpu

    def counting_init(self, *args, **kwargs):
        built[0] += 1
        assert built[0] <= 200_000, "the memory model lists every data-parallel rank"
        original_init(self, *args, **kwargs)

    def counting_memory(*args, **kwargs):
        modelled[0] += 1
        assert modelled[0] <= 50_000, "the search is not bounded"
        return original_memory(*args, **kwargs)

    monkeypatch.setattr(memory.StaticMemory, "__init__", counting_init)
    monkeypatch.setattr(planner, "memory_per_gpu", counting_memory)
    monkeypatch.setattr(memory, "_STATIC", {})
    monkeypatch.setattr(memory, "_FULLEST", {})
    assert main(["plan", "--recipe", "demo", "--gpus", "1000000", "--accelerate-config", str(tmp_path / "a.yaml"),
                 "--json", "--top", "1"]) == 0
    (best, *_) = json.loads(capsys.readouterr().out)
    assert best["fits"] and best["tp"] * best["pp"] * best["dp"] == 1_000_000
    assert 0 < modelled[0] <= MAX_LAYOUTS * 3 * 4 * 1  # checkpointing modes x data-parallel options x precisions (fp32)
    assert built[0] <= 64 * modelled[0], (built[0], modelled[0])
    print(f"demo on 10^6 GPUs: {modelled[0]} layouts modelled, {built[0]} static-memory records built")

    modelled[0] = 0
    with pytest.raises(SystemExit):
        main(["plan", "--preset", "cola-30b", "--gpus", "32", "--gpu", "h100", "--global-batch", "720720",
              "--accelerate-config", str(tmp_path / "b.yaml")])
    assert modelled[0] == 0 and re.search(r"this plan has 6,331 layouts to search .*, more than the 1,000 one plan "
                                          r"searches: each replica's batch splits into up to \d+ micro-batch counts",
                                          capsys.readouterr().err)
    with pytest.raises(ValueError, match=r"--gpus 4294967296 is more than a plan takes \(2147483647, 2\^31 - 1"):
        check_positive(gpus=2**32)  # (its divisors would take minutes to list)


def test_fsdp2_only_settings_and_zero1_narrow_the_backends_searched(tmp_path, capsys):
    """A value given is kept: ``--zero1 true`` searches DDP with ZeRO-1 only (FSDP2 runs without it: the command used to
    print ``--zero1_optimizer false`` for FSDP2 layouts); ``--dp_replicate_size 2`` or an FSDP2 setting, FSDP2 only."""
    def layouts(*arguments):
        assert main(["plan", "--preset", "cola-30b", "--gpus", "32", "--gpu", "h100", "--json", "--all",
                     "--accelerate-config", str(tmp_path / "a.yaml"), *arguments]) == 0
        return [layout for layout in json.loads(capsys.readouterr().out)]

    zero1 = layouts("--zero1", "true")
    assert {(x["data_parallel"], x["zero1"]) for x in zero1 if x["dp"] > 1} == {("ddp", True)}
    assert all("--zero1_optimizer true" in x["command"] for x in zero1 if x["command"] and x["dp"] > 1)
    hsdp = layouts("--dp_replicate_size", "2")
    assert {(x["data_parallel"], x["dp_replicate_size"]) for x in hsdp} == {("fsdp2", 2)}
    one_unit = layouts("--fsdp_units", "model")
    assert {x["data_parallel"] for x in one_unit} == {"fsdp2"}
    assert all("--fsdp_units model" in x["command"] for x in one_unit if x["command"])
