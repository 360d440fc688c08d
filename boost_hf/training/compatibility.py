"""Settings honoured or refused whatever set them: a flag, a recipe, the accelerate config or the environment.

``accelerate launch`` hands its config to the workers as environment variables, which transformers and accelerate
read on their own: ``ACCELERATE_USE_DEEPSPEED`` (``distributed_type: DEEPSPEED``; transformers then builds a DeepSpeed
plugin without ``--deepspeed``), ``ACCELERATE_USE_FSDP``, ``ACCELERATE_USE_PARALLELISM_CONFIG`` with
``PARALLELISM_CONFIG_*_SIZE``, ``ACCELERATE_USE_CPU``, ``ACCELERATE_MIXED_PRECISION``, ``ACCELERATE_DYNAMO_BACKEND``.
:func:`check_settings` (called by ``BoostTrainingArguments.__post_init__`` on every rank, before the process group
exists) reads each setting as it will take effect, so each refusal holds for every way of making it:

* DeepSpeed (:func:`deepspeed_origin`) with ``pp_size > 1``, ``--zero1_optimizer``, ``--lowrank_optimizer loro``,
  ``--nonfinite skip_step``, or ``ACCELERATE_USE_CPU`` (with which accelerate silently drops DeepSpeed);
* FSDP (``--fsdp`` or ``ACCELERATE_USE_FSDP``) and accelerate's own N-D parallelism (``parallelism_config``):
  boost-hf lays out TP x PP x DP itself;
* ``--zero1_optimizer`` with LORO.

What accelerate's config sets and boost-hf can honour is copied onto the arguments (:func:`settings_from_accelerate`),
so the rest of boost-hf reads one place: ``mixed_precision`` (``--bf16`` / ``--fp16``) and ``dynamo_backend``
(``--torch_compile``: per decoder layer).

To refuse a new combination, add a check here and a row to ``tests/training/test_refusals.py``.
"""

from __future__ import annotations

import os

from ..optim.loro import LORO_WITHOUT_DEEPSPEED
from .zero1 import ZERO1_WITH_DEEPSPEED, ZERO1_WITH_LORO

ACCELERATE_DEEPSPEED = (
    " Here DeepSpeed is on because ACCELERATE_USE_DEEPSPEED=true, which `accelerate launch` sets for a config with "
    "distributed_type: DEEPSPEED (or it is set in the environment): launch with an accelerate config without DeepSpeed "
    "(e.g. accelerate_configs/cpu-4proc.yaml, gpu-8.yaml) or unset it."
)
PARALLELISM_SIZES = ("dp_replicate", "dp_shard", "tp", "cp", "sp")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "false").strip().lower() in ("1", "true", "yes", "on")


def deepspeed_origin(args) -> str | None:
    """What turns DeepSpeed on, as transformers decides it: ``"--deepspeed"`` (the flag, or ``deepspeed:`` in a recipe),
    ``"accelerate"`` (``ACCELERATE_USE_DEEPSPEED``), or ``None``."""
    if args.deepspeed:
        return "--deepspeed"
    return "accelerate" if _env_flag("ACCELERATE_USE_DEEPSPEED") else None


def fsdp_origin(args) -> str | None:
    if args.fsdp:
        return f"--fsdp {args.fsdp}"
    return "ACCELERATE_USE_FSDP=true (an accelerate config with distributed_type: FSDP)" if _env_flag("ACCELERATE_USE_FSDP") else None


def accelerate_parallelism(args) -> dict[str, int]:
    """The sizes above 1 of accelerate's ``ParallelismConfig`` (``parallelism_config=`` or the accelerate config's)."""
    config = getattr(args, "parallelism_config", None)
    if config is not None:
        sizes = {name: getattr(config, f"{name}_size", 1) for name in PARALLELISM_SIZES}
    elif _env_flag("ACCELERATE_USE_PARALLELISM_CONFIG"):
        sizes = {name: int(os.environ.get(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", "1")) for name in PARALLELISM_SIZES}
    else:
        return {}
    return {name: size for name, size in sizes.items() if size > 1}


def _refuse_with_deepspeed(message: str, origin: str) -> None:
    raise ValueError(message + (ACCELERATE_DEEPSPEED if origin == "accelerate" else ""))


def check_settings(args) -> None:
    """Raise ``ValueError`` naming the settings and the fix when ``args`` (with the accelerate environment) combine
    settings boost-hf cannot run together. No collective."""
    deepspeed = deepspeed_origin(args)
    if deepspeed is not None:
        if args.pp_size > 1:
            _refuse_with_deepspeed(
                f"DeepSpeed cannot run with pp_size={args.pp_size}: the pipeline schedule runs each micro-batch's backward "
                "itself, which DeepSpeed's engine must own (DeepSpeed's own pipeline engine refuses ZeRO-2/3 for the same "
                "reason). Drop --deepspeed: boost-hf trains pipelines with DDP over the data-parallel group, and "
                "--zero1_optimizer shards the optimizer state over it (ZeRO-1 with torch's ZeroRedundancyOptimizer).",
                deepspeed,
            )
        if args.zero1_optimizer:
            _refuse_with_deepspeed(ZERO1_WITH_DEEPSPEED, deepspeed)
        if args.lowrank_optimizer == "loro":
            _refuse_with_deepspeed(LORO_WITHOUT_DEEPSPEED, deepspeed)
        if args.nonfinite == "skip_step":
            _refuse_with_deepspeed(
                "--nonfinite skip_step is not supported with DeepSpeed (its engine applies the update inside backward): "
                "use --nonfinite stop.", deepspeed)
        if _env_flag("ACCELERATE_USE_CPU"):
            raise ValueError(
                f"DeepSpeed is requested ({deepspeed}) but ACCELERATE_USE_CPU is set (`accelerate launch --cpu`, or the "
                "environment), with which accelerate drops DeepSpeed silently. Remove it: boost-hf selects the CPU itself "
                "when there is no GPU."
            )
    fsdp = fsdp_origin(args)
    if fsdp is not None:
        raise ValueError(
            f"FSDP ({fsdp}) is not supported: boost-hf shards the model itself (tp_size, pp_size) and its checkpoints "
            "gather those shards, which FSDP's flat parameters would break. To shard the optimizer state over the "
            "data-parallel group use --zero1_optimizer (any layout) or DeepSpeed ZeRO-1/2/3 (pp_size 1; "
            "accelerate_configs/*-zero*.yaml), and launch with an accelerate config without FSDP."
        )
    sizes = accelerate_parallelism(args)
    if sizes:
        given = ", ".join(f"{name}_size={size}" for name, size in sizes.items())
        raise ValueError(
            f"accelerate's parallelism_config ({given}) is accelerate's own N-D parallelism, which boost-hf does not use: "
            "boost-hf lays out TP x PP x DP itself (DP is what is left of the world). Set --tp_size / --pp_size (or "
            "tp_size / pp_size in the recipe) and remove parallelism_config from the accelerate config."
        )
    if args.zero1_optimizer and args.lowrank_optimizer == "loro":
        raise ValueError(ZERO1_WITH_LORO)


def settings_from_accelerate(args) -> None:
    """Copy onto ``args`` what the accelerate config sets and boost-hf honours (flags given explicitly win):
    ``ACCELERATE_MIXED_PRECISION`` -> ``bf16`` / ``fp16``; ``ACCELERATE_DYNAMO_BACKEND`` (and ``_MODE``) ->
    ``torch_compile`` / ``torch_compile_backend`` / ``torch_compile_mode`` (boost-hf compiles each decoder layer)."""
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").strip().lower()
    if not (args.bf16 or args.fp16) and precision in ("bf16", "fp16"):
        setattr(args, precision, True)
    backend = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no").strip().lower()
    if not args.torch_compile and backend not in ("", "no"):
        args.torch_compile = True
        args.torch_compile_backend = args.torch_compile_backend or backend
        mode = os.environ.get("ACCELERATE_DYNAMO_MODE")
        args.torch_compile_mode = args.torch_compile_mode or (mode if mode and mode != "default" else None)


__all__ = ["accelerate_parallelism", "check_settings", "deepspeed_origin", "fsdp_origin", "settings_from_accelerate"]
