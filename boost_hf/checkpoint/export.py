"""The Hugging Face model folder (what ``save_pretrained`` of the single-device model writes) from a
``torch.distributed.checkpoint`` of the model, streamed one output file at a time: no rank holds the whole model.

* :func:`export_weights`: the canonical weights as safetensors files of at most ``max_shard_size`` bytes each, with
  transformers' names and index (``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` and
  ``model.safetensors.index.json``; the file plan is ``huggingface_hub.split_torch_state_dict_into_shards`` over the
  single-device model's state dict, tied weights removed as transformers removes them). Output file ``i`` is
  written by rank ``i mod world``, which reads that file's tensors from the DCP checkpoint (only their byte
  ranges) and holds at most that one file's tensors.
* :func:`save_model_files`: everything ``save_pretrained`` writes besides the weights: ``config.json``
  (``architectures``, ``dtype``, ``auto_map``), ``generation_config.json`` and the remote code, of the model's own
  class (:func:`own_class`: never FSDP2's, DDP's, compile's or DeepSpeed's wrapper).
* :func:`save_sharded_pretrained`: ``save_pretrained`` of a parallel model: every rank writes its own shards (DCP,
  into a hidden ``.shards`` folder), the ranks export them, the folder is removed.
"""

from __future__ import annotations

import glob
import json
import math
import os
import shutil

import torch
import torch.distributed as dist
from torch import nn

from .sharded_state import MODEL_KEY, dcp_metadata, model_state, quiet_single_process_warning, saved_tensors
from .weights_io import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

DEFAULT_MAX_SHARD_SIZE = "5GB"
"""Largest safetensors file of an export, and so the most a writing rank holds (transformers' own default, 50GB,
would put a 13B model in one file on one rank)."""
SHARDS_FOLDER = ".shards"
"""Hidden folder of a parallel ``save_pretrained``'s DCP shards, removed once exported."""


def single_device_skeleton_of(config) -> nn.Module:
    """The single-device model of ``config`` on the meta device (names, shapes, tied weights; no memory). Its weights
    are tied here: ``no_init_weights`` skips transformers' ``init_weights``, which is where they are tied."""
    from transformers.initialization import no_init_weights

    from ..modeling_boost_llama import BoostLlamaForCausalLM

    with torch.device("meta"), no_init_weights():
        skeleton = BoostLlamaForCausalLM(config)
    skeleton.tie_weights()
    return skeleton


def weight_files_plan(config, saved: dict[str, tuple], max_shard_size: int | str):
    """``huggingface_hub``'s ``StateDictSplit`` of the single-device model's state dict (tied weights removed as
    transformers' ``save_pretrained`` removes them), each tensor with its saved shape and dtype (``saved``:
    :func:`~boost_hf.checkpoint.sharded_state.saved_tensors`). Raises ``ValueError`` naming missing or
    wrongly-shaped tensors."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    skeleton = single_device_skeleton_of(config)
    names = list(remove_tied_weights_from_state_dict(skeleton.state_dict(), skeleton))
    shapes = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}
    missing = [n for n in names if n not in saved]
    wrong = [f"{n}: saved {saved[n][0]} vs config {shapes[n]}" for n in names if n in saved and saved[n][0] != shapes[n]]
    if missing or wrong:
        raise ValueError(f"the checkpoint does not hold the model of its config.json: missing {missing[:5]}, shape mismatch {wrong[:5]}")
    meta = {name: torch.empty(saved[name][0], dtype=saved[name][1], device="meta") for name in names}
    return split_torch_state_dict_into_shards(meta, filename_pattern=SAFE_WEIGHTS_NAME.replace(".safetensors", "{suffix}.safetensors"),
                                              max_shard_size=max_shard_size)


def _remove_weight_files(folder: str) -> None:
    """Earlier weight files of ``folder`` (a new export may have fewer or other files)."""
    for path in [os.path.join(folder, SAFE_WEIGHTS_NAME), os.path.join(folder, SAFE_WEIGHTS_INDEX_NAME),
                 *glob.glob(os.path.join(folder, "model-*-of-*.safetensors"))]:
        if os.path.isfile(path):
            os.remove(path)


def _rank_and_world(process_group=None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(process_group), dist.get_world_size(process_group)
    return 0, 1


def export_weights(dcp_folder: str, output_dir: str, config, *, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                   process_group=None) -> list[str]:
    """Write the canonical weights of the DCP checkpoint ``dcp_folder`` (entries ``model.<name>``) into
    ``output_dir`` as transformers' safetensors files (see the module docstring); return the files this rank wrote.
    Collective over ``process_group`` when ``torch.distributed`` is initialised (each rank writes every
    ``world``-th file, rank 0 the index); no collective inside, only each rank's reads and writes."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    saved = saved_tensors(dcp_metadata(dcp_folder), MODEL_KEY)
    plan = weight_files_plan(config, saved, max_shard_size)
    rank, world = _rank_and_world(process_group)
    written = []
    for i, (filename, names) in enumerate(plan.filename_to_tensors.items()):
        if i % world != rank:
            continue
        tensors = {name: torch.empty(saved[name][0], dtype=saved[name][1]) for name in names}
        with quiet_single_process_warning():
            dcp.load({MODEL_KEY: tensors}, checkpoint_id=dcp_folder, no_dist=True)
        save_file(tensors, os.path.join(output_dir, filename), metadata={"format": "pt"})
        written.append(filename)
        del tensors
    if rank == 0 and plan.is_sharded:
        total = sum(math.prod(saved[name][0]) for name in plan.tensor_to_filename)
        index = {"metadata": {"total_parameters": total, **plan.metadata}, "weight_map": plan.tensor_to_filename}
        with open(os.path.join(output_dir, SAFE_WEIGHTS_INDEX_NAME), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return written


def unwrapped(model: nn.Module) -> nn.Module:
    """``model`` out of its containers (DDP, DeepSpeed's engine, ``torch.compile``'s ``OptimizedModule``: accelerate's
    ``extract_model_from_parallel``)."""
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model, keep_torch_compile=False)


def own_class(model: nn.Module) -> type:
    """The class ``model`` was defined as, whatever wraps it: the first class of the MRO of :func:`unwrapped`'s
    ``model`` that torch did not make (FSDP2's ``fully_shard`` swaps the module's class, in place, for
    ``FSDP<Class>``, made in torch, in front of its own). A tensor-parallel class keeps the name and module of the
    class it adopts (:func:`~boost_hf.parallel.parallelize.parallelize`), so it names the single-device model."""
    return next(c for c in type(unwrapped(model)).__mro__ if not c.__module__.startswith("torch."))


def save_model_files(model: nn.Module, output_dir: str, dtype: torch.dtype | None = None) -> None:
    """What ``PreTrainedModel.save_pretrained`` writes besides the weights, as it writes it: ``config.json`` (with
    ``architectures``, ``dtype`` and the ``auto_map`` of the remote code), ``generation_config.json`` and the remote
    code files (``modeling_boost_llama.py``, the siblings it imports, ``configuration_boost_llama.py``), each naming
    the model's own class (:func:`own_class`), never a wrapper's. One process."""
    from transformers.dynamic_module_utils import custom_object_save

    model = unwrapped(model)
    cls = own_class(model)
    config = model.config
    config.dtype = str(dtype if dtype is not None else model.dtype).split(".")[1]
    config.architectures = [cls.__name__]
    if cls.is_remote_code():
        # custom_object_save reads only the class of what it is given (its name, module and auto class): an instance
        # of the model's own class made without __init__, which holds nothing
        custom_object_save(cls.__new__(cls), output_dir, config=config)
    config.save_pretrained(output_dir)
    if model.can_generate():
        model.generation_config.save_pretrained(output_dir)


def save_sharded_pretrained(model: nn.Module, output_dir: str, *, is_main_process: bool,
                            max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> None:
    """``save_pretrained`` of a parallel model into ``output_dir`` (shared by every rank): the single-device model's
    folder. Collective: every rank writes the shards it holds (``torch.distributed.checkpoint``, DP replicas
    deduplicated) into ``output_dir/.shards``, the ranks export them file by file (:func:`export_weights`), the main
    process writes the config and remote code (:func:`save_model_files`) and removes ``.shards``. No rank holds
    more than its own shards and one output file."""
    import torch.distributed.checkpoint as dcp

    launched = dist.is_available() and dist.is_initialized()
    shards = os.path.join(output_dir, SHARDS_FOLDER)
    state = model_state(model)
    if is_main_process:
        os.makedirs(output_dir, exist_ok=True)
        _remove_weight_files(output_dir)
        shutil.rmtree(shards, ignore_errors=True)
        save_model_files(model, output_dir, dtype=next(t.dtype for t in state.values() if t.is_floating_point()))
    if launched:
        dist.barrier()
    with quiet_single_process_warning():
        dcp.save({MODEL_KEY: state}, checkpoint_id=shards, no_dist=not launched)
    export_weights(shards, output_dir, model.config, max_shard_size=max_shard_size)
    if launched:
        dist.barrier()
    if is_main_process:
        shutil.rmtree(shards, ignore_errors=True)
    if launched:
        dist.barrier()


__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "SHARDS_FOLDER",
    "export_weights",
    "own_class",
    "save_model_files",
    "unwrapped",
    "save_sharded_pretrained",
    "single_device_skeleton_of",
    "weight_files_plan",
]
