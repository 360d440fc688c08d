"""Reading a checkpoint whole in one process (:func:`read_checkpoint`), and writing one in the format of boost-hf 0.x
(before distributed checkpoints: the canonical ``model.safetensors`` and one ``torch`` optimizer file per pipeline and
TP rank), which must keep resuming (:func:`write_legacy_checkpoint`: from a checkpoint of a one-process run, holding
the same values)."""

from __future__ import annotations

import json
import pickle
import shutil
import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from boost_hf import BoostLlamaConfig
from boost_hf.checkpoint.integrity import write_manifest
from boost_hf.checkpoint.export import export_weights
from boost_hf.checkpoint.resume import LAYOUT_NAME


def read_checkpoint(checkpoint: Path) -> dict:
    """Everything in ``checkpoint/dcp``, whole tensors, nested as saved: ``{"model": {name: tensor}, "optimizer":
    {"state": {name: {key: value}}, "param_groups": {"pp<q>": pickled groups}}}``."""
    with tempfile.TemporaryDirectory() as folder:
        dcp_to_torch_save(checkpoint / "dcp", Path(folder) / "all.pt")
        return torch.load(Path(folder) / "all.pt", weights_only=False)


def saved_param_groups(saved: dict) -> dict[str, list[dict]]:
    """The parameter groups' hyper-parameters of each pipeline rank of :func:`read_checkpoint`'s result."""
    return {rank: pickle.loads(groups) for rank, groups in saved["optimizer"]["param_groups"].items()}


def write_legacy_checkpoint(checkpoint: Path, out: Path) -> Path:
    """``out``: ``checkpoint`` (tp 1, pp 1, no DeepSpeed) as boost-hf 0.x wrote it: ``model.safetensors`` instead
    of ``dcp/``, the optimizer's ``torch`` state dict in ``optimizer.pt`` (parameters numbered in the optimizer's
    order), the record's ``files``, a new manifest."""
    shutil.copytree(checkpoint, out, ignore=shutil.ignore_patterns("dcp", "manifest.json"))
    config = BoostLlamaConfig.from_pretrained(checkpoint)
    export_weights(str(checkpoint / "dcp"), str(out), config, max_shard_size="100GB")
    saved = read_checkpoint(checkpoint)
    layout = json.loads((out / LAYOUT_NAME).read_text())
    (record,) = layout["optimizer"]
    names = [p["name"] for p in record["parameters"]]
    state = {i: saved["optimizer"]["state"][name] for i, name in enumerate(names) if name in saved["optimizer"]["state"]}
    groups, start = [], 0
    for group, count in zip(saved_param_groups(saved)["pp0"], record["groups"]):
        groups.append({**group, "params": list(range(start, start + count))})
        start += count
    torch.save({"state": state, "param_groups": groups}, out / "optimizer.pt")
    record["files"] = ["optimizer.pt"]
    (out / LAYOUT_NAME).write_text(json.dumps(layout, indent=1))
    write_manifest(str(out), config)
    return out
