"""Resume across pipeline layouts with the optimizer (no DeepSpeed), and ZeRO-1 under pipeline parallelism.

``recipes/demo.yaml`` (shrunk, see ``launcher.TINY``, with 4 layers; global batch 8) saved at step 3 and resumed
at another pp x tp x dp: every resumed run's per-step losses equal the uninterrupted single process's (1e-4), and
the optimizer state each rank holds right after loading is bit-identical to its slice of the saved state
reassembled from the checkpoint (pp 2 x tp 2, saved with ``--save_async``, -> one process, -> pp 1 x tp 2 x dp 2,
-> pp 2 x dp 2 interleaved; one process -> pp 2 x tp 2, also from the same checkpoint in the format of boost-hf 0.x). ``--zero1_optimizer`` at pp 2 x dp 2 matches one process and the same
run without it; its checkpoint (consolidated) resumes at its layout and at pp 1 x dp 4 with ZeRO-1, and in one
process without; the same at pp 1 x tp 2 x dp 2 (each TP rank's optimizer sharded over its DP group), resumed at its
layout and in one process.
A stream (19 blocks per pass in 4 logical streams, an 8-block shuffle buffer) trains at pp 2 x dp 2 what one process
trains, and its checkpoint resumes at pp 1 x tp 2 x dp 2 and in one process; the one-process checkpoint resumes at
dp 4; each pass's short last global batch (3 blocks) is dropped in every layout, or, with
``--dataloader_drop_last false``, trained at pp 2 x tp 2 with 2 micro-batches as one process trains it. One rank per
DP replica reads the stream; each logical stream's position is a file of the checkpoint.
Runs: :mod:`tests.training.pipeline_resume_cases`, three launches (about 4-5 minutes on 2 cores). In one process:
the resharding across pipeline ranks, the layout checks and the refusals (``--zero1_optimizer`` with DeepSpeed, LORO
or a given optimizer); at dp 1 ``--zero1_optimizer`` is the plain optimizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from boost_hf.parallel.sharding import ShardSpec
from boost_hf.checkpoint.resume import (
    LAYOUT_NAME,
    ResumeLayoutError,
    check_resume_layout,
    reshard_optimizer_state,
    write_training_layout,
)

from .checkpoint_files import read_checkpoint, write_legacy_checkpoint
from .launcher import DEMO_RECIPE, REPO, TINY, accelerate_command, python_command, run_command
from .run_outputs import losses

RELATIVE_TOLERANCE = 1e-4
CASES = REPO / "tests" / "training" / "pipeline_resume_cases.py"
RESUMED = {  # resumed run -> the run whose checkpoint-3 it resumed
    "pp2-tp2-from-single": "single",
    "pp2-tp2-from-legacy": "single",  # single/checkpoint-3 as boost-hf 0.x wrote it (checkpoint_files.write_legacy_checkpoint)
    "tp2-dp2-from-pp2": "pp2-tp2",
    "pp2-dp2-interleaved-from-pp2": "pp2-tp2",
    "single-from-pp2": "pp2-tp2",
    "pp2-dp2-zero1-resumed": "pp2-dp2-zero1",
    "dp4-zero1-from-zero1": "pp2-dp2-zero1",
    "single-from-zero1": "pp2-dp2-zero1",
    "tp2-dp2-zero1-resumed": "tp2-dp2-zero1",
    "single-from-tp2-zero1": "tp2-dp2-zero1",
}
STREAMED = {  # streamed run -> the one-process run with the same data and the same global batches
    "stream-pp2-dp2": "stream-single",
    "stream-tp2-dp2-from-pp2": "stream-single",
    "stream-dp4-from-single": "stream-single",
    "stream-single-from-pp2": "stream-single",
    "stream-pp2-tp2-keep-last": "stream-single-keep-last",
}
ZERO1_TP_SIZE = {"pp2-dp2-zero1": 1, "dp4-zero1": 1, "tp2-dp2-zero1": 2}  # ZeRO-1 runs (as resumed) -> their tp_size


@pytest.fixture(scope="module")
def runs(training_env, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pipeline_resume")
    common = [DEMO_RECIPE, *TINY, "--num_hidden_layers", "4", "--dataset", training_env["CORPUS"]]
    run_command(python_command(CASES, "single", out, *common), training_env, timeout=450)
    write_legacy_checkpoint(out / "single" / "checkpoint-3", out / "single-legacy" / "checkpoint-3")
    run_command(accelerate_command("cpu-4proc.yaml", CASES, "four", out, *common), training_env, timeout=1500)
    run_command(python_command(CASES, "one", out, *common), training_env, timeout=450)
    return out


def assert_close(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for step, value in expected.items():
        assert abs(actual[step] - value) <= RELATIVE_TOLERANCE * abs(value), (step, actual[step], value)


@pytest.mark.parametrize("run", ["pp2-tp2", "pp2-dp2", "pp2-dp2-zero1", "tp2-dp2-zero1", *RESUMED])
def test_losses_match_one_process(runs, run):
    """Steps 1-3 of a resumed run's log come from its checkpoint, steps 4-6 are its own."""
    assert len(losses(runs / "single")) == 6
    assert_close(losses(runs / run), losses(runs / "single"))


@pytest.mark.parametrize("run", list(STREAMED))
def test_streamed_runs_match_one_process(runs, run):
    """Steps 1-6 cross two pass ends; a resumed run continued its checkpoint's position (inside the second pass)."""
    assert len(losses(runs / STREAMED[run])) == 6
    assert_close(losses(runs / run), losses(runs / STREAMED[run]))


def test_a_short_last_global_batch_is_dropped_or_trained(runs):
    """Each pass is 2 global batches and 3 blocks: dropped, step 3 starts the next pass; kept (padded with ignored rows,
    split into 2 micro-batches at pp 2), step 3 trains those 3 blocks and step 4 starts the next pass."""
    dropped, kept = losses(runs / "stream-single"), losses(runs / "stream-single-keep-last")
    assert [dropped[1], dropped[2]] == [kept[1], kept[2]] and dropped[3] != kept[3]


def test_one_rank_per_replica_reads_the_stream(runs):
    """The reader of each DP replica (tp rank 0 of stage 0: global ranks 0 and 1 at pp 2 x dp 2, rank 0 at pp 2 x tp 2)
    reads; its TP peers and later stages receive its batches. A checkpoint holds each logical stream's position."""
    def read(run: str) -> list[int]:
        return json.loads((runs / run / "documents_read.json").read_text())

    assert read("stream-pp2-dp2")[:2] > [0, 0] and read("stream-pp2-dp2")[2:] == [0, 0]
    assert read("stream-pp2-tp2-keep-last")[0] > 0 and read("stream-pp2-tp2-keep-last")[1:] == [0, 0, 0]
    assert all(n > 0 for n in read("stream-dp4-from-single"))
    position = runs / "stream-pp2-dp2" / "checkpoint-3" / "data_position"
    assert sorted(p.name for p in position.iterdir()) == ["position.json"] + [f"stream-{i:05d}.pt" for i in range(4)]
    record = json.loads((position / "position.json").read_text())
    assert (record["logical_streams"], record["epoch"], record["steps_in_pass"]) == (4, 1, 1)


def test_zero1_matches_the_same_run_without_it(runs):
    assert_close(losses(runs / "pp2-dp2-zero1"), losses(runs / "pp2-dp2"))


def canonical_optimizer_state(checkpoint: Path) -> dict[str, dict]:
    """Every parameter's saved optimizer state, whole tensors, by canonical name (read from ``dcp/`` in one process)."""
    return read_checkpoint(checkpoint)["optimizer"]["state"]


MEMORY_FIELDS = ("parameters", "gradients", "gradient_buckets", "optimizer_states")


def test_memory_model_equals_what_every_rank_holds(runs):
    """``boost_hf.perf.memory.static_memory`` equals, on every rank of every run (one process, pp 2 x tp 2, pp 2 x
    dp 2 with and without ZeRO-1, interleaved, tp 2 x dp 2 with and without ZeRO-1, dp 4 with ZeRO-1), the bytes of
    its parameters, gradients, optimizer state and DDP buckets after a step's backward, exactly."""
    from boost_hf import BoostLlamaConfig, ParallelConfig
    from boost_hf.perf.memory import static_memory

    layouts = set()
    for path in sorted(runs.glob("*/memory.json")):
        for held in json.loads(path.read_text()):
            config = BoostLlamaConfig.from_dict(held["config"])
            fields = held["parallel"]
            parallel = ParallelConfig(**{**fields, "pp_layer_split": fields["pp_layer_split"] and tuple(fields["pp_layer_split"])})
            ranks = held["ranks"]
            model = static_memory(config, parallel, dp_size=held["dp_size"], precision="autocast" if held["bf16"] else "fp32",
                                  zero1=held["zero1"])[ranks["pp"]][ranks["dp"]]
            assert {name: getattr(model, name) for name in MEMORY_FIELDS} == {name: held[name] for name in MEMORY_FIELDS}, \
                (path.parent.name, ranks)
            layouts.add((parallel.pp_size, parallel.tp_size, held["dp_size"], held["zero1"]))
    assert {(2, 2, 1, False), (2, 1, 2, True), (1, 2, 2, True), (1, 1, 4, True), (1, 1, 1, False)} <= layouts


@pytest.mark.parametrize("run", list(RESUMED))
def test_loaded_optimizer_state_is_the_saved_one(runs, run):
    """Right after loading, every rank holds exactly its slice of the saved moments (and the saved step count) of
    its parameters; together the ranks hold every saved parameter's state. Under ZeRO-1 the DP ranks of one TP rank
    (TP ranks are adjacent: global ranks ``t, t + tp, ...``) hold disjoint shares that together cover every parameter."""
    saved = canonical_optimizer_state(runs / RESUMED[run] / "checkpoint-3")
    seen, held = set(), []
    ranks = sorted((runs / run / "loaded-optimizer").glob("rank*.pt"))
    assert len(ranks) == (1 if run.startswith("single") else 4)
    for path in ranks:
        rank = torch.load(path, weights_only=True)
        held.append(set(rank))
        for name, loaded in rank.items():
            full_shape, dim, tp_rank, tp_size = loaded["spec"]
            spec = ShardSpec(tuple(full_shape), dim, tp_rank, tp_size)
            assert sorted(loaded["state"]) == sorted(saved[name]), name
            for key, value in saved[name].items():
                expected = spec.local_slice(value) if value.dim() > 0 else value
                assert torch.equal(loaded["state"][key], expected), (path.name, name, key)
            seen.add(name)
    assert seen == set(saved)
    resumed_as = run.split("-from-")[0].removesuffix("-resumed")
    if resumed_as in ZERO1_TP_SIZE:  # ZeRO-1 over the DP ranks: each holds its own share only
        tp_size = ZERO1_TP_SIZE[resumed_as]
        for tp_rank in range(tp_size):
            shares = held[tp_rank::tp_size]
            assert all(shares) and sum(map(len, shares)) == len(set().union(*shares)) == len(saved), (tp_rank, list(map(len, shares)))


def test_a_requeue_after_the_last_step_publishes_the_uninterrupted_weights_at_pp2(runs):
    """pp 2 x tp 2 saved checkpoint-6 at max_steps 6; its requeue (without final/, ``--resume_from_checkpoint auto``)
    trains no step 7, saves no checkpoint, and publishes the uninterrupted run's weights exactly."""
    from safetensors.torch import load_file

    def weights(folder: Path) -> dict:
        return {name: t for file in sorted(folder.glob("*.safetensors")) for name, t in load_file(file).items()}

    requeued, whole = runs / "pp2-tp2-requeued", runs / "pp2-tp2"
    assert sorted(p.name for p in requeued.glob("checkpoint-*")) == sorted(p.name for p in whole.glob("checkpoint-*"))
    assert json.loads((requeued / "trainer_state.json").read_text())["global_step"] == 6
    published, uninterrupted = weights(requeued / "final"), weights(whole / "final")
    assert published.keys() == uninterrupted.keys() and published
    assert all(torch.equal(published[name], uninterrupted[name]) for name in published)


def test_checkpoints_record_every_pipeline_rank(runs):
    """pp 2 x tp 2 (saved asynchronously): each rank wrote its own shards, the record names each pipeline rank's
    parameters, and the checkpoint holds every parameter's state once."""
    checkpoint = runs / "pp2-tp2" / "checkpoint-3"
    layout = json.loads((checkpoint / LAYOUT_NAME).read_text())
    assert sorted(p.name for p in (checkpoint / "dcp").glob("*.distcp")) == [f"__{rank}_0.distcp" for rank in range(4)]
    stage_names = [{p["name"] for p in entry["parameters"]} for entry in layout["optimizer"]]
    assert "model.embed_tokens.weight" in stage_names[0] and "lm_head.weight" in stage_names[1]
    assert not stage_names[0] & stage_names[1]
    assert stage_names[0] | stage_names[1] == set(canonical_optimizer_state(runs / "single" / "checkpoint-3"))
    assert set(canonical_optimizer_state(checkpoint)) == stage_names[0] | stage_names[1]


# ---------------------------------------------------------------------------- in one process
def split_by_pipeline_rank(optimizer, names: list[str], held_by: dict[str, int], pp_size: int):
    """The state dict of ``optimizer`` (over ``names``) as ``pp_size`` pipeline ranks would save it: rank ``q`` holds
    the parameters ``held_by[name] == q``, in the same group order, renumbered."""
    full = optimizer.state_dict()
    records, files = [], []
    for q in range(pp_size):
        state, groups, parameters, index = {}, [], [], 0
        for group in full["param_groups"]:
            held = [i for i in group["params"] if held_by[names[i]] == q]
            for i in held:
                state[index] = full["state"][i]
                parameters.append({"name": names[i], "partition_dim": None})
                index += 1
            groups.append(len(held))
        files.append([{"state": state, "param_groups": [dict(g, params=[]) for g in full["param_groups"]]}])
        records.append({"files": [f"pp{q}"], "groups": groups, "parameters": parameters})
    return records, files


def stepped_adamw():
    torch.manual_seed(0)
    params = {f"layer{i}.weight": torch.nn.Parameter(torch.randn(4, 6)) for i in range(4)}
    params["norm.weight"] = torch.nn.Parameter(torch.randn(6))
    names = list(params)
    optimizer = torch.optim.AdamW([{"params": [params[n] for n in names[:4]], "weight_decay": 0.1},
                                   {"params": [params[names[4]]], "weight_decay": 0.0}], lr=1e-2)
    for _ in range(2):
        sum((p ** 2).sum() for p in params.values()).backward()
        optimizer.step()
    return optimizer, names, params


def test_reshard_across_pipeline_ranks_in_one_process():
    """Saved by 2 pipeline ranks (layers 0-1 + norm on rank 1, as a last stage), loaded by one rank holding everything,
    and by a rank holding layers 1-2 of TP 2 (sharded along dim 1): the saved moments, exactly; a saved parameter in
    another group, or one this run does not hold anywhere, is refused."""
    optimizer, names, params = stepped_adamw()
    held_by = {"layer0.weight": 0, "layer1.weight": 0, "layer2.weight": 1, "layer3.weight": 1, "norm.weight": 1}
    records, files = split_by_pipeline_rank(optimizer, names, held_by, 2)
    asked = []

    def load(q):
        asked.append(q)
        return files[q]

    full = reshard_optimizer_state(load, records, names, [ShardSpec(tuple(params[n].shape)) for n in names], optimizer.param_groups)
    original = optimizer.state_dict()
    assert all(torch.equal(full["state"][i][k], v) for i, entry in original["state"].items() for k, v in entry.items())
    assert [g["weight_decay"] for g in full["param_groups"]] == [0.1, 0.0] and full["param_groups"][1]["params"] == [4]
    asked.clear()
    stage = ["layer1.weight", "layer2.weight"]
    specs = [ShardSpec((4, 6), 1, 1, 2)] * 2
    part = reshard_optimizer_state(load, records, stage, specs, [{"params": stage}, {"params": []}],
                                   held_elsewhere=frozenset(set(names) - set(stage)))
    assert sorted(asked) == [0, 1]
    for i, name in enumerate(stage):
        assert torch.equal(part["state"][i]["exp_avg_sq"], original["state"][names.index(name)]["exp_avg_sq"][:, 3:])
    with pytest.raises(ResumeLayoutError, match="unexpected \\['layer3.weight'"):
        reshard_optimizer_state(load, records, stage, specs, [{"params": stage}, {"params": []}],
                                held_elsewhere=frozenset({"layer0.weight", "norm.weight"}))
    with pytest.raises(ResumeLayoutError, match="other parameter groups"):
        reshard_optimizer_state(load, records, stage, specs, [{"params": stage[:1]}, {"params": stage[1:]}],
                                held_elsewhere=frozenset(set(names) - set(stage)))


def layout(pp: int, tp: int, dp: int, batch: int = 8, **extra) -> dict:
    return {"pp_size": pp, "tp_size": tp, "dp_size": dp, "zero_stage": None, "global_batch_size": batch, **extra}


def test_resume_layout_checks_under_pipeline_parallelism(tmp_path):
    record = {"optimizer": [{"files": ["optimizer_pp00_tp00.pt"], "groups": [1], "parameters": []}]}
    write_training_layout(str(tmp_path), layout(2, 2, 1, **record))
    for current in (layout(1, 1, 1), layout(1, 2, 2), layout(2, 1, 2), layout(4, 1, 1)):
        check_resume_layout(str(tmp_path), current)  # any pp x tp x dp with the same global batch
    with pytest.raises(ResumeLayoutError, match=r"global batch of 8 .* this run has 4 .* = 8"):
        check_resume_layout(str(tmp_path), layout(1, 1, 1, batch=4))
    write_training_layout(str(tmp_path), layout(2, 2, 1))  # a pipeline checkpoint of a version without the record
    check_resume_layout(str(tmp_path), layout(2, 2, 2))
    with pytest.raises(ResumeLayoutError, match="did not record its optimizer's parameters per pipeline rank.*Resume at pp_size=2 and tp_size=2"):
        check_resume_layout(str(tmp_path), layout(1, 1, 1))


@pytest.mark.parametrize("fields, words", [
    ({"zero1_optimizer": True, "deepspeed": {"zero_optimization": {"stage": 1}}}, "use either DeepSpeed's ZeRO"),
    ({"zero1_optimizer": True, "lowrank_optimizer": "loro"}, "LORO's exact step needs both factors"),
    ({"pp_size": 2, "deepspeed": {"zero_optimization": {"stage": 1}}}, "--zero1_optimizer shards the optimizer state"),
])
def test_zero1_refusals(tmp_path, fields, words):
    from boost_hf.training import BoostTrainingArguments

    with pytest.raises(ValueError, match=words):
        BoostTrainingArguments(output_dir=str(tmp_path), report_to="none", **fields)


def test_zero1_with_a_given_optimizer_is_refused(tmp_path):
    from boost_hf.training import BoostTrainer

    from .test_reliability import arguments, blocks, tiny_model

    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="an optimizer was passed in optimizers=.*optimizer_cls_and_kwargs"):
        BoostTrainer(model=model, args=arguments(tmp_path, zero1_optimizer=True), optimizers=(optimizer, None),
                     train_dataset=blocks(32), eval_dataset=blocks(4))


def test_zero1_in_one_process_is_the_plain_optimizer(tmp_path):
    """At dp 1 there is nothing to shard: the run is the one without ``--zero1_optimizer``, bit for bit."""
    from .test_reliability import trainer

    with_zero1, without = trainer(tmp_path / "zero1", zero1_optimizer=True), trainer(tmp_path / "plain")
    for t in (with_zero1, without):
        t.train()
        t.run.release()
    assert not isinstance(getattr(with_zero1.optimizer, "optimizer", None), torch.distributed.optim.ZeroRedundancyOptimizer)
    assert all(torch.equal(a, b) for a, b in zip(with_zero1.model.parameters(), without.model.parameters()))
