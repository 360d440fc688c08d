"""Settings honoured or refused whatever set them: a flag, a recipe, the accelerate config or the environment.

``accelerate launch`` hands its config to the workers as environment variables, which transformers and accelerate
read on their own: ``ACCELERATE_USE_DEEPSPEED`` (``distributed_type: DEEPSPEED``; transformers then builds a DeepSpeed
plugin without ``--deepspeed``), ``ACCELERATE_USE_FSDP``, ``ACCELERATE_USE_PARALLELISM_CONFIG`` with
``PARALLELISM_CONFIG_*_SIZE``, ``ACCELERATE_USE_CPU``, ``ACCELERATE_MIXED_PRECISION``, ``ACCELERATE_DYNAMO_BACKEND``.
:func:`check_settings` (called by ``BoostTrainingArguments.__post_init__`` on every rank, before the process group
exists) reads each setting as it will take effect, so each refusal holds for every way of making it:

* DeepSpeed (:func:`deepspeed_origin`) with ``pp_size > 1``, ``--zero1_optimizer``, ``--lowrank_optimizer loro``,
  ``--nonfinite skip_step``, or ``ACCELERATE_USE_CPU`` (with which accelerate silently drops DeepSpeed);
* FSDP (``--fsdp`` or ``ACCELERATE_USE_FSDP``): boost-hf lays out TP x PP x DP itself;
* ``--zero1_optimizer`` with LORO.

What accelerate's config sets and boost-hf can honour is copied onto the arguments (:func:`settings_from_accelerate`),
so the rest of boost-hf reads one place: ``mixed_precision`` (``--bf16`` / ``--fp16``), ``dynamo_backend``
(``--torch_compile``: per decoder layer) and ``parallelism_config`` (:func:`layout_from_parallelism_config`):

* ``tp_size`` -> ``--tp_size`` (boost-hf's own TP layouts, not accelerate's); ``dp_replicate_size`` -> the data
  parallelism, checked to be ``world / (tp_size x pp_size)`` (boost-hf's DP is what is left of the world);
* ``dp_shard_size`` (FSDP), ``cp_size`` (context parallelism), ``sp_size`` (DeepSpeed's Ulysses) are refused, each
  naming boost-hf's nearest setting;
* one layout, two ways of writing it: a size set by both ``parallelism_config`` and a flag or the recipe must agree
  (else refused, naming both), a flag or recipe value of 1 included: ``--tp_size`` is unset (``None``) unless given.
  On accelerate's side a size of 1 sets nothing (accelerate's default, which ``accelerate launch`` always writes).

accelerate itself then never sees ``parallelism_config``: the trainer creates its ``Accelerator`` without it
(:func:`accelerator_without_parallelism_config`), or accelerate would build its own device mesh and TP on top.

To refuse a new combination, add a check here and a row to ``tests/training/test_refusals.py``.
"""

from __future__ import annotations

import contextlib
import logging
import os

from ..optim.loro import LORO_WITHOUT_DEEPSPEED
from .zero1 import ZERO1_WITH_DEEPSPEED, ZERO1_WITH_LORO

ACCELERATE_DEEPSPEED = (
    " Here DeepSpeed is on because ACCELERATE_USE_DEEPSPEED=true, which `accelerate launch` sets for a config with "
    "distributed_type: DEEPSPEED (or it is set in the environment): launch with an accelerate config without DeepSpeed "
    "(e.g. accelerate_configs/cpu-4proc.yaml, gpu-8.yaml) or unset it."
)
PARALLELISM_SIZES = ("dp_replicate", "dp_shard", "tp", "cp", "sp")
SHARD_OPTIMIZER_STATE = (
    "To shard the optimizer state over the data-parallel group use --zero1_optimizer (any layout) or DeepSpeed "
    "ZeRO-1/2/3 (pp_size 1; accelerate_configs/*-zero*.yaml)"
)

logger = logging.getLogger(__name__)


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


def accelerate_parallelism(args) -> tuple[str, dict[str, int]] | None:
    """accelerate's ``ParallelismConfig`` as it would take effect: ``(where it comes from, its sizes above 1)``, or
    ``None`` without one. The ``parallelism_config=`` training argument wins over the accelerate config's (which
    ``accelerate launch`` passes as ``ACCELERATE_USE_PARALLELISM_CONFIG`` and ``PARALLELISM_CONFIG_<NAME>_SIZE``), as in
    accelerate."""
    config = getattr(args, "parallelism_config", None)
    if config is not None:
        origin = "parallelism_config (the training argument)"
        sizes = {name: getattr(config, f"{name}_size", None) or 1 for name in PARALLELISM_SIZES}
    elif _env_flag("ACCELERATE_USE_PARALLELISM_CONFIG"):
        origin = "the accelerate config's parallelism_config (ACCELERATE_USE_PARALLELISM_CONFIG, PARALLELISM_CONFIG_*_SIZE)"
        sizes = {name: int(os.environ.get(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", "1")) for name in PARALLELISM_SIZES}
    else:
        return None
    return origin, {name: size for name, size in sizes.items() if size > 1}


def unsupported_parallelism(sizes: dict[str, int], origin: str) -> str | None:
    """The refusal of the first size of accelerate's ``ParallelismConfig`` that boost-hf has no equivalent of (``sizes``
    as :func:`accelerate_parallelism` gives them), naming the boost-hf setting to use; ``None`` when all map."""
    if sizes.get("dp_shard", 1) > 1:
        return (
            f"{origin} sets dp_shard_size={sizes['dp_shard']}: accelerate would shard the model over those ranks with FSDP, "
            "which boost-hf does not support: boost-hf shards the model itself (tp_size, pp_size) and its checkpoints "
            f"gather those shards. {SHARD_OPTIMIZER_STATE}; for plain data parallelism leave dp_shard_size out (the data "
            "parallelism is what is left of the world, or dp_replicate_size)."
        )
    if sizes.get("cp", 1) > 1:
        return (
            f"{origin} sets cp_size={sizes['cp']}: context parallelism (each rank attends over its part of the sequence) "
            "is not supported by boost-hf. The nearest is --sequence_parallel with --tp_size > 1, which is not the same: "
            "it splits the tokens of the norms and the residual stream (BTP: the latents) over the TP ranks, while each "
            "rank still attends over the whole sequence. Remove cp_size from parallelism_config."
        )
    if sizes.get("sp", 1) > 1:
        return (
            f"{origin} sets sp_size={sizes['sp']}: accelerate's sequence parallelism (DeepSpeed's ALST/Ulysses, attention "
            "heads exchanged all-to-all over sp_size extra ranks) is not supported by boost-hf. The nearest is "
            "--sequence_parallel with --tp_size > 1, which is not the same: it splits the tokens of the norms and the "
            "residual stream (BTP: the latents) over the TP ranks. Remove sp_size from parallelism_config."
        )
    return None


def layout_from_parallelism_config(args) -> None:
    """Honour accelerate's ``parallelism_config`` on ``args`` (no collective; every rank reads the same arguments and
    environment): its ``tp_size`` becomes ``args.tp_size`` (``None``: not given; 1 without either), its
    ``dp_replicate_size`` must equal ``WORLD_SIZE / (tp_size
    x pp_size)``; ``ValueError`` naming the fix for what does not map (:func:`unsupported_parallelism`) and for a size
    that a flag or the recipe sets otherwise. ``args.parallelism_config`` is then ``None``: accelerate must not apply it."""
    found = accelerate_parallelism(args)
    if found is None:
        args.tp_size = 1 if args.tp_size is None else args.tp_size
        return
    origin, sizes = found
    refusal = unsupported_parallelism(sizes, origin)
    if refusal is not None:
        raise ValueError(refusal)
    tp = sizes.get("tp")
    if tp is not None and args.tp_size not in (None, tp):
        raise ValueError(
            f"{origin} sets tp_size={tp} but the flag or the recipe sets tp_size={args.tp_size} (--tp_size, tp_size: in "
            "the recipe): one layout, written twice, differently. Set one of them (or both to the same value)."
        )
    args.tp_size = args.tp_size if args.tp_size is not None else tp or 1
    dp = sizes.get("dp_replicate", 1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if dp > 1 and dp * args.tp_size * args.pp_size != world:
        raise ValueError(
            f"{origin} sets dp_replicate_size={dp}, which with tp_size={args.tp_size} x pp_size={args.pp_size} needs "
            f"{dp * args.tp_size * args.pp_size} processes, but {world} are launched (WORLD_SIZE): boost-hf's data "
            "parallelism is what is left of the world, world / (tp_size x pp_size). Launch that many processes, or "
            "remove dp_replicate_size from parallelism_config."
        )
    if sizes:
        logger.info("%s honoured: tp_size=%d%s", origin, args.tp_size, f", dp={dp}" if dp > 1 else "")
    args.parallelism_config = None


@contextlib.contextmanager
def accelerator_without_parallelism_config():
    """While the ``Accelerator`` is created: without ``ACCELERATE_USE_PARALLELISM_CONFIG``, from which accelerate would
    build its own ``ParallelismConfig`` (a device mesh, its own TP) after :func:`layout_from_parallelism_config` has
    put what it honours onto the arguments."""
    saved = os.environ.pop("ACCELERATE_USE_PARALLELISM_CONFIG", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] = saved


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
            f"gather those shards, which FSDP's flat parameters would break. {SHARD_OPTIMIZER_STATE}, and launch with an "
            "accelerate config without FSDP."
        )
    if args.zero1_optimizer and args.lowrank_optimizer == "loro":
        raise ValueError(ZERO1_WITH_LORO)


def settings_from_accelerate(args) -> None:
    """Copy onto ``args`` what the accelerate config sets and boost-hf honours (flags given explicitly win):
    ``ACCELERATE_MIXED_PRECISION`` -> ``bf16`` / ``fp16``; ``ACCELERATE_DYNAMO_BACKEND`` (and ``_MODE``) ->
    ``torch_compile`` / ``torch_compile_backend`` / ``torch_compile_mode`` (boost-hf compiles each decoder layer);
    ``parallelism_config`` -> ``tp_size`` (:func:`layout_from_parallelism_config`: a conflict is refused)."""
    layout_from_parallelism_config(args)
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").strip().lower()
    if not (args.bf16 or args.fp16) and precision in ("bf16", "fp16"):
        setattr(args, precision, True)
    backend = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no").strip().lower()
    if not args.torch_compile and backend not in ("", "no"):
        args.torch_compile = True
        args.torch_compile_backend = args.torch_compile_backend or backend
        mode = os.environ.get("ACCELERATE_DYNAMO_MODE")
        args.torch_compile_mode = args.torch_compile_mode or (mode if mode and mode != "default" else None)


__all__ = [
    "accelerate_parallelism",
    "accelerator_without_parallelism_config",
    "check_settings",
    "deepspeed_origin",
    "fsdp_origin",
    "layout_from_parallelism_config",
    "settings_from_accelerate",
    "unsupported_parallelism",
]
