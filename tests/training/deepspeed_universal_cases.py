"""DeepSpeed ZeRO-2 checkpoints at tp 2 x dp 2 resumed at another TP x DP size or ZeRO stage through DeepSpeed's
universal checkpoint, for every layout (inside one launched group of 4 processes; see test_deepspeed_universal.py).

For each model, every rank builds it at tp 2 x dp 2 (two models also at tp 1 x dp 4) and hands it to ``deepspeed.initialize`` under boost-hf's hooks
(:func:`~boost_hf.training.deepspeed.deepspeed_initialize_hooks`, as ``BoostTrainer`` does), takes two AdamW steps
and saves a DeepSpeed checkpoint as the trainer does (``checkpoint-2/global_step2``). The saved state, read back
through DeepSpeed's own accessors (``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state``, all-gathered over
DP) and all-gathered over TP, is the canonical fp32 master and AdamW moments of every parameter. The run then takes
step 3 (the uninterrupted run's loss). Each resume converts the checkpoint
(:func:`~boost_hf.checkpoint.deepspeed_universal.universal_resume`, on rank 0), builds the model at its layout, loads
it under the hooks through ``engine.load_checkpoint(checkpoint)`` (what transformers calls) and records, per
parameter, whether its fp32 master, its two moments and the parameter itself equal this layout's slice of the
canonical tensors, the step counts and learning rates, and then the loss of step 3 on the same global batch.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM, ParallelConfig
from boost_hf.parallel.sharding import gather_full, shard_spec_of
from boost_hf.parallel.state import get_parallel_state
from boost_hf.training.deepspeed import ModelParallelUnit, deepspeed_initialize_hooks
from boost_hf.checkpoint.deepspeed_universal import universal_resume

SEED, LR, GLOBAL_BATCH, SEQ = 1234, 1e-3, 4, 8
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, rank=16, max_position_embeddings=64)
MODELS = {
    "btp": (dict(bottleneck="cola"), dict(tp_style="btp")),
    "btp-lax": (dict(bottleneck="lax"), dict(tp_style="btp")),
    "vanilla": (dict(bottleneck="cola"), dict(tp_style="vanilla")),
    "vanilla-tt": (dict(bottleneck="tt"), dict(tp_style="vanilla", group_linears=False)),
    "megatron": (dict(bottleneck=None), dict(tp_style="megatron")),
}
# (tp, ZeRO stage) of each run on the 4 processes; every model is saved at tp 2 x dp 2 with ZeRO-2 and resumed at
# RESUMES, two also saved at tp 1 x dp 4 with ZeRO-1 (every parameter whole: the description marks each replicated,
# and the resumed run's own ShardSpecs cut them) and resumed at FROM_TP1
SAVES = {"tp2-dp2-zero2": (2, 2), "tp1-dp4-zero1": (1, 1)}
RESUMES = {"tp1-dp4-zero2": (1, 2), "tp4-dp1-zero1": (4, 1), "tp2-dp2-zero1": (2, 1)}
FROM_TP1 = {"tp2-dp2-zero2": (2, 2), "tp4-dp1-zero2": (4, 2)}
# (model, how saved, resumes, DeepSpeed's bf16 mode): the bf16 run keeps bf16 parameters over fp32 masters
PLAN = ([(model, "tp2-dp2-zero2", RESUMES, False) for model in MODELS]
        + [(model, "tp1-dp4-zero1", FROM_TP1, False) for model in ("btp", "vanilla-tt")]
        + [("btp", "tp2-dp2-zero2-bf16", {"tp1-dp4-zero2": (1, 2)}, True)])
SAVES["tp2-dp2-zero2-bf16"] = SAVES["tp2-dp2-zero2"]


def _batches():
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, TINY["vocab_size"], (GLOBAL_BATCH, SEQ), generator=generator) for _ in range(3)]


def _param_groups(model):
    """The two groups ``transformers.Trainer`` makes (weight decay on all but biases and norm weights)."""
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = [p for p in model.parameters() if "norm" in names[id(p)] or names[id(p)].endswith("bias")]
    decay = [p for p in model.parameters() if all(p is not q for q in no_decay)]
    return [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]


def _engine(config, parallel, stage: int, universal=None, bf16: bool = False):
    import deepspeed

    state = get_parallel_state(parallel.tp_size)
    torch.manual_seed(SEED)
    model = BoostLlamaForCausalLM(config, parallel_config=parallel)
    optimizer = torch.optim.AdamW(_param_groups(model), lr=LR)
    micro = GLOBAL_BATCH // state.dp_size
    ds_config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
                 "train_batch_size": GLOBAL_BATCH, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
                 "bf16": {"enabled": bf16}}
    with deepspeed_initialize_hooks(ModelParallelUnit(state), universal):
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    return engine, model, state


def _step(engine, state, ids) -> float:
    """One optimizer step on this DP rank's rows of the global batch; the global batch's mean loss."""
    micro = GLOBAL_BATCH // state.dp_size
    rows = ids[state.dp_rank * micro:(state.dp_rank + 1) * micro]
    loss = engine(rows, labels=rows, use_cache=False).loss
    engine.backward(loss)
    engine.step()
    total = loss.detach().float()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()  # TP peers hold the same loss: the mean of the DP ranks' means


def _link_moments(engine) -> None:
    """Let DeepSpeed's accessors reach every parameter's moments: it links them to the parameters after the first
    parameter group's first step, before the second group has any (DeepSpeed 0.19.8)."""
    engine.optimizer._hp_optimizer_states_linked = False
    engine.optimizer._lazy_init_hp_params_optimizer_state()


def _canonical_state(engine, model, state) -> dict:
    """{name: {"fp32", "exp_avg", "exp_avg_sq"}}: DeepSpeed's masters and moments, whole (gathered over DP and TP)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    _link_moments(engine)
    whole = {}
    for name, param in model.named_parameters():
        spec = shard_spec_of(param)
        local = {"fp32": safe_get_full_fp32_param(param), "exp_avg": safe_get_full_optimizer_state(param, "exp_avg"),
                 "exp_avg_sq": safe_get_full_optimizer_state(param, "exp_avg_sq")}
        whole[name] = {k: gather_full(v.reshape(param.shape), spec, state.tp_group) if spec.is_sharded else v.reshape(param.shape)
                       for k, v in local.items()}
    return whole


def _resumed_equals(engine, model, canonical: dict) -> dict:
    """Per parameter: its fp32 master, moments and value (in its dtype) equal this rank's slice of the canonical
    tensors (exactly);
    and the optimizer's step counts and learning rates."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    unequal = []
    for name, param in model.named_parameters():
        spec = shard_spec_of(param)
        expected = {k: spec.local_slice(v) for k, v in canonical[name].items()}
        actual = {"fp32": safe_get_full_fp32_param(param), "exp_avg": safe_get_full_optimizer_state(param, "exp_avg"),
                  "exp_avg_sq": safe_get_full_optimizer_state(param, "exp_avg_sq")}
        for key in expected:
            if not torch.equal(actual[key].reshape(param.shape), expected[key]):
                unequal.append(f"{name}.{key}")
        if not torch.equal(param.detach(), expected["fp32"].to(param.dtype)):
            unequal.append(f"{name}.param")
    optimizer = engine.optimizer.optimizer
    steps = sorted({int(s["step"]) for s in optimizer.state.values() if "step" in s})
    return {"unequal": unequal, "steps": steps, "lrs": [g["lr"] for g in optimizer.param_groups],
            "weight_decays": [g["weight_decay"] for g in optimizer.param_groups]}


def everything(out: str) -> dict:
    import deepspeed

    # what a launcher sets, which DeepSpeed reads (the gloo process group is already up)
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(dist.get_rank()), RANK=str(dist.get_rank()),
                      WORLD_SIZE=str(dist.get_world_size()))
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    results = {}
    for name, save, resumes, bf16 in PLAN:
        model_fields, parallel_fields = MODELS[name]
        config = BoostLlamaConfig(**{**TINY, **model_fields})
        batches = _batches()
        tp, stage = SAVES[save]
        engine, model, state = _engine(config, ParallelConfig(tp_size=tp, **parallel_fields), stage, bf16=bf16)
        losses = [_step(engine, state, ids) for ids in batches[:2]]
        checkpoint = os.path.join(out, name, save, "checkpoint-2")
        engine.save_checkpoint(checkpoint, tag="global_step2")
        canonical = _canonical_state(engine, model, state)
        losses.append(_step(engine, state, batches[2]))
        run = results.setdefault(name, {})[save] = {"losses": losses, "info": model.universal_checkpoint_info,
                                                    "dtypes": sorted({str(p.dtype) for p in model.parameters()})}
        saved = {"tp_size": tp, "dp_size": state.dp_size, "zero_stage": stage}
        for resume, (tp, stage) in resumes.items():
            parallel = ParallelConfig(tp_size=tp, **parallel_fields)
            current = {"tp_size": tp, "dp_size": dist.get_world_size() // tp, "zero_stage": stage}
            universal = universal_resume(checkpoint, os.path.join(out, name, save, resume), saved, current)
            engine, model, state = _engine(config, parallel, stage, universal, bf16)
            engine.load_checkpoint(checkpoint)
            record = _resumed_equals(engine, model, canonical)
            dist.barrier()
            record["converted_folder_left"] = os.path.exists(universal.folder)
            record["dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
            record["loss"] = _step(engine, state, batches[2])
            run[resume] = record
    return results
