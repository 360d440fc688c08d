"""Checkpoints of the BOOST authors' release (``Arcana-2236/BOOST``, a Nanotron fork) as canonical boost-hf
checkpoints: ``boost-hf convert RELEASE_FOLDER OUTPUT``, or :func:`load_boost_release` in memory.

**What the release writes** (read from its ``src/nanotron/serialize/`` and ``trainer.py``, and its models
``examples/cola/cola_llama.py`` (BTP), ``vanilla_cola_llama.py`` (vanilla TP), ``basic_cola_llama.py`` (no TP)):
``<checkpoints_path>/<step>/`` holds ``config.yaml`` (the whole training config), ``model_config.json`` (the model's
config dataclass as JSON), ``checkpoint_metadata.json`` (version, tp, dp, data position), ``model/``,
``optimizer/``, ``lr_scheduler/``, ``random/``; ``<checkpoints_path>/latest.txt`` names the last step. ``model/``
holds **one safetensors file per parameter and TP rank**, a single tensor ``"data"``, at the path of the
parameter's name (dots become folders, the last part the file name):

* a parameter sharded over TP: one file per TP rank, ``model_<last>_pp-rank-<i>-of-<P>_tp-rank-<j>-of-<T>.safetensors``
  (``<i>`` the pipeline rank that wrote it), whose header metadata gives ``version`` (1.4),
  ``unsharded_shape`` (``"(a, b)"``) and ``local_global_slices_pairs``: which slices of the whole tensor the shard
  holds, ``"l0|l1#g0|g1;..."`` with each slice ``start,stop,step`` (several pairs when a fused weight is split
  inside each of its chunks, e.g. vanilla's ``[A_q; A_k; A_v]``);
* a parameter not sharded (norms, replicated factors): the release marks it *tied* across the TP ranks and only
  the first rank writes it, as ``model_<last>.safetensors`` without metadata;
* with ``tie_word_embeddings`` the LM head is the embedding's tied parameter, written once under the embedding's name.

**Its CoLA models** (every projection ``y = B act(A x)``, ``act`` = ``hidden_act``; ``attn_rank`` for attention and
``mlp_rank`` for the MLP), under ``model.decoder.<l>.pp_block.``:

====================  =========================================================  =====================================
layout                attention                                                  MLP
====================  =========================================================  =====================================
BTP (cola_llama)      ``attn.qkv_proj0 [3r, d]`` = ``[A_q; A_k; A_v]`` (TP: dim   ``mlp.gate_up_proj0 [2r, d]`` (dim 1),
                      1); ``attn.qkv_proj1 [3, H dh, r]`` = ``B_q, B_k, B_v``     ``mlp.gate_up_proj1 [2, f, r]``
                      (dim 1), or with GQA ``attn.q_proj1 [H dh, r]`` (dim 0) and  (dim 1), ``mlp.down_proj0 [r, f]``
                      ``attn.kv_proj1 [2, KV dh, r]`` (dim 1); ``attn.o_proj0     (dim 1), ``mlp.down_proj1 [d, r]``
                      [r, H dh]`` (dim 1), ``attn.o_proj1 [d, r]`` (dim 0)        (dim 0); no SiLU on the gate
vanilla               ``attn.qkv_proj0 [3r, d]`` (dim 0, inside each ``r``),      ``mlp.gate_up_proj0 [2r, d]`` (dim 0,
                      ``attn.{q,k,v}_proj1 [out, r]`` (dim 1), ``attn.o_proj0     inside each ``r``),
                      [r, H dh]`` (dim 0), ``attn.o_proj1 [d, r]`` (dim 1)        ``mlp.{gate,up}_proj1 [f, r]``,
                                                                                 ``mlp.down_proj{0,1}``; no SiLU on
                                                                                 the gate
no TP (basic)         ``attn.{q,k,v,o}_proj.cola_a [in, r]`` = ``A^T``,            the same for gate, up, down; the
                      ``.cola_b [r, out]`` = ``B^T`` (replicated)                 gate's SiLU only with ``both_act``
====================  =========================================================  =====================================

and ``model.token_position_embeddings.pp_block.token_embedding.weight [V, d]`` (vocabulary split),
``model.final_layer_norm.pp_block.weight [d]``, ``model.lm_head.pp_block.weight [V, d]`` (vocabulary split),
``input_layernorm`` / ``post_attention_layernorm`` per layer: ``[d]`` replicated (vanilla, basic), or under BTP a
``d / T`` shard per rank (``rmsnorm_type`` ``sync`` and ``online``: both exact RMSNorm, split on dim 0).

**Its tensor-train model** (``examples/tensor/basic_tt_llama.py``, no TP: the release refuses TP for it) holds each
projection as cores ``attn.{q,k,v,o}_proj.cores.<i>`` / ``mlp.{gate,up,down}_proj.cores.<i>`` ``[rank_in, mode, rank_out]``
(not sharded, written once), which are boost-hf's ``bottleneck="tt"`` cores under the same names (its model config:
``tt_rank``, ``tt_cores``, ``tt_rank_ratio``; the MLP keeps SwiGLU's activation). Refused, with the reason: its
``vanilla_tt_llama.py`` (a ``q_proj`` bias; its attention views the ``[seq, batch]`` projections as
``[batch, seq]`` without transposing, another function), a folder written at TP > 1 (which ``basic_tt_llama.py``
refuses), GQA (its GQA branch reads an undefined tensor) and ``rope_interleaved`` (a tensor train's output rows cannot
be reordered within each head). Its ``tt_llama.py`` (two ``TensorParallel`` linears per projection) is not converted.

**Conversions**: fused weights are split (``[A_q; A_k; A_v]`` by rows, the batched ``B``'s by their first index),
``cola_a`` / ``cola_b`` transposed; with ``rope_interleaved: true`` (their RoPE rotates pairs ``(2i, 2i + 1)``,
ours ``(i, i + dh/2)``) the rows of each head of ``B_q`` and ``B_k`` are reordered ``[0, 2, ..., dh-2, 1, 3, ...]``,
which makes our rotation of the new rows the release's rotation of the old ones (and ``q . k`` unchanged).
**Refused**, naming the parameter or setting: BTP's default ``rmsnorm_type: triton`` at TP > 1 (each rank normalises
its own ``d / T`` slice, another function than RMSNorm, and the release writes only TP rank 0's slice of those norm
weights: the others are not in the checkpoint), ``attn_rank != mlp_rank`` (one ``rank`` here), ``rope_scaling``,
expert-parallel files, a missing TP shard, a shard whose slices do not tile the tensor, a parameter of the folder
that no rule maps (nothing is dropped silently), and a tensor whose shape is not the config's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from safetensors import SafetensorError, safe_open

from ..checkpoint.integrity import write_manifest
from ..configuration_boost_llama import BoostLlamaConfig

RELEASE_CHECKPOINT_VERSIONS = ("1.2", "1.3", "1.4")
"""Nanotron checkpoint versions whose sharded-file metadata this reader knows (the release writes 1.4)."""
LAYER_PREFIX = "model.decoder.{layer}.pp_block."
EMBEDDING = "model.token_position_embeddings.pp_block.token_embedding.weight"
FINAL_NORM = "model.final_layer_norm.pp_block.weight"
LM_HEAD = "model.lm_head.pp_block.weight"
CONVERSION_RECORD = "conversion.json"
"""Written next to the converted checkpoint: what it was converted from, and how."""

_FILE = re.compile(
    r"^model_(?P<last>.+?)(?:_pp-rank-(?P<pp>\d+)-of-(?P<pp_size>\d+)_tp-rank-(?P<tp>\d+)-of-(?P<tp_size>\d+)"
    r"(?P<expert>_exp-rank-\d+-of-\d+)?)?\.safetensors$"
)


class ReleaseCheckpointError(ValueError):
    """A BOOST-release folder that cannot be converted (the message names the parameter or setting and why)."""


# ---------------------------------------------------------------------------------------------- reading the folder
@dataclass
class ReleaseCheckpoint:
    """A release checkpoint read back: the model config, every parameter whole (shards put back together), the TP and
    PP sizes its files were written at, and the files read."""

    folder: Path
    model_config: dict
    tensors: dict[str, torch.Tensor]
    tp_size: int
    pp_size: int
    files: int


def _parse_slice(text: str) -> slice:
    return slice(*(None if part == "None" else int(part) for part in text.split(",")))


def _parse_slices_pairs(text: str) -> list[tuple[tuple[slice, ...], tuple[slice, ...]]]:
    """Nanotron's ``local_global_slices_pairs`` string (``SlicesPair.tuple_to_str``) as ``[(local, global), ...]``."""
    pairs = []
    for pair in text.split(";"):
        local, whole = pair.split("#")
        pairs.append((tuple(map(_parse_slice, local.split("|"))), tuple(map(_parse_slice, whole.split("|")))))
    return pairs


def _parse_shape(text: str) -> tuple[int, ...]:
    return tuple(int(size) for size in text.strip("()").split(",") if size.strip())


def step_folder(folder: str | os.PathLike) -> Path:
    """The checkpoint folder to read: ``folder`` itself when it holds ``model/``, else the step that
    ``folder/latest.txt`` names (the release's ``checkpoints_path``)."""
    folder = Path(folder)
    if (folder / "model").is_dir():
        return folder
    latest = folder / "latest.txt"
    if latest.is_file():
        step = folder / latest.read_text().strip()
        if (step / "model").is_dir():
            return step
        raise ReleaseCheckpointError(f"{latest} names step {latest.read_text().strip()!r}, but {step} has no model/ folder.")
    raise ReleaseCheckpointError(
        f"{folder} is not a BOOST-release checkpoint: it has no model/ folder (one safetensors file per parameter and TP "
        "rank) and no latest.txt. Pass the step folder the release wrote (<checkpoints_path>/<step>)."
    )


def _read_model_config(folder: Path) -> dict:
    """The model's config: ``model_config.json``, else ``config.yaml``'s ``model.model_config``."""
    if (folder / "model_config.json").is_file():
        return json.loads((folder / "model_config.json").read_text())
    training = {}
    if (folder / "config.yaml").is_file():
        training = yaml.safe_load((folder / "config.yaml").read_text()) or {}
    model_config = (training.get("model") or {}).get("model_config")
    if not model_config:
        raise ReleaseCheckpointError(f"{folder} has neither model_config.json nor a model.model_config in config.yaml: the model's sizes are unknown.")
    return model_config


def read_boost_release(folder: str | os.PathLike) -> ReleaseCheckpoint:
    """Read every parameter of a release checkpoint, each put back whole from its TP shards (by their slice metadata).

    Raises :class:`ReleaseCheckpointError` for an unknown file, expert-parallel shards, shards written at different
    TP or PP sizes, a missing or duplicated TP rank, slices that do not tile the unsharded tensor exactly once."""
    folder = step_folder(folder)
    model_config = _read_model_config(folder)
    shards: dict[str, list[tuple[Path, int | None, int | None, int | None, int | None]]] = {}
    root = folder / "model"
    for path in sorted(root.rglob("*.safetensors")):
        match = _FILE.match(path.name)
        if match is None:
            raise ReleaseCheckpointError(f"{path}: not a Nanotron parameter file name (model_<name>[_pp-rank-i-of-P_tp-rank-j-of-T].safetensors).")
        if match["expert"]:
            raise ReleaseCheckpointError(f"{path}: expert-parallel shards (mixture-of-experts models) are not converted.")
        name = ".".join([*path.parent.relative_to(root).parts, match["last"]])
        ranks = tuple(None if match[key] is None else int(match[key]) for key in ("tp", "tp_size", "pp", "pp_size"))
        shards.setdefault(name, []).append((path, *ranks))
    if not shards:
        raise ReleaseCheckpointError(f"{root} holds no parameter file.")
    tp_sizes = {tp_size for files in shards.values() for _, _, tp_size, _, _ in files if tp_size is not None}
    pp_sizes = {pp_size for files in shards.values() for _, _, _, _, pp_size in files if pp_size is not None}
    if len(tp_sizes) > 1 or len(pp_sizes) > 1:
        raise ReleaseCheckpointError(f"{root} mixes files written at TP sizes {sorted(tp_sizes)} and PP sizes {sorted(pp_sizes)}: one save, one layout.")
    tensors = {name: _whole_tensor(name, files) for name, files in shards.items()}
    return ReleaseCheckpoint(folder=folder, model_config=model_config, tensors=tensors, tp_size=next(iter(tp_sizes), 1),
                             pp_size=next(iter(pp_sizes), 1), files=sum(map(len, shards.values())))


def _read_parameter_file(path: Path) -> tuple[dict, torch.Tensor]:
    """``(metadata, tensor "data")`` of one parameter file; :class:`ReleaseCheckpointError` naming the file and the
    reader's error when it cannot be read (truncated, damaged, not safetensors)."""
    try:
        with safe_open(path, framework="pt") as f:
            return f.metadata() or {}, f.get_tensor("data")
    except (SafetensorError, OSError) as error:
        raise ReleaseCheckpointError(
            f"{path}: cannot be read as a safetensors parameter file ({type(error).__name__}: {error}); the file is damaged, "
            "truncated or still being copied: copy it again from the release."
        ) from error


def _whole_tensor(name: str, files: list) -> torch.Tensor:
    """One parameter from its files: the single unsharded file, or every TP rank's shard placed by its metadata."""
    if len(files) == 1 and files[0][1] is None:
        return _read_parameter_file(files[0][0])[1]
    if any(tp is None for _, tp, _, _, _ in files):
        raise ReleaseCheckpointError(f"{name}: written both whole and as TP shards ({[str(f[0].name) for f in files]}).")
    tp_size = files[0][2]
    ranks = sorted(tp for _, tp, _, _, _ in files)
    if ranks != list(range(tp_size)):
        missing = sorted(set(range(tp_size)) - set(ranks))
        raise ReleaseCheckpointError(
            f"{name}: the shards of TP ranks {missing or ranks} of {tp_size} are "
            f"{'missing' if missing else 'duplicated'} in {files[0][0].parent}: the parameter cannot be put back together."
        )
    whole = covered = None
    for path, tp_rank, _, _, _ in files:
        metadata, shard = _read_parameter_file(path)
        version = metadata.get("version")
        if version not in RELEASE_CHECKPOINT_VERSIONS or "unsharded_shape" not in metadata or "local_global_slices_pairs" not in metadata:
            raise ReleaseCheckpointError(
                f"{path}: a TP shard without Nanotron's slice metadata of a known version ({', '.join(RELEASE_CHECKPOINT_VERSIONS)}): "
                f"got {dict(metadata)!r}."
            )
        shape = _parse_shape(metadata["unsharded_shape"])
        if whole is None:
            whole, covered = torch.empty(shape, dtype=shard.dtype), torch.zeros(shape, dtype=torch.uint8)
        elif tuple(whole.shape) != shape:
            raise ReleaseCheckpointError(f"{name}: its shards disagree on the unsharded shape ({tuple(whole.shape)} and {shape}, {path.name}).")
        for local, target in _parse_slices_pairs(metadata["local_global_slices_pairs"]):
            try:
                whole[target] = shard[local]
            except (RuntimeError, IndexError) as error:
                raise ReleaseCheckpointError(f"{path}: its slices do not fit the unsharded shape {shape}: {error}") from error
            covered[target] += 1
    if not bool((covered == 1).all()):
        raise ReleaseCheckpointError(
            f"{name}: the TP shards' slices cover {int((covered > 0).sum())} of {covered.numel()} elements "
            f"({int((covered > 1).sum())} more than once): the shards do not tile the tensor."
        )
    return whole


# ---------------------------------------------------------------------------------------------- the release's models
class _Taken:
    """The release's tensors, each taken at most once by a rule; what no rule took is refused, named."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.left = dict(tensors)

    def __call__(self, name: str, hint: str = "") -> torch.Tensor:
        if name not in self.left:
            raise ReleaseCheckpointError(f"the checkpoint has no parameter {name}, which its model needs{hint}.")
        return self.left.pop(name)


def _split_rows(tensor: torch.Tensor, name: str, rank: int, parts: int) -> tuple[torch.Tensor, ...]:
    if tensor.dim() != 2 or tensor.shape[0] != parts * rank:
        raise ReleaseCheckpointError(f"{name} has shape {tuple(tensor.shape)}: expected [{parts} x rank {rank}, in] (fused A's).")
    return tensor.split(rank)


def _unbind(tensor: torch.Tensor, name: str, parts: int) -> tuple[torch.Tensor, ...]:
    if tensor.dim() != 3 or tensor.shape[0] != parts:
        raise ReleaseCheckpointError(f"{name} has shape {tuple(tensor.shape)}: expected [{parts}, out, rank] (batched B's).")
    return tensor.unbind(0)


def _btp_layer(take: _Taken, p: str, rank: int, gqa: bool) -> dict[str, tuple[torch.Tensor, str]]:
    """cola_llama.py (BTP): fused ``qkv_proj0`` / ``gate_up_proj0`` A's, batched B's."""
    A_q, A_k, A_v = _split_rows(take(f"{p}attn.qkv_proj0.weight"), f"{p}attn.qkv_proj0.weight", rank, 3)
    if gqa:
        B_q = take(f"{p}attn.q_proj1.weight", " (num_key_value_heads < num_attention_heads: q_proj1 and kv_proj1)")
        B_k, B_v = _unbind(take(f"{p}attn.kv_proj1.weight"), f"{p}attn.kv_proj1.weight", 2)
    else:
        B_q, B_k, B_v = _unbind(take(f"{p}attn.qkv_proj1.weight"), f"{p}attn.qkv_proj1.weight", 3)
    A_gate, A_up = _split_rows(take(f"{p}mlp.gate_up_proj0.weight"), f"{p}mlp.gate_up_proj0.weight", rank, 2)
    B_gate, B_up = _unbind(take(f"{p}mlp.gate_up_proj1.weight"), f"{p}mlp.gate_up_proj1.weight", 2)
    return {
        "self_attn.q_proj": (A_q, B_q, "attn.qkv_proj0/qkv_proj1"), "self_attn.k_proj": (A_k, B_k, "attn.qkv_proj0/qkv_proj1"),
        "self_attn.v_proj": (A_v, B_v, "attn.qkv_proj0/qkv_proj1"),
        "self_attn.o_proj": (take(f"{p}attn.o_proj0.weight"), take(f"{p}attn.o_proj1.weight"), "attn.o_proj0/o_proj1"),
        "mlp.gate_proj": (A_gate, B_gate, "mlp.gate_up_proj0/gate_up_proj1"), "mlp.up_proj": (A_up, B_up, "mlp.gate_up_proj0/gate_up_proj1"),
        "mlp.down_proj": (take(f"{p}mlp.down_proj0.weight"), take(f"{p}mlp.down_proj1.weight"), "mlp.down_proj0/down_proj1"),
    }


def _vanilla_layer(take: _Taken, p: str, rank: int, gqa: bool) -> dict:
    """vanilla_cola_llama.py: fused A's (split inside each chunk), separate B's."""
    A_q, A_k, A_v = _split_rows(take(f"{p}attn.qkv_proj0.weight"), f"{p}attn.qkv_proj0.weight", rank, 3)
    A_gate, A_up = _split_rows(take(f"{p}mlp.gate_up_proj0.weight"), f"{p}mlp.gate_up_proj0.weight", rank, 2)
    projections = {f"self_attn.{x}_proj": (A, take(f"{p}attn.{x}_proj1.weight"), f"attn.qkv_proj0/{x}_proj1")
                   for x, A in (("q", A_q), ("k", A_k), ("v", A_v))}
    projections["self_attn.o_proj"] = (take(f"{p}attn.o_proj0.weight"), take(f"{p}attn.o_proj1.weight"), "attn.o_proj0/o_proj1")
    projections |= {f"mlp.{x}_proj": (A, take(f"{p}mlp.{x}_proj1.weight"), f"mlp.gate_up_proj0/{x}_proj1") for x, A in (("gate", A_gate), ("up", A_up))}
    projections["mlp.down_proj"] = (take(f"{p}mlp.down_proj0.weight"), take(f"{p}mlp.down_proj1.weight"), "mlp.down_proj0/down_proj1")
    return projections


def _basic_layer(take: _Taken, p: str, rank: int, gqa: bool) -> dict:
    """basic_cola_llama.py (no TP): ``ColaLayer``'s ``cola_a [in, r]`` and ``cola_b [r, out]``, transposed."""
    projections = {}
    for module, release in [*((f"self_attn.{x}_proj", f"attn.{x}_proj") for x in "qkvo"),
                            *((f"mlp.{x}_proj", f"mlp.{x}_proj") for x in ("gate", "up", "down"))]:
        a, b = take(f"{p}{release}.cola_a"), take(f"{p}{release}.cola_b")
        projections[module] = (a.T, b.T, f"{release}.cola_a/cola_b (transposed)")
    return projections


@dataclass(frozen=True)
class ReleaseLayout:
    """One of the release's model files: how to recognise it (a parameter of its first layer), read its layers, and
    whether its MLP keeps the SwiGLU activation on the gate."""

    name: str
    source: str
    marker: str
    read_layer: Callable[[_Taken, str, int, bool], dict]  # (take, layer prefix, rank, gqa) -> {module: (A, B, source)}
    keeps_gate_activation: Callable[[dict], bool]  # the release's model config -> whether act(gate) * up


RELEASE_LAYOUTS = (
    ReleaseLayout("btp", "examples/cola/cola_llama.py", "attn.qkv_proj0.weight", _btp_layer, lambda config: False),
    ReleaseLayout("vanilla", "examples/cola/vanilla_cola_llama.py", "attn.k_proj1.weight", _vanilla_layer, lambda config: False),
    ReleaseLayout("basic", "examples/cola/basic_cola_llama.py", "attn.q_proj.cola_a", _basic_layer,
                  lambda config: bool(config.get("both_act", False))),
)
TT_MARKER = "attn.q_proj.cores.0"
TENSOR_TRAIN = ReleaseLayout("tt", "examples/tensor/basic_tt_llama.py", TT_MARKER, lambda *args: {}, lambda config: True)
"""The release's tensor-train model (its layers are read by :func:`_tensor_train_layer`)."""


def _tensor_train_layer(take: _Taken, p: str, config: BoostLlamaConfig) -> dict[str, tuple[torch.Tensor, str]]:
    """basic_tt_llama.py: each projection's cores, under our names (``self_attn.q_proj.cores.0``, ...)."""
    state = {}
    for module, release in [*((f"self_attn.{x}_proj", f"attn.{x}_proj") for x in "qkvo"),
                            *((f"mlp.{x}_proj", f"mlp.{x}_proj") for x in ("gate", "up", "down"))]:
        for i in range(config.tt_cores):
            state[f"{module}.cores.{i}"] = (take(f"{p}{release}.cores.{i}", f" (tt_cores={config.tt_cores})"), f"{release}.cores.{i}")
    return state


def _layout_of(tensors: dict[str, torch.Tensor]) -> ReleaseLayout:
    first = LAYER_PREFIX.format(layer=0)
    if f"{first}{TT_MARKER}" in tensors:
        if f"{first}attn.q_proj.bias" in tensors:
            raise ReleaseCheckpointError(
                f"{first}attn.q_proj.bias: a tensor-train model of the release's vanilla_tt_llama.py, which computes another "
                "function than its basic_tt_llama.py: a bias on q_proj, and its attention views the [seq, batch, ...] "
                "projections as [batch, seq, ...] without transposing (at TP > 1 it cannot run at all). Not converted."
            )
        return TENSOR_TRAIN
    vanilla = f"{first}attn.k_proj1.weight" in tensors
    for layout in RELEASE_LAYOUTS:
        if layout.name == "btp" and vanilla:
            continue
        if f"{first}{layout.marker}" in tensors:
            return layout
    raise ReleaseCheckpointError(
        f"no CoLA model of the release recognised: layer 0 has {sorted(n[len(first):] for n in tensors if n.startswith(first))}, "
        "none of the BTP (attn.qkv_proj0 with qkv_proj1 or q_proj1/kv_proj1), vanilla (attn.k_proj1) or no-TP "
        "(attn.q_proj.cola_a) parameters."
    )


def _tensor_train_fields(release: ReleaseCheckpoint) -> dict:
    """Our tensor-train fields of the release's ``TTLlamaConfig`` (refusing what its basic model cannot have trained)."""
    c = release.model_config
    missing = [key for key in ("tt_rank", "tt_cores") if key not in c]
    if missing:
        raise ReleaseCheckpointError(f"the release's model config lacks {missing}: not a tensor-train model config (TTLlamaConfig).")
    if release.tp_size > 1:
        raise ReleaseCheckpointError(
            f"a tensor-train checkpoint written at TP {release.tp_size}: the release's basic_tt_llama.py refuses TP > 1 "
            "('TP>1 not supported for TT'), so this folder is not one of its models. Not converted."
        )
    if c.get("num_key_value_heads") not in (None, c["num_attention_heads"]):
        raise ReleaseCheckpointError(
            f"num_key_value_heads={c['num_key_value_heads']} differs from num_attention_heads={c['num_attention_heads']}: the "
            "release's basic_tt_llama.py cannot run GQA (its GQA branch reads an undefined qkv_states). Not converted."
        )
    if c.get("rope_interleaved"):
        raise ReleaseCheckpointError(
            "rope_interleaved=True in a tensor-train checkpoint: boost-hf rotates (i, i + head_dim/2) pairs, and the output "
            "rows of a tensor train cannot be reordered within each head to match the release's (2i, 2i + 1) pairs. Not converted."
        )
    return dict(bottleneck="tt", tt_rank=c["tt_rank"], tt_cores=c["tt_cores"], tt_rank_ratio=c.get("tt_rank_ratio", 1.0))


def boost_config(release: ReleaseCheckpoint, layout: ReleaseLayout) -> BoostLlamaConfig:
    """Our config of the release's model config (refusing what computes another function or cannot be represented)."""
    c = release.model_config
    ranks = () if layout is TENSOR_TRAIN else ("attn_rank", "mlp_rank")
    required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size", *ranks)
    missing = [key for key in required if key not in c]
    if missing:
        raise ReleaseCheckpointError(f"the release's model config lacks {missing}: not a model config of its CoLA or tensor-train models.")
    if layout is TENSOR_TRAIN:
        bottleneck = _tensor_train_fields(release)
    elif c["attn_rank"] != c["mlp_rank"]:
        raise ReleaseCheckpointError(
            f"attn_rank={c['attn_rank']} and mlp_rank={c['mlp_rank']} differ: boost-hf's models have one rank for every projection."
        )
    else:
        bottleneck = dict(bottleneck="cola", rank=c["attn_rank"], only_lr_act=not layout.keeps_gate_activation(c))
    if c.get("rope_scaling"):
        raise ReleaseCheckpointError(f"rope_scaling={c['rope_scaling']!r}: the release's models ignore it and boost-hf would apply it; not converted.")
    if layout.name == "btp" and release.tp_size > 1 and c.get("rmsnorm_type", "triton") not in ("sync", "online"):
        raise ReleaseCheckpointError(
            f"rmsnorm_type={c.get('rmsnorm_type', 'triton')!r} at TP {release.tp_size}: the release's BTP model then normalises "
            f"each rank's d/{release.tp_size} slice of the residual by that slice's own statistics (another function than "
            "RMSNorm, which depends on the TP size), and its checkpoint holds only TP rank 0's slice of every decoder norm "
            "weight (model.decoder.<l>.pp_block.input_layernorm.weight / post_attention_layernorm.weight are marked tied "
            "across TP, so one rank writes them): the other slices are not in the folder. Train with rmsnorm_type sync or online."
        )
    heads = c["num_attention_heads"]
    return BoostLlamaConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=c.get("num_key_value_heads") or heads, hidden_act=c.get("hidden_act", "silu"),
        lr_act=c.get("hidden_act", "silu"), max_position_embeddings=c.get("max_position_embeddings", 2048),
        initializer_range=c.get("initializer_range", 0.02), rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        rope_theta=float(c.get("rope_theta", 10000.0)), tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        pad_token_id=c.get("pad_token_id"), bos_token_id=c.get("bos_token_id", 1), eos_token_id=c.get("eos_token_id", 2),
        **bottleneck,
    )


def _interleaved_to_halves(head_dim: int) -> torch.Tensor:
    """Row order that turns RoPE on pairs ``(2i, 2i+1)`` into RoPE on ``(i, i + head_dim/2)``."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def canonical_state_dict(release: ReleaseCheckpoint) -> tuple[BoostLlamaConfig, dict[str, torch.Tensor], dict]:
    """``(config, state dict in canonical names, record of the conversion)`` of a release checkpoint."""
    layout = _layout_of(release.tensors)
    config = boost_config(release, layout)
    take, rank = _Taken(release.tensors), config.rank
    gqa = config.num_key_value_heads != config.num_attention_heads
    interleaved = bool(release.model_config.get("rope_interleaved", False))
    order = _interleaved_to_halves(config.head_dim)
    state, sources = {"model.embed_tokens.weight": take(EMBEDDING)}, {"model.embed_tokens.weight": EMBEDDING}
    for layer in range(config.num_hidden_layers):
        p = LAYER_PREFIX.format(layer=layer)
        ours = f"model.layers.{layer}."
        if layout is TENSOR_TRAIN:
            for name, (core, source) in _tensor_train_layer(take, p, config).items():
                state[f"{ours}{name}"], sources[f"{ours}{name}"] = core, p + source
        for module, (A, B, source) in layout.read_layer(take, p, rank, gqa).items():
            if interleaved and module in ("self_attn.q_proj", "self_attn.k_proj"):
                B = B.unflatten(0, (-1, config.head_dim))[:, order].flatten(0, 1)
            state[f"{ours}{module}.A"], state[f"{ours}{module}.B"] = A.contiguous(), B.contiguous()
            sources[f"{ours}{module}.A"] = sources[f"{ours}{module}.B"] = p + source
        for norm in ("input_layernorm", "post_attention_layernorm"):
            hint = " (a run with COLA_DISABLE_ALL_RMSNORM=1 has no decoder norms: not a LLaMA, not converted)"
            state[f"{ours}{norm}.weight"], sources[f"{ours}{norm}.weight"] = take(f"{p}{norm}.weight", hint), f"{p}{norm}.weight"
    state["model.norm.weight"], sources["model.norm.weight"] = take(FINAL_NORM), FINAL_NORM
    if not config.tie_word_embeddings:
        state["lm_head.weight"], sources["lm_head.weight"] = take(LM_HEAD, " (tie_word_embeddings is false)"), LM_HEAD
    if take.left:
        raise ReleaseCheckpointError(
            f"parameters of the checkpoint that no rule of the {layout.name} model maps (nothing is dropped silently): "
            f"{sorted(take.left)}"
        )
    _check_shapes(config, state, sources)
    record = {
        "converted_from": "BOOST release (Arcana-2236/BOOST, Nanotron)", "folder": str(release.folder.resolve()),
        "model": layout.source, "tp_size": release.tp_size, "pp_size": release.pp_size, "files_read": release.files,
        "rmsnorm_type": release.model_config.get("rmsnorm_type"), "rope_interleaved_rows_reordered": interleaved,
        "sources": sources,
    }
    return config, state, record


def _check_shapes(config: BoostLlamaConfig, state: dict, sources: dict) -> None:
    """Every tensor at the shape our model has for it, else an error naming the release parameter it came from."""
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in _empty_model(config).state_dict().items()}
    for name, tensor in state.items():
        if name in expected and tuple(tensor.shape) != expected[name]:
            raise ReleaseCheckpointError(
                f"{sources[name]} gives {name} the shape {tuple(tensor.shape)}, but the release's model config "
                f"(hidden {config.hidden_size}, intermediate {config.intermediate_size}, heads {config.num_attention_heads}/"
                f"{config.num_key_value_heads}, rank {config.rank}, vocab {config.vocab_size}) makes it {expected[name]}."
            )


def _empty_model(config: BoostLlamaConfig):
    from transformers.initialization import no_init_weights

    from ..modeling_boost_llama import BoostLlamaForCausalLM

    with no_init_weights():
        return BoostLlamaForCausalLM(config)


# ---------------------------------------------------------------------------------------------- entry points
def load_boost_release(folder: str | os.PathLike, dtype: torch.dtype | None = None):
    """A :class:`~boost_hf.BoostLlamaForCausalLM` holding a release checkpoint's weights (in ``dtype``, default the
    checkpoint's), converted in memory; ``model.boost_release_conversion`` records from what and how."""
    config, state, record = canonical_state_dict(read_boost_release(folder))
    if dtype is not None:
        state = {name: tensor.to(dtype) for name, tensor in state.items()}
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    with torch.device("meta"):
        model = _empty_model(config)
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # its frequencies, built on the meta device
    model.boost_release_conversion = record
    return model.eval()


def convert_boost_release(folder: str | os.PathLike, output: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
    """Write a release checkpoint as a canonical boost-hf checkpoint in ``output`` (which must not exist): weights in
    canonical names (``save_pretrained``, loadable with ``from_pretrained`` at any TP size, remote code included),
    ``conversion.json`` (what it was converted from, the release parameter behind each tensor) and ``manifest.json``
    (written last, with the architecture record). Written into a staging folder renamed at the end: an interrupted
    conversion leaves no folder that looks complete."""
    output = Path(output)
    if output.exists():
        raise ReleaseCheckpointError(f"output {output} exists: choose a new folder (nothing is overwritten).")
    model = load_boost_release(folder, dtype)
    staging = output.parent / f".{output.name}.converting-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(staging)
        (staging / CONVERSION_RECORD).write_text(json.dumps(model.boost_release_conversion, indent=1))
        write_manifest(str(staging), model.config)
        os.replace(staging, output)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return output


__all__ = ["RELEASE_LAYOUTS", "ReleaseCheckpoint", "ReleaseCheckpointError", "canonical_state_dict", "convert_boost_release",
           "load_boost_release", "read_boost_release", "step_folder"]
