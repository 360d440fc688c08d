"""Pre-train a boost-hf model from a YAML recipe; any field can be overridden on the command line.

    python recipes/pretrain.py recipes/demo.yaml --max_steps 100
    accelerate launch --config_file accelerate_configs/cpu-4proc.yaml recipes/pretrain.py recipes/demo.yaml --tp_size 2

Evaluates validation perplexity, trains (resuming with ``--resume_from_checkpoint PATH|last``), evaluates
again, prints a greedy sample and saves the model with its tokenizer to ``<output_dir>/final``.
"""

import sys

from boost_hf.training import BoostTrainer, build_datasets, build_model, build_tokenizer, parse_recipe
from boost_hf.training.recipe import rank_zero_print


def main(argv: list[str]) -> None:
    model_args, data_args, training_args = parse_recipe(argv)
    tokenizer = build_tokenizer(data_args)
    datasets = build_datasets(data_args, tokenizer, training_args)
    model = build_model(model_args, training_args, tokenizer)
    trainer = BoostTrainer(
        model=model,
        args=training_args,
        train_dataset=datasets["train"],
        eval_dataset=datasets["validation"],
        processing_class=tokenizer,
    )
    resume = training_args.resume_from_checkpoint
    start = None if resume else trainer.evaluate()
    trainer.train(resume_from_checkpoint=True if resume == "last" else resume)
    end = trainer.evaluate()
    trainer.save_state()  # <output_dir>/trainer_state.json: every logged loss, lr, grad norm, throughput
    sample = trainer.generate_sample() if training_args.sample_max_new_tokens > 0 else None
    final = trainer.save_final_model()
    if start is not None:
        rank_zero_print(f"validation perplexity: {start['eval_perplexity']:.1f} before training")
    rank_zero_print(f"validation perplexity: {end['eval_perplexity']:.1f} after {trainer.state.global_step} steps")
    if sample is not None:
        rank_zero_print(f"sample: {sample!r}")
    rank_zero_print(f"model and tokenizer saved to {final}")


if __name__ == "__main__":
    main(sys.argv[1:])
