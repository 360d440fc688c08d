"""Settings honoured or refused whatever set them: a flag, a recipe, the accelerate config or the environment.

``accelerate launch`` hands its config to the workers as environment variables, which transformers and accelerate
read on their own: ``ACCELERATE_USE_DEEPSPEED`` (``distributed_type: DEEPSPEED``; transformers then builds a DeepSpeed
plugin without ``--deepspeed``) with ``ACCELERATE_DEEPSPEED_*`` and ``ACCELERATE_GRADIENT_*``, ``ACCELERATE_USE_FSDP``
with ``FSDP_*``, ``ACCELERATE_USE_PARALLELISM_CONFIG`` with ``PARALLELISM_CONFIG_*_SIZE``, ``ACCELERATE_USE_CPU``,
``ACCELERATE_MIXED_PRECISION``, ``ACCELERATE_DYNAMO_*``. ``BoostTrainingArguments.__post_init__`` (on every rank, before
the process group exists) reads each setting as it will take effect, so each refusal holds for every way of making it.

**One source per setting.** A setting that two sources can make is taken from one, or refused when they disagree,
naming both and the fix (:func:`settle`): the training fields that another source can set are unset (``None``) unless
given, so a value given (the default's value included: ``--data_parallel ddp``, ``--tp_size 1``) is told from none, as
``tp_size`` is. On accelerate's side a value that is its own default, which ``accelerate launch`` always writes
(a size of 1, ``mixed_precision: no``, ``dynamo_backend: no``, FSDP's ``activation_checkpointing: false``), sets
nothing. A flag on the command line replaces the recipe's value of the same field: they are one source, the
command line winning. :func:`settings_from_accelerate` settles, in this order:

* ``parallelism_config`` (the training argument, or the accelerate config's; both given, they must agree):
  ``tp_size`` -> ``--tp_size`` (boost-hf's own TP layouts, not accelerate's); ``dp_shard_size`` -> ``--data_parallel
  fsdp2`` over that many ranks, with ``dp_replicate_size`` as HSDP's ``--dp_replicate_size``; ``dp_replicate_size``
  alone -> whole replicas, ``--data_parallel ddp`` (accelerate refuses FSDP without a ``dp_shard_size`` too:
  replicas are never dropped); ``dp_replicate_size x dp_shard_size`` checked to be ``world / (tp_size x pp_size)``
  (boost-hf's DP is what is left of the world); ``cp_size`` (context parallelism), ``sp_size`` (DeepSpeed's Ulysses)
  refused, each naming boost-hf's nearest setting (:func:`layout_from_parallelism_config`);
* FSDP, from transformers' ``--fsdp`` / ``--fsdp_config`` and from an accelerate config (``distributed_type: FSDP``:
  ``ACCELERATE_USE_FSDP`` and ``FSDP_*``), each parsed by accelerate's own ``FullyShardedDataParallelPlugin``
  (both given, they must agree): version 2 -> ``--data_parallel fsdp2``; ``reshard_after_forward`` true -> ``--fsdp_reshard_after_forward
  default`` (torchtitan's: every layer but the last without PP, none under PP; ``always`` is asked for by that name,
  ``--fsdp_reshard_after_forward always``, which a true also allows), false -> ``never``; the auto-wrap policy ->
  ``--fsdp_units`` (``TRANSFORMER_BASED_WRAP``: each decoder layer; ``NO_WRAP``: the whole model);
  ``activation_checkpointing: true`` -> ``--activation_checkpointing_mode full`` (``lowrank`` also agrees);
  ``cpu_ram_efficient_loading`` holds always (each rank reads only its own slices of ``--init_from``:
  :func:`without_accelerate_parallelism` hides the variables from transformers' loading as well);
  ``state_dict_type`` either way (boost-hf's checkpoints are per-rank shards, its ``final/`` the whole model); version
  1 and the settings boost-hf does not apply (CPU offload, size-based wrapping, other layer classes, its own
  mixed-precision policy, ignored modules) are refused naming the fix (:func:`fully_shard_from_fsdp_settings`);
* the Trainer's own ``--activation_checkpointing`` (``gradient_checkpointing`` before transformers 5.23) ->
  ``--activation_checkpointing_mode full`` (``lowrank`` also agrees; the switch is then turned off);
* ``mixed_precision`` -> ``--bf16`` / ``--fp16`` (another, e.g. fp8, refused); ``dynamo_backend`` (and
  ``dynamo_mode``) -> ``--torch_compile`` with ``--torch_compile_backend`` / ``--torch_compile_mode`` (boost-hf
  compiles each decoder layer; ``dynamo_use_fullgraph`` / ``dynamo_use_dynamic`` refused: not applied);

then the settings left unset take their declared defaults. DeepSpeed's config (``--deepspeed FILE``, or the one the
accelerate config builds) is checked after transformers has filled its ``"auto"`` values
(:func:`check_deepspeed_sources`): each value it sets explicitly (gradient accumulation, micro-batch, clipping,
bf16 / fp16, the optimizer's and scheduler's, transformers' own comparison, which it would raise only once the model
is built) must equal the training argument's, and a ``--deepspeed FILE`` launched with an accelerate DeepSpeed config
must agree with that config's ZeRO stage, offload devices, accumulation, clipping and config file.

**Refused combinations** (:func:`check_settings`, after the settings are settled):

* DeepSpeed (:func:`deepspeed_origin`) with ``pp_size > 1``, ``--zero1_optimizer``, ``--lowrank_optimizer loro``,
  ``--nonfinite skip_step``, ``--data_parallel fsdp2``, or ``ACCELERATE_USE_CPU`` (with which accelerate silently
  drops DeepSpeed);
* FSDP2 (``--data_parallel fsdp2``, however asked for) with ``--zero1_optimizer`` or ``--lowrank_optimizer loro``, or
  a ``--dp_replicate_size`` that does not divide the data parallelism;
* ``--zero1_optimizer`` with LORO.

accelerate itself then never applies ``parallelism_config`` or FSDP: the trainer creates its ``Accelerator`` without
them (:func:`without_accelerate_parallelism`), or accelerate would build its own device mesh, TP and
``fully_shard`` over the whole world on top; boost-hf applies FSDP2 over each TP x PP rank's DP group.

To refuse a new combination, add a check here and a row to ``tests/training/test_refusals.py``; a new setting with
a second source: an unset training default, a :func:`settle` call, and a row there too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import fields

import torch

from ..data_parallel_config import DataParallelConfig
from ..parallel.config import ParallelConfig
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


FLAG = "the flag or the recipe"


def settle(args, name: str, value, origin: str, origins: dict[str, str], *, agrees: tuple = ()) -> None:
    """``args.<name>`` takes ``value``, which ``origin`` sets, unless it holds one already: the flag's or the recipe's
    (``None``: unset), or an earlier source's (``origins``: setting -> who set it, updated here), which must be
    ``value`` or one of ``agrees`` (the values ``origin``'s allows, e.g. accelerate's ``reshard_after_forward: true``
    allows ``always``; the one held is kept). Else ``ValueError`` naming both sources, both values and the fix. No
    collective."""
    given = getattr(args, name)
    if given is None:
        setattr(args, name, value)
        origins[name] = origin
        return
    if given == value or given in agrees:
        return
    first = origins.get(name)
    held = f"{first} sets {name}={given!r}" if first else f"{FLAG} sets {name}={given!r} (--{name}, {name}: in the recipe)"
    raise ValueError(f"{origin} sets {name}={value!r} but {held}: one setting, written twice, differently. Set it in "
                     "one of them only (or to the same value in both).")


def fsdp_sources(args) -> list[tuple[str, dict | None]]:
    """What asks for FSDP, as transformers and accelerate decide it, each as ``(origin, its settings)``: transformers'
    ``--fsdp`` (``fsdp:`` in a recipe, with ``--fsdp_config``: the plugin's arguments as the Trainer builds them) and
    ``ACCELERATE_USE_FSDP`` (an accelerate config with ``distributed_type: FSDP``: ``None``, its ``FSDP_*``
    variables)."""
    sources = []
    if args.fsdp:
        from transformers import TrainingArguments

        if isinstance(args.fsdp_config, str) and args.fsdp_config.lstrip().startswith("{"):  # a recipe's mapping, as JSON
            args.fsdp_config = json.loads(args.fsdp_config)
        origin = f"transformers' --fsdp {args.fsdp}" + (" with --fsdp_config" if args.fsdp_config else "")
        sources.append((origin, TrainingArguments._process_fsdp_args(args)))  # as the Trainer builds its plugin
    if _env_flag("ACCELERATE_USE_FSDP"):
        sources.append(("the accelerate config's FSDP settings (distributed_type: FSDP: ACCELERATE_USE_FSDP, FSDP_*)", None))
    return sources


#: the decoder layer class names an FSDP ``transformer_cls_names_to_wrap`` may name (boost-hf's units)
DECODER_LAYER_CLASSES = ("BoostLlamaDecoderLayer",)


@contextlib.contextmanager
def _environment_without(prefix: str):
    """Within: no environment variable starting with ``prefix``."""
    saved = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith(prefix)}
    try:
        yield
    finally:
        os.environ.update(saved)


def _fsdp_plugin(origin: str, settings: dict | None):
    """accelerate's ``FullyShardedDataParallelPlugin`` of one FSDP source: ``settings`` (transformers', the ``FSDP_*``
    variables hidden) or the variables alone (``None``); ``ValueError`` naming the fix for a version other than 2 and
    for what boost-hf does not apply."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy

    version = int(settings.get("fsdp_version", 2) if settings is not None else os.environ.get("FSDP_VERSION", "1"))
    if version != 2:  # (the Trainer's default: 2, accelerate's: 1)
        raise ValueError(
            f"FSDP version {version} ({origin}) is not supported: FSDP1 (FullyShardedDataParallel) flattens "
            "the parameters, which breaks boost-hf's tensor-parallel shards and their checkpoints. Use FSDP2: "
            "fsdp_version: 2 in the accelerate config (or fsdp_config {\"version\": 2}, or --data_parallel fsdp2)."
        )
    if settings is None:
        plugin = FullyShardedDataParallelPlugin()
    else:
        with _environment_without("FSDP_"):
            plugin = FullyShardedDataParallelPlugin(**settings)
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
    return plugin


def fully_shard_from_fsdp_settings(args, origins: dict[str, str] | None = None) -> None:
    """Honour FSDP asked for through transformers' ``--fsdp`` / ``--fsdp_config`` or an accelerate config (see the
    module docstring, :func:`fsdp_sources`): each source parsed by accelerate's ``FullyShardedDataParallelPlugin`` and
    settled onto boost-hf's ``--data_parallel fsdp2`` settings (:func:`settle`; ``origins``: who set what so far);
    ``ValueError`` naming the fix for FSDP version 1, for what boost-hf does not apply and for two sources that
    disagree. No collective. transformers and accelerate then never see FSDP (``args.fsdp`` is cleared; the trainer
    hides ``ACCELERATE_USE_FSDP`` while it creates its ``Accelerator``)."""
    origins = {} if origins is None else origins
    sources = fsdp_sources(args)
    for origin, settings in sources:
        plugin = _fsdp_plugin(origin, settings)
        reshard = bool(plugin.reshard_after_forward)  # torchtitan's default, or "always" by its name; or never
        settle(args, "data_parallel", "fsdp2", origin, origins)
        settle(args, "fsdp_reshard_after_forward", "default" if reshard else "never", origin, origins,
               agrees=("always",) if reshard else ())
        settle(args, "fsdp_units", "decoder_layers" if plugin.auto_wrap_policy is not None else "model", origin, origins)
        if plugin.activation_checkpointing:
            settle(args, "activation_checkpointing_mode", "full", origin, origins, agrees=("lowrank",))
    if sources:
        args.fsdp, args.fsdp_config = None, None  # boost-hf applies it; transformers must not build its own plugin
        logger.info("%s honoured: --data_parallel fsdp2, reshard after forward %s, units %s",
                    " and ".join(origin for origin, _ in sources), args.fsdp_reshard_after_forward, args.fsdp_units)


def accelerate_parallelism(args) -> tuple[str, dict[str, int]] | None:
    """accelerate's ``ParallelismConfig`` as it would take effect: ``(where it comes from, its sizes above 1)``, or
    ``None`` without one. The ``parallelism_config=`` training argument (made under the launch's environment, it takes
    the accelerate config's sizes it does not set, as in accelerate) and the accelerate config's
    (``ACCELERATE_USE_PARALLELISM_CONFIG`` with ``PARALLELISM_CONFIG_<NAME>_SIZE``), both given, must agree: a size the
    argument sets otherwise is refused, naming both."""
    config = getattr(args, "parallelism_config", None)
    launched = "the accelerate config's parallelism_config (ACCELERATE_USE_PARALLELISM_CONFIG, PARALLELISM_CONFIG_*_SIZE)"
    environment = {name: int(os.environ.get(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", "1")) for name in PARALLELISM_SIZES}
    if config is not None:
        origin = "parallelism_config (the training argument)"
        sizes = {name: getattr(config, f"{name}_size", None) or 1 for name in PARALLELISM_SIZES}
        differ = [name for name in PARALLELISM_SIZES if sizes[name] != environment[name]]
        if _env_flag("ACCELERATE_USE_PARALLELISM_CONFIG") and differ:
            raise ValueError(
                f"{origin} sets {', '.join(f'{name}_size={sizes[name]}' for name in differ)} but {launched} sets "
                f"{', '.join(f'{name}_size={environment[name]}' for name in differ)}: one layout, written twice, "
                "differently. Set it in one of them only (or to the same sizes in both).")
    elif _env_flag("ACCELERATE_USE_PARALLELISM_CONFIG"):
        origin, sizes = launched, environment
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


def launched_world_size() -> int:
    """The number of processes launched (``WORLD_SIZE``; 1 without a launcher), which the checks of the data-parallel
    size read."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def layout_from_parallelism_config(args, origins: dict[str, str] | None = None) -> None:
    """Honour accelerate's ``parallelism_config`` on ``args`` (no collective; every rank reads the same arguments and
    environment), each size settled with the flag's (:func:`settle`; ``origins``: who set what so far): its
    ``tp_size`` becomes ``args.tp_size`` (``None``: not given; 1 without either); its ``dp_shard_size`` (FSDP2's)
    ``--data_parallel fsdp2``, with its ``dp_replicate_size`` as HSDP's ``--dp_replicate_size``; a ``dp_replicate_size``
    alone whole replicas (``--data_parallel ddp``: with ``--data_parallel fsdp2`` refused, as accelerate refuses FSDP
    with nothing to shard over); ``dp_replicate_size x dp_shard_size`` must equal ``WORLD_SIZE / (tp_size x
    pp_size)``; ``ValueError`` naming the fix for what does not map (:func:`unsupported_parallelism`) and for a size
    that a flag or the recipe sets otherwise. ``args.parallelism_config`` is then ``None``: accelerate must not apply
    it."""
    origins = {} if origins is None else origins
    found = accelerate_parallelism(args)
    if found is None:
        args.tp_size = 1 if args.tp_size is None else args.tp_size
        return
    origin, sizes = found
    refusal = unsupported_parallelism(sizes, origin)
    if refusal is not None:
        raise ValueError(refusal)
    if "tp" in sizes:
        settle(args, "tp_size", sizes["tp"], origin, origins)
    args.tp_size = 1 if args.tp_size is None else args.tp_size
    replicate, shard = sizes.get("dp_replicate", 1), sizes.get("dp_shard", 1)
    dp = replicate * shard
    if shard > 1:  # FSDP2 over dp_shard_size ranks, HSDP over dp_replicate_size replicas of them
        settle(args, "data_parallel", "fsdp2", origin, origins)
        settle(args, "dp_replicate_size", replicate, origin, origins)
    elif replicate > 1:  # whole replicas: DDP
        if args.data_parallel == "fsdp2":
            raise ValueError(
                f"{origin} sets dp_replicate_size={replicate} and no dp_shard_size: {replicate} whole replicas (DDP; "
                f"accelerate refuses FSDP with nothing to shard over), but {origins.get('data_parallel', FLAG)} sets "
                "data_parallel='fsdp2', which shards the model: the replicas would be dropped. Set dp_shard_size too "
                "(HSDP: dp_replicate_size replicas of dp_shard_size shards, their product the data parallelism), or "
                "drop --data_parallel fsdp2 (DDP over the replicas).")
        settle(args, "data_parallel", "ddp", origin, origins)
    world = launched_world_size()
    if dp > 1 and dp * args.tp_size * args.pp_size != world:
        given = " x ".join(f"{name}_size={sizes[name]}" for name in ("dp_replicate", "dp_shard") if name in sizes)
        raise ValueError(
            f"{origin} sets {given}, which with tp_size={args.tp_size} x pp_size={args.pp_size} needs "
            f"{dp * args.tp_size * args.pp_size} processes, but {world} are launched (WORLD_SIZE): boost-hf's data "
            "parallelism is what is left of the world, world / (tp_size x pp_size). Launch that many processes, or "
            "remove them from parallelism_config."
        )
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
        world = launched_world_size()
        if world % (args.tp_size * args.pp_size) == 0:
            data_parallel.shard_size(world // (args.tp_size * args.pp_size))
    if args.zero1_optimizer and args.lowrank_optimizer == "loro":
        raise ValueError(ZERO1_WITH_LORO)


TRAINER_SWITCHES = ("activation_checkpointing", "gradient_checkpointing")  # from transformers 5.23, and before (an alias since)
#: the settings another source can set, unset (``None``) among the training arguments unless given, and the value each
#: takes when no source sets it (the declared defaults of boost-hf's fields; transformers' for its own)
UNSET_DEFAULTS = {
    **{f.name: f.default for f in fields(DataParallelConfig)},
    "activation_checkpointing_mode": next(f.default for f in fields(ParallelConfig) if f.name == "activation_checkpointing"),
    "bf16": False, "fp16": False,
}  # torch_compile, unset, is decided by the device (resolve_torch_compile)


def activation_checkpointing_from_trainer_switch(args, origins: dict[str, str]) -> None:
    """The Trainer's own switch (``--activation_checkpointing``; ``gradient_checkpointing`` before transformers 5.23),
    which boost-hf models do not read, settled as ``--activation_checkpointing_mode full`` (``lowrank`` agrees) and
    turned off."""
    switches = [name for name in TRAINER_SWITCHES if getattr(args, name, False)]
    if not switches:
        return
    settle(args, "activation_checkpointing_mode", "full", f"the Trainer's --{switches[0]}", origins, agrees=("lowrank",))
    logger.warning("boost-hf models checkpoint activations through activation_checkpointing_mode (now %r); the Trainer's "
                   "%s flag is turned off.", args.activation_checkpointing_mode, switches[0])
    for name in TRAINER_SWITCHES:
        if hasattr(args, name):
            setattr(args, name, False)


def precision_and_compile_from_accelerate(args, origins: dict[str, str]) -> None:
    """The accelerate config's ``mixed_precision`` (``ACCELERATE_MIXED_PRECISION``: bf16 / fp16; another refused) as
    ``--bf16`` / ``--fp16``, and its ``dynamo_backend`` / ``dynamo_mode`` (``ACCELERATE_DYNAMO_*``) as ``--torch_compile``
    with ``--torch_compile_backend`` / ``--torch_compile_mode`` (boost-hf compiles each decoder layer: ``fullgraph``
    and ``dynamic`` are refused, not applied), each settled with the flag's (:func:`settle`). ``no`` (and a mode of
    ``default``), what ``accelerate launch`` writes by default, sets nothing."""
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").strip().lower()
    if precision not in ("", "no"):
        origin = f"the accelerate config's mixed_precision: {precision} (ACCELERATE_MIXED_PRECISION)"
        if precision not in ("bf16", "fp16"):
            raise ValueError(f"{origin} is not supported by boost-hf, which trains in fp32, bf16 (--precision_policy) "
                             "or fp16 autocast: set mixed_precision: bf16 (or no) in the accelerate config.")
        settle(args, precision, True, origin, origins)
        settle(args, "fp16" if precision == "bf16" else "bf16", False, origin, origins)
    backend = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no").strip().lower()
    if backend in ("", "no"):
        return
    origin = f"the accelerate config's dynamo_backend: {backend} (ACCELERATE_DYNAMO_BACKEND)"
    for variable in ("ACCELERATE_DYNAMO_USE_FULLGRAPH", "ACCELERATE_DYNAMO_USE_DYNAMIC"):
        if _env_flag(variable):
            raise ValueError(
                f"the accelerate config's {variable[len('ACCELERATE_'):].lower()}: true ({variable}) is not applied by "
                "boost-hf, which compiles each decoder layer with --torch_compile_backend and --torch_compile_mode: remove "
                "it from the accelerate config's dynamo_config.")
    settle(args, "torch_compile", True, origin, origins)
    settle(args, "torch_compile_backend", backend, origin, origins)
    mode = os.environ.get("ACCELERATE_DYNAMO_MODE")
    if mode and mode != "default":
        settle(args, "torch_compile_mode", mode, f"the accelerate config's dynamo_mode: {mode} (ACCELERATE_DYNAMO_MODE)",
               origins)


def resolve_torch_compile(args) -> None:
    """``--torch_compile`` left unset by every source (``None``) becomes ``True`` on a CUDA device (each decoder layer
    and the loss compiled: the readings in docs/performance.md put eager at a third of compiled's throughput there) and
    ``False`` on the CPU (a CPU run is short, and compiling costs more than it saves). An explicit ``true`` or
    ``false`` stays. No collective."""
    if args.torch_compile is None:
        args.torch_compile = torch.cuda.is_available() and not args.use_cpu


def settings_from_accelerate(args) -> None:
    """Settle every setting that two sources can make (the module docstring, in its order; :func:`settle`): the
    accelerate config's ``parallelism_config`` (:func:`layout_from_parallelism_config`), FSDP from transformers' and
    the accelerate config's settings (:func:`fully_shard_from_fsdp_settings`), the Trainer's activation checkpointing
    switch, the accelerate config's mixed precision and compilation (:func:`precision_and_compile_from_accelerate`);
    then the settings left unset take their defaults (:data:`UNSET_DEFAULTS`). ``ValueError`` naming both sources and
    the fix for two that disagree. No collective."""
    origins: dict[str, str] = {}
    layout_from_parallelism_config(args, origins)
    fully_shard_from_fsdp_settings(args, origins)
    activation_checkpointing_from_trainer_switch(args, origins)
    precision_and_compile_from_accelerate(args, origins)
    for name, default in UNSET_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


DEEPSPEED_ARGUMENTS = {  # a DeepSpeed config key -> the training argument transformers fills it from ("auto")
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "gradient_clipping": "max_grad_norm",
    "bf16.enabled": "bf16",
    "fp16.enabled": "fp16",
}
ACCELERATE_DEEPSPEED_SETTINGS = {  # the accelerate config's DeepSpeed setting (as accelerate launch passes it) -> the key
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": "zero_optimization.stage",
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "gradient_accumulation_steps",
    "ACCELERATE_GRADIENT_CLIPPING": "gradient_clipping",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "zero_optimization.offload_optimizer.device",
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "zero_optimization.offload_param.device",
}


def _config_value(config: dict, key: str):
    for part in key.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def _same(value, other) -> bool:
    """A DeepSpeed value as written (a number, a bool, a name) equals another, as accelerate's variables spell them."""
    try:
        return float(value) == float(other)
    except (TypeError, ValueError):
        return str(value).strip().lower() == str(other).strip().lower()


def check_deepspeed_sources(args) -> None:
    """DeepSpeed's config against the other sources of its settings, after transformers built it (``--deepspeed`` or
    the accelerate config's DeepSpeed) and filled its ``"auto"`` values from the training arguments: each value it sets
    explicitly must equal the training argument's (:data:`DEEPSPEED_ARGUMENTS`, then transformers' own comparisons of
    the optimizer and scheduler, which it raises only once the model is built); with ``--deepspeed FILE`` under an
    accelerate config with ``distributed_type: DEEPSPEED``, that config's ZeRO stage, offload devices, accumulation,
    clipping (:data:`ACCELERATE_DEEPSPEED_SETTINGS`) and config file must agree with the file's (accelerate would
    silently take the file's). ``ValueError`` naming both and the fix. No collective."""
    plugin = getattr(args, "deepspeed_plugin", None)
    if plugin is None:
        return
    config = plugin.deepspeed_config
    if args.deepspeed:
        where = f"the DeepSpeed config {args.deepspeed if isinstance(args.deepspeed, str) else '(--deepspeed)'}"
        fix = "in the DeepSpeed config"
    else:
        where = ("the accelerate config's DeepSpeed settings (distributed_type: DEEPSPEED: ACCELERATE_DEEPSPEED_*, "
                 "ACCELERATE_GRADIENT_*)")
        fix = "in the accelerate config's deepspeed_config"
    if args.deepspeed and _env_flag("ACCELERATE_USE_DEEPSPEED"):
        launched = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
        if launched != "none" and isinstance(args.deepspeed, str) and os.path.abspath(launched) != os.path.abspath(args.deepspeed):
            raise ValueError(f"--deepspeed {args.deepspeed} and the accelerate config's deepspeed_config_file {launched} "
                             "(ACCELERATE_DEEPSPEED_CONFIG_FILE) are two DeepSpeed configs: give one of them only.")
        for variable, key in ACCELERATE_DEEPSPEED_SETTINGS.items():
            value, ours = os.environ.get(variable), _config_value(config, key)
            if value not in (None, "", "none", "auto") and ours not in (None, "auto") and not _same(value, ours):
                raise ValueError(
                    f"the accelerate config's DeepSpeed settings ({variable}={value}) set {key}={value} but {where} sets "
                    f"{key}={ours!r}: one setting, written twice, differently (accelerate would take the file's). Set "
                    "it in one of them only: remove it from the accelerate config's deepspeed_config, or the file's.")
    for key, name in DEEPSPEED_ARGUMENTS.items():
        value, ours = _config_value(config, key), getattr(args, name)
        if value not in (None, "auto") and not _same(value, ours):
            raise ValueError(
                f"{where} sets {key}={value!r} but --{name} (the flag, the recipe or its default) is {ours!r}: one "
                f"setting, written twice, differently. Set {key} to \"auto\" {fix} (transformers fills it from the "
                f"training arguments), or --{name} to {value!r}.")
    mismatches = [line for line in getattr(getattr(args, "hf_deepspeed_config", None), "mismatches", [])
                  if "train_batch_size" not in line]  # boost-hf sets train_batch_size from the DP size
    if mismatches:
        raise ValueError(f"{where} sets values the training arguments set otherwise:\n" + "\n".join(mismatches)
                         + "\nSet them to \"auto\" in the DeepSpeed config (transformers fills them from the training "
                           "arguments), or the arguments to the config's values.")


__all__ = [
    "ACCELERATE_DEEPSPEED_SETTINGS",
    "DEEPSPEED_ARGUMENTS",
    "UNSET_DEFAULTS",
    "accelerate_parallelism",
    "activation_checkpointing_from_trainer_switch",
    "check_deepspeed_sources",
    "check_settings",
    "deepspeed_origin",
    "fsdp_sources",
    "fully_shard_from_fsdp_settings",
    "launched_world_size",
    "layout_from_parallelism_config",
    "precision_and_compile_from_accelerate",
    "resolve_torch_compile",
    "settings_from_accelerate",
    "settle",
    "unsupported_parallelism",
    "without_accelerate_parallelism",
]
