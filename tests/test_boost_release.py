"""``boost-hf convert``: a checkpoint of the BOOST authors' release (``Arcana-2236/BOOST``, Nanotron) becomes a canonical
boost-hf checkpoint computing the release model's logits.

The release folders are written here as the release writes them (read from its ``src/nanotron/serialize/weights.py``,
``serialize/utils.py``, ``parallel/sharded_parameters.py``, ``trainer.py``, the three CoLA models of
``examples/cola/`` and the tensor-train model ``examples/tensor/basic_tt_llama.py``): one safetensors file per parameter and TP rank named ``model_<last>_pp-rank-i-of-P_tp-rank-j-of-T``
with Nanotron's slice metadata, a split dimension (and chunks) per module type, parameters not sharded written once
without metadata, the LM head absent when tied, ``model_config.json``, ``config.yaml``, ``checkpoint_metadata.json``
and ``latest.txt``. The reference is the release's forward written here on the whole (release-named) tensors, in
float64: fused ``A``'s, batched ``B``'s, flash-attn's rotary (interleaved or not), causal attention.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from boost_hf import BoostLlamaForCausalLM
from boost_hf.cli import main as cli
from boost_hf.configuration_boost_llama import tensor_train_shape
from boost_hf.convert import ReleaseCheckpointError, convert_boost_release

from .test_tensor_train import tensor_train_weight
from .tolerances import assert_scaled_close, fp32_rounding

SIZE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, rank=8, layers=4, tt_cores=4)
P = "model.decoder.{l}.pp_block."
# Logits of 4 blocks in fp32 against float64: 4 x 10 chained reductions of <= 64 terms, and a tensor train's weight
# contracted from 4 cores of bond 8 first (3 x 8 more per element): what fp32 rounding allows (tests/tolerances.py).
RELEASE_LOGITS = fp32_rounding(4 * 10 * 64 + 3 * 8)  # 1.82e-5 (measured: 2e-7 to 6e-7, the tensor train 4.7e-6 to 1.1e-5)


# ---------------------------------------------------------------------------------------------- the release's weights
def release_weights(layout: str, *, kv_heads: int, tied: bool, layers: int, gen: torch.Generator, norms: bool = True) -> dict:
    """Whole tensors under the release's names for ``layout`` (btp, vanilla, basic, tt): ``name -> (tensor, split)``,
    ``split`` = ``(dim, chunks)`` as the release's module shards it over TP, or ``None`` (not sharded)."""
    d, f, r, V = SIZE["hidden_size"], SIZE["intermediate_size"], SIZE["rank"], SIZE["vocab_size"]
    H, dh = SIZE["num_attention_heads"], SIZE["hidden_size"] // SIZE["num_attention_heads"]
    q, kv = H * dh, kv_heads * dh

    def w(*shape, std=0.3):
        return torch.randn(*shape, generator=gen) * std

    weights = {"model.token_position_embeddings.pp_block.token_embedding.weight": (w(V, d, std=1.0), (0, None)),
               "model.final_layer_norm.pp_block.weight": (1 + w(d, std=0.1), None)}
    if not tied:
        weights["model.lm_head.pp_block.weight"] = (w(V, d), (0, None))
    for l in range(layers):
        p = P.format(l=l)
        if layout == "btp":  # cola_llama.py: Row (dim 1), Column (dim 0), Batched column (dim 1)
            weights[p + "attn.qkv_proj0.weight"] = (w(3 * r, d), (1, None))
            if kv_heads == H:
                weights[p + "attn.qkv_proj1.weight"] = (w(3, q, r), (1, None))
            else:
                weights[p + "attn.q_proj1.weight"] = (w(q, r), (0, None))
                weights[p + "attn.kv_proj1.weight"] = (w(2, kv, r), (1, None))
            weights[p + "attn.o_proj0.weight"] = (w(r, q), (1, None))
            weights[p + "attn.o_proj1.weight"] = (w(d, r), (0, None))
            weights[p + "mlp.gate_up_proj0.weight"] = (w(2 * r, d), (1, None))
            weights[p + "mlp.gate_up_proj1.weight"] = (w(2, f, r), (1, None))
            weights[p + "mlp.down_proj0.weight"] = (w(r, f), (1, None))
            weights[p + "mlp.down_proj1.weight"] = (w(d, r), (0, None))
            norm_split = (0, None)  # SyncRMSNorm / OnlineRMSNorm: d / T per rank, marked sharded
        elif layout == "vanilla":  # vanilla_cola_llama.py: the A's column-parallel inside each chunk, the B's row-parallel
            weights[p + "attn.qkv_proj0.weight"] = (w(3 * r, d), (0, (r, r, r)))
            for x, out in (("q", q), ("k", kv), ("v", kv)):
                weights[p + f"attn.{x}_proj1.weight"] = (w(out, r), (1, None))
            weights[p + "attn.o_proj0.weight"] = (w(r, q), (0, None))
            weights[p + "attn.o_proj1.weight"] = (w(d, r), (1, None))
            weights[p + "mlp.gate_up_proj0.weight"] = (w(2 * r, d), (0, (r, r)))
            weights[p + "mlp.gate_proj1.weight"] = (w(f, r), (1, None))
            weights[p + "mlp.up_proj1.weight"] = (w(f, r), (1, None))
            weights[p + "mlp.down_proj0.weight"] = (w(r, f), (0, None))
            weights[p + "mlp.down_proj1.weight"] = (w(d, r), (1, None))
            norm_split = None  # TritonRMSNorm(d), replicated
        elif layout == "tt":  # basic_tt_llama.py: TensorTrainLinear's cores [rank_in, mode, rank_out], replicated
            for name, (fan_in, out) in {"attn.q": (d, q), "attn.k": (d, kv), "attn.v": (d, kv), "attn.o": (q, d),
                                        "mlp.gate": (d, f), "mlp.up": (d, f), "mlp.down": (f, d)}.items():
                for i, core in enumerate(tensor_train_shape(fan_in, out, r, SIZE["tt_cores"]).core_shapes):
                    weights[p + f"{name}_proj.cores.{i}"] = (w(*core, std=0.4), None)
            norm_split = None
        else:  # basic_cola_llama.py: ColaLayer cola_a [in, r], cola_b [r, out], replicated
            for x, (fan_in, out) in {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d)}.items():
                weights[p + f"attn.{x}_proj.cola_a"], weights[p + f"attn.{x}_proj.cola_b"] = (w(fan_in, r), None), (w(r, out), None)
            for x, (fan_in, out) in {"gate": (d, f), "up": (d, f), "down": (f, d)}.items():
                weights[p + f"mlp.{x}_proj.cola_a"], weights[p + f"mlp.{x}_proj.cola_b"] = (w(fan_in, r), None), (w(r, out), None)
            norm_split = None
        if norms:
            for norm in ("input_layernorm", "post_attention_layernorm"):
                weights[p + f"{norm}.weight"] = (1 + w(d, std=0.1), norm_split)
    return weights


# ---------------------------------------------------------------------------------------------- written as Nanotron does
def _slice_text(s: slice) -> str:
    return ",".join("None" if x is None else str(x) for x in (s.start, s.stop, s.step))


def nanotron_shards(tensor: torch.Tensor, dim: int, chunks, tp: int) -> list[tuple[torch.Tensor, str]]:
    """Each TP rank's shard and its ``local_global_slices_pairs`` string, as ``create_sharded_parameter_from_config``
    makes them: without chunks the rank's contiguous block (local slices ``None,None,None``); with chunks the rank's
    block of each chunk, one slices pair per chunk."""
    full = tuple(slice(None) for _ in tensor.shape)
    shards = []
    for rank in range(tp):
        if chunks is None:
            length = tensor.shape[dim] // tp
            target = tuple(slice(rank * length, (rank + 1) * length) if i == dim else s for i, s in enumerate(full))
            pairs = [(full, target)]
            local = tensor[target]
        else:
            pairs, pieces, start = [], [], 0
            for chunk in chunks:
                length = chunk // tp
                where = len(pieces) * length
                local_slice = tuple(slice(where, where + length) if i == dim else s for i, s in enumerate(full))
                target = tuple(slice(start + rank * length, start + (rank + 1) * length) if i == dim else s for i, s in enumerate(full))
                pairs.append((local_slice, target))
                pieces.append(tensor[target])
                start += chunk
            local = torch.cat(pieces, dim)
        text = ";".join("|".join(map(_slice_text, a)) + "#" + "|".join(map(_slice_text, b)) for a, b in pairs)
        shards.append((local.contiguous(), text))
    return shards


def stage_of(name: str, layers: int, pp: int) -> int:
    if ".decoder." in name:
        return int(name.split(".")[2]) * pp // layers
    return 0 if "token_embedding" in name else pp - 1


def write_release_checkpoint(root: Path, weights: dict, model_config: dict, *, tp: int, pp: int, step: int = 100,
                             dtype=torch.float32, local_norm_slice: bool = False) -> Path:
    """``<root>/<step>/`` as the release's trainer writes it (model files only from DP rank 0; ``latest.txt`` in
    ``root``). ``local_norm_slice``: BTP's ``triton`` norm at TP > 1, whose ``d / T`` weights are marked tied across
    TP, so only rank 0's slice is written."""
    folder = root / str(step)
    for name, (tensor, split) in weights.items():
        *path, last = name.split(".")
        where = folder / "model" / Path(*path)
        where.mkdir(parents=True, exist_ok=True)
        tensor = tensor.to(dtype)
        if split is None:
            if local_norm_slice and "layernorm" in name and "final" not in name:
                tensor = tensor[: tensor.shape[0] // tp]
            save_file({"data": tensor.contiguous()}, str(where / f"model_{last}.safetensors"), metadata={})
            continue
        for rank, (shard, pairs) in enumerate(nanotron_shards(tensor, *split, tp)):
            metadata = {"version": "1.4", "local_global_slices_pairs": pairs, "unsharded_shape": str(tuple(tensor.shape))}
            file = f"model_{last}_pp-rank-{stage_of(name, SIZE['layers'], pp)}-of-{pp}_tp-rank-{rank}-of-{tp}.safetensors"
            save_file({"data": shard}, str(where / file), metadata=metadata)
    (folder / "model_config.json").write_text(json.dumps(model_config))
    config_yaml = {"general": {"project": "test", "run": "release", "seed": 42, "step": step},
                   "model": {"dtype": "bfloat16", "init_method": {"std": 0.025}, "make_vocab_size_divisible_by": 1,
                             "model_config": model_config},
                   "parallelism": {"dp": 1, "pp": pp, "tp": tp, "pp_engine": "1f1b", "tp_mode": "ALL_REDUCE"}}
    (folder / "config.yaml").write_text(yaml.safe_dump(config_yaml))
    (folder / "checkpoint_metadata.json").write_text(json.dumps(
        {"version": "1.4", "tp": tp, "dp": 1, "custom_metas": None,
         "metas": {"consumed_train_samples": 800, "last_train_step": step, "last_stage_idx": 0,
                   "data_stages": [{"name": "Stable Training Stage", "start_training_step": 1, "consumed_train_samples": 800}]}}))
    (root / "latest.txt").write_text(str(step))
    return folder


def release_model_config(*, kv_heads: int, tied: bool, layers: int, layout: str = "btp", **extra) -> dict:
    """``asdict(ColaLlamaConfig(...))`` as ``model_config.json`` (``examples/cola/config_cola_llama.py``), or for the
    tensor-train model ``asdict(TTLlamaConfig(...))`` (``examples/tensor/config_tt_llama.py``)."""
    if layout == "tt":
        bottleneck = {"is_tt_llama_config": True, "tt_rank": SIZE["rank"], "tt_cores": SIZE["tt_cores"], "tt_rank_ratio": 1.0}
    else:
        bottleneck = {"is_cola_llama_config": True, "attn_rank": SIZE["rank"], "mlp_rank": SIZE["rank"]}
    return {"bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": SIZE["hidden_size"],
            "initializer_range": 0.02, "intermediate_size": SIZE["intermediate_size"],
            "max_position_embeddings": 64, "num_attention_heads": SIZE["num_attention_heads"], "num_hidden_layers": layers,
            "num_key_value_heads": kv_heads, "pad_token_id": None, "pretraining_tp": 1, "rms_norm_eps": 1e-6,
            "rope_scaling": None, "rope_theta": 10000.0, "rope_interleaved": False, "tie_word_embeddings": tied,
            "use_cache": True, "vocab_size": SIZE["vocab_size"], **bottleneck, **extra}


# ---------------------------------------------------------------------------------------------- the release's forward
def rotary(x: torch.Tensor, theta: float, interleaved: bool) -> torch.Tensor:
    """flash-attn's ``apply_rotary`` on ``x [b, s, heads, dh]``, positions 0..s-1: pairs ``(i, i + dh/2)`` or, interleaved,
    ``(2i, 2i + 1)``, rotated by ``pos / theta^(2i/dh)``."""
    dh = x.shape[-1]
    angle = torch.arange(x.shape[1], dtype=torch.float64)[:, None] / theta ** (torch.arange(0, dh, 2, dtype=torch.float64) / dh)
    cos, sin = angle.cos()[None, :, None], angle.sin()[None, :, None]
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., : dh // 2], x[..., dh // 2:])
    y1, y2 = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    return torch.stack([y1, y2], -1).flatten(-2) if interleaved else torch.cat([y1, y2], -1)


def release_logits(layout: str, weights: dict, config: dict, ids: torch.Tensor) -> torch.Tensor:
    """The release model's logits (float64) from its whole tensors."""
    W = {name: tensor.double() for name, (tensor, _) in weights.items()}
    act, r, eps = torch.nn.functional.silu, config.get("attn_rank"), config["rms_norm_eps"]
    H, KV = config["num_attention_heads"], config["num_key_value_heads"]
    dh = config["hidden_size"] // H

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def cola(x, p):  # basic's ColaLayer
        return act(x @ W[p + ".cola_a"]) @ W[p + ".cola_b"]

    def tensor_train(x, p):  # TensorTrainLinear: x (input cores contracted) (output cores contracted), every core here
        cores = [W[f"{p}.cores.{i}"] for i in range(config["tt_cores"])]
        return x @ tensor_train_weight(cores, config["tt_cores"] // 2)

    x = W["model.token_position_embeddings.pp_block.token_embedding.weight"][ids]
    b, s = ids.shape
    for l in range(config["num_hidden_layers"]):
        p = P.format(l=l)
        h = norm(x, W[p + "input_layernorm.weight"])
        if layout == "btp":
            latent = act(h @ W[p + "attn.qkv_proj0.weight"].T)
            if KV == H:
                q, k, v = torch.einsum("bscr,cdr->cbsd", latent.unflatten(-1, (3, r)), W[p + "attn.qkv_proj1.weight"])
            else:
                q = latent[..., :r] @ W[p + "attn.q_proj1.weight"].T
                k, v = torch.einsum("bscr,cdr->cbsd", latent[..., r:].unflatten(-1, (2, r)), W[p + "attn.kv_proj1.weight"])
        elif layout == "vanilla":
            latent = act(h @ W[p + "attn.qkv_proj0.weight"].T)
            q, k, v = (part @ W[p + f"attn.{x_}_proj1.weight"].T for part, x_ in zip(latent.split(r, -1), "qkv"))
        elif layout == "tt":
            q, k, v = (tensor_train(h, p + f"attn.{x_}_proj") for x_ in "qkv")
        else:
            q, k, v = (cola(h, p + f"attn.{x_}_proj") for x_ in "qkv")
        q, k, v = q.view(b, s, H, dh), k.view(b, s, KV, dh), v.view(b, s, KV, dh)
        q, k = (rotary(t, config["rope_theta"], config["rope_interleaved"]) for t in (q, k))
        k, v = k.repeat_interleave(H // KV, dim=2), v.repeat_interleave(H // KV, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dh)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        attention = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, s, H * dh)
        if layout == "basic":
            x = x + cola(attention, p + "attn.o_proj")
        elif layout == "tt":
            x = x + tensor_train(attention, p + "attn.o_proj")
        else:
            x = x + act(attention @ W[p + "attn.o_proj0.weight"].T) @ W[p + "attn.o_proj1.weight"].T
        h = norm(x, W[p + "post_attention_layernorm.weight"])
        if layout == "btp":
            latent = act(h @ W[p + "mlp.gate_up_proj0.weight"].T).unflatten(-1, (2, r))
            gate, up = torch.einsum("bscr,cdr->cbsd", latent, W[p + "mlp.gate_up_proj1.weight"])
        elif layout == "vanilla":
            latent_gate, latent_up = act(h @ W[p + "mlp.gate_up_proj0.weight"].T).split(r, -1)
            gate, up = latent_gate @ W[p + "mlp.gate_proj1.weight"].T, latent_up @ W[p + "mlp.up_proj1.weight"].T
        elif layout == "tt":  # its MLP keeps the SwiGLU activation on the gate
            gate, up = act(tensor_train(h, p + "mlp.gate_proj")), tensor_train(h, p + "mlp.up_proj")
        else:
            gate, up = cola(h, p + "mlp.gate_proj"), cola(h, p + "mlp.up_proj")
            gate = act(gate) if config.get("both_act") else gate
        if layout == "basic":
            x = x + cola(gate * up, p + "mlp.down_proj")
        elif layout == "tt":
            x = x + tensor_train(gate * up, p + "mlp.down_proj")
        else:
            x = x + act((gate * up) @ W[p + "mlp.down_proj0.weight"].T) @ W[p + "mlp.down_proj1.weight"].T
    x = norm(x, W["model.final_layer_norm.pp_block.weight"])
    head = W.get("model.lm_head.pp_block.weight", W["model.token_position_embeddings.pp_block.token_embedding.weight"])
    return x @ head.T


# ---------------------------------------------------------------------------------------------- cases
CASES = {
    # name: (layout, kv_heads, tied, tp, pp, storage dtype, model_config extras)
    "btp-online-tp2-pp2": ("btp", 4, False, 2, 2, torch.float32, {"rmsnorm_type": "online"}),
    "btp-gqa-sync-tied-interleaved-bf16-tp2": ("btp", 2, True, 2, 1, torch.bfloat16, {"rmsnorm_type": "sync", "rope_interleaved": True}),
    "vanilla-tp2-pp2": ("vanilla", 4, False, 2, 2, torch.float32, {"rmsnorm_type": "triton"}),
    "basic-both-act-tp2": ("basic", 2, False, 2, 1, torch.float32, {"both_act": True}),
    "tensor-train-pp2": ("tt", 4, False, 1, 2, torch.float32, {}),
}


@pytest.mark.parametrize("case", CASES)
def test_release_checkpoint_converts_to_the_release_models_logits(tmp_path, case):
    layout, kv_heads, tied, tp, pp, dtype, extra = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    weights = release_weights(layout, kv_heads=kv_heads, tied=tied, layers=SIZE["layers"], gen=gen)
    model_config = release_model_config(kv_heads=kv_heads, tied=tied, layers=SIZE["layers"], layout=layout, **extra)
    folder = write_release_checkpoint(tmp_path / "checkpoints", weights, model_config, tp=tp, pp=pp, dtype=dtype)
    if layout == "basic":
        (folder / "model_config.json").unlink()  # the model config read from config.yaml's model.model_config instead
    output = tmp_path / "converted"
    if case == "btp-online-tp2-pp2":
        assert cli(["convert", str(tmp_path / "checkpoints"), str(output)]) == 0  # the checkpoints folder: its latest.txt
    else:
        convert_boost_release(tmp_path / "checkpoints" / "100", output, dtype=torch.float32)

    model = BoostLlamaForCausalLM.from_pretrained(output, dtype=torch.float32).eval()
    config = model.config
    bottleneck = "tt" if layout == "tt" else "cola"
    assert (config.bottleneck, config.rank, config.num_key_value_heads, config.tie_word_embeddings) == (bottleneck, 8, kv_heads, tied)
    if layout == "tt":
        assert (config.tt_rank, config.tt_cores, config.tt_rank_ratio) == (8, 4, 1.0)
    else:
        assert config.only_lr_act is (layout != "basic")
    ids = torch.randint(0, SIZE["vocab_size"], (2, 12), generator=gen)
    stored = {name: (tensor.to(dtype), split) for name, (tensor, split) in weights.items()}  # what the release computed with
    expected = release_logits(layout, stored, model_config, ids)
    with torch.no_grad():
        logits = model(ids).logits.double()
    assert_scaled_close(logits, expected, RELEASE_LOGITS, case)  # fp32 against the release's function in float64
    record = json.loads((output / "conversion.json").read_text())
    source = {"btp": "cola_llama.py", "vanilla": "vanilla_cola_llama.py", "basic": "basic_cola_llama.py", "tt": "basic_tt_llama.py"}[layout]
    assert (record["tp_size"], record["pp_size"], record["model"].rsplit("/", 1)[-1]) == (tp, pp, source)
    assert record["rope_interleaved_rows_reordered"] is bool(extra.get("rope_interleaved"))
    assert (output / "manifest.json").is_file() and not list(tmp_path.glob(".converted*"))


def _release(tmp_path, norms=True, **extra) -> Path:
    """A BTP checkpoint at TP 2 (2 layers); ``rmsnorm_type: triton`` writes its decoder norms as the release does then:
    ``d / T`` weights marked tied across TP, only rank 0's written, without metadata."""
    weights = release_weights("btp", kv_heads=4, tied=False, layers=2, gen=torch.Generator().manual_seed(0), norms=norms)
    local = extra.get("rmsnorm_type") == "triton"
    if local:
        weights = {name: (tensor, None if "layernorm" in name else split) for name, (tensor, split) in weights.items()}
    model_config = release_model_config(kv_heads=4, tied=False, layers=2, **{"rmsnorm_type": "sync", **extra})
    return write_release_checkpoint(tmp_path / "checkpoints", weights, model_config, tp=2, pp=1, local_norm_slice=local)


def test_btp_local_norm_at_tp2_is_refused_with_the_reason(tmp_path):
    folder = _release(tmp_path, rmsnorm_type="triton")
    assert (folder / "model/model/decoder/0/pp_block/input_layernorm/model_weight.safetensors").is_file()
    with pytest.raises(ReleaseCheckpointError, match="rmsnorm_type='triton' at TP 2.*only TP rank 0's slice"):
        convert_boost_release(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage, message", [
    ("ranks", "attn_rank=8 and mlp_rank=16 differ"),
    ("missing-shard", r"model\.decoder\.1\.pp_block\.attn\.o_proj1\.weight: the shards of TP ranks \[1\] of 2 are missing"),
    ("extra-parameter", r"no rule of the btp model maps.*model\.decoder\.0\.pp_block\.attn\.qkv_proj0\.bias"),
    ("no-norms", r"no parameter model\.decoder\.0\.pp_block\.input_layernorm\.weight.*COLA_DISABLE_ALL_RMSNORM"),
    ("bad-slices", r"attn\.qkv_proj0\.weight: the TP shards' slices cover"),
    ("truncated-shard", r"decoder/1/pp_block/attn/o_proj1/model_weight_pp-rank-0-of-1_tp-rank-1-of-2\.safetensors: cannot be "
                        r"read as a safetensors parameter file \(SafetensorError: .*copy it again"),
    ("garbage-file", r"input_layernorm/model_weight_pp-rank-0-of-1_tp-rank-0-of-2\.safetensors: cannot be read .*\(SafetensorError: "),
])
def test_what_cannot_be_mapped_is_refused_naming_it(tmp_path, damage, message):
    folder = _release(tmp_path, norms=damage != "no-norms", **({"mlp_rank": 16} if damage == "ranks" else {}))
    layer0, layer1 = folder / "model/model/decoder/0/pp_block", folder / "model/model/decoder/1/pp_block"
    if damage == "missing-shard":
        (layer1 / "attn/o_proj1/model_weight_pp-rank-0-of-1_tp-rank-1-of-2.safetensors").unlink()
    elif damage == "extra-parameter":
        save_file({"data": torch.zeros(24)}, str(layer0 / "attn/qkv_proj0/model_bias.safetensors"))
    elif damage == "truncated-shard":  # one file of many cut short (a copy interrupted)
        path = layer1 / "attn/o_proj1/model_weight_pp-rank-0-of-1_tp-rank-1-of-2.safetensors"
        path.write_bytes(path.read_bytes()[:-40])
    elif damage == "garbage-file":
        (layer0 / "input_layernorm/model_weight_pp-rank-0-of-1_tp-rank-0-of-2.safetensors").write_bytes(b"\x00" * 64)
    elif damage == "bad-slices":  # rank 1's shard claims rank 0's columns
        path = layer0 / "attn/qkv_proj0/model_weight_pp-rank-0-of-1_tp-rank-1-of-2.safetensors"
        save_file({"data": torch.zeros(24, 16)}, str(path), metadata={
            "version": "1.4", "local_global_slices_pairs": "None,None,None|None,None,None#None,None,None|0,16,None",
            "unsharded_shape": "(24, 32)"})
    with pytest.raises(ReleaseCheckpointError, match=message):
        convert_boost_release(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage, message", [
    ("vanilla", r"attn\.q_proj\.bias: a tensor-train model of the release's vanilla_tt_llama\.py"),
    ("tp2", "a tensor-train checkpoint written at TP 2: the release's basic_tt_llama.py refuses TP > 1"),
    ("gqa", "num_key_value_heads=2 differs from num_attention_heads=4: the release's basic_tt_llama.py cannot run GQA"),
    ("interleaved", "rope_interleaved=True in a tensor-train checkpoint"),
    ("cores", r"no parameter model\.decoder\.0\.pp_block\.mlp\.down_proj\.cores\.3, which its model needs \(tt_cores=4\)"),
])
def test_what_a_tensor_train_checkpoint_cannot_be_is_refused_with_the_reason(tmp_path, damage, message):
    """The release's tensor-train models other than basic_tt_llama.py's, or settings it could not have trained with."""
    kv_heads = 2 if damage == "gqa" else 4
    weights = release_weights("tt", kv_heads=kv_heads, tied=False, layers=2, gen=torch.Generator().manual_seed(0))
    if damage == "vanilla":
        weights[P.format(l=0) + "attn.q_proj.bias"] = (torch.zeros(SIZE["hidden_size"]), None)
    if damage == "tp2":  # the embedding and head are vocabulary-parallel: they carry the TP size
        weights = {name: (tensor, (0, None) if "token_embedding" in name or "lm_head" in name else None) for name, (tensor, _) in weights.items()}
    if damage == "cores":
        del weights[P.format(l=0) + "mlp.down_proj.cores.3"]
    model_config = release_model_config(kv_heads=kv_heads, tied=False, layers=2, layout="tt", rope_interleaved=damage == "interleaved")
    folder = write_release_checkpoint(tmp_path / "checkpoints", weights, model_config, tp=2 if damage == "tp2" else 1, pp=1)
    with pytest.raises(ReleaseCheckpointError, match=message):
        convert_boost_release(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()
