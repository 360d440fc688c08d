"""The exactness matrix's factors, read from the settings' own declarations, and each case as ``boost-hf train``'s
arguments.

The declarations: :class:`~boost_hf.parallel.config.ParallelConfig`'s, :class:`~boost_hf.precision_config.PrecisionConfig`'s
and :class:`~boost_hf.data_parallel_config.DataParallelConfig`'s fields, with their ``Literal`` choices (``get_args``)
or booleans; the model options (the parameters of ``BoostLlamaConfig.__init__``, whose choices are the tuples of
:mod:`boost_hf.configuration_boost_llama`: ``BOTTLENECKS``, ``LAX_GATES``, ``LAX_BASES``, ``FACTOR_INITS``); the
training arguments boost-hf adds for data parallelism (``zero1_optimizer``) and DeepSpeed's ZeRO stages
(``ZeroStageEnum``). When a declaration gains a value, its factor gains it. Every declared setting is a factor or is
in :data:`EXCLUDED` with the reason (``test_covering.py`` checks both ways). A value is left out only in
:data:`EXCLUDED_VALUES`, with the reason.

The runs are what ``tests/matrix/test_matrix.py`` compares with one process: 4 processes (every tp x pp x dp of 4,
:data:`WORLD`), a 4-layer d=64 model (4 layers: a pipeline of 4 stages, or 2 ranks of 2 interleaved stages, each
hold a layer), 3 optimizer steps of a global batch of :data:`GLOBAL_BATCH` blocks of 32 tokens.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import fields
from typing import get_args, get_origin, Literal

from boost_hf import configuration_boost_llama as model_declarations
from boost_hf.configuration_boost_llama import BoostLlamaConfig, PRESET_ARCHS
from boost_hf.data_parallel_config import DATA_PARALLEL_BACKENDS, DataParallelConfig
from boost_hf.parallel.config import ParallelConfig
from boost_hf.parallel.settings import TRAINING_NAMES
from boost_hf.precision_config import PrecisionConfig
from boost_hf.option_fields import field_types

from .covering import INACTIVE, Constraint, Factor

WORLD = 4
GLOBAL_BATCH = 8  # blocks per optimizer step: divisible by every dp x accumulation of the matrix
ACCUMULATION = (1, 2)  # gradient_accumulation_steps (an int): none, and the least that accumulates
HSDP_REPLICAS = 2  # dp_replicate_size of HSDP (an int): the least that replicates
KV_HEADS = (4, 2)  # num_key_value_heads of the 4-head model: no GQA, and GQA (2 heads per key/value head)

try:  # DeepSpeed's ZeRO stages, as DeepSpeed declares them (the [train] extra installs it)
    from deepspeed.runtime.zero.config import ZeroStageEnum

    DEEPSPEED_STAGES: tuple[int, ...] = tuple(int(stage) for stage in ZeroStageEnum)
except ImportError:  # pragma: no cover - without DeepSpeed its stages are no factor
    DEEPSPEED_STAGES = ()


def _choices(kind) -> tuple:
    """A declared type's values: a ``Literal``'s choices (and ``None`` for an ``Optional`` one), or ``(False, True)``."""
    if kind is bool:
        return (False, True)
    args = [kind] if get_origin(kind) is Literal else list(get_args(kind))
    for arg in args:
        if get_origin(arg) is Literal:
            return get_args(arg) + ((None,) if type(None) in args else ())
    raise TypeError(f"{kind} declares no choices")


def _field_choices(config_class, name: str) -> tuple:
    """The values of field ``name`` of ``config_class`` that the matrix takes: its declared choices but
    :data:`EXCLUDED_VALUES`."""
    return tuple(v for v in _choices(field_types(config_class)[name]) if (name, v) not in EXCLUDED_VALUES)


def layouts(world: int = WORLD) -> tuple[str, ...]:
    """Every ``tp x pp x dp`` of ``world`` processes, as ``"tp2-pp1-dp2"``."""
    return tuple(f"tp{tp}-pp{pp}-dp{world // (tp * pp)}" for tp, pp in itertools.product(range(1, world + 1), repeat=2)
                 if world % (tp * pp) == 0)


def sizes(layout: str) -> dict[str, int]:
    return {part[:2]: int(part[2:]) for part in layout.split("-")}


def dp_backends() -> tuple[str, ...]:
    """Every way the DP ranks hold the model: each ``DataParallelConfig.data_parallel``, ZeRO-1 (``--zero1_optimizer``)
    under ``ddp``, HSDP (``--dp_replicate_size``) under ``fsdp2``, and DeepSpeed at each ZeRO stage."""
    backends = []
    for name in DATA_PARALLEL_BACKENDS:
        backends.append(name)
        if name == "ddp":
            backends.append("zero1")
        if name == "fsdp2":
            backends.append("hsdp")
    backends += [f"deepspeed-zero{stage}" for stage in DEEPSPEED_STAGES]
    return tuple(b for b in backends if ("dp_backend", b) not in EXCLUDED_VALUES)


FULLY_SHARDED = ("fsdp2", "hsdp")


EXCLUDED_VALUES: dict[tuple[str, object], str] = {
    ("rmsnorm", "local"): "approximate by its declaration: a group norm over each rank's d/p shard, another model at "
                          "each tp_size, so it has no one-process run to equal",
    ("precision_policy", None): "unset: resolves to fp32 without --bf16 and to bf16_params with it, both values of the factor",
    ("grad_reduce_dtype", None): "unset: fp32, a value of the factor",
    ("dp_backend", "deepspeed-zero0"): "ZeRO disabled: DeepSpeed's engine as plain data parallelism, which boost-hf does "
                                       "not offer (its DeepSpeed modes are ZeRO 1/2/3, docs/training.md)",
}


def _low_rank_with_latent_activation(v: dict) -> bool:
    return v["bottleneck"] == "cola" or (v["bottleneck"] == "lax" and v["lax_base"] == "cola")


def _boost_hf_bf16_params(v: dict) -> bool:
    """bf16 parameters under boost-hf's own precision settings: under DeepSpeed its config sets them, and
    ``boost-hf train`` refuses ``--grad_reduce_dtype`` / ``--fp32_residual`` there."""
    return v["precision_policy"] == "bf16_params" and deepspeed_stage(v) is None


def _default(config_class, name: str):
    return config_class.__dataclass_fields__[name].default


FACTORS: list[Factor] = [
    Factor("layout", layouts(), default=f"tp1-pp1-dp{WORLD}"),
    Factor("bottleneck", model_declarations.BOTTLENECKS, default="cola"),
    Factor("tp_style", _field_choices(ParallelConfig, "tp_style"), ("layout", "bottleneck"),
           lambda v: not (v["bottleneck"] is None and sizes(v["layout"])["tp"] == 1), _default(ParallelConfig, "tp_style"),
           "the full-rank model at tp_size 1 always runs megatron (ParallelConfig's help)"),
    Factor("rmsnorm", _field_choices(ParallelConfig, "rmsnorm"), ("tp_style",), lambda v: v["tp_style"] == "btp",
           _default(ParallelConfig, "rmsnorm"), "BTP's norms (its help): the other styles have none to choose"),
    Factor("group_linears", _field_choices(ParallelConfig, "group_linears"), default=_default(ParallelConfig, "group_linears")),
    Factor("activation_checkpointing", _field_choices(ParallelConfig, "activation_checkpointing"),
           default=_default(ParallelConfig, "activation_checkpointing")),
    Factor("sequence_parallel", _field_choices(ParallelConfig, "sequence_parallel"), ("layout",),
           lambda v: sizes(v["layout"])["tp"] > 1, False, "a no-op at tp_size 1 (its help): no TP ranks to split over"),
    Factor("pp_schedule", _field_choices(ParallelConfig, "pp_schedule"), ("layout",), lambda v: sizes(v["layout"])["pp"] > 1,
           _default(ParallelConfig, "pp_schedule"), "no pipeline to schedule at pp_size 1"),
    Factor("dp_backend", dp_backends(), ("layout",), lambda v: sizes(v["layout"])["dp"] > 1, "ddp",
           "no data-parallel ranks to hold the model at dp 1"),
    Factor("fsdp_reshard_after_forward", _field_choices(DataParallelConfig, "fsdp_reshard_after_forward"), ("dp_backend",),
           lambda v: v["dp_backend"] in FULLY_SHARDED, _default(DataParallelConfig, "fsdp_reshard_after_forward"),
           "FSDP2's (its help): nothing is resharded without it"),
    Factor("fsdp_units", _field_choices(DataParallelConfig, "fsdp_units"), ("dp_backend",), lambda v: v["dp_backend"] in FULLY_SHARDED,
           _default(DataParallelConfig, "fsdp_units"), "FSDP2's (its help): no units without it"),
    Factor("precision_policy", _field_choices(PrecisionConfig, "precision_policy"), default="fp32"),
    Factor("grad_reduce_dtype", _field_choices(PrecisionConfig, "grad_reduce_dtype"), ("precision_policy", "dp_backend"),
           _boost_hf_bf16_params, "fp32", "bf16_params' own (its help): the other policies reduce in fp32, and under "
           "DeepSpeed its engine does (its config's communication_data_type, deepspeed_config)"),
    Factor("fp32_residual", _field_choices(PrecisionConfig, "fp32_residual"), ("precision_policy", "dp_backend"),
           _boost_hf_bf16_params, False, "bf16_params' own (its help): the other policies keep an fp32 residual stream, "
           "and DeepSpeed's engine owns the precision (its config)"),
    Factor("gradient_accumulation_steps", ACCUMULATION, default=1),
    Factor("tie_word_embeddings", (False, True), default=False),
    Factor("attention_bias", (False, True), default=False),
    Factor("mlp_bias", (False, True), default=False),
    Factor("num_key_value_heads", KV_HEADS, default=KV_HEADS[0]),
    Factor("lax_gate", model_declarations.LAX_GATES, ("bottleneck",), lambda v: v["bottleneck"] == "lax", "kronecker",
           "LaX's (its docstring)"),
    Factor("lax_latent_norm", (False, True), ("bottleneck",), lambda v: v["bottleneck"] == "lax", True, "LaX's"),
    Factor("lax_base", model_declarations.LAX_BASES, ("bottleneck",), lambda v: v["bottleneck"] == "lax", "cola", "LaX's"),
    Factor("only_lr_act", (False, True), ("bottleneck", "lax_base"), _low_rank_with_latent_activation, True,
           "CoLA's (cola, or lax on a cola base): only a latent activation can replace the SwiGLU one"),
    Factor("factor_init", model_declarations.FACTOR_INITS, ("bottleneck",), lambda v: v["bottleneck"] in ("svd", "cola", "lax"),
           "cola", "how the A and B factors are drawn: full rank has none, the tensor train draws its cores"),
]
FACTOR_NAMES = [f.name for f in FACTORS]

CONSTRAINTS = [
    Constraint(("dp_backend", "layout"), lambda v: v["dp_backend"] != "hsdp" or sizes(v["layout"])["dp"] % HSDP_REPLICAS == 0,
               f"HSDP's {HSDP_REPLICAS} replicas need a data-parallel size they divide"),
]

#: TP style x sequence parallelism x DP backend: every triple (where bugs sat this round: FSDP2 x LaX x btp + SP)
TRIPLES = (("tp_style", "sequence_parallel", "dp_backend"),)

#: the declared settings each factor stands for ("<declaration>.<field>")
FACTOR_OF: dict[str, str] = {
    "ParallelConfig.tp_size": "layout", "ParallelConfig.pp_size": "layout", "ParallelConfig.tp_style": "tp_style",
    "ParallelConfig.rmsnorm": "rmsnorm", "ParallelConfig.group_linears": "group_linears",
    "ParallelConfig.activation_checkpointing": "activation_checkpointing",
    "ParallelConfig.sequence_parallel": "sequence_parallel", "ParallelConfig.pp_schedule": "pp_schedule",
    "PrecisionConfig.precision_policy": "precision_policy", "PrecisionConfig.grad_reduce_dtype": "grad_reduce_dtype",
    "PrecisionConfig.fp32_residual": "fp32_residual",
    "DataParallelConfig.data_parallel": "dp_backend", "DataParallelConfig.dp_replicate_size": "dp_backend",
    "DataParallelConfig.fsdp_reshard_after_forward": "fsdp_reshard_after_forward",
    "DataParallelConfig.fsdp_units": "fsdp_units",
    "BoostTrainingArguments.zero1_optimizer": "dp_backend",
    "BoostLlamaConfig.bottleneck": "bottleneck", "BoostLlamaConfig.tie_word_embeddings": "tie_word_embeddings",
    "BoostLlamaConfig.attention_bias": "attention_bias", "BoostLlamaConfig.mlp_bias": "mlp_bias",
    "BoostLlamaConfig.num_key_value_heads": "num_key_value_heads", "BoostLlamaConfig.lax_gate": "lax_gate",
    "BoostLlamaConfig.lax_latent_norm": "lax_latent_norm", "BoostLlamaConfig.lax_base": "lax_base",
    "BoostLlamaConfig.only_lr_act": "only_lr_act", "BoostLlamaConfig.factor_init": "factor_init",
}

_SHAPE = "a size of the tiny model (4 layers, d=64, d_ff=128, 4 heads, rank 16, vocab 512, 64 positions), fixed so "
_SHAPE += "that the one-process runs are few; the layouts' divisibility checks are unit-tested (tests/parallel)"
#: declared settings that are no factor, and why
EXCLUDED: dict[str, str] = {
    "ParallelConfig.pp_microbatches": "a count: the schedule's default (its stage count) splits each replica's batch; "
                                      "other counts are the pipeline suite's (tests/parallel/test_pipeline.py)",
    "ParallelConfig.pp_stages_per_rank": "a count: the schedule's default (2 for the interleaved ones)",
    "ParallelConfig.pp_layer_split": "a list of layer counts: the even split; uneven splits are the pipeline suite's",
    **{f"BoostLlamaConfig.{name}": _SHAPE for name in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "head_dim",
        "max_position_embeddings", "rank", "lax_kronecker_factor", "tt_rank", "tt_cores", "tt_rank_ratio",
        "tt_leading_mode_multiple")},
    "BoostLlamaConfig.hidden_act": "an element-wise activation (any ACT2FN name), applied where the tensors are whole "
                                   "or split element by element in every layout: silu",
    "BoostLlamaConfig.lr_act": "as hidden_act, on the latents: silu",
    "BoostLlamaConfig.initializer_range": "a number of the initialisation, drawn the same in every layout",
    "BoostLlamaConfig.rms_norm_eps": "a number inside the norms",
    "BoostLlamaConfig.rope_theta": "a number of the rotary tables, the same on every rank",
    "BoostLlamaConfig.rope_parameters": "the rotary tables' settings, the same on every rank",
    "BoostLlamaConfig.attention_dropout": "dropout draws random masks that no other layout draws alike; 0 in pre-training",
    "BoostLlamaConfig.use_cache": "generation only; the matrix trains",
    **{f"BoostLlamaConfig.{name}": "the tokenizer's special token ids, the same in every run" for name in (
        "pad_token_id", "bos_token_id", "eos_token_id")},
    "BoostLlamaConfig.lax_version": "only the current LaX definition is accepted",
}


def declared_settings() -> set[str]:
    """Every declared setting the matrix must account for, ``"<declaration>.<field>"``."""
    declared = {f"{cls.__name__}.{f.name}" for cls in (ParallelConfig, PrecisionConfig, DataParallelConfig) for f in fields(cls)}
    declared |= {f"BoostLlamaConfig.{name}" for name, p in inspect.signature(BoostLlamaConfig.__init__).parameters.items()
                 if name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD}
    declared.add("BoostTrainingArguments.zero1_optimizer")
    return declared


def declared_values(setting: str) -> tuple:
    """The values a declared setting offers, as the factor reads them (``()`` for those of no factor)."""
    declaration, name = setting.split(".")
    classes = {"ParallelConfig": ParallelConfig, "PrecisionConfig": PrecisionConfig, "DataParallelConfig": DataParallelConfig}
    if declaration in classes:
        try:
            return _choices(field_types(classes[declaration])[name])
        except TypeError:
            return ()
    return {"bottleneck": model_declarations.BOTTLENECKS, "lax_gate": model_declarations.LAX_GATES,
            "lax_base": model_declarations.LAX_BASES, "factor_init": model_declarations.FACTOR_INITS,
            **{flag: (False, True) for flag in model_declarations.BOOL_FIELDS}}.get(name, ())


# ---------------------------------------------------------------------- a case as `boost-hf train`'s arguments
TINY_MODEL = ["--hidden_size", "64", "--intermediate_size", "128", "--num_hidden_layers", "4", "--num_attention_heads", "4",
              "--max_position_embeddings", "64"]
RUN = ["--tokenizer", "bpe-512", "--block_size", "32", "--max_train_blocks", "64", "--max_eval_blocks", "4",
       "--max_steps", "3", "--learning_rate", "1e-2", "--logging_steps", "1", "--eval_strategy", "no", "--save_strategy", "no",
       "--sample_max_new_tokens", "0", "--disable_tqdm", "true", "--report_to", "none", "--per_device_eval_batch_size", "4",
       "--seed", "0", "--ddp_timeout", "120",
       # AdamW's epsilon 1 (test_matrix.py's parameter bound): its update m / (sqrt(v) + eps) then moves by at most
       # |dg| / eps when a gradient moves by dg; with 1e-8 an element whose gradient is near zero turns the fp32 rounding
       # of another summation order into an update of the size of the learning rate
       "--adam_epsilon", "1"]
_BOOL = {False: "false", True: "true"}
SAMPLE_TOKENS = 4  # a trained case's end-of-training sample (its reference takes none)


def _flag(name: str, value) -> list[str]:
    return [f"--{name}", _BOOL[value] if isinstance(value, bool) else str(value)]


def model_arguments(case: dict) -> list[str]:
    """The model of ``case``: its bottleneck's preset (``PRESET_ARCHS``) at the tiny size, and its model options."""
    arch = next(name for name, bottleneck in PRESET_ARCHS.items() if bottleneck == case["bottleneck"])
    argv = ["--preset", f"{arch}-130m", *TINY_MODEL]
    if case["bottleneck"] == "tt":  # 4 cores as the BOOST release; leading modes that TP 2 and 4 split
        argv += ["--tt_rank", "16", "--tt_cores", "4", "--tt_leading_mode_multiple", "4"]
    elif case["bottleneck"] is not None:
        argv += ["--rank", "16"]
    for name in ("tie_word_embeddings", "attention_bias", "mlp_bias", "num_key_value_heads", "lax_gate", "lax_latent_norm",
                 "lax_base", "only_lr_act", "factor_init"):
        if case[name] != INACTIVE:
            argv += _flag(name, case[name])
    return argv


def precision_arguments(case: dict) -> list[str]:
    policy = case["precision_policy"]
    argv = _flag("precision_policy", policy) + (["--bf16", "true"] if policy != "fp32" else [])
    for name in ("grad_reduce_dtype", "fp32_residual"):
        if case[name] != INACTIVE:
            argv += _flag(name, case[name])
    return argv


def reference_key(case: dict) -> tuple:
    """What the one-process run of ``case`` depends on: its model, precision and accumulation."""
    return tuple(model_arguments(case) + precision_arguments(case) + _flag("gradient_accumulation_steps",
                                                                             case["gradient_accumulation_steps"]))


def deepspeed_stage(case: dict) -> int | None:
    backend = case["dp_backend"]
    return int(backend.removeprefix("deepspeed-zero")) if str(backend).startswith("deepspeed-zero") else None


def deepspeed_config(stage: int) -> dict:
    """The DeepSpeed config of a ZeRO ``stage`` case: batch, accumulation and clipping from the training arguments;
    bf16 when ``--bf16`` asks (gradients accumulated and reduced in fp32, as ``bf16_params``'s default)."""
    return {"zero_optimization": {"stage": stage}, "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
            "data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp32"}


def training_arguments(case: dict) -> list[str]:
    """``boost-hf train``'s arguments of ``case`` (without the data set and the output folder; a DeepSpeed case also
    needs ``--deepspeed`` with the file of :func:`deepspeed_config`)."""
    tp, pp, dp = (sizes(case["layout"])[k] for k in ("tp", "pp", "dp"))
    accumulation = case["gradient_accumulation_steps"]
    argv = model_arguments(case) + precision_arguments(case) + RUN
    argv += ["--tp_size", str(tp), "--pp_size", str(pp), "--per_device_train_batch_size", str(GLOBAL_BATCH // (dp * accumulation)),
             "--gradient_accumulation_steps", str(accumulation)]
    for name in ("tp_style", "rmsnorm", "group_linears", "activation_checkpointing", "sequence_parallel", "pp_schedule"):
        if case[name] != INACTIVE:
            argv += _flag(TRAINING_NAMES.get(name, name), case[name])
    if case["sequence_parallel"] is not True:  # a sample after training, as `boost-hf train` takes one (SP refuses it)
        argv += ["--sample_max_new_tokens", str(SAMPLE_TOKENS)]
    backend = case["dp_backend"]
    if backend == "zero1":
        argv += ["--zero1_optimizer", "true"]
    elif backend in FULLY_SHARDED:
        argv += ["--data_parallel", "fsdp2"] + (["--dp_replicate_size", str(HSDP_REPLICAS)] if backend == "hsdp" else [])
        argv += _flag("fsdp_reshard_after_forward", case["fsdp_reshard_after_forward"]) + _flag("fsdp_units", case["fsdp_units"])
    elif backend != INACTIVE and deepspeed_stage(case) is None:
        argv += _flag("data_parallel", backend)
    return argv


def reference_arguments(case: dict) -> list[str]:
    """The one-process run ``case`` is compared with: its model, precision and accumulation, the global batch in one
    process, every layout setting at its default."""
    accumulation = case["gradient_accumulation_steps"]
    return model_arguments(case) + precision_arguments(case) + RUN + [
        "--tp_size", "1", "--per_device_train_batch_size", str(GLOBAL_BATCH // accumulation),
        "--gradient_accumulation_steps", str(accumulation)]


_SHORT = {"group_linears": {False: "ungrouped"}, "sequence_parallel": {True: "sp"}, "fp32_residual": {True: "fp32res"},
          "tie_word_embeddings": {True: "tied"}, "attention_bias": {True: "attnbias"}, "mlp_bias": {True: "mlpbias"},
          "lax_latent_norm": {False: "nolatentnorm"}, "only_lr_act": {False: "swiglu"}, "gradient_accumulation_steps": {2: "acc2"},
          "num_key_value_heads": {2: "gqa"}, "activation_checkpointing": {"full": "ckpt-full", "lowrank": "ckpt-lowrank"}}


def case_name(index: int, case: dict) -> str:
    """``c07-tp2-pp1-dp2-cola-vanilla-sp-fsdp2-...``: the index, the layout, the bottleneck and each value that is not
    its factor's default."""
    parts = [f"c{index:03d}", case["layout"], "full" if case["bottleneck"] is None else case["bottleneck"]]
    for f in FACTORS[2:]:
        value = case[f.name]
        if value != INACTIVE and value != f.preferred:
            parts.append(_SHORT.get(f.name, {}).get(value, str(value)))
    return "-".join(parts)


__all__ = ["CONSTRAINTS", "DEEPSPEED_STAGES", "EXCLUDED", "EXCLUDED_VALUES", "FACTORS", "FACTOR_NAMES", "FACTOR_OF", "GLOBAL_BATCH",
           "TRIPLES", "WORLD", "case_name", "declared_settings", "declared_values", "deepspeed_config", "deepspeed_stage",
           "dp_backends", "layouts", "model_arguments", "reference_arguments", "reference_key", "sizes", "training_arguments"]
