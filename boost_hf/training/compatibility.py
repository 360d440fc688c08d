"""Settings honoured or refused whatever set them: a flag, a recipe, the accelerate config or the environment.

``accelerate launch`` hands its config to the workers as environment variables, which transformers and accelerate
read on their own: ``ACCELERATE_USE_DEEPSPEED`` (``distributed_type: DEEPSPEED``; transformers then builds a DeepSpeed
plugin without ``--deepspeed``), ``ACCELERATE_USE_FSDP``, ``ACCELERATE_USE_PARALLELISM_CONFIG`` with
``PARALLELISM_CONFIG_*_SIZE``, ``ACCELERATE_USE_CPU``, ``ACCELERATE_MIXED_PRECISION``, ``ACCELERATE_DYNAMO_BACKEND``.
:func:`check_settings` (called by ``BoostTrainingArguments.__post_init__`` on every rank, before the process group
exists) reads each setting as it will take effect, so each refusal holds for every way of making it:

* DeepSpeed (:func:`deepspeed_origin`) with ``pp_size > 1``, ``--zero1_optimizer``, ``--lowrank_optimizer loro``,
  ``--nonfinite skip_step``, ``--data_parallel fsdp2``, or ``ACCELERATE_USE_CPU`` (with which accelerate silently
  drops DeepSpeed);
* FSDP2 (``--data_parallel fsdp2``, however asked for) with ``--zero1_optimizer`` or ``--lowrank_optimizer loro``; FSDP
  version 1; the FSDP settings boost-hf does not apply (:func:`fully_shard_from_fsdp_settings`);
* ``--zero1_optimizer`` with LORO.

What accelerate's config sets and boost-hf can honour is copied onto the arguments (:func:`settings_from_accelerate`),
so the rest of boost-hf reads one place: ``mixed_precision`` (``--bf16`` / ``--fp16``), ``dynamo_backend``
(``--torch_compile``: per decoder layer), ``parallelism_config`` (:func:`layout_from_parallelism_config`) and FSDP
(:func:`fully_shard_from_fsdp_settings`):

* ``tp_size`` -> ``--tp_size`` (boost-hf's own TP layouts, not accelerate's); ``dp_replicate_size`` -> the data
  parallelism, checked to be ``world / (tp_size x pp_size)`` (boost-hf's DP is what is left of the world);
  ``dp_shard_size`` -> ``--data_parallel fsdp2`` over that many ranks (with ``dp_replicate_size``: HSDP,
  ``--dp_replicate_size``), ``dp_replicate_size x dp_shard_size`` checked to be the data parallelism;
* ``cp_size`` (context parallelism), ``sp_size`` (DeepSpeed's Ulysses) are refused, each naming boost-hf's nearest
  setting;
* FSDP, from an accelerate config (``distributed_type: FSDP``: ``ACCELERATE_USE_FSDP`` and ``FSDP_*``) or from
  transformers' ``--fsdp`` / ``--fsdp_config``, parsed by accelerate's own ``FullyShardedDataParallelPlugin``: version 2
  -> ``--data_parallel fsdp2``, its ``reshard_after_forward`` -> ``--fsdp_reshard_after_forward always|never``, its
  auto-wrap policy -> ``--fsdp_units`` (``TRANSFORMER_BASED_WRAP``: each decoder layer; ``NO_WRAP``: the whole model),
  its ``activation_checkpointing`` -> ``--activation_checkpointing_mode full``; ``cpu_ram_efficient_loading`` holds
  always (each rank reads only its own slices of ``--init_from``: :func:`without_accelerate_parallelism` hides the
  variables from transformers' loading as well); ``state_dict_type`` either way (boost-hf's checkpoints are
  per-rank shards, its ``final/`` the whole model); version 1 and the settings boost-hf does not apply (CPU offload,
  size-based wrapping, other layer classes, its own mixed-precision policy, ignored modules) are refused naming the
  fix;
* one layout, two ways of writing it: a size set by both ``parallelism_config`` and a flag or the recipe must agree
  (else refused, naming both), a flag or recipe value of 1 included: ``--tp_size`` is unset (``None``) unless given.
  On accelerate's side a size of 1 sets nothing (accelerate's default, which ``accelerate launch`` always writes).

accelerate itself then never applies ``parallelism_config`` or FSDP: the trainer creates its ``Accelerator`` without
them (:func:`without_accelerate_parallelism`), or accelerate would build its own device mesh, TP and
``fully_shard`` over the whole world on top; boost-hf applies FSDP2 over each TP x PP rank's DP group.

To refuse a new combination, add a check here and a row to ``tests/training/test_refusals.py``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os

import torch

from ..data_parallel_config import DataParallelConfig
from ..optim.loro import LORO_WITHOUT_DEEPSPEED
from .zero1 import ZERO1_WITH_DEEPSPEED, ZERO1_WITH_LORO

ACCELERATE_DEEPSPEED = (
    " Here DeepSpeed is on because ACCELERATE_USE_DEEPSPEED=true, which `accelerate launch` sets for a config with "
    "distributed_type: DEEPSPEED (or it is set in the environment): launch with an accelerate config without DeepSpeed "
    "(e.g. accelerate_configs/cpu-4proc.yaml, gpu-8.yaml) or unset it."
)
PARALLELISM_SIZES = ("dp_replicate", "dp_shard", "tp", "cp", "sp")

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
    """What asks for FSDP, as transformers and accelerate decide it: transformers' ``--fsdp`` (``fsdp:`` in a recipe),
    ``ACCELERATE_USE_FSDP`` (an accelerate config with ``distributed_type: FSDP``), or ``None``."""
    if args.fsdp:
        return f"--fsdp {args.fsdp}"
    return "ACCELERATE_USE_FSDP=true (an accelerate config with distributed_type: FSDP)" if _env_flag("ACCELERATE_USE_FSDP") else None


#: the decoder layer class names an FSDP ``transformer_cls_names_to_wrap`` may name (boost-hf's units)
DECODER_LAYER_CLASSES = ("BoostLlamaDecoderLayer",)


def _set_agreeing(args, name: str, value, default, origin: str) -> None:
    """``args.<name> = value`` unless a flag or the recipe set it otherwise (not ``default``): then refused."""
    given = getattr(args, name)
    if given not in (default, value):
        raise ValueError(f"{origin} sets {name}={value!r} but the flag or the recipe sets {name}={given!r}: one setting, "
                         "written twice, differently. Set one of them (or both to the same value).")
    setattr(args, name, value)


def fully_shard_from_fsdp_settings(args) -> None:
    """Honour FSDP asked for through transformers' ``--fsdp`` / ``--fsdp_config`` or an accelerate config (see the
    module docstring): parsed by accelerate's ``FullyShardedDataParallelPlugin`` (from the arguments as transformers
    builds it, or from the ``FSDP_*`` variables), written onto boost-hf's ``--data_parallel fsdp2`` settings;
    ``ValueError`` naming the fix for FSDP version 1 and for what boost-hf does not apply. No collective. transformers
    and accelerate then never see FSDP (``args.fsdp`` is cleared; the trainer hides ``ACCELERATE_USE_FSDP`` while it
    creates its ``Accelerator``)."""
    origin = fsdp_origin(args)
    if origin is None:
        return
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy
    from transformers import TrainingArguments

    if isinstance(args.fsdp_config, str) and args.fsdp_config.lstrip().startswith("{"):  # a recipe's mapping, as JSON
        args.fsdp_config = json.loads(args.fsdp_config)
    settings = TrainingArguments._process_fsdp_args(args) if args.fsdp else {}  # as the Trainer builds its plugin
    version = int(settings.get("fsdp_version", os.environ.get("FSDP_VERSION", "1")))  # (accelerate's default: 1)
    if version != 2:
        raise ValueError(
            f"FSDP version {version} ({origin}) is not supported: FSDP1 (FullyShardedDataParallel) flattens "
            "the parameters, which breaks boost-hf's tensor-parallel shards and their checkpoints. Use FSDP2: "
            "fsdp_version: 2 in the accelerate config (or fsdp_config {\"version\": 2}, or --data_parallel fsdp2)."
        )
    plugin = FullyShardedDataParallelPlugin(**settings)  # the rest from the accelerate config's FSDP_* variables
    unsupported = {
        "CPU offload (fsdp_offload_params / cpu_offload)": isinstance(plugin.cpu_offload, CPUOffloadPolicy),
        "activation_checkpointing_offload": plugin.activation_checkpointing_offload,
        "ignored_modules": plugin.ignored_modules is not None,
        "a mixed_precision_policy of FSDP's own (boost-hf's comes from --bf16 and --precision_policy)": plugin.mixed_precision_policy is not None,
        "SIZE_BASED_WRAP (boost-hf's units are the decoder layers: TRANSFORMER_BASED_WRAP, or NO_WRAP for one unit)":
            getattr(plugin.auto_wrap_policy, "__name__", "") == "size_based_auto_wrap_policy",
    }
    names = plugin.transformer_cls_names_to_wrap
    if names and not set(names) <= set(DECODER_LAYER_CLASSES):
        unsupported[f"transformer_cls_names_to_wrap {names} (boost-hf's units are {', '.join(DECODER_LAYER_CLASSES)})"] = True
    refused = [name for name, given in unsupported.items() if given]
    if refused:
        raise ValueError(f"FSDP ({origin}) asks for {'; '.join(refused)}, which boost-hf's FSDP2 does not apply: remove "
                         f"{'it' if len(refused) == 1 else 'them'} from the FSDP settings.")
    _set_agreeing(args, "data_parallel", "fsdp2", "ddp", origin)
    _set_agreeing(args, "fsdp_reshard_after_forward", "always" if plugin.reshard_after_forward else "never", "default", origin)
    _set_agreeing(args, "fsdp_units", "decoder_layers" if plugin.auto_wrap_policy is not None else "model", "decoder_layers", origin)
    if plugin.activation_checkpointing and args.activation_checkpointing_mode == "none":
        args.activation_checkpointing_mode = "full"
    args.fsdp, args.fsdp_config = None, None  # boost-hf applies it; transformers must not build its own plugin
    logger.info("%s honoured: --data_parallel fsdp2, reshard after forward %s, units %s", origin,
                args.fsdp_reshard_after_forward, args.fsdp_units)


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
    environment): its ``tp_size`` becomes ``args.tp_size`` (``None``: not given; 1 without either); its
    ``dp_shard_size`` (FSDP2's) ``--data_parallel fsdp2``, with its ``dp_replicate_size`` as HSDP's
    ``--dp_replicate_size``; ``dp_replicate_size x dp_shard_size`` must equal ``WORLD_SIZE / (tp_size x pp_size)``;
    ``ValueError`` naming the fix for what does not map (:func:`unsupported_parallelism`) and for a size that a flag or
    the recipe sets otherwise. ``args.parallelism_config`` is then ``None``: accelerate must not apply it."""
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
    replicate, shard = sizes.get("dp_replicate", 1), sizes.get("dp_shard", 1)
    dp = replicate * shard
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if dp > 1 and dp * args.tp_size * args.pp_size != world:
        given = " x ".join(f"{name}_size={sizes[name]}" for name in ("dp_replicate", "dp_shard") if name in sizes)
        raise ValueError(
            f"{origin} sets {given}, which with tp_size={args.tp_size} x pp_size={args.pp_size} needs "
            f"{dp * args.tp_size * args.pp_size} processes, but {world} are launched (WORLD_SIZE): boost-hf's data "
            "parallelism is what is left of the world, world / (tp_size x pp_size). Launch that many processes, or "
            "remove them from parallelism_config."
        )
    if shard > 1:  # FSDP2 over dp_shard_size ranks, HSDP over dp_replicate_size replicas of them
        _set_agreeing(args, "data_parallel", "fsdp2", "ddp", origin)
        _set_agreeing(args, "dp_replicate_size", replicate, 1, origin)
    if sizes:
        logger.info("%s honoured: tp_size=%d%s%s", origin, args.tp_size, f", dp={dp}" if dp > 1 else "",
                    f", FSDP2 over {shard} ranks x {replicate} replicas" if shard > 1 else "")
    args.parallelism_config = None


@contextlib.contextmanager
def without_accelerate_parallelism():
    """While the ``Accelerator`` is created (and the model built or loaded): without
    ``ACCELERATE_USE_PARALLELISM_CONFIG`` and ``ACCELERATE_USE_FSDP``, from which accelerate would build its own
    ``ParallelismConfig`` (a device mesh, its own TP) and FSDP plugin (``fully_shard`` over the whole world), and
    transformers' ``from_pretrained`` would load the weights on rank 0 only (``cpu_ram_efficient_loading``), after
    :func:`layout_from_parallelism_config` and :func:`fully_shard_from_fsdp_settings` have put what they honour onto
    the arguments."""
    saved = {name: os.environ.pop(name) for name in ("ACCELERATE_USE_PARALLELISM_CONFIG", "ACCELERATE_USE_FSDP")
             if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


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
    data_parallel = DataParallelConfig.of(args)
    if data_parallel.fully_sharded:
        if deepspeed is not None:
            _refuse_with_deepspeed(
                "--data_parallel fsdp2 (FSDP2, however asked for) cannot run with DeepSpeed: both shard the data-parallel "
                "state and own the gradients. Choose one: FSDP2 (any pp_size) without --deepspeed, or DeepSpeed ZeRO "
                "(pp_size 1) without FSDP.", deepspeed)
        if args.zero1_optimizer:
            raise ValueError(
                "--zero1_optimizer with --data_parallel fsdp2: FSDP2 shards the optimizer state over the data-parallel "
                "group already (with the parameters and the gradients), so there is nothing left for ZeRO-1 to shard. "
                "Drop --zero1_optimizer (or use it with --data_parallel ddp)."
            )
        if args.lowrank_optimizer == "loro":
            raise ValueError(
                "--lowrank_optimizer loro with --data_parallel fsdp2 is not supported: LORO's exact step needs both "
                "factors (B and A) of a projection whole on one rank, and FSDP2 shards each over the data-parallel "
                "group. Use --data_parallel ddp with LORO."
            )
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world % (args.tp_size * args.pp_size) == 0:
            data_parallel.shard_size(world // (args.tp_size * args.pp_size))
    if args.zero1_optimizer and args.lowrank_optimizer == "loro":
        raise ValueError(ZERO1_WITH_LORO)


def resolve_torch_compile(args) -> None:
    """``--torch_compile`` unset (``None``) becomes ``True`` on a CUDA device (each decoder layer and the loss compiled:
    the readings in docs/performance.md put eager at a third of compiled's throughput there) and ``False`` on the CPU
    (a CPU run is short, and compiling costs more than it saves). An explicit ``true`` or ``false`` stays. No
    collective."""
    if args.torch_compile is None:
        args.torch_compile = torch.cuda.is_available() and not args.use_cpu


def settings_from_accelerate(args) -> None:
    """Copy onto ``args`` what the accelerate config sets and boost-hf honours (flags given explicitly win):
    ``ACCELERATE_MIXED_PRECISION`` -> ``bf16`` / ``fp16``; ``ACCELERATE_DYNAMO_BACKEND`` (and ``_MODE``) ->
    ``torch_compile`` / ``torch_compile_backend`` / ``torch_compile_mode`` (boost-hf compiles each decoder layer);
    ``parallelism_config`` -> ``tp_size`` and FSDP2 (:func:`layout_from_parallelism_config`: a conflict is refused);
    FSDP -> ``--data_parallel fsdp2`` (:func:`fully_shard_from_fsdp_settings`)."""
    layout_from_parallelism_config(args)
    fully_shard_from_fsdp_settings(args)
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").strip().lower()
    if not (args.bf16 or args.fp16) and precision in ("bf16", "fp16"):
        setattr(args, precision, True)
    backend = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no").strip().lower()
    if args.torch_compile is None and backend not in ("", "no"):  # an explicit --torch_compile (true or false) wins
        args.torch_compile = True
        args.torch_compile_backend = args.torch_compile_backend or backend
        mode = os.environ.get("ACCELERATE_DYNAMO_MODE")
        args.torch_compile_mode = args.torch_compile_mode or (mode if mode and mode != "default" else None)


__all__ = [
    "accelerate_parallelism",
    "without_accelerate_parallelism",
    "check_settings",
    "deepspeed_origin",
    "fsdp_origin",
    "fully_shard_from_fsdp_settings",
    "layout_from_parallelism_config",
    "resolve_torch_compile",
    "settings_from_accelerate",
    "unsupported_parallelism",
]
