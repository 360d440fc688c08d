"""DeepSpeed's universal checkpoint: a ZeRO-1/2 checkpoint resumed at another TP x DP size or ZeRO stage.

DeepSpeed's ZeRO-1/2 checkpoint holds, per (DP rank, TP rank), that rank's partition of DeepSpeed's flat fp32
masters and AdamW moments, and per TP rank the TP-local module state. It cannot be loaded at another DP size as it
is, nor at another TP size at all. DeepSpeed's *universal checkpoint* is its way across: ``ds_to_universal`` cuts
the flat partitions into one folder per parameter (``zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt``), merging the
TP ranks' slices into the whole tensor as the checkpoint's ``universal_checkpoint_info`` says, and an engine started
with ``{"checkpoint": {"load_universal": true}}`` takes each of its parameters' slices from those files, at any
DP size, TP size and ZeRO-1/2 stage. Megatron-DeepSpeed describes its parameters by hand
(``universal_checkpoint_info()``: TP-replicated, row-parallel, vocabulary and PP-replicated patterns);
:func:`universal_checkpoint_info` generates the same description from the :class:`~boost_hf.parallel.sharding.ShardSpec`
every boost-hf parameter carries, so every layout (btp, vanilla, megatron; grouped or not) is described by what it
actually did. Nothing of boost-hf's own storage stands in the way: DeepSpeed's flat buffers record each parameter's
fragment by name (``param_slice_mappings``), so the order in which the grouped projections' parameters sit in them
(:mod:`boost_hf.training.deepspeed`) does not enter the conversion, and the names are the single-device model's
(every layout keeps them). So the conversion is DeepSpeed's own; boost-hf adds only:

* the description, attached to the model (``model.universal_checkpoint_info``, which DeepSpeed writes into every
  checkpoint's model states) by :func:`~boost_hf.training.deepspeed.deepspeed_initialize_hooks`: TP-replicated
  parameters (``partition_dim`` ``None``), row-parallel ones (split along dim 1: BTP's ``A`` and hidden-sharded
  embedding, vanilla's ``B``, Megatron's ``o_proj`` / ``down_proj``), vocabulary-parallel ones (the embedding and LM
  head split along the vocabulary; never padded, ``original_vocab_size`` is the config's), column-parallel ones
  (dim 0, DeepSpeed's default) and any other split dimension (a tensor-train core's dim 2) as a parameter of one
  sub-parameter split along that dim. Pipeline-replicated patterns are empty: DeepSpeed never runs under
  ``pp_size > 1`` here, and no parameter sits on two pipeline stages (tied embeddings are refused under PP);
* on resume, each parameter's own slicing (:data:`AUTOTP_META`, DeepSpeed's per-parameter universal-checkpoint
  metadata): the whole tensor is cut as *this* run's ShardSpec says, whatever the saving run's TP size or style;
* :func:`universal_resume`: when the checkpoint's TP x DP size or ZeRO stage differs from this run's, global rank 0
  converts ``checkpoint-<N>/global_step<N>`` into ``<output_dir>/.universal-checkpoint-<N>/`` (DeepSpeed's
  ``ds_to_universal``, one worker), every rank waits, and the returned :class:`UniversalResume` has the engine load
  from there (then the folder is removed). The checks that need no collective (:func:`universal_resume_refusal`,
  called by :func:`~boost_hf.checkpoint.resume.check_resume_layout`) run first.

The conversion runs on global rank 0 while the other ranks wait in one collective, so it must end within the
collective timeout (``--ddp_timeout``): raise it for a large model. Refused, with the fix: ZeRO-3 (saved or resumed) and ZeRO-0 (DeepSpeed without ZeRO) checkpoints, whose files this
path does not convert (resume them at their own layout, or start from their weights with ``--init_from``); a
checkpoint written before this description existed (no ``deepspeed_universal_info`` in its ``training_layout.json``:
its model states carry no ``universal_checkpoint_info``, so DeepSpeed could not tell a row-parallel slice from a
column-parallel one); optimizer state other than Adam's (``ds_to_universal`` converts ``exp_avg`` / ``exp_avg_sq``
only); frozen parameters (:meth:`UniversalResume.prepare_model`: DeepSpeed restores only what its optimizer
holds).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..parallel.sharding import shard_spec_of

#: recorded in a DeepSpeed checkpoint's ``training_layout.json`` (``deepspeed_universal_info``): its model states
#: carry :func:`universal_checkpoint_info`, so it converts to DeepSpeed's universal checkpoint
UNIVERSAL_INFO_RECORD = "shard-specs-v1"
#: DeepSpeed's attribute of per-parameter universal-checkpoint metadata (``deepspeed.checkpoint.constants
#: .DS_AUTOTP_UC_META``), read when loading a universal checkpoint: how to cut this rank's slice of the whole tensor
AUTOTP_META = "ds_autotp_universal_checkpoint_meta"
#: the folder (in the run's output folder) a checkpoint is converted into, removed once loaded
UNIVERSAL_FOLDER = ".universal-{name}"
#: the optimizer state ``ds_to_universal`` converts (AdamW's moments)
ADAM_STATE = ("exp_avg", "exp_avg_sq")


# ---------------------------------------------------------------------------------------------------- description
def _pattern(key: str) -> str:
    """An anchored regex matching the parameter names whose layer indices were replaced by ``#``."""
    return "^" + re.escape(key).replace("\\#", "#").replace("#", r"\d+") + "$"


def _category(spec, vocabulary: bool) -> tuple:
    if not spec.is_sharded:
        return ("replicated",)
    if spec.partition_dim == 0:
        return ("vocabulary",) if vocabulary else ("column",)
    if spec.partition_dim == 1:
        return ("row",)
    return ("split", spec.partition_dim, spec.full_shape, spec.tp_size)


def universal_checkpoint_info(model) -> dict:
    """DeepSpeed's ``universal_checkpoint_info`` of ``model`` (a boost-hf model at any layout), generated from its
    parameters' :class:`~boost_hf.parallel.sharding.ShardSpec` (see the module docstring). Names that differ only in
    a layer index share one pattern when every such parameter is split alike, else each has its own."""
    from deepspeed.checkpoint import constants as C

    vocabulary_params = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, getter, lambda: None)()
        if module is not None and getattr(module, "weight", None) is not None:
            vocabulary_params.add(id(module.weight))
    by_key: dict[str, dict[str, tuple]] = {}
    for name, param in model.named_parameters():
        category = _category(shard_spec_of(param), id(param) in vocabulary_params)
        by_key.setdefault(re.sub(r"\.\d+\.", ".#.", name), {})[name] = category
    patterns: dict[str, tuple] = {}
    for key, names in by_key.items():
        if len(set(names.values())) == 1:
            patterns[_pattern(key)] = next(iter(names.values()))
        else:
            patterns.update({"^" + re.escape(name) + "$": category for name, category in names.items()})

    def matching(kind: str) -> list[str]:
        return sorted(p for p, category in patterns.items() if category[0] == kind)

    sub_params, widths = [], {}
    for pattern, category in sorted(patterns.items()):
        if category[0] == "split":
            _, dim, full_shape, tp_size = category
            shape = list(full_shape)
            shape[dim] = (full_shape[dim],)  # one sub-parameter: the whole dimension, split evenly over the TP ranks
            sub_params.append({"patterns": [pattern], "shape": tuple(shape), "partition_dim": dim})
            widths[pattern] = [[full_shape[dim] // tp_size] * tp_size]
    config = getattr(model, "config", None)
    info = {
        C.UNIVERSAL_CHECKPOINT_VERSION_KEY: C.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        C.TP_REPLICATED_PARAMETER_PATTERNS: matching("replicated"),
        C.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: matching("row"),
        C.VOCABULARY_PARAMETER_PATTERNS: matching("vocabulary"),
        C.PIPELINE_REPLICATED_PARAMETER_PATTERNS: [],  # DeepSpeed runs at pp_size 1 only (module docstring)
        C.PARAMETER_TO_AVERAGE_PATTERNS: [],
        C.PARAMETER_WITH_SUB_PARAMS: sub_params,
        C.SUB_PARAM_SHARD_WIDTHS: widths,
    }
    if info[C.VOCABULARY_PARAMETER_PATTERNS]:
        info[C.ORIGINAL_VOCAB_SIZE] = config.vocab_size  # tp_size divides it: nothing is padded
    return info


def parameter_slicing(param) -> dict:
    """DeepSpeed's per-parameter universal-checkpoint metadata (:data:`AUTOTP_META`) of ``param``: replicated, or the
    whole tensor's shape and the dimension its ShardSpec cuts into ``tp_size`` contiguous slices (the same cut as
    :meth:`~boost_hf.parallel.sharding.ShardSpec.local_slice`)."""
    spec = shard_spec_of(param)
    if not spec.is_sharded:
        return {"replicated": True, "partition_dim": None}
    return {"partition_dim": spec.partition_dim, "logical_shape": tuple(spec.full_shape)}


def attach_universal_checkpoint_info(model, loading: bool = False) -> None:
    """Set ``model.universal_checkpoint_info`` (written by DeepSpeed into each checkpoint's model states); with
    ``loading``, also each parameter's :func:`parameter_slicing` (read by DeepSpeed's universal loader)."""
    model.universal_checkpoint_info = universal_checkpoint_info(model)
    if loading:
        for param in model.parameters():
            setattr(param, AUTOTP_META, parameter_slicing(param))


# ---------------------------------------------------------------------------------------------------- resume checks
def _describe(layout: dict) -> str:
    """As :mod:`boost_hf.checkpoint.resume` names a layout in its messages."""
    zero = f", ZeRO-{layout['zero_stage']}" if layout.get("zero_stage") is not None else ", no DeepSpeed"
    batch = f", global batch {layout['global_batch_size']}" if "global_batch_size" in layout else ""
    return f"tp_size={layout['tp_size']} x dp={layout['dp_size']}{zero}{batch}"


def deepspeed_folder(checkpoint: str) -> str | None:
    """The checkpoint's DeepSpeed folder (``global_step<N>``), the one its ``latest`` file names if there is one."""
    latest = os.path.join(checkpoint, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            folder = os.path.join(checkpoint, f.read().strip())
        return folder if os.path.isdir(folder) else None
    folders = sorted(glob.glob(os.path.join(checkpoint, "global_step*")))
    return folders[-1] if folders else None


def needs_conversion(saved: dict | None, current: dict) -> bool:
    """Both layouts are DeepSpeed's and differ in TP size, DP size or ZeRO stage."""
    if saved is None or saved.get("zero_stage") is None or current.get("zero_stage") is None:
        return False
    return tuple(saved[k] for k in ("tp_size", "dp_size", "zero_stage")) != tuple(current[k] for k in ("tp_size", "dp_size", "zero_stage"))


def _saved_optimizer_state_keys(path: str) -> set[str]:
    """The per-group state keys of a ZeRO-1/2 optimizer file (memory-mapped: the tensors are not read)."""
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    groups = state["optimizer_state_dict"]["base_optimizer_state"]
    groups = groups["state"] if isinstance(groups, dict) and "state" in groups else groups
    groups = groups.values() if isinstance(groups, dict) else groups
    return set().union(*(set(group) for group in groups)) if groups else set()


def universal_resume_refusal(checkpoint: str, saved: dict, current: dict) -> str | None:
    """Why the DeepSpeed checkpoint ``checkpoint`` (its :func:`~boost_hf.checkpoint.resume.training_layout` ``saved``)
    cannot resume at ``current`` (a DeepSpeed layout with another TP x DP size or ZeRO stage) through DeepSpeed's
    universal checkpoint, with the fix; ``None`` when it can. Reads files only (no collective): the same answer on
    every rank."""
    weights_only = f"start from its weights only with --init_from {checkpoint} (a new optimizer and learning-rate schedule)"
    at_saved = (f"Resume at tp_size={saved['tp_size']} on {saved['tp_size'] * saved['dp_size']} processes with "
                f"ZeRO-{saved['zero_stage']}, or {weights_only}.")
    prefix = f"{checkpoint} is a DeepSpeed checkpoint of {_describe(saved)} and this run is {_describe(current)}"
    stages = (saved["zero_stage"], current["zero_stage"])
    if any(stage not in (1, 2) for stage in stages):
        return (f"{prefix}: boost-hf reshards DeepSpeed's ZeRO partitions to another TP x DP size or stage through "
                "DeepSpeed's universal checkpoint for ZeRO-1/2 checkpoints resumed with ZeRO-1/2 only (ZeRO-3 partitions "
                "the parameters themselves, ZeRO-0 keeps no ZeRO files; neither conversion is wired in or tested). "
                f"{at_saved}")
    if saved.get("deepspeed_universal_info") != UNIVERSAL_INFO_RECORD:
        return (f"{prefix}: it was written by a boost-hf version whose DeepSpeed checkpoints do not describe how each "
                "parameter is split over the TP ranks (universal_checkpoint_info), which DeepSpeed's universal checkpoint "
                f"needs to reshard them. {at_saved}")
    folder = deepspeed_folder(checkpoint)
    if folder is None:
        return (f"{checkpoint} has no DeepSpeed folder (global_step<N>) with its ZeRO partitions: the checkpoint is "
                f"incomplete or was copied without it. Resume from a complete checkpoint, or {weights_only}.")
    tp, dp = saved["tp_size"], saved["dp_size"]
    prefixes = ("", "bf16_", "fp16_")
    for t in range(tp):
        needed = [f"mp_rank_{t:02d}_model_states.pt"]
        needed += [[f"{p}zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt" for p in prefixes] for d in range(dp)]
        for names in needed:
            names = [names] if isinstance(names, str) else names
            if not any(os.path.isfile(os.path.join(folder, n)) for n in names):
                return (f"{os.path.join(folder, names[0])} is missing: resuming at another layout converts every TP and "
                        f"DP rank's ZeRO partition. Resume from a complete checkpoint, or {weights_only}.")
    first = next(os.path.join(folder, f"{p}zero_pp_rank_0_mp_rank_00_optim_states.pt") for p in prefixes
                 if os.path.isfile(os.path.join(folder, f"{p}zero_pp_rank_0_mp_rank_00_optim_states.pt")))
    keys = _saved_optimizer_state_keys(first)
    if not set(ADAM_STATE) <= keys:
        return (f"{prefix}: its optimizer state holds {sorted(keys)}, and DeepSpeed's universal checkpoint converts "
                f"Adam's moments ({', '.join(ADAM_STATE)}) only. {at_saved}")
    return None


# ---------------------------------------------------------------------------------------------------- conversion and loading
@dataclass
class UniversalResume:
    """A DeepSpeed checkpoint converted to DeepSpeed's universal checkpoint in ``folder`` (which holds
    ``latest_universal`` and the converted ``global_step<N>``), to be loaded in place of ``checkpoint``'s ZeRO files.
    :func:`~boost_hf.training.deepspeed.deepspeed_initialize_hooks` applies it to ``deepspeed.initialize``."""

    checkpoint: str
    folder: str

    def deepspeed_config(self, config) -> dict:
        """``config`` with ``{"checkpoint": {"load_universal": true}}`` (a copy)."""
        if not isinstance(config, dict):
            raise ValueError(f"resuming through DeepSpeed's universal checkpoint needs the DeepSpeed config as a dict, got {type(config).__name__}.")
        return {**config, "checkpoint": {**config.get("checkpoint", {}), "load_universal": True}}

    def prepare_model(self, model) -> None:
        """Give each parameter its slicing of the whole tensors (:func:`parameter_slicing`). A frozen parameter is
        refused (the same error on every rank, before DeepSpeed starts): the universal checkpoint restores the
        parameters DeepSpeed's optimizer holds, and DeepSpeed loads no module state from it."""
        frozen = [name for name, param in model.named_parameters() if not param.requires_grad]
        if frozen:
            if not dist.is_initialized() or dist.get_rank() == 0:
                shutil.rmtree(self.folder, ignore_errors=True)
            raise ValueError(
                f"resuming {self.checkpoint} at another layout through DeepSpeed's universal checkpoint restores the "
                f"parameters DeepSpeed's optimizer holds, and {len(frozen)} parameters are frozen (requires_grad=False: "
                f"{', '.join(frozen[:3])}{', ...' if len(frozen) > 3 else ''}), which would keep this run's initial values. "
                "Resume at the layout the checkpoint was saved at, or start from its weights only with --init_from "
                f"{self.checkpoint}."
            )
        attach_universal_checkpoint_info(model, loading=True)

    def redirect(self, engine) -> None:
        """Make ``engine.load_checkpoint(checkpoint)`` (what transformers calls on resume) load the universal folder;
        afterwards the engine reads ordinary checkpoints again and the folder is removed (after every rank loaded)."""
        load = engine.load_checkpoint

        def load_checkpoint(load_dir, tag=None, **kwargs):
            if os.path.abspath(load_dir) != os.path.abspath(self.checkpoint):
                return load(load_dir, tag, **kwargs)
            try:
                loaded = load(self.folder, None, **kwargs)  # the tag: the folder's latest_universal
            finally:
                engine.load_checkpoint = load
                engine._config.load_universal_checkpoint = False  # a later load (best model) is an ordinary checkpoint
            if dist.is_initialized():
                dist.barrier()  # every rank has read the folder
            if not dist.is_initialized() or dist.get_rank() == 0:
                shutil.rmtree(self.folder, ignore_errors=True)
            return loaded

        engine.load_checkpoint = load_checkpoint


def convert_to_universal(checkpoint: str, folder: str) -> None:
    """DeepSpeed's ``ds_to_universal`` of ``checkpoint``'s ``global_step<N>`` into ``folder`` (emptied first): one
    worker process (the training process itself), strict (every pattern of the description must match)."""
    import argparse

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    source = deepspeed_folder(checkpoint)
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    ds_to_universal(argparse.Namespace(input_folder=source, output_folder=os.path.join(folder, os.path.basename(source)),
                                       num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                                       inject_missing_state=False))


def universal_resume(checkpoint: str | None, output_dir: str, saved: dict | None, current: dict) -> UniversalResume | None:
    """For a DeepSpeed resume of ``checkpoint`` (its training layout ``saved``) at another TP x DP size or ZeRO stage
    (``current``: this run's), which :func:`~boost_hf.checkpoint.resume.check_resume_layout` let through
    (:func:`universal_resume_refusal`): convert it on global rank 0 into ``<output_dir>/.universal-<checkpoint name>``
    while the other ranks wait, and return the :class:`UniversalResume`; ``None`` (no collective) when no conversion
    is needed. Collective otherwise: a failed conversion raises on every rank."""
    if not checkpoint or not needs_conversion(saved, current):
        return None
    folder = os.path.join(output_dir, UNIVERSAL_FOLDER.format(name=os.path.basename(os.path.normpath(checkpoint))))
    error = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            convert_to_universal(checkpoint, folder)
        except Exception as exc:  # noqa: BLE001 (raised on every rank below)
            error[0] = f"{type(exc).__name__}: {exc}"
    if dist.is_initialized():
        dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise RuntimeError(
            f"converting the DeepSpeed checkpoint {checkpoint} to DeepSpeed's universal checkpoint (to resume it at "
            f"{_describe(current)}) failed: {error[0]}. Resume at {_describe(saved)}, or start from its weights only "
            f"with --init_from {checkpoint}."
        )
    return UniversalResume(checkpoint, folder)


__all__ = [
    "UNIVERSAL_INFO_RECORD", "AUTOTP_META", "UniversalResume", "universal_checkpoint_info", "parameter_slicing",
    "attach_universal_checkpoint_info", "universal_resume_refusal", "needs_conversion", "convert_to_universal",
    "universal_resume", "deepspeed_folder",
]
