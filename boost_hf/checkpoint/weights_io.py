"""Canonical (unsharded, layout-free) weights for models of any tensor-parallel layout.

The canonical checkpoint is exactly what the single-device model saves (``model.safetensors`` with the
canonical parameter names), so a model saved at TP=4 loads at TP=1, TP=2 or in plain ``transformers``.
Everything here is generic: it only reads each parameter's :class:`~boost_hf.parallel.sharding.ShardSpec`.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from torch import nn

from ..parallel.sharding import shard_spec_of

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
HUB_KWARGS = ("cache_dir", "revision", "token", "local_files_only", "force_download", "subfolder", "proxies")


def resolve_checkpoint_files(path: str, **hub_kwargs) -> list[str]:
    """The safetensors file(s) of a local checkpoint folder or a Hub repo (cached download)."""
    if os.path.isdir(path):
        folder = os.path.join(path, hub_kwargs.get("subfolder") or "")
        single, index = os.path.join(folder, SAFE_WEIGHTS_NAME), os.path.join(folder, SAFE_WEIGHTS_INDEX_NAME)
    else:
        from transformers.utils import cached_file

        single = cached_file(path, SAFE_WEIGHTS_NAME, _raise_exceptions_for_missing_entries=False, **hub_kwargs)
        index = None if single else cached_file(path, SAFE_WEIGHTS_INDEX_NAME, **hub_kwargs)
        folder = os.path.dirname(single or index)
    if single and os.path.isfile(single):
        return [single]
    if index and os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, n) for n in names]
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "dcp", ".metadata")):
        raise FileNotFoundError(
            f"{path!r} is a training checkpoint (the model's shards as a torch.distributed.checkpoint in dcp/), not a "
            f"Hugging Face folder: export it with `boost-hf export {path} OUT` (or start a run from it with --init_from)."
        )
    raise FileNotFoundError(f"no {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME} in {path!r}: is it a boost-hf checkpoint folder?")


@torch.no_grad()
def load_canonical_checkpoint(model: nn.Module, files: list[str]) -> None:
    """Copy this rank's slice of every canonical tensor in ``files`` into ``model`` (reads only the slice).

    Raises ``ValueError`` naming missing, unexpected or wrongly-shaped tensors (e.g. a checkpoint of
    another architecture) before modifying any parameter.
    """
    params = dict(model.named_parameters())
    handles = [safe_open(f, framework="pt") for f in files]
    where = {key: h for h in handles for key in h.keys()}
    missing = sorted(set(params) - set(where))
    tied = getattr(model, "all_tied_weights_keys", {}) or {}
    missing = [m for m in missing if m not in tied]
    pipeline = getattr(model, "pipeline", None)  # under pipeline parallelism other stages' tensors are not read here
    unexpected = sorted(set(where) - set(params) - (pipeline.placement.absent if pipeline is not None else set()))
    wrong = []
    for name, param in params.items():
        if name in where:
            shape = tuple(where[name].get_slice(name).get_shape())
            if shape != shard_spec_of(param).full_shape:
                wrong.append(f"{name}: checkpoint {shape} vs model {shard_spec_of(param).full_shape}")
    if missing or unexpected or wrong:
        raise ValueError(
            "checkpoint does not match this model's architecture (was it saved from another bottleneck, rank "
            "or size? load it with its own config.json): "
            + "; ".join(
                part
                for part in (
                    f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}" if missing else "",
                    f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}" if unexpected else "",
                    f"shape mismatch {wrong[:5]}" if wrong else "",
                )
                if part
            )
        )
    for name, param in params.items():
        if name not in where:
            continue
        spec = shard_spec_of(param)
        tensor_slice = where[name].get_slice(name)
        index = [slice(None)] * len(spec.full_shape)
        if spec.is_sharded:
            size = spec.local_shape[spec.partition_dim]
            index[spec.partition_dim] = slice(spec.tp_rank * size, (spec.tp_rank + 1) * size)
        param.copy_(tensor_slice[tuple(index)].to(param.dtype))


__all__ = ["HUB_KWARGS", "resolve_checkpoint_files", "load_canonical_checkpoint"]
