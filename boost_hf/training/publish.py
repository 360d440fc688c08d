"""What makes a saved model folder publishable as it is (a Hub repo's content): settings for inference and the
model card.

* :func:`inference_settings`: ``use_cache=True`` in the saved config and generation config (training runs
  without a KV cache; generation and pipelines should not);
* :func:`save_tokenizer`: the tokenizer with ``model_max_length`` = the trained context, and without a BOS
  declaration when training never put one in front of documents (documents are separated by EOS only, so
  tools that prepend the declared BOS, e.g. lm-evaluation-harness, would score text the model never saw);
* :func:`model_card`: ``README.md`` with the Hub's YAML metadata, the architecture, its cost against full rank,
  the parallel layout and recipe it was trained with, held-out perplexity / bits per byte, and how to load it
  with and without boost-hf (:func:`write_model_card`: a trainer's);
* :func:`publishing`, :func:`save_publishing_files`: what a trainer's saved folders hold besides the weights;
* :func:`export_checkpoint` (``boost-hf export CHECKPOINT OUT``): a training checkpoint (its model's shards in
  ``dcp/``) as that folder, the weights streamed into safetensors files of at most ``max_shard_size``, one file per
  rank at a time (:mod:`boost_hf.checkpoint.export`).
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import shutil
import uuid

import torch
import yaml

from ..perf.flops import forward_flops_per_token
from ..perf.parameters import parameter_count

ARCHITECTURE_NAMES = {
    None: "full-rank LLaMA",
    "svd": "SVD-factorised LLaMA (y = B A x)",
    "cola": "CoLA (y = B act(A x))",
    "lax": "LaX (latent crossing between blocks)",
    "tt": "tensor-train LLaMA (y = B A x, A and B contracted from tensor-train cores)",
}


@contextlib.contextmanager
def inference_settings(model):
    """During the block: ``config.use_cache`` and ``generation_config.use_cache`` are ``True`` (the Trainer sets
    ``config.use_cache = args.use_cache``, ``False``, for training); restored afterwards."""
    config, generation = model.config, getattr(model, "generation_config", None)
    saved = (config.use_cache, getattr(generation, "use_cache", None))
    config.use_cache = True
    if generation is not None:
        generation.use_cache = True
    try:
        yield
    finally:
        config.use_cache = saved[0]
        if generation is not None:
            generation.use_cache = saved[1]


def save_tokenizer(tokenizer, output_dir: str, *, context: int | None, used_bos: bool) -> None:
    """Save a copy of ``tokenizer`` with ``model_max_length = context`` (when known) and, unless ``used_bos``,
    no BOS token declared (its id stays in the vocabulary)."""
    published = copy.deepcopy(tokenizer)
    if context is not None:
        published.model_max_length = context
    if not used_bos and published.bos_token is not None:
        published.bos_token = None
        if hasattr(published, "add_bos_token"):
            published.add_bos_token = False
    published.save_pretrained(output_dir)


@contextlib.contextmanager
def publish_special_tokens(model, tokenizer, used_bos: bool):
    """During the block: the config's and generation config's ``bos_token_id`` follow the published tokenizer
    (``None`` when training did not use the BOS) and ``eos_token_id`` is the tokenizer's; restored afterwards."""
    targets = [model.config] + ([model.generation_config] if getattr(model, "generation_config", None) is not None else [])
    values = {"bos_token_id": tokenizer.bos_token_id if used_bos else None}
    if tokenizer.eos_token_id is not None:
        values["eos_token_id"] = tokenizer.eos_token_id
    saved = [(target, {name: getattr(target, name, None) for name in values}) for target in targets]
    for target in targets:
        for name, value in values.items():
            setattr(target, name, value)
    try:
        yield
    finally:
        for target, old in saved:
            for name, value in old.items():
                setattr(target, name, value)


def full_rank_config(config):
    full = copy.deepcopy(config)
    full.bottleneck = None
    return full


def _format_count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def model_card(config, *, seq_len: int, license: str = "apache-2.0", datasets: list[str] | None = None,
               parallel: dict | None = None, recipe: dict | None = None, metrics: dict | None = None,
               used_bos: bool = False, repo_hint: str = "path/to/model") -> str:
    """The ``README.md`` of a saved model: Hub YAML metadata, then the card.

    ``parallel``: the layout it was trained with (``tp_size``, ``dp_size``, ``tp_style``, ...); ``recipe``:
    ``steps``, ``tokens``, ``global_batch``, ``learning_rate``, ...; ``metrics``: the last held-out
    ``eval_perplexity`` / ``eval_bits_per_byte`` / ``eval_loss``; ``repo_hint``: the folder or Hub repo id in
    the loading examples.
    """
    bottleneck = config.bottleneck
    params, full_params = parameter_count(config), parameter_count(full_rank_config(config))
    flops, full_flops = forward_flops_per_token(config, seq_len), forward_flops_per_token(full_rank_config(config), seq_len)
    tags = ["boost-hf", "llama", "low-rank" if bottleneck else "full-rank", "text-generation", "custom_code"]
    if bottleneck:
        tags.insert(2, bottleneck)
    metadata = {
        "library_name": "transformers",
        "license": license,
        "pipeline_tag": "text-generation",
        "tags": tags,
        "datasets": list(datasets or []),
        "model_type": config.model_type,
        "base_model_architecture": "LlamaForCausalLM" if bottleneck is None else f"BoostLlamaForCausalLM ({bottleneck} bottleneck of LlamaForCausalLM)",
    }
    if not metadata["datasets"]:
        del metadata["datasets"]
    lines = ["---", yaml.safe_dump(metadata, sort_keys=False).strip(), "---", ""]
    title = ARCHITECTURE_NAMES[bottleneck]
    lines += [
        f"# {title}, {_format_count(params)} parameters (boost-hf)",
        "",
        "Pre-trained with boost-hf (BOOST: bottleneck-aware tensor parallelism for low-rank LLaMA).",
        "",
        "## Architecture",
        "",
        "| | this model | full rank, same shape |",
        "|---|---|---|",
        f"| bottleneck | `{bottleneck}` | `None` |",
        f"| rank | {config.rank if bottleneck else '-'} | - |",
        f"| parameters | {params:,} | {full_params:,} |",
        f"| forward FLOPs per token (context {seq_len}) | {flops:,} | {full_flops:,} |",
        f"| FLOPs vs full rank | {flops / full_flops:.3f} | 1.000 |",
        "",
        f"{config.num_hidden_layers} layers, hidden size {config.hidden_size}, {config.num_attention_heads} heads "
        f"({config.num_key_value_heads} key/value heads), intermediate size {config.intermediate_size}, vocabulary "
        f"{config.vocab_size}, context {config.max_position_embeddings} positions (trained on {seq_len}).",
    ]
    if bottleneck:
        details = [f"latent activation `{config.latent_activation}`", f"`only_lr_act={config.only_lr_act}`"]
        if bottleneck == "lax":
            details += [f"gate `{config.lax_gate}`", f"latent norm `{config.lax_latent_norm}`", f"base `{config.lax_base}`"]
        if bottleneck == "tt":
            details = [f"contracted from `{config.tt_cores}` tensor-train cores (`tt_rank={config.tt_rank}`, "
                       f"`tt_rank_ratio={config.tt_rank_ratio}`, `tt_leading_mode_multiple={config.tt_leading_mode_multiple}`)"]
        lines += ["", "Every projection (q, k, v, o, gate, up, down) is `A (d_in -> r)`, `B (r -> d_out)`; " + ", ".join(details) + "."]
    if parallel:
        lines += ["", "## Training", "", "Parallel layout: " + ", ".join(f"{k} `{v}`" for k, v in parallel.items()) + "."]
    if recipe:
        lines += ["", "| recipe | |", "|---|---|", *(f"| {k} | {v} |" for k, v in recipe.items())]
    if metrics:
        shown = {k: v for k, v in metrics.items() if k.endswith(("perplexity", "bits_per_byte", "loss"))}
        lines += ["", "## Held-out evaluation", "", "| metric | value |", "|---|---|",
                  *(f"| {k} | {v:.4f} |" for k, v in shown.items())]
        lines += ["", "Bits per byte: summed next-token NLL of every held-out target token (EOS included) over ln 2 x the "
                      "UTF-8 bytes of their text (`boost_hf/evaluation`)."]
    lines += [
        "",
        "## How to load",
        "",
        "Without boost-hf (only `torch` and `transformers`; the model code ships in this folder):",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline",
        f'model = AutoModelForCausalLM.from_pretrained("{repo_hint}", trust_remote_code=True)',
        f'tokenizer = AutoTokenizer.from_pretrained("{repo_hint}", trust_remote_code=True)  # reads config.json too',
        f'generate = pipeline("text-generation", model="{repo_hint}", trust_remote_code=True)',
        "```",
        "",
        "With boost-hf (no remote code; any tensor-parallel size):",
        "",
        "```python",
        "import boost_hf",
        "from transformers import AutoModelForCausalLM",
        f'model = AutoModelForCausalLM.from_pretrained("{repo_hint}")',
        "# inside a launched process group (torchrun / accelerate launch), this rank's shard at tp_size 2:",
        f'model = boost_hf.BoostLlamaForCausalLM.from_pretrained("{repo_hint}", parallel_config=boost_hf.ParallelConfig(tp_size=2))',
        "```",
    ]
    if bottleneck is None:
        lines += [
            "",
            "This is a full-rank model with exactly `LlamaForCausalLM`'s weights and names: it also loads as plain LLaMA,",
            "",
            "```python",
            "from transformers import LlamaConfig, LlamaForCausalLM",
            f'config = LlamaConfig.from_pretrained("{repo_hint}")  # the LLaMA fields of config.json',
            f'model = LlamaForCausalLM.from_pretrained("{repo_hint}", config=config)',
            "```",
        ]
    lines += [
        "",
        ("Tokenizer: documents were packed as `<s> text </s> <s> text </s> ...`" if used_bos else
         "Tokenizer: documents were packed as `text </s> text </s> ...` (no BOS, so the tokenizer declares none)")
        + f" in blocks of {seq_len} tokens; `model_max_length` is {seq_len}.",
        "",
    ]
    return "\n".join(lines)


@contextlib.contextmanager
def publishing(trainer):
    """During the block the trainer's model config is as published: ``use_cache`` on, the tokenizer's special tokens
    (:func:`inference_settings`, :func:`publish_special_tokens`)."""
    tokenizer = trainer.processing_class if hasattr(trainer.processing_class, "save_pretrained") else None
    tokens = publish_special_tokens(trainer.model, tokenizer, trainer.trained_with_bos) if tokenizer is not None else contextlib.nullcontext()
    with inference_settings(trainer.model), tokens:
        yield


def save_publishing_files(trainer, output_dir: str) -> None:
    """The files of a published folder beside the weights and config: the tokenizer, the model card and the training
    arguments. One process."""
    tokenizer = trainer.processing_class if hasattr(trainer.processing_class, "save_pretrained") else None
    if tokenizer is not None:
        save_tokenizer(tokenizer, output_dir, context=trainer.context_length(), used_bos=trainer.trained_with_bos)
    write_model_card(trainer, output_dir)
    torch.save(trainer.args, os.path.join(output_dir, "training_args.bin"))


def write_model_card(trainer, output_dir: str) -> None:
    """``<output_dir>/README.md``: the model card (:func:`model_card`) with the trainer's layout, recipe and last
    held-out metrics; ``trainer.card_metadata`` sets its ``license`` and ``datasets``."""
    state, args, config = trainer.parallel_state, trainer.args, trainer.model.config
    layout = args.to_parallel_config(config) if hasattr(args, "to_parallel_config") else None
    parallel = {"pp_size": state.pp_size, "tp_size": state.tp_size, "dp_size": state.dp_size}
    if layout is not None:
        parallel.update(tp_style=layout.tp_style, rmsnorm=layout.rmsnorm, group_linears=layout.group_linears,
                        activation_checkpointing=layout.activation_checkpointing)
    parallel["deepspeed_zero_stage"] = trainer.zero_stage
    global_batch = args.per_device_train_batch_size * state.dp_size * args.gradient_accumulation_steps
    context, steps = trainer.context_length(), trainer.state.global_step
    recipe = {"optimizer steps": steps, "global batch (sequences)": global_batch, "sequence length": context,
              "training tokens": steps * global_batch * context, "peak learning rate": args.learning_rate,
              "schedule": schedule_name(args), "weight decay": args.weight_decay, "gradient clipping": args.max_grad_norm,
              "seed": args.seed, "precision": trainer.precision.describe()}
    evaluations = [log for log in trainer.state.log_history if "eval_perplexity" in log]
    card = model_card(config, seq_len=context, parallel=parallel, recipe=recipe,
                      metrics=evaluations[-1] if evaluations else None, used_bos=trainer.trained_with_bos,
                      repo_hint=args.hub_model_id or os.path.join(args.output_dir, "final"), **trainer.card_metadata)
    with open(os.path.join(output_dir, "README.md"), "w") as f:
        f.write(card)


def schedule_name(args) -> str:
    """The learning-rate schedule training arguments ``args`` follow, as the model card names it."""
    name = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    if getattr(args, "lowrank_optimizer", "adamw") != "loro":
        return name
    if args.loro_schedule == "authors":
        return (f"the LORO authors' cosine_restart (min ratio {args.lr_scheduler_kwargs['min_lr_rate']}, restart every "
                f"{args.loro_exact_every} steps over {args.loro_restart_warmup_steps})")
    return f"{name}, restarted after each LORO exact step (every {args.loro_exact_every} steps, over {args.loro_restart_warmup_steps})"


PUBLISHED_FILES = ("config.json", "generation_config.json", "README.md", "training_args.bin")
"""Files of a training checkpoint that an export copies as they are (with the remote code, the model file's siblings
included, and the tokenizer)."""


def check_export_target(checkpoint: str, output_dir: str, *, overwrite: bool = False) -> None:
    """``ValueError`` naming the fix unless exporting ``checkpoint`` into ``output_dir`` destroys nothing by surprise:
    ``output_dir`` is never the checkpoint, a folder holding it or a folder inside it; an existing ``output_dir`` that is
    not an empty folder (a training run, a checkpoint, an earlier export, anything) is replaced only with
    ``overwrite``, and a file never."""
    source, target = os.path.realpath(checkpoint), os.path.realpath(output_dir)
    if target == source or source.startswith(target + os.sep) or target.startswith(source + os.sep):
        where = ("is the checkpoint itself" if target == source else "holds the checkpoint" if source.startswith(target + os.sep)
                 else "is inside the checkpoint")
        raise ValueError(f"export: the output folder {output_dir!r} {where} ({checkpoint!r}); writing it would replace or "
                         "change its own source. Choose a folder outside the checkpoint and its run, e.g. exports/"
                         f"{os.path.basename(source)}.")
    if not os.path.exists(target):
        return
    if not os.path.isdir(target):
        raise ValueError(f"export: {output_dir!r} exists and is not a folder: choose another output path.")
    entries = sorted(os.listdir(target))
    if not entries or overwrite:
        return
    from ..checkpoint.lock import LOCK_NAME

    run = [name for name in entries if re.match(r"^checkpoint-\d+$", name) or name in (LOCK_NAME, "trainer_state.json")]
    if run:
        what = f"holds a training run ({', '.join(run[:3])}{', ...' if len(run) > 3 else ''}): exporting there would delete it"
    elif os.path.isdir(os.path.join(target, "dcp")):
        what = "is a training checkpoint (it holds dcp/): exporting there would delete it"
    else:
        shown = ", ".join(entries[:3]) + (f", ... ({len(entries)} entries)" if len(entries) > 3 else "")
        what = f"is not empty ({shown}): exporting there would replace it"
    raise ValueError(f"export: the output folder {output_dir!r} {what}. Choose a new or empty folder, or pass --overwrite "
                     "(overwrite=True) to replace it.")


def export_checkpoint(checkpoint: str, output_dir: str, *, max_shard_size: int | str | None = None,
                      overwrite: bool = False) -> str:
    """Write the Hugging Face folder of the training checkpoint ``checkpoint`` into ``output_dir``: its weights as
    transformers' safetensors files of at most ``max_shard_size`` (default 5GB), streamed out of ``dcp/`` file by
    file (:func:`~boost_hf.checkpoint.export.export_weights`; launched on several processes, each writes every
    ``world``-th file), its config, generation config, remote code, tokenizer and model card, and a manifest. The
    checkpoint is verified first (each rank its share of the files). Atomic like a checkpoint: a staging folder,
    the manifest, one rename. An existing ``output_dir`` must be an empty folder, or is replaced with ``overwrite``;
    never the checkpoint or its run (:func:`check_export_target`, on every rank before any collective). Collective
    when ``torch.distributed`` is initialised. Returns ``output_dir``."""
    import torch.distributed as dist

    from ..configuration_boost_llama import BoostLlamaConfig
    from ..checkpoint.export import DEFAULT_MAX_SHARD_SIZE, export_weights
    from ..checkpoint.folders import DCP_FOLDER, atomic_directory, is_distributed_checkpoint, verify_checkpoint_once

    if not is_distributed_checkpoint(checkpoint):
        raise FileNotFoundError(
            f"{checkpoint!r} is not a training checkpoint with its model in {DCP_FOLDER}/ (a checkpoint-<step> folder of a "
            "boost-hf run); a Hugging Face folder needs no export."
        )
    check_export_target(checkpoint, output_dir, overwrite=overwrite)
    config = BoostLlamaConfig.from_pretrained(checkpoint)
    verify_checkpoint_once(checkpoint, config)
    launched = dist.is_available() and dist.is_initialized()
    writer = not launched or dist.get_rank() == 0
    run_id = [uuid.uuid4().hex[:8]]
    if launched:
        dist.broadcast_object_list(run_id, src=0)
    with atomic_directory(output_dir, is_writer=writer, run_id=f"export-{run_id[0]}", config=config) as staging:
        if writer:
            code = sorted(name for name in os.listdir(checkpoint) if name.endswith(".py"))  # the remote code and its siblings
            for name in (*PUBLISHED_FILES, *code):
                if os.path.isfile(os.path.join(checkpoint, name)):
                    shutil.copy2(os.path.join(checkpoint, name), os.path.join(staging, name))
            if os.path.isfile(os.path.join(checkpoint, "tokenizer_config.json")):
                from transformers import AutoTokenizer

                AutoTokenizer.from_pretrained(checkpoint).save_pretrained(staging)
        if launched:
            dist.barrier()
        export_weights(os.path.join(checkpoint, DCP_FOLDER), staging, config, max_shard_size=max_shard_size or DEFAULT_MAX_SHARD_SIZE)
    return output_dir


__all__ = [
    "check_export_target",
    "export_checkpoint",
    "inference_settings",
    "model_card",
    "publish_special_tokens",
    "publishing",
    "save_publishing_files",
    "save_tokenizer",
    "schedule_name",
    "write_model_card",
]
