"""DeepSpeed runs of grouped layouts at tp 2 (inside a launched process group; see test_deepspeed_grouped.py).

Each rank builds a tiny model at tp 2, hands it to ``deepspeed.initialize`` under boost-hf's hooks
(:func:`~boost_hf.training.deepspeed.deepspeed_initialize_hooks`), as ``BoostTrainer`` does, and takes a few steps,
recording whether the grouped projections' parameters are still stored together, the ``cat`` / ``stack`` ops of
each forward and backward, and the losses. It also trains the single-device model itself (no communication) with
the same data: in fp32, or with bf16 parameters and fp32 master weights (DeepSpeed's bf16 mode, written out).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM, ParallelConfig
from boost_hf.parallel.shared_storage import SharedStorageOwner, cast_parameters, joined_rows
from boost_hf.parallel.state import get_parallel_state
from boost_hf.training.deepspeed import ModelParallelUnit, deepspeed_initialize_hooks

SEED, STEPS, LR = 1234, 3, 1e-3
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, rank=16, max_position_embeddings=64)
MODELS = {"btp": (dict(bottleneck="cola"), dict(tp_style="btp")), "megatron": (dict(bottleneck=None), dict(tp_style="megatron"))}


class _Copies(TorchDispatchMode):
    """Counts the ``cat`` and ``stack`` ops run inside it while ``active`` (forward: inside the decoder layers, set by
    :func:`_count_in_layers`; the rotary tables and the loss concatenate outside them whatever the storage)."""

    active = True

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += self.active and func._overloadpacket.__name__ in ("cat", "stack")
        return func(*args, **(kwargs or {}))


def _count_in_layers(model) -> None:
    """Make :class:`_Copies` count in forward only inside ``model``'s decoder layers."""
    _Copies.active = False
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda *_: setattr(_Copies, "active", True))
        layer.register_forward_hook(lambda *_: setattr(_Copies, "active", False))


def _batches():
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, TINY["vocab_size"], (2, 8), generator=generator) for _ in range(STEPS)]


def _param_groups(model):
    """The two groups ``transformers.Trainer`` makes (weight decay on all but biases and norm weights)."""
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for p in model.parameters() if p.requires_grad]
    no_decay = [p for p in params if "norm" in names[id(p)] or names[id(p)].endswith("bias")]
    decay = [p for p in params if all(p is not q for q in no_decay)]
    return [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]


def _stored_together(model) -> bool:
    owners = [m for m in model.modules() if isinstance(m, SharedStorageOwner) and m.shared_storage]
    return bool(owners) and all(joined_rows(params) is not None for m in owners for params in m.parameters_stored_together())


def _deepspeed_run(config, parallel, bf16: bool) -> dict:
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    torch.manual_seed(SEED)
    model = BoostLlamaForCausalLM(config, parallel_config=parallel)
    optimizer = torch.optim.AdamW(_param_groups(model), lr=LR)
    ds_config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 2}, "bf16": {"enabled": bf16},
    }
    with deepspeed_initialize_hooks(ModelParallelUnit(get_parallel_state(parallel.tp_size))):
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    _count_in_layers(model)
    losses, copies = [], []
    for ids in _batches():
        with _Copies() as forward:
            loss = engine(ids, labels=ids, use_cache=False).loss
        _Copies.active = True
        with _Copies() as backward:
            engine.backward(loss)
        _Copies.active = False
        engine.step()
        losses.append(loss.item())
        copies.append([forward.count, backward.count])
    return {"stored_together": _stored_together(model), "dtypes": dtypes, "losses": losses, "copies": copies}


def _reference_run(config, bf16: bool) -> list[float]:
    """The single-device model; with ``bf16``: bf16 parameters, gradients applied to fp32 master weights by AdamW
    and cast back after each step."""
    torch.manual_seed(SEED)
    model = BoostLlamaForCausalLM(config).train()
    masters = [p.detach().clone() for p in model.parameters()]
    if bf16:
        cast_parameters(model, torch.bfloat16)
    groups = _param_groups(model)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    optimizer = torch.optim.AdamW([{**g, "params": [masters[index[id(p)]] for p in g["params"]]} for g in groups], lr=LR)
    losses = []
    for ids in _batches():
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        for param, master in zip(model.parameters(), masters):
            master.grad = param.grad.float()
            param.grad = None
        optimizer.step()
        with torch.no_grad():
            for param, master in zip(model.parameters(), masters):
                param.copy_(master)
        losses.append(loss.item())
    return losses


def everything() -> dict:
    # what a launcher sets, which DeepSpeed reads (the gloo process group is already up)
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(dist.get_rank()), RANK=str(dist.get_rank()),
                      WORLD_SIZE=str(dist.get_world_size()))
    results = {}
    for name, (model_fields, parallel_fields) in MODELS.items():
        config = BoostLlamaConfig(**{**TINY, **model_fields})
        for bf16 in (False, True):
            key = f"{name}-{'bf16' if bf16 else 'fp32'}"
            results[key] = _deepspeed_run(config, ParallelConfig(tp_size=2, **parallel_fields), bf16)
            results[key]["reference"] = _reference_run(config, bf16)
    return results
