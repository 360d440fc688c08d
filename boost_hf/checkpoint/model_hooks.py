"""The model hooks: what a ``BoostLlamaForCausalLM`` given a ``parallel_config`` runs to check, build, load and
save this rank's shard.

Why this module exists: the single-device model file (``modeling_boost_llama.py``) ships as remote code and
imports only torch, transformers and its siblings, so it cannot import boost-hf. It reaches boost-hf
through the one object a caller with boost-hf installed hands it, the
:class:`~boost_hf.parallel.config.ParallelConfig`, whose methods (``single_device_skeleton``, ``parallelize``,
``load_pretrained``, ``check_model``; and ``save_pretrained``, which a parallel model's own ``save_pretrained``
calls) call the functions of the same names here. ``ParallelConfig`` is plain data and imports no boost-hf module:
this module registers itself with it (:func:`~boost_hf.parallel.config.register_model_hooks`) when it is imported,
and ``boost_hf`` imports it. It sits in the checkpoint package, above ``parallel/``: the imports run one way::

    model_hooks -> export, sharded_state, weights_io (checkpoint) -> parallelize, layouts -> config (parallel)

and no module but this one and the package faces imports :mod:`~boost_hf.parallel.parallelize`.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
from transformers.initialization import no_init_weights

from ..parallel.config import ParallelConfig, register_model_hooks
from ..parallel.parallelize import checked_layout, parallelize
from .sharded_state import DCP_FOLDER, is_distributed_checkpoint, load_model_state
from .export import DEFAULT_MAX_SHARD_SIZE, save_sharded_pretrained
from .weights_io import HUB_KWARGS, load_canonical_checkpoint, resolve_checkpoint_files

# from_pretrained arguments with nothing to do when each rank reads its own slices itself
IGNORED_UNDER_TP = ("trust_remote_code", "low_cpu_mem_usage", "use_safetensors", "_from_auto", "_from_pipeline", "_commit_hash", "adapter_kwargs")


def check_model(config, parallel: ParallelConfig) -> None:
    """Raise ``ValueError`` naming the field to change if ``parallel``'s layout (and pipeline) cannot hold ``config``."""
    checked_layout(config, parallel)


def single_device_skeleton() -> contextlib.ExitStack:
    """Context in which the single-device modules are built on the meta device, uninitialised (nothing allocated)."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.device("meta"))
    stack.enter_context(no_init_weights())
    return stack


def load_pretrained(model_class, pretrained_model_name_or_path, parallel: ParallelConfig, *model_args, **kwargs):
    """``model_class.from_pretrained`` into this rank's shard of ``parallel``'s layout.

    At ``tp_size=1`` without recomputation this is transformers' own ``from_pretrained`` (every argument
    applies), then :func:`~boost_hf.parallel.parallelize.parallelize`, which slices the loaded values (never re-draws
    them). Otherwise the model is built on
    the meta device, sharded, and each rank reads only its slices of the canonical safetensors files.
    Arguments that cannot apply there (``device_map`` other than ``"cpu"``, ``state_dict``,
    ``quantization_config``, ``ignore_mismatched_sizes``, ...) raise a ``ValueError`` naming them. A training
    checkpoint (``checkpoint-<step>`` with its shards in ``dcp/``) loads at any layout
    (:func:`load_training_checkpoint`).
    """
    if is_distributed_checkpoint(str(pretrained_model_name_or_path)):
        return load_training_checkpoint(model_class, str(pretrained_model_name_or_path), parallel, kwargs.get("config"))
    if parallel.tp_size == 1 and parallel.pp_size == 1 and parallel.activation_checkpointing == "none":
        loaded = model_class.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        model, info = loaded if isinstance(loaded, tuple) else (loaded, None)
        parallelize(model, parallel)
        return (model, info) if info is not None else model
    if model_args:
        raise ValueError(f"from_pretrained takes no positional model arguments under tensor parallelism, got {model_args!r}")
    path = str(pretrained_model_name_or_path)
    config = kwargs.pop("config", None)
    dtype = kwargs.pop("dtype", None)
    dtype = kwargs.pop("torch_dtype", None) if dtype is None else dtype
    attn_implementation = kwargs.pop("attn_implementation", None)
    output_loading_info = kwargs.pop("output_loading_info", False)
    if kwargs.get("device_map") in (None, "cpu"):
        kwargs.pop("device_map", None)
    hub = {k: kwargs.pop(k) for k in HUB_KWARGS if k in kwargs}
    kwargs.pop("check_architecture", None)  # done by the model's from_pretrained
    for name in IGNORED_UNDER_TP:
        kwargs.pop(name, None)
    if config is None:
        config, kwargs = model_class.config_class.from_pretrained(path, return_unused_kwargs=True, **hub, **kwargs)
    if kwargs:
        raise ValueError(
            f"from_pretrained arguments {sorted(kwargs)} cannot apply under tensor parallelism "
            f"(tp_size={parallel.tp_size}, activation_checkpointing={parallel.activation_checkpointing!r}): each rank "
            "reads its own slices of the canonical checkpoint on the CPU. Drop them, or load with tp_size=1."
        )
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    with single_device_skeleton():
        model = model_class(config)
    parallelize(model, parallel, initialize=False)
    load_canonical_checkpoint(model, resolve_checkpoint_files(path, **hub))
    if dtype is not None and dtype != "auto":
        model = model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    model.eval()
    if output_loading_info:
        return model, {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    return model


def load_training_checkpoint(model_class, folder: str, parallel: ParallelConfig, config=None):
    """This rank's shard of ``parallel``'s layout from the training checkpoint ``folder`` (its ``dcp/``, saved at any
    layout; :func:`~boost_hf.checkpoint.sharded_state.load_model_state` reads only this rank's byte ranges), with its
    ``config.json`` unless ``config`` is given."""
    if config is None:
        config = model_class.config_class.from_pretrained(folder)
    with single_device_skeleton():
        model = model_class(config)
    parallelize(model, parallel, initialize=False)
    load_model_state(model, os.path.join(folder, DCP_FOLDER))
    model.eval()
    return model


def save_pretrained(model, save_directory: str, *, is_main_process: bool, max_shard_size=None) -> None:
    """``save_pretrained`` of a parallel model: :func:`~boost_hf.checkpoint.export.save_sharded_pretrained` (files of at
    most ``max_shard_size``, default 5GB)."""
    save_sharded_pretrained(model, save_directory, is_main_process=is_main_process,
                            max_shard_size=max_shard_size or DEFAULT_MAX_SHARD_SIZE)


register_model_hooks(sys.modules[__name__])

__all__ = ["check_model", "single_device_skeleton", "parallelize", "load_pretrained", "load_training_checkpoint", "save_pretrained"]
