"""Pre-train a boost-hf model from a YAML recipe; any field can be overridden on the command line.

    boost-hf train demo --max_steps 100                       # a shipped recipe by name, or a path to a YAML file
    accelerate launch --config_file CONFIG.yaml -m boost_hf.cli train demo --tp_size 2
    python recipes/pretrain.py recipes/demo.yaml              # the same, from a source checkout

Logs validation perplexity before training and every ``eval_steps``, trains (``--resume_from_checkpoint
PATH|last`` continues a run; ``auto``: from the last complete checkpoint if there is one, else a new run; a run
resumed at its ``max_steps`` trains no step more, and a finished one whose ``final/`` is published ends at once,
saying so: :meth:`~boost_hf.checkpoint.run_folder.RunFolder.completion`), evaluates again, prints a greedy sample and saves the model with its
tokenizer, its remote code and model card (``README.md``) to ``<output_dir>/final``. A signal of ``--exit_signals``
(SIGTERM, SIGUSR1) or the end of ``--exit_after_minutes`` saves a checkpoint and exits with status 76 instead
(:mod:`boost_hf.training.preemption`).
"""

from __future__ import annotations

from .stack import check_training_stack

check_training_stack()  # before the [train] extra's packages are imported: a missing or untested stack is named with its fix

from .preemption import PREEMPTED_EXIT_CODE
from .preflight import check_model_and_data
from .recipe import build_config, build_datasets, build_model, build_tokenizer, card_datasets, parse_recipe
from .trainer import BoostTrainer
from .watchdog import enter_phase


AFTER_TRAINING = (f"training is over: once the final evaluation or sample under way ends, the run saves a checkpoint at "
                  f"its last step (unless there is one) and exits with status {PREEMPTED_EXIT_CODE}, without final/ "
                  "(continue with --resume_from_checkpoint last)")
DURING_THE_FINAL_SAVE = ("the final model's save goes on to its end (stopped now, it would leave no final/); the run then "
                         "ends complete, with status 0, and a requeue with --resume_from_checkpoint auto does nothing")
"""What a signal of ``--exit_signals`` does after the training loop (:meth:`StopRequests.meaning`)."""


def checked_settings(argv: list[str], tokenizer=None) -> tuple:
    """What ``boost-hf train`` reads and checks of the recipe ``argv`` before any collective and before the data:
    ``(model_args, data_args, training_args, tokenizer, config, parallel_config)``, the training arguments settled and
    checked whatever set them (:mod:`boost_hf.training.compatibility`), the model config, the run's layout (built once)
    and :func:`~boost_hf.training.preflight.check_model_and_data`; ``tokenizer``: one already loaded (default: the data
    arguments')."""
    model_args, data_args, training_args = parse_recipe(argv)
    tokenizer = build_tokenizer(data_args) if tokenizer is None else tokenizer
    config = build_config(model_args, tokenizer)
    parallel_config = training_args.to_parallel_config(config)  # the run's layout, built once
    check_model_and_data(config, tokenizer, data_args.block_size, parallel_config)  # before any collective
    return model_args, data_args, training_args, tokenizer, config, parallel_config


def build_trainer(argv: list[str], **trainer_kwargs) -> BoostTrainer:
    """The :class:`BoostTrainer` of the recipe ``argv`` (model, tokenizer, training and validation sets), its settings,
    model and data checked before any collective (:func:`checked_settings`); ``trainer_kwargs`` go to the trainer
    (e.g. ``compute_metrics``)."""
    model_args, data_args, training_args, tokenizer, config, parallel_config = checked_settings(argv)
    enter_phase("dataset building")
    datasets = build_datasets(data_args, tokenizer, training_args)
    enter_phase("model building")
    model = build_model(model_args, training_args, tokenizer, config=config, parallel_config=parallel_config)
    enter_phase("trainer set-up")
    trainer = BoostTrainer(
        model=model,
        args=training_args,
        train_dataset=datasets["train"],
        eval_dataset=datasets["validation"],
        processing_class=tokenizer,
        **trainer_kwargs,
    )
    trainer.card_metadata["datasets"] = card_datasets(data_args)  # the model card in <output_dir>/final
    return trainer


def main(argv: list[str]) -> None:
    trainer = build_trainer(argv)
    training_args = trainer.args
    if trainer.is_world_process_zero():
        print(trainer.precision.describe())
        how = trainer.fully_shard()
        if how is not None:
            print(f"data parallelism FSDP2 (fully_shard) over {how.shard_size} ranks"
                  + (f" in each of {how.replicate_size} replicas (HSDP)" if how.replicate_size > 1 else "")
                  + f", reshard after forward {how.reshard_after_forward}, units "
                  + ("each decoder layer, then the rest" if how.layers_apart else "the whole model"))
    # "auto": a job script's first launch and its requeues alike; decided on rank 0 for every rank, once the output
    # folder is claimed (locked, what killed runs left restored)
    complete = trainer.run.completion(training_args.resume_from_checkpoint)
    if complete is not None:
        if trainer.is_world_process_zero():
            print(f"boost-hf: the run in {training_args.output_dir} is complete: {complete}; nothing to do.", flush=True)
        return
    resume = trainer.resume_point(training_args.resume_from_checkpoint)
    training_args.eval_on_start = training_args.eval_on_start or not resume  # logged at step 0
    requests = trainer.run.stop_requests
    with requests.handling():  # a signal after the last step still saves a checkpoint
        trainer.train(resume_from_checkpoint=resume)
        with requests.meaning(AFTER_TRAINING):
            trainer.stop_if_requested()
            end = trainer.evaluate()
            trainer.save_state()  # <output_dir>/trainer_state.json: every logged loss, lr, grad norm, throughput
            trainer.stop_if_requested()
            sample = trainer.generate_sample() if training_args.sample_max_new_tokens > 0 else None
            trainer.stop_if_requested()
        with requests.meaning(DURING_THE_FINAL_SAVE):
            final = trainer.save_final_model()
    if trainer.is_world_process_zero():
        start = next((log for log in trainer.state.log_history if "eval_perplexity" in log), end)
        print(f"validation perplexity: {start['eval_perplexity']:.1f} at step {start['step']}")
        print(f"validation perplexity: {end['eval_perplexity']:.1f} after {trainer.state.global_step} steps")
        if sample is not None:
            print(f"sample: {sample!r}")
        print(f"model and tokenizer saved to {final}")


__all__ = ["build_trainer", "checked_settings", "main"]
