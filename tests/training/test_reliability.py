"""Training that never lies, in one process: non-finite steps, data and path mistakes, checkpoint integrity,
the output folder's lock, disk-full saves, and the Trainer internals that BoostTrainer still overrides."""

from __future__ import annotations

import errno
import json
import math
import os
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import Trainer

from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM
from boost_hf.checkpoint.integrity import CheckpointIntegrityError
from boost_hf.training import BoostTrainer, BoostTrainingArguments
from boost_hf.checkpoint.folders import CheckpointWriteError
from boost_hf.training.health import NonFiniteError
from boost_hf.checkpoint.lock import OutputDirInUseError, OutputDirLock
from boost_hf.training.preemption import PREEMPTED_EXIT_CODE, TrainingStopped

VOCAB, BLOCK = 64, 16


def tiny_model(**fields) -> BoostLlamaForCausalLM:
    torch.manual_seed(0)
    config = BoostLlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, bottleneck="cola", rank=8, max_position_embeddings=BLOCK, **fields)
    return BoostLlamaForCausalLM(config)


def blocks(n: int, high: int = VOCAB) -> Dataset:
    ids = torch.randint(0, high, (n, BLOCK), generator=torch.Generator().manual_seed(n)).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def arguments(output_dir, **overrides) -> BoostTrainingArguments:
    values = dict(output_dir=str(output_dir), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-3,
                  logging_steps=1, save_strategy="steps", save_steps=2, report_to="none", disable_tqdm=True,
                  sample_max_new_tokens=0, warmup_steps=0)
    return BoostTrainingArguments(**{**values, **overrides})


def trainer(output_dir, train=None, **overrides) -> BoostTrainer:
    return BoostTrainer(model=tiny_model(), args=arguments(output_dir, **overrides),
                        train_dataset=train if train is not None else blocks(32), eval_dataset=blocks(4))


@pytest.fixture
def nan_loss_at(monkeypatch):
    """``nan_loss_at({3})``: the loss of the micro-batches of steps 3 is NaN, its gradients stay finite (a constant
    is added), so only the loss check can catch it."""
    def install(steps: set[int]):
        original = Trainer.compute_loss

        def compute_loss(self, *args, **kwargs):
            loss = original(self, *args, **kwargs)
            return loss + torch.tensor(float("nan")) if self.state.global_step + 1 in steps else loss

        monkeypatch.setattr(Trainer, "compute_loss", compute_loss)
    return install


def parameters(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------- numerical health
def test_nonfinite_stop_names_the_step_and_the_last_checkpoint(tmp_path, nan_loss_at):
    nan_loss_at({3})
    t = trainer(tmp_path)
    with pytest.raises(NonFiniteError, match=r"non-finite loss or gradient norm \(nan\) at step 3: .*checkpoint-2"):
        t.train()
    assert sorted(os.listdir(tmp_path)) == [".boost_hf.lock", "checkpoint-2", "last_checkpoint.json"]  # no final, no later checkpoint
    assert all(torch.isfinite(p).all() for p in t.model.parameters()), "the non-finite update was applied"


def test_huge_learning_rate_stops_instead_of_saving_nan(tmp_path):
    t = trainer(tmp_path, learning_rate=1e12, max_steps=20, save_strategy="no", max_grad_norm=0.0)
    with pytest.raises(NonFiniteError, match="no checkpoint was saved before it"):
        t.train()


def test_nonfinite_skip_step_leaves_the_weights_and_counts(tmp_path, nan_loss_at):
    nan_loss_at({2})
    t = trainer(tmp_path, nonfinite="skip_step", save_strategy="no")
    seen = {}

    class Snapshot(__import__("transformers").TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            seen[state.global_step] = parameters(model)

    t.add_callback(Snapshot())
    t.train()
    assert all(torch.equal(seen[1][n], seen[2][n]) for n in seen[1]), "the skipped step changed the weights"
    assert not all(torch.equal(seen[2][n], seen[3][n]) for n in seen[2])
    logs = [log for log in t.state.log_history if "nonfinite_skipped_steps" in log]
    assert [log["nonfinite_skipped_steps"] for log in logs] == [0, 1, 1, 1]


def test_skip_step_stops_after_consecutive_skips_and_logs_nan(tmp_path, nan_loss_at):
    nan_loss_at({2, 4, 5, 6})
    t = trainer(tmp_path, nonfinite="skip_step", nonfinite_max_consecutive_skips=3, max_steps=8, save_steps=3)
    message = (r"non-finite loss or gradient norm \(nan\) at step 6: 3 steps in a row skipped by --nonfinite skip_step "
               r"\(--nonfinite_max_consecutive_skips 3\), the run has diverged: training stopped .*checkpoint-3")
    with pytest.raises(NonFiniteError, match=message):
        t.train()
    losses = {log["step"]: log["loss"] for log in t.state.log_history if "loss" in log}
    assert sorted(losses) == [1, 2, 3, 4, 5]
    assert [math.isnan(losses[step]) for step in sorted(losses)] == [False, True, False, True, True]
    assert sorted(os.listdir(tmp_path)) == [".boost_hf.lock", "checkpoint-3", "last_checkpoint.json"]  # no final, nothing after the skips


def test_nonfinite_policy_is_validated(tmp_path):
    with pytest.raises(ValueError, match="nonfinite must be one of stop, skip_step, got 'ignore'"):
        arguments(tmp_path, nonfinite="ignore")


# ---------------------------------------------------------------------------- data and arguments
@pytest.mark.parametrize("steps", [dict(max_steps=-5, num_train_epochs=0), dict(max_steps=0, num_train_epochs=0)])
def test_a_run_that_would_train_no_step_is_refused(tmp_path, steps):
    with pytest.raises(ValueError, match=rf"this run would train no step \(max_steps={steps['max_steps']}, num_train_epochs=0\): set "
                                         "--max_steps to a positive number"):
        arguments(tmp_path, **steps)
    with pytest.raises(ValueError, match="nonfinite_max_consecutive_skips must be >= 0"):
        arguments(tmp_path, nonfinite_max_consecutive_skips=-1)


def test_fewer_blocks_than_one_global_batch(tmp_path):
    with pytest.raises(ValueError, match="the training set has 3 blocks, fewer than 8 .one global batch"):
        trainer(tmp_path, train=blocks(3), per_device_train_batch_size=8)


def test_empty_validation_set(tmp_path):
    with pytest.raises(ValueError, match="the validation set has 0 blocks, fewer than 1 .it is empty"):
        BoostTrainer(model=tiny_model(), args=arguments(tmp_path), train_dataset=blocks(8), eval_dataset=blocks(0))


def test_token_ids_and_labels_out_of_range_fail_before_training(tmp_path):
    with pytest.raises(ValueError, match=rf"token id {VOCAB} in the training set is outside the model's vocabulary \[0, {VOCAB}\)"):
        trainer(tmp_path, train=blocks(8, high=VOCAB + 1))
    labelled = blocks(8).map(lambda row: {"labels": [-100, 300] + row["labels"][2:]})  # -100 is fine, 300 is not
    with pytest.raises(ValueError, match=rf"token id 300 in the training set's labels is neither in the model's vocabulary "
                                         rf"\[0, {VOCAB}\) nor the ignore index -100: the data was tokenized with another"):
        trainer(tmp_path, train=labelled)
    streamed = trainer(tmp_path).data_collator  # batches of streams are checked one by one
    with pytest.raises(ValueError, match=r"token id -1 in a batch is outside"):
        streamed([{"input_ids": [1, -1], "labels": [1, -1]}])
    with pytest.raises(ValueError, match=r"token id -5 in a batch's labels is neither"):
        streamed([{"input_ids": [1, 2], "labels": [-5, -100]}])
    assert streamed([{"input_ids": [1, 2], "labels": [-100, 2]}])["labels"].tolist() == [[-100, 2]]


@pytest.mark.parametrize("parallel", [False, True], ids=["plain-model", "parallelized-tp1"])
def test_compute_metrics_is_honoured(tmp_path, parallel):
    """``compute_metrics`` sees every evaluation block's (preprocessed) logits and labels; the exact loss stays."""
    seen = {}

    def accuracy(prediction):
        seen["shapes"] = (prediction.predictions.shape, prediction.label_ids.shape)
        hits = prediction.predictions[:, :-1] == prediction.label_ids[:, 1:]
        return {"accuracy": float(hits.mean())}

    model = tiny_model()
    if parallel:
        from boost_hf import parallelize

        model = parallelize(model, arguments(tmp_path).to_parallel_config(model.config))
    evaluation = blocks(6)
    t = BoostTrainer(model=model, args=arguments(tmp_path, per_device_eval_batch_size=4), train_dataset=blocks(8),
                     eval_dataset=evaluation, compute_metrics=accuracy,
                     preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1))
    metrics = t.evaluate()
    ids = torch.tensor(evaluation["input_ids"])
    with torch.no_grad():
        logits = tiny_model()(ids).logits
    expected = (logits.argmax(-1)[:, :-1] == ids[:, 1:]).float().mean().item()
    assert seen["shapes"] == ((6, BLOCK), (6, BLOCK))
    assert metrics["eval_accuracy"] == pytest.approx(expected)
    assert metrics["eval_loss"] == pytest.approx(tiny_model()(ids, labels=ids).loss.item(), rel=1e-5)


def test_model_must_fit_block_size_and_tokenizer():
    from boost_hf.training.preflight import check_model_and_data

    config = tiny_model().config
    tokenizer = type("Tokenizer", (), {"__len__": lambda self: VOCAB + 1})()
    with pytest.raises(ValueError, match=r"block_size \(32\) exceeds the model's max_position_embeddings \(16\)"):
        check_model_and_data(config, tokenizer, 32)
    with pytest.raises(ValueError, match=rf"the tokenizer has {VOCAB + 1} tokens but the model's vocab_size is {VOCAB}"):
        check_model_and_data(config, tokenizer, BLOCK)
    with pytest.raises(TypeError, match="block_size must be an int, got str"):
        check_model_and_data(config, tokenizer, "16")


# ---------------------------------------------------------------------------- checkpoints and the output folder
@pytest.fixture(scope="module")
def pristine_run(tmp_path_factory):
    """A finished 4-step run (checkpoint-2, checkpoint-4, final), trained once for the module."""
    folder = tmp_path_factory.mktemp("finished") / "run"
    t = trainer(folder)
    t.train()
    t.save_final_model()
    t.run.release()
    return folder


@pytest.fixture
def finished_run(pristine_run, tmp_path):
    """A copy of the finished run of its own for each test to damage."""
    shutil.copytree(pristine_run, tmp_path / "run")
    return tmp_path / "run"


def test_checkpoints_have_a_manifest_and_resume_verifies_it(finished_run, tmp_path):
    for folder in ("checkpoint-2", "checkpoint-4", "final"):
        assert (finished_run / folder / "manifest.json").is_file(), folder
    assert not [p for p in finished_run.iterdir() if p.name.startswith(".") and p.name != ".boost_hf.lock"]
    weights = finished_run / "checkpoint-2" / "dcp" / "__0_0.distcp"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointIntegrityError, match="checkpoint-2/dcp/__0_0.distcp' is corrupted"):
        trainer(finished_run).train(resume_from_checkpoint=str(finished_run / "checkpoint-2"))
    with pytest.raises(FileNotFoundError, match="resume_from_checkpoint: no such file or folder"):
        trainer(finished_run).train(resume_from_checkpoint=str(tmp_path / "nowhere"))


def flip_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_resume_last_with_a_damaged_last_checkpoint_names_the_intact_earlier_one(finished_run):
    flip_byte(finished_run / "checkpoint-4" / "dcp" / "__0_0.distcp")
    earlier = finished_run / "checkpoint-2"
    with pytest.raises(CheckpointIntegrityError, match=rf"checkpoint-4/dcp/__0_0.distcp' is corrupted .* The previous complete "
                                                       rf"checkpoint of this run is '{earlier}': resume from it with "
                                                       rf"--resume_from_checkpoint {earlier}\."):
        trainer(finished_run).train(resume_from_checkpoint=True)


@pytest.mark.parametrize("damage", ["truncated", "not json", "not a manifest"])
def test_a_damaged_manifest_names_the_file_and_last_skips_it(finished_run, damage, caplog):
    """A damaged ``manifest.json`` in the newest checkpoint: resuming it names the file and the previous complete
    checkpoint; ``--resume_from_checkpoint last`` skips it (a warning naming it) and resumes from the previous one."""
    manifest = finished_run / "checkpoint-4" / "manifest.json"
    text = manifest.read_text()
    manifest.write_text({"truncated": text[: len(text) // 2], "not json": "\x00" * 64, "not a manifest": '{"files": [1, 2]}'}[damage])
    earlier = finished_run / "checkpoint-2"
    with pytest.raises(CheckpointIntegrityError, match=rf"'{manifest}' is damaged \(not a valid manifest: .*\), so .*checkpoint-4' cannot "
                                                       rf"be verified .* The previous complete checkpoint of this run is '{earlier}'"):
        trainer(finished_run).train(resume_from_checkpoint=str(finished_run / "checkpoint-4"))
    t = trainer(finished_run)
    with caplog.at_level("WARNING", logger="boost_hf.checkpoint.folders"):
        t.train(resume_from_checkpoint=True)
    assert f"skipping {finished_run / 'checkpoint-4'}, not a complete checkpoint: '{manifest}' is damaged" in caplog.text
    assert f"resuming from {earlier}" in caplog.text
    assert [log["step"] for log in t.state.log_history if "loss" in log] == [1, 2, 3, 4]  # 3 and 4 retrained


def test_eval_verifies_the_checkpoint(finished_run, tmp_path):
    from boost_hf.evaluation import evaluate_checkpoint

    data = tmp_path / "held_out.txt"
    data.write_text("some held-out text\n")
    final = finished_run / "final"
    flip_byte(final / "model.safetensors")
    with pytest.raises(CheckpointIntegrityError, match="final/model.safetensors' is corrupted"):
        evaluate_checkpoint(str(final), str(data))
    (final / "manifest.json").unlink()
    weights = final / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated, and no manifest to name it
    with pytest.raises(CheckpointIntegrityError, match=rf"the weights of '{final}' cannot be read .*: a safetensors file is "
                                                       "truncated or damaged"):
        evaluate_checkpoint(str(final), str(data))


def test_a_sigterm_during_an_export_says_it_stopped_and_leaves_the_output_as_it_was(finished_run, tmp_path):
    """``boost-hf export`` gets SIGTERM while writing the weights: it says it stopped, the output folder is as before
    (no partial copy left) and it exits 143. Before, it died of the signal without a word, its staging folder left."""
    import sys

    script = (
        "import os, signal, sys\n"
        "import boost_hf.checkpoint.export as export\n"
        "from boost_hf import cli\n"
        "weights = export.export_weights\n"
        "def signalled(*args, **kwargs):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return weights(*args, **kwargs)\n"
        "export.export_weights = signalled\n"
        "sys.exit(cli.main(['export', sys.argv[1], sys.argv[2]]))\n"
    )
    out = tmp_path / "exported"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script, str(finished_run / "checkpoint-4"), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 143, (done.returncode, done.stderr[-3000:])
    assert (f"boost-hf export: SIGTERM received: the export stopped before its end; '{out}' is as it was before it (its "
            "partial copy removed). Run the export again.") in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing exported, no staging folder left


def test_resume_last_takes_the_last_complete_checkpoint(finished_run):
    (finished_run / "checkpoint-4" / "manifest.json").unlink()  # as if the save of step 4 had been interrupted
    t = trainer(finished_run)
    t.train(resume_from_checkpoint=True)
    assert [log["step"] for log in t.state.log_history if "loss" in log] == [1, 2, 3, 4]  # 3 and 4 retrained


def test_a_new_run_refuses_a_finished_output_dir(finished_run):
    with pytest.raises(FileExistsError, match="already holds a run .checkpoint-2, checkpoint-4, final.*--overwrite_output_dir"):
        trainer(finished_run).train()
    t = trainer(finished_run, overwrite_output_dir=True, save_strategy="no", max_steps=1)
    t.train()
    assert not (finished_run / "checkpoint-4").exists() and not (finished_run / "final").exists()


def test_a_second_run_into_a_locked_output_dir_fails(tmp_path):
    first = OutputDirLock(str(tmp_path))
    first.acquire("first-run")
    with pytest.raises(OutputDirInUseError, match=rf"is in use by another run \(pid {os.getpid()} on .*delete .*\.boost_hf\.lock"):
        trainer(tmp_path).train()
    first.release()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / ".boost_hf.lock").write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename}))
    OutputDirLock(str(tmp_path)).acquire("second-run")  # a dead run's lock on this host is taken over


def remote_lock(folder, beats: int, heartbeat: float, **fields) -> dict:
    """The lock of a run on another node ("node-b"), as its heartbeat left it."""
    owner = {"run_id": "remote-run", "pid": 4242, "host": "node-b", "since": "yesterday", "launch": None,
             "heartbeat": heartbeat, "beats": beats, **fields}
    (folder / ".boost_hf.lock").write_text(json.dumps(owner))
    return owner


def test_a_remote_owners_lock_is_taken_over_when_its_heartbeat_stopped_and_refused_while_it_beats(tmp_path, monkeypatch):
    """A requeued run on another node: the dead owner's pid cannot be checked from here, its heartbeat can."""
    import threading
    import time

    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    remote_lock(tmp_path, beats=7, heartbeat=time.time() - 600)  # dead for 10 minutes
    lock = OutputDirLock(str(tmp_path), heartbeat_s=0.2, stale_after_s=60)
    lock.acquire("requeued-run")
    assert "pid 4242 on node-b" in lock.taken_over and "its heartbeat stopped 60" in lock.taken_over
    assert json.loads((tmp_path / ".boost_hf.lock").read_text())["run_id"] == "requeued-run"
    beat = (tmp_path / ".boost_hf.lock").stat().st_mtime_ns
    waited = time.monotonic()  # its own heartbeat goes on: the lock's time moves (a loaded machine may take a while)
    while (tmp_path / ".boost_hf.lock").stat().st_mtime_ns == beat and time.monotonic() - waited < 60:
        time.sleep(0.05)
    assert (tmp_path / ".boost_hf.lock").stat().st_mtime_ns > beat
    assert "beats" not in json.loads((tmp_path / ".boost_hf.lock").read_text())  # the lock itself is never written over
    lock.release()
    assert not (tmp_path / ".boost_hf.lock").exists()

    owner = remote_lock(tmp_path, beats=0, heartbeat=time.time() - 600)  # an old time stamp (a skewed clock), but it beats
    stop = threading.Event()

    def beat():
        while not stop.wait(0.1):
            owner["beats"] += 1
            (tmp_path / ".boost_hf.lock").write_text(json.dumps(owner))

    beating = threading.Thread(target=beat)
    beating.start()
    try:
        with pytest.raises(OutputDirInUseError, match=r"in use by another run \(pid 4242 on node-b, since yesterday; its "
                                                      r"heartbeat goes on\)"):
            OutputDirLock(str(tmp_path), heartbeat_s=0.2, stale_after_s=60).acquire("another-run")
    finally:
        stop.set()
        beating.join()


def test_a_requeued_job_takes_its_earlier_launchs_lock_at_once(tmp_path, monkeypatch):
    import time

    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    launch = {"job": "slurm-4711", "attempt": [0, 0]}
    remote_lock(tmp_path, beats=3, heartbeat=time.time(), launch=launch)  # fresh: killed a second ago
    started = time.monotonic()
    lock = OutputDirLock(str(tmp_path))  # default heartbeat bounds: no waiting needed
    lock.acquire("requeued")
    assert time.monotonic() - started < 2
    assert "slurm-4711 attempt [0, 0]" in lock.taken_over and "an earlier launch of this job" in lock.taken_over
    assert json.loads((tmp_path / ".boost_hf.lock").read_text())["launch"] == {"job": "slurm-4711", "attempt": [1, 0]}
    lock.release()


class PausedFileOperations:
    """``os``'s file operations on the lock (create, rename, remove, replace) pause the racing threads (named
    ``run-*``): a seeded random pause of up to 3 ms before each, and, with ``hold``, ``{thread: event}``, a thread's first
    rename or removal of the lock waits for ``event`` (e.g. until the other run holds the folder)."""

    NAMES = ("open", "rename", "remove", "replace", "unlink", "link")

    def __init__(self, monkeypatch, seed: int, hold: dict | None = None):
        import random
        import threading

        self.random, self.hold, self.lock = random.Random(seed), dict(hold or {}), threading.Lock()
        for name in self.NAMES:
            monkeypatch.setattr(os, name, self.paused(getattr(os, name), name))

    def paused(self, operation, name):
        import threading
        import time

        def call(path, *args, **kwargs):
            thread = threading.current_thread().name
            if thread.startswith("run-") and ".boost_hf.lock" in os.fspath(path):
                with self.lock:
                    pause = self.random.uniform(0, 0.003)
                time.sleep(pause)
                if name in ("rename", "remove", "unlink") and os.path.basename(os.fspath(path)) == ".boost_hf.lock":
                    event = self.hold.pop(thread, None)
                    if event is not None:
                        event.wait(timeout=10)
            return operation(path, *args, **kwargs)

        return call


def race_for_the_folder(folder, dead_pid: int, monkeypatch, seed: int, scheduled: bool) -> dict:
    """Two runs taking over the stale lock of a dead run of this host at once (in two threads, with
    :class:`PausedFileOperations`); ``scheduled``: run-b judges the dead run's lock gone, then removes it only once
    run-a holds the folder (the interleaving that deleted run-a's fresh lock). What each got: its lock, or the error."""
    import socket
    import threading

    folder.mkdir()
    (folder / ".boost_hf.lock").write_text(json.dumps({"run_id": "dead-run", "pid": dead_pid, "host": socket.gethostname(),
                                                        "since": "before", "heartbeat": 0, "beats": 3}))
    a_holds = threading.Event()
    with monkeypatch.context() as patched:
        PausedFileOperations(patched, seed, hold={"run-b": a_holds} if scheduled else None)
        outcome = {}

        def run(name: str) -> None:
            lock = OutputDirLock(str(folder), heartbeat_s=60)  # no heartbeat during the race
            try:
                lock.acquire(name)
                outcome[name] = lock
            except OutputDirInUseError as error:
                outcome[name] = error
            finally:
                if name == "run-a":
                    a_holds.set()

        threads = [threading.Thread(target=run, args=(name,), name=name) for name in ("run-a", "run-b")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    return outcome


def test_two_runs_racing_for_a_stale_lock_exactly_one_takes_the_folder(tmp_path, monkeypatch):
    """A dead run's lock, two new runs taking it over at once, 200 times with seeded pauses between the lock's file
    operations and once in the interleaving that lost before (both judge the dead run gone; run-b removes the lock
    after run-a took it): each time exactly one run holds the folder, the lock names it, and the other is refused
    naming it. Before, run-b deleted run-a's fresh lock and created its own: both trained."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    for trial in range(201):
        folder = tmp_path / f"trial-{trial}"
        outcome = race_for_the_folder(folder, dead.pid, monkeypatch, seed=trial, scheduled=trial == 200)
        holders = [name for name, got in outcome.items() if isinstance(got, OutputDirLock)]
        assert len(outcome) == 2 and len(holders) == 1, (trial, outcome)
        (other,) = set(outcome) - set(holders)
        assert "is in use by another run" in str(outcome[other]), (trial, outcome)
        assert json.loads((folder / ".boost_hf.lock").read_text())["run_id"] == holders[0], trial
        outcome[holders[0]].release()


def test_a_heartbeat_never_writes_over_a_lock_taken_over(tmp_path, monkeypatch):
    """The owner's heartbeat is paused between its check of the lock and its write (a frozen process) while another
    run takes the lock over: the heartbeat writes nothing over the new owner's lock, and the owner stops (exit 1) at
    its next beat. Before, the beat replaced the new owner's lock with its own (the new owner then stopped)."""
    import threading
    import time

    taken = threading.Event()
    stopped = []

    def exit_recorded(code):
        stopped.append(code)
        lock._stop.set()  # the heartbeat ends instead of the process

    monkeypatch.setattr(os, "_exit", exit_recorded)
    lock = OutputDirLock(str(tmp_path), heartbeat_s=0.1)

    def paused_until_taken(write):  # the heartbeat's write (os.replace of a rewritten lock, or os.utime of its own)
        def call(*args, **kwargs):
            if threading.current_thread().name == "boost-hf-output-lock" and not taken.is_set():
                taken.wait(timeout=10)
            return write(*args, **kwargs)
        return call

    for name in ("replace", "utime"):
        monkeypatch.setattr(os, name, paused_until_taken(getattr(os, name)))
    lock.acquire("frozen-run")
    time.sleep(0.3)  # the first beat is waiting
    new_owner = {"run_id": "new-run", "pid": 4242, "host": "node-b", "since": "now", "launch": None}
    aside = tmp_path / "aside"
    os.rename(tmp_path / ".boost_hf.lock", aside)  # as a taker does: the stale lock moved aside, then its own created
    (tmp_path / ".boost_hf.lock").write_text(json.dumps(new_owner))
    aside.unlink()
    taken.set()
    deadline = time.monotonic() + 10
    while not stopped and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stopped == [1]
    assert json.loads((tmp_path / ".boost_hf.lock").read_text()) == new_owner
    lock.release()  # not its lock any more: left to its owner
    assert json.loads((tmp_path / ".boost_hf.lock").read_text()) == new_owner


def test_checkpoints_are_staged_verified_renamed_then_rotated(tmp_path, monkeypatch):
    """Each save: files into ``.checkpoint-<step>.tmp-<run id>``, its manifest, one rename, and only then the rotation
    of ``--save_total_limit``: when old checkpoints are deleted, the new one is complete under its final name."""
    import boost_hf.training.checkpointing as checkpointing
    from boost_hf.checkpoint.integrity import verify_manifest

    events = []
    rotate = checkpointing.rotate_checkpoints

    def recording_rotation(output_dir, **kwargs):
        names = sorted(n for n in os.listdir(output_dir) if n not in (".boost_hf.lock", "last_checkpoint.json"))
        newest = max((n for n in names if n.startswith("checkpoint-")), key=lambda n: int(n.split("-")[1]))
        verify_manifest(os.path.join(output_dir, newest))  # complete before anything is deleted
        events.append(names)
        rotate(output_dir, **kwargs)

    monkeypatch.setattr(checkpointing, "rotate_checkpoints", recording_rotation)
    t = trainer(tmp_path, save_total_limit=1, max_steps=6)
    stale = tmp_path / ".checkpoint-9.tmp-killed-run"  # a run killed while saving left its staging folder
    stale.mkdir(parents=True)
    t.train()
    assert events == [["checkpoint-2"], ["checkpoint-2", "checkpoint-4"], ["checkpoint-4", "checkpoint-6"]]
    assert sorted(os.listdir(tmp_path)) == [".boost_hf.lock", "checkpoint-6", "last_checkpoint.json"]  # rotated; no staging folder left


def test_a_save_that_fails_before_its_rename_keeps_the_previous_checkpoint_with_save_total_limit(tmp_path, monkeypatch):
    import boost_hf.checkpoint.folders as checkpoint_module
    from boost_hf.checkpoint.integrity import verify_manifest

    write_manifest = checkpoint_module.write_manifest
    t = trainer(tmp_path, save_total_limit=1, max_steps=4)

    def killed_at_step_4(folder, config=None, **kwargs):
        if t.state.global_step == 4:
            raise KeyboardInterrupt  # as a kill between the files and the manifest
        return write_manifest(folder, config, **kwargs)

    monkeypatch.setattr(checkpoint_module, "write_manifest", killed_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        t.train()
    assert sorted(os.listdir(tmp_path)) == [".boost_hf.lock", "checkpoint-2", "last_checkpoint.json"]
    verify_manifest(str(tmp_path / "checkpoint-2"))


def _tmpfs(path, size: str) -> bool:
    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True).returncode == 0


def test_disk_full_keeps_the_previous_checkpoint_and_no_partial_folder(tmp_path, monkeypatch):
    """On a 560 KiB tmpfs (or, without mount rights, a simulated ENOSPC) the first ~370 KiB checkpoint (with its remote-code
    files, in 4 KiB blocks) fits and the second does not: DCP's writer fails inside its write thread."""
    disk = tmp_path / "disk"
    mounted = _tmpfs(disk, "560k")
    try:
        t = trainer(disk, max_steps=4)
        if not mounted:
            original = torch.save

            def full_after_first_checkpoint(obj, f, *args, **kwargs):
                if t.state.global_step > 2:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return original(obj, f, *args, **kwargs)

            monkeypatch.setattr(torch, "save", full_after_first_checkpoint)
        with pytest.raises(CheckpointWriteError, match=r"could not save .*checkpoint-4': no space left on device"):
            t.train()
        assert sorted(p.name for p in disk.iterdir() if p.name != ".boost_hf.lock") == ["checkpoint-2", "last_checkpoint.json"]
        from boost_hf.checkpoint.integrity import verify_manifest

        verify_manifest(str(disk / "checkpoint-2"))
    finally:
        t.run.release()  # the run's lock, held open while it runs
        if mounted:
            subprocess.run(["umount", str(disk)], check=True)


def test_init_from_paths_and_architecture_are_checked(finished_run, tmp_path):
    from boost_hf.training.recipe import build_model, parse_recipe

    def model_from(path, *extra):
        model_args, _, training_args = parse_recipe(["--init_from", str(path), "--output_dir", str(tmp_path / "o"), *extra])
        tokenizer = type("Tokenizer", (), {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None})()
        return build_model(model_args, training_args, tokenizer)

    with pytest.raises(FileNotFoundError, match="init_from: no such file or folder"):
        model_from(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json, so it is not a saved model"):
        model_from(tmp_path / "empty")
    with pytest.raises(CheckpointIntegrityError, match="only_lr_act: checkpoint True, config False"):
        model_from(finished_run / "final", "--only_lr_act", "false")
    assert model_from(finished_run / "final").config.only_lr_act is True
    flip_byte(finished_run / "final" / "model.safetensors")
    with pytest.raises(CheckpointIntegrityError, match="final/model.safetensors' is corrupted"):
        model_from(finished_run / "final")


# ---------------------------------------------------------------------------- Trainer internals still overridden
def test_the_overridden_private_trainer_methods_are_the_reviewed_ones(monkeypatch):
    """BoostTrainer overrides exactly the private Trainer methods boost_hf/training/stack.py records, their source in the
    installed transformers is the reviewed one, and a release that changes one is refused when a trainer is built
    (naming the method and the fix) unless the user allows it."""
    from boost_hf.training import stack

    overridden = sorted(n for n in vars(BoostTrainer) if n.startswith("_") and not n.startswith("__") and hasattr(Trainer, n))
    assert overridden == sorted(stack.REVIEWED_TRAINER_INTERNALS)
    assert stack.unreviewed_trainer_internals() == []
    stack.check_trainer_internals()
    changed = type("ChangedTrainer", (Trainer,), {"_wrap_model": lambda self, model, training=True, dataloader=None: model})
    assert stack.unreviewed_trainer_internals(changed) == ["_wrap_model"]
    monkeypatch.setattr(stack, "unreviewed_trainer_internals", lambda: ["_wrap_model"])
    with pytest.raises(stack.TrainingStackError, match=r"changed Trainer methods that BoostTrainer overrides \(_wrap_model\).*"
                                                       r"reviewed against transformers 5\.24\.0.*BOOST_HF_ALLOW_UNREVIEWED_TRAINER=1"):
        BoostTrainer(model=None, args=None)
    monkeypatch.setenv(stack.ALLOW_UNREVIEWED_ENV, "1")
    stack.check_trainer_internals()


# ---------------------------------------------------------------------------- cryptic cases, named
def test_resume_from_a_final_model_points_to_init_from(finished_run):
    final = finished_run / "final"
    with pytest.raises(FileNotFoundError, match=rf"'{final}' has no trainer_state.json, so it is a saved model .*not a training "
                                                rf"checkpoint.*--init_from {final}"):
        trainer(finished_run).train(resume_from_checkpoint=str(final))


def test_a_malformed_json_lines_file_names_the_line(tmp_path):
    from boost_hf.data.sources import load_raw_dataset

    data = tmp_path / "docs.jsonl"
    data.write_text('{"text": "one"}\n{"text": "two",\n{"text": "three"}\n')
    with pytest.raises(ValueError, match=rf"data file '{data}', line 2: not valid JSON .*Fix or remove that line"):
        load_raw_dataset(str(data))


@pytest.mark.parametrize("name", ["per_device_train_batch_size", "gradient_accumulation_steps"])
def test_zero_batch_size_or_accumulation_is_refused(tmp_path, name):
    with pytest.raises(ValueError, match=rf"{name} must be >= 1, got 0"):
        arguments(tmp_path, **{name: 0})


def test_an_empty_tokenizer_folder_is_named(tmp_path):
    from boost_hf.data import load_tokenizer

    (tmp_path / "tok").mkdir()
    with pytest.raises(FileNotFoundError, match=r"tokenizer: the folder '.*tok' holds no tokenizer \(none of tokenizer.json"):
        load_tokenizer(str(tmp_path / "tok"))


@pytest.mark.parametrize("failure, cause", [
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"),  # torch.save on a full disk
     r"a write failed \(RuntimeError: .*unexpected pos 576 vs 534\), [\d.]+ MiB free now \(a full disk is the usual cause"),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242"),
     r"another rank stopped while saving \(this rank's collective lost it\); that rank's error names the cause"),
], ids=["torch-writer", "peer-gone"])
def test_a_failed_save_on_any_rank_is_named_without_errno_prefix(tmp_path, monkeypatch, failure, cause):
    """What the other rank of a tp 2 run saw when the disk filled: torch's zip writer failing (no errno), or the save's
    barrier broken by the rank that failed first; both used to be raw torch errors, and every message began with
    ``[Errno 5]``."""
    t = trainer(tmp_path, max_steps=4)
    original = torch.save

    def failing_at_step_4(*args, **kwargs):
        if t.state.global_step == 4:
            raise failure
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_at_step_4)
    with pytest.raises(CheckpointWriteError) as error:
        t.train()
    assert str(error.value).startswith(f"could not save '{tmp_path / 'checkpoint-4'}': "), str(error.value)
    assert re.search(cause, str(error.value)), str(error.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".boost_hf.lock", "checkpoint-2", "last_checkpoint.json"]


def test_disk_full_inside_safetensors_is_a_checkpoint_write_error(tmp_path, monkeypatch):
    """The final model's safetensors writer reports a full disk as ``SafetensorError: ... os error 28``."""
    import transformers.modeling_utils
    from safetensors import SafetensorError

    t = trainer(tmp_path, max_steps=4)
    t.train()

    def full(*args, **kwargs):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })')

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    with pytest.raises(CheckpointWriteError, match=r"could not save .*final': no space left on device") as error:
        t.save_final_model()
    assert error.value.errno == errno.ENOSPC  # no "[Errno 5]" in the text, the right errno on the exception
    assert sorted(p.name for p in tmp_path.iterdir()) == [".boost_hf.lock", "checkpoint-2", "checkpoint-4", "last_checkpoint.json"]


# ---------------------------------------------------------------------------- preemption (one process; launched: test_hangs.py)
def logged_losses(t) -> dict[int, float]:
    return {log["step"]: log["loss"] for log in t.state.log_history if "loss" in log}


def test_the_time_budget_saves_a_checkpoint_and_exits_76_and_the_resume_loses_no_step(tmp_path):
    whole = trainer(tmp_path / "whole", save_strategy="no")
    whole.train()
    stopped = trainer(tmp_path / "run", save_strategy="no", exit_after_minutes=1e-9)  # spent at the first step's end
    with pytest.raises(TrainingStopped) as error:
        stopped.train()
    assert error.value.code == PREEMPTED_EXIT_CODE == 76 and error.value.step == 1
    assert str(error.value) == (
        "boost-hf: the time budget of --exit_after_minutes 1e-09 is spent: every rank finished step 1 and the run saved "
        f"'{tmp_path / 'run' / 'checkpoint-1'}'; exiting with status 76. Continue with --resume_from_checkpoint last.")
    assert (tmp_path / "run" / "checkpoint-1" / "manifest.json").is_file() and not (tmp_path / "run" / "final").exists()
    stopped.run.release()
    resumed = trainer(tmp_path / "run", save_strategy="no")
    resumed.train(resume_from_checkpoint=True)
    assert list(logged_losses(stopped)) == [1]
    assert logged_losses(resumed) == logged_losses(whole)  # step 1 from the checkpoint's log, 2-4 trained: bit-identical


def test_an_exit_signal_finishes_the_step_saves_and_restores_the_handlers(tmp_path):
    import signal

    from transformers import TrainerCallback

    class SignalDuringStep2(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step + 1 == 2:
                os.kill(os.getpid(), signal.SIGUSR1)  # handled at once (main thread); the step goes on

    before = signal.getsignal(signal.SIGUSR1)
    t = trainer(tmp_path, save_strategy="no", max_steps=6)
    t.add_callback(SignalDuringStep2())
    with pytest.raises(TrainingStopped, match=r"SIGUSR1 received: every rank finished step 2 and the run saved .*checkpoint-2'"):
        t.train()
    assert t.state.global_step == 2 and (tmp_path / "checkpoint-2" / "manifest.json").is_file()
    assert signal.getsignal(signal.SIGUSR1) is before
    with pytest.raises(ValueError, match="exit_signals: 'SIGKILL' is a signal no process can catch"):
        arguments(tmp_path, exit_signals="SIGTERM,SIGKILL")
    with pytest.raises(ValueError, match="exit_signals: 'SIGNOPE' is not a signal"):
        arguments(tmp_path, exit_signals="nope")



def test_the_signal_handler_does_nothing_that_can_block(capfd):
    """The handler only records the signal: asking the launcher's store whether a peer left (a network call; here a
    store that answers after 3 s) happens outside it, so the signal returns at once; a peer gone ends the process
    (exit 128 + the signal), else the follow-up says what the signal will do. Before, the handler itself waited for
    the store: 3 s inside a signal handler."""
    import signal
    import threading
    import time

    from boost_hf.training import preemption

    asked, ended = threading.Event(), []

    def slow_store() -> bool:
        time.sleep(3)
        asked.set()
        return False

    requests = preemption.StopRequests((signal.SIGUSR1,), run_broken=slow_store)
    with requests.handling():
        started = time.monotonic()
        os.kill(os.getpid(), signal.SIGUSR1)  # handled in this thread, right after this call
        returned = time.monotonic() - started
        assert asked.wait(timeout=30)
    assert returned < 1, returned
    assert requests.received == {signal.SIGUSR1}
    assert f"boost-hf: SIGUSR1 received by rank 0: {preemption.TRAINING}." in capfd.readouterr().err

    broken = preemption.StopRequests((signal.SIGUSR1,), run_broken=lambda: True)
    exit_now = os._exit
    try:
        os._exit = ended.append  # the process would end here
        with broken.handling():
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.2)
    finally:
        os._exit = exit_now
    assert ended == [128 + signal.SIGUSR1]
    assert "SIGUSR1 received after another rank left the run" in capfd.readouterr().err


def test_a_signal_during_the_final_save_says_the_save_goes_on_and_the_run_ends_complete(tmp_path, monkeypatch, capfd):
    """SIGTERM while ``final/`` is written: said at once (the save goes on, the run ends complete with status 0), the
    save completes and the run returns. Before, the signal was recorded and ignored without a word."""
    import signal

    from boost_hf.training import pretrain

    t = trainer(tmp_path, max_steps=2, save_strategy="no", resume_from_checkpoint="auto")
    save_model = t.save_model

    def signalled_save(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return save_model(*args, **kwargs)

    monkeypatch.setattr(t, "save_model", signalled_save)
    monkeypatch.setattr(pretrain, "build_trainer", lambda argv: t)
    try:
        pretrain.main([])
    finally:
        t.run.release()
    assert (tmp_path / "final" / "manifest.json").is_file()
    assert (f"boost-hf: SIGTERM received by rank 0: {pretrain.DURING_THE_FINAL_SAVE}.") in capfd.readouterr().err


def word_tokenizer():
    """A word-level tokenizer of the words ``w0`` .. ``w61`` (and ``<eos>``, ``[UNK]``): 64 ids, the tiny model's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="[UNK]")


@pytest.mark.parametrize("streaming", [False, True], ids=["map-style", "stream"])
def test_resuming_on_changed_data_is_refused_naming_both_fingerprints(tmp_path, caplog, streaming):
    """The same JSON Lines file with its lines shuffled (same size, same block count) between the save and the resume:
    refused, naming the file, what differs and both fingerprints; the unchanged file resumes, and so does a copy of it
    on local scratch without its modification time and under another name (before: refused as changed data);
    --resume_on_changed_data continues at the saved position on the new data, with a warning."""
    from boost_hf.data import build_lm_datasets

    rng = random.Random(0)
    lines = [json.dumps({"text": " ".join(f"w{rng.randrange(VOCAB - 2)}" for _ in range(rng.randint(5, 40)))}) + "\n"
             for _ in range(120)]
    data, valid = tmp_path / "docs.jsonl", tmp_path / "valid.jsonl"
    data.write_text("".join(lines))
    valid.write_text("".join(lines[:20]))
    tokenizer = word_tokenizer()

    def train(resume_from_checkpoint=None, source=data, **overrides) -> None:
        built = build_lm_datasets({"train": str(source), "validation": str(valid)}, tokenizer, BLOCK, streaming=streaming,
                                  max_eval_blocks=4 if streaming else None, datasets_cache_dir=tmp_path / "hf")
        t = trainer(tmp_path / "run", train=built["train"], **overrides)
        try:
            t.train(resume_from_checkpoint=resume_from_checkpoint)
        finally:
            t.run.release()

    train()
    checkpoint = str(tmp_path / "run" / "checkpoint-2")
    assert "fingerprint" in json.loads((tmp_path / "run" / "checkpoint-2" / "data_position" / "position.json").read_text())
    train(checkpoint)  # the same data: resumes
    scratch = tmp_path / "scratch" / "corpus.jsonl"
    scratch.parent.mkdir()
    shutil.copyfile(data, scratch)  # staged to local scratch without its times, under another name
    os.utime(scratch, ns=(0, data.stat().st_mtime_ns + 10**12))
    train(checkpoint, source=scratch)  # the same content: resumes
    rng.shuffle(lines)
    data.write_text("".join(lines))
    message = (rf"the training data is not the data '{checkpoint}' was saved with: docs\.jsonl: sampled content (\w+) -> "
               r"(\w+), modified .* Saved: digest \w+ \(1 file, [\d,]+ bytes, .*\); now: digest \w+ \(1 file, .* pass "
               r"--resume_on_changed_data true")
    with pytest.raises(ValueError, match=message):
        train(checkpoint)
    with caplog.at_level("WARNING"):
        train(checkpoint, resume_on_changed_data=True)
    assert "Continuing at the saved position on this data (--resume_on_changed_data)" in caplog.text


def test_a_damaged_lock_is_said_at_once_and_taken_over_after_two_heartbeats_unless_its_owner_repairs_it(tmp_path, capfd):
    """A garbage lock file written just now (an old heartbeat bound of 60 s would wait a minute, silently): the run says
    it found it and takes it over after 2 heartbeats; a live owner whose lock was written over rewrites it at its next
    beat, so a second run is refused."""
    import time

    (tmp_path / ".boost_hf.lock").write_text("garbage {")
    started = time.monotonic()
    lock = OutputDirLock(str(tmp_path), heartbeat_s=0.5, stale_after_s=60)
    lock.acquire("new-run")
    assert time.monotonic() - started < 5
    err = capfd.readouterr().err
    assert re.search(r"holds a damaged lock file .*\.boost_hf\.lock \(not the record a run writes\): taking it over if it "
                     r"stays so for 1 s", err), err
    assert "took over the lock" in err and "a damaged lock file, owner unknown: it stayed damaged for 1 s" in err
    assert json.loads((tmp_path / ".boost_hf.lock").read_text())["run_id"] == "new-run"

    (tmp_path / ".boost_hf.lock").write_text("written over")  # the live owner's lock damaged
    with pytest.raises(OutputDirInUseError, match="is in use by another run"):
        OutputDirLock(str(tmp_path), heartbeat_s=0.5, stale_after_s=60).acquire("second-run")
    assert "was damaged; rewriting it" in capfd.readouterr().err
    assert json.loads((tmp_path / ".boost_hf.lock").read_text())["run_id"] == "new-run"
    lock.release()


def test_a_stop_during_an_evaluation_saves_at_the_step_the_evaluation_followed(tmp_path, monkeypatch):
    """A signal that arrives while the step-2 evaluation runs: the checkpoint is saved at step 2 (right after that
    evaluation), not after training step 3."""
    import signal

    t = trainer(tmp_path, save_strategy="no", max_steps=6, eval_strategy="steps", eval_steps=2)
    evaluate = t.engine.evaluate

    def evaluate_then_signal(*args, **kwargs):
        totals = evaluate(*args, **kwargs)
        if t.state.global_step == 2:
            os.kill(os.getpid(), signal.SIGUSR1)  # handled at once (main thread): the evaluation was under way
        return totals

    monkeypatch.setattr(t.engine, "evaluate", evaluate_then_signal)
    with pytest.raises(TrainingStopped, match=r"SIGUSR1 received: every rank finished step 2 and the run saved .*checkpoint-2'"):
        t.train()
    assert t.state.global_step == 2 and sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]


def test_a_requeued_run_ends_once(tmp_path, monkeypatch):
    """The job script's requeue (``--resume_from_checkpoint auto``) of a run stopped after its last step trains no step
    more and publishes the uninterrupted run's weights; a requeue of the finished run does nothing (no step, no new or
    rotated checkpoint, ``final/`` untouched) and says the run is complete."""
    import signal

    from safetensors.torch import load_file
    from transformers import TrainerCallback

    class SignalDuringLastStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step + 1 == args.max_steps:
                os.kill(os.getpid(), signal.SIGUSR1)

    def run(folder, *callbacks) -> BoostTrainer:
        return main_of(folder, monkeypatch, *callbacks, max_steps=4, save_steps=2, save_total_limit=1,
                       resume_from_checkpoint="auto")

    whole = run(tmp_path / "whole")
    assert whole.state.global_step == 4
    with pytest.raises(TrainingStopped, match=r"finished step 4 and the run saved .*checkpoint-4'"):
        run(tmp_path / "run", SignalDuringLastStep())
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-4", "last_checkpoint.json"]  # no final yet
    requeued = run(tmp_path / "run")
    assert requeued.state.global_step == 4 and max(logged_losses(requeued)) == 4  # no step 5
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-4", "final", "last_checkpoint.json", "trainer_state.json"]
    published, uninterrupted = (load_file(folder / "final" / "model.safetensors") for folder in (tmp_path / "run", tmp_path / "whole"))
    assert published.keys() == uninterrupted.keys()
    assert all(torch.equal(published[name], uninterrupted[name]) for name in published)
    assert (tmp_path / "run" / "final" / "config.json").read_text() == (tmp_path / "whole" / "final" / "config.json").read_text()
    manifest = (tmp_path / "run" / "final" / "manifest.json").read_bytes()
    again = run(tmp_path / "run")
    assert again.state.global_step == 0  # nothing loaded, nothing trained: the run was complete
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-4", "final", "last_checkpoint.json", "trainer_state.json"]
    assert (tmp_path / "run" / "final" / "manifest.json").read_bytes() == manifest


# ---------------------------------------------------------------------------- the run's lineage
class StopAtStep:
    """A callback sending this process ``SIGUSR1`` as step ``step`` begins: the run saves that step and stops (76)."""

    def __init__(self, step: int):
        from transformers import TrainerCallback

        self.step, self.trained = step, []

        class Callback(TrainerCallback):
            def on_step_begin(inner, args, state, control, **kwargs):
                if state.global_step + 1 == self.step:
                    import signal

                    os.kill(os.getpid(), signal.SIGUSR1)

            def on_step_end(inner, args, state, control, **kwargs):
                self.trained.append(state.global_step)

        self.callback = Callback()


def run_trainer(folder, resume_from_checkpoint=None, stop_at: int | None = None, **overrides) -> tuple[BoostTrainer, list[int]]:
    """A run into ``folder`` (stopped as step ``stop_at`` begins, saving it); the trainer and the steps it trained."""
    t = trainer(folder, **overrides)
    steps = StopAtStep(stop_at or 0)
    t.add_callback(steps.callback)
    try:
        if stop_at is None:
            t.train(resume_from_checkpoint=resume_from_checkpoint)
        else:
            with pytest.raises(TrainingStopped, match=rf"finished step {stop_at} and the run saved"):
                t.train(resume_from_checkpoint=resume_from_checkpoint)
    finally:
        t.run.release()
    return t, steps.trained


def test_a_resume_follows_the_lineage_it_continues(tmp_path, caplog):
    """Checkpoints 2, 4, 6; rolled back to checkpoint-2 (at a lower learning rate, as after a loss spike), the run saves
    step 3 and is stopped: its requeue (``auto``, or ``last``) resumes checkpoint-3 of that lineage, not the abandoned
    checkpoint-6 (which would have ended the run without a step). The abandoned checkpoints are set aside as
    ``abandoned-checkpoint-<step>`` (kept, said), ``last_checkpoint.json`` records the committed checkpoint, and
    ``save_total_limit`` rotates by step within the lineage (before: by modification time, keeping the abandoned
    checkpoint-6 and deleting checkpoint-2)."""
    from boost_hf.checkpoint.resume_point import resume_checkpoint

    run_trainer(tmp_path, max_steps=6)
    assert json.loads((tmp_path / "last_checkpoint.json").read_text()) == {"checkpoint": "checkpoint-6", "step": 6}
    abandoned = {name: (tmp_path / name / "manifest.json").read_bytes() for name in ("checkpoint-4", "checkpoint-6")}
    with caplog.at_level("WARNING", logger="boost_hf.checkpoint.lineage"):
        run_trainer(tmp_path, str(tmp_path / "checkpoint-2"), stop_at=3, max_steps=6, learning_rate=1e-4, save_total_limit=2)
    assert re.search(r"resuming .*checkpoint-2 sets aside the checkpoints of later steps \(another lineage of this run\): "
                     r"checkpoint-4 -> abandoned-checkpoint-4, checkpoint-6 -> abandoned-checkpoint-6", caplog.text), caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "abandoned-checkpoint-4", "abandoned-checkpoint-6", "checkpoint-2", "checkpoint-3", "last_checkpoint.json"]
    assert {name: (tmp_path / f"abandoned-{name}" / "manifest.json").read_bytes() for name in abandoned} == abandoned  # kept as saved
    assert json.loads((tmp_path / "last_checkpoint.json").read_text()) == {"checkpoint": "checkpoint-3", "step": 3}
    assert resume_checkpoint(str(tmp_path), "last") == resume_checkpoint(str(tmp_path), "auto") == str(tmp_path / "checkpoint-3")
    requeued, trained = run_trainer(tmp_path, "auto", max_steps=6, learning_rate=1e-4, save_total_limit=2)
    assert trained == [4, 5, 6]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]  # by step, in the lineage
    assert [log["step"] for log in requeued.state.log_history if "loss" in log] == [1, 2, 3, 4, 5, 6]


def test_an_output_folder_of_an_earlier_version_resumes_its_newest_checkpoint_said(finished_run, caplog):
    """A run folder without ``last_checkpoint.json`` (written before boost-hf recorded it) resumes as before: its newest
    complete checkpoint, with a warning saying why."""
    (finished_run / "last_checkpoint.json").unlink()
    from boost_hf.checkpoint.resume_point import resume_checkpoint

    with caplog.at_level("WARNING", logger="boost_hf.checkpoint.lineage"):
        assert resume_checkpoint(str(finished_run), "last") == str(finished_run / "checkpoint-4")
    assert f"{finished_run} has no last_checkpoint.json (an output folder of an earlier boost-hf version)" in caplog.text


# ---------------------------------------------------------------------------- the end of a run
def main_of(folder, monkeypatch, *callbacks, **overrides) -> BoostTrainer:
    """``boost-hf train``'s main (``pretrain.main``) on a trainer of :func:`trainer`, the lock released after."""
    from boost_hf.training import pretrain

    t = trainer(folder, **overrides)
    for callback in callbacks:
        t.add_callback(callback)
    monkeypatch.setattr(pretrain, "build_trainer", lambda argv: t)
    try:
        pretrain.main([])
    finally:
        t.run.release()
    return t


def test_a_finished_run_that_saved_only_final_is_complete_when_requeued(tmp_path, monkeypatch, capfd):
    """``--save_strategy no``: the run ends with ``final/`` only. Its requeue with ``auto`` (or ``last``) trains nothing,
    leaves ``final/`` as it is and says the run is complete (before: ``FileExistsError`` advising ``last``, which then
    failed with "no complete checkpoint"); raised ``max_steps``, with no checkpoint to continue from, names
    ``--init_from``."""
    main_of(tmp_path, monkeypatch, save_strategy="no", resume_from_checkpoint="auto")
    published = (tmp_path / "final" / "manifest.json").read_bytes()
    capfd.readouterr()
    for resume in ("auto", "last"):
        again = main_of(tmp_path, monkeypatch, save_strategy="no", resume_from_checkpoint=resume)
        assert again.state.global_step == 0 and (tmp_path / "final" / "manifest.json").read_bytes() == published
        assert (f"boost-hf: the run in {tmp_path} is complete: final/ is published (trained to step 4, its max_steps 4) and "
                "no checkpoint was saved to continue from; nothing to do.") in capfd.readouterr().out
    with pytest.raises(FileExistsError, match=rf"output_dir '{tmp_path}' holds a finished run \(final/, trained to step 4\) "
                                              rf"and no checkpoint to continue it from.*--init_from {tmp_path / 'final'}"):
        main_of(tmp_path, monkeypatch, save_strategy="no", resume_from_checkpoint="auto", max_steps=8)


def test_resuming_a_final_model_names_init_from_before_anything(finished_run, monkeypatch):
    """``--resume_from_checkpoint RUN/final`` through ``boost-hf train``: the error names ``--init_from`` (before: a raw
    ``FileNotFoundError`` for ``final/trainer_state.json``, from the check of whether the run was complete)."""
    final = finished_run / "final"
    with pytest.raises(FileNotFoundError, match=rf"'{final}' has no trainer_state.json, so it is a saved model .*--init_from {final}"):
        main_of(finished_run, monkeypatch, resume_from_checkpoint=str(final))


def test_raising_max_steps_continues_the_schedule_of_the_longer_run_and_says_so(tmp_path, monkeypatch, caplog):
    """A finished 4-step run (cosine to 10 %) requeued with ``--max_steps 8``: steps 5-8 are trained at the learning
    rates of an 8-step run from its step 5 on (before: step 5 at the 4-step schedule's end, 1e-4, then a jump), and a
    warning says so with the numbers; lowering ``max_steps`` below the saved step says so, correctly."""
    def rates(t) -> dict[int, float]:
        return {log["step"]: log["learning_rate"] for log in t.state.log_history if "loss" in log}

    main_of(tmp_path / "run", monkeypatch, resume_from_checkpoint="auto", save_steps=4)
    whole = main_of(tmp_path / "whole", monkeypatch, resume_from_checkpoint="auto", save_steps=4, max_steps=8)
    with caplog.at_level("WARNING", logger="boost_hf.training.checkpointing"):
        longer = main_of(tmp_path / "run", monkeypatch, resume_from_checkpoint="auto", save_steps=4, max_steps=8)
    assert sorted(rates(longer)) == list(range(1, 9))
    assert {s: r for s, r in rates(longer).items() if s > 4} == pytest.approx({s: r for s, r in rates(whole).items() if s > 4})
    checkpoint = tmp_path / "run" / "checkpoint-4"
    assert re.search(rf"{checkpoint} was saved at step 4 of a run of max_steps 4 and this run trains to max_steps 8: the "
                     r"learning-rate schedule \(cosine_with_min_lr\) continues as a run of 8 steps has it, from step 5 on: "
                     r"5\.50e-04 at step 5 \(the saved schedule was at 1\.00e-04 there, the end of its 4 steps\)", caplog.text), caplog.text


def test_lowering_max_steps_below_the_checkpoints_step_says_so(tmp_path, monkeypatch, capfd):
    """A run stopped after saving step 4 (no final/ yet) requeued with ``--max_steps 2``: it trains nothing and says
    the checkpoint is past ``max_steps``, not "at" it; once ``final/`` is published, the requeue says the same."""
    t = trainer(tmp_path, save_steps=4)
    stop = StopAtStep(4)
    t.add_callback(stop.callback)
    with pytest.raises(TrainingStopped):
        t.train()
    t.run.release()
    capfd.readouterr()
    lowered = main_of(tmp_path, monkeypatch, resume_from_checkpoint="auto", save_steps=4, max_steps=2)
    err = capfd.readouterr().err
    assert (f"boost-hf: {tmp_path / 'checkpoint-4'} was saved at step 4, past this run's max_steps 2: no step is trained "
            "(a run does not go back: to end at an earlier step, resume an earlier checkpoint)") in err, err
    assert lowered.state.global_step == 4 and (tmp_path / "final" / "manifest.json").is_file()
    main_of(tmp_path, monkeypatch, resume_from_checkpoint="auto", save_steps=4, max_steps=2)
    assert (f"boost-hf: the run in {tmp_path} is complete: {tmp_path / 'checkpoint-4'} is at step 4, past max_steps 2, and "
            "final/ is published; nothing to do.") in capfd.readouterr().out


def test_a_rollback_of_a_finished_run_sets_its_end_aside_and_the_requeue_finishes_the_new_lineage(tmp_path, monkeypatch):
    """A finished run (checkpoints 2 and 4, final/) rolled back to checkpoint-2 and stopped after saving step 3: its
    final/ and trainer_state.json (the end of the abandoned lineage, step 4) are set aside with its checkpoint-4, so
    the requeue with ``auto`` is not taken for complete: it resumes checkpoint-3, trains step 4 and publishes the new
    lineage's final/."""
    main_of(tmp_path, monkeypatch, resume_from_checkpoint="auto")
    old_final = (tmp_path / "final" / "manifest.json").read_bytes()
    stop = StopAtStep(3)
    with pytest.raises(TrainingStopped, match="finished step 3"):
        main_of(tmp_path, monkeypatch, stop.callback, resume_from_checkpoint=str(tmp_path / "checkpoint-2"), learning_rate=1e-4)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "abandoned-checkpoint-4", "abandoned-final", "abandoned-trainer_state.json", "checkpoint-2", "checkpoint-3",
        "last_checkpoint.json"]
    assert (tmp_path / "abandoned-final" / "manifest.json").read_bytes() == old_final
    steps = StopAtStep(0)
    main_of(tmp_path, monkeypatch, steps.callback, resume_from_checkpoint="auto", learning_rate=1e-4)
    assert steps.trained == [4] and (tmp_path / "final" / "manifest.json").read_bytes() != old_final
