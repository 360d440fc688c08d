"""What ``fully_shard``'ed models hold, for ``tests/perf/test_memory_measured.py``: every case runs inside one launched
process group of 4 (gloo, CPU).

Each case builds the model split by its layout (TP, pipeline stages), applies FSDP2 over each TP x PP rank's DP
group as the trainer's engines do (:func:`~boost_hf.parallel.parts.prepare_part`, HSDP's mesh from
:func:`~boost_hf.parallel.state.data_parallel_mesh`), runs two training steps (forward, backward, AdamW; the second
without its optimizer step) and reports what the rank then holds: the unique storages of its sharded parameters, of
their gradients and of AdamW's state (the local tensors of the ``DTensor``\\ s), and the units
:func:`~boost_hf.parallel.fully_shard.units_of` finds on the built parts.
"""

from __future__ import annotations


import torch
from torch.multiprocessing.reductions import StorageWeakRef

from boost_hf import BoostLlamaForCausalLM, ParallelConfig
from boost_hf.parallel.fully_shard import FullyShard, units_of
from boost_hf.parallel.state import data_parallel_mesh
from tests.parallel.fsdp_cases import fully_sharded_parts
from tests.parallel.tp_cases import SEED, tiny_config

BATCH, SEQ = 8, 8
#: a vocabulary of 126 rows: 63 per TP rank at tp 2, 32, 32, 32, 30 over 4 DP ranks: FSDP2 pads it
VOCAB = 126


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor


def unique_bytes(tensors) -> int:
    """Bytes of the unique storages under ``tensors`` (a ``DTensor``'s local tensor's: FSDP2's padded shard)."""
    storages = {}
    for tensor in tensors:
        if tensor is not None:
            storage = _local(tensor).untyped_storage()
            storages[StorageWeakRef(storage)] = storage.nbytes()
    return sum(storages.values())


def held_case(case: dict) -> dict:
    """Build, shard and train ``case``'s model; return what this rank holds and the units of its parts."""
    config = tiny_config(vocab_size=VOCAB, num_hidden_layers=4, **case.get("model", {}))
    parallel = ParallelConfig(**case.get("parallel", {}))
    sharding = dict(case.get("sharding", {}))
    bf16 = sharding.pop("bf16_params", False)
    torch.manual_seed(SEED)
    model = BoostLlamaForCausalLM(config, parallel_config=parallel).train()
    state = model.plan.state
    pipeline = getattr(model, "pipeline", None)
    how = FullyShard(mesh=data_parallel_mesh(state, sharding.pop("dp_replicate_size", 1)), pipeline=pipeline is not None,
                     param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32 if bf16 else None, **sharding)
    parts = fully_sharded_parts(model, how)
    units = [u for part in parts for u in units_of(part, how)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (BATCH // state.dp_size, SEQ), generator=torch.Generator().manual_seed(state.dp_rank))
    for step in range(2):
        if pipeline is not None:
            pipeline.train_step(ids, ids)
        else:
            model(ids, labels=ids).loss.backward()
        if step == 0:
            optimizer.step()
            optimizer.zero_grad()
    params = list(model.parameters())
    return {
        "case": case,
        "ranks": {"pp": state.pp_rank, "dp": state.dp_rank, "tp": state.tp_rank},
        "dp_size": state.dp_size,
        "config": config.to_dict(),
        "parameters": unique_bytes(params),
        "gradients": unique_bytes(p.grad for p in params),
        "optimizer_states": unique_bytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)),
        "units": [[sorted(map(list, u.shapes)), u.reshards_after_forward] for u in units],
    }


def cases() -> list[dict]:
    """dp 4 (fp32 and bf16_params), HSDP 2 x 2, the whole model as one unit, tp 2 x dp 2 (btp with sequence
    parallelism, the tensor train, megatron with tied embeddings), pp 2 x dp 2 (1F1B and interleaved)."""
    tp2 = {"tp_size": 2}
    return [
        {"model": {"bottleneck": "cola"}},
        {"model": {"bottleneck": "cola"}, "sharding": {"bf16_params": True}},
        {"model": {"bottleneck": "lax"}, "sharding": {"dp_replicate_size": 2}},
        {"model": {"bottleneck": "cola"}, "sharding": {"layers_apart": False, "reshard_after_forward": "always"}},
        {"model": {"bottleneck": "cola"}, "parallel": {**tp2, "tp_style": "btp", "sequence_parallel": True}},
        {"model": {"bottleneck": "tt"}, "parallel": {**tp2, "tp_style": "btp"}},
        {"model": {"bottleneck": None, "tie_word_embeddings": True}, "parallel": {**tp2, "tp_style": "megatron"}},
        {"model": {"bottleneck": "cola"}, "parallel": {"pp_size": 2, "pp_microbatches": 2}},
        {"model": {"bottleneck": "cola"}, "parallel": {"pp_size": 2, "pp_schedule": "interleaved-1f1b", "pp_microbatches": 4}},
    ]


def everything() -> list[dict]:
    return [held_case(case) for case in cases()]
