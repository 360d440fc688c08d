"""The memory model's FSDP2 accounting (``boost_hf.perf.memory``) against what ``fully_shard``'ed models hold on 4
gloo ranks (tests/perf/memory_cases.py, one launched group): the static bytes of every rank, exactly, and the units.
DDP's and ZeRO-1's static bytes are compared with launched training runs in ``tests/training/test_pipeline_resume.py``."""

from __future__ import annotations

import pytest

from boost_hf import BoostLlamaConfig, ParallelConfig
from boost_hf.data_parallel_config import DataParallelConfig
from tests.distributed import launch
from tests.perf import memory_cases

FIELDS = ("parameters", "masters", "gradients", "gradient_buckets", "optimizer_states")


@pytest.fixture(scope="module")
def held():
    return [c for rank in launch(memory_cases.everything, 4, timeout=1800) for c in rank]


def _model_of(case: dict):
    sharding = case["case"].get("sharding", {})
    data_parallel = DataParallelConfig(
        data_parallel="fsdp2", dp_replicate_size=sharding.get("dp_replicate_size", 1),
        fsdp_reshard_after_forward=sharding.get("reshard_after_forward", "default"),
        fsdp_units="decoder_layers" if sharding.get("layers_apart", True) else "model")
    return (BoostLlamaConfig.from_dict(case["config"]), ParallelConfig(**case["case"].get("parallel", {})), data_parallel,
            "bf16_params" if sharding.get("bf16_params") else "fp32")


def test_every_case_ran_on_every_rank(held):
    assert len(held) == 4 * len(memory_cases.cases())


def test_static_memory_equals_what_every_fully_sharded_rank_holds(held):
    """Sharded parameters and gradients (each dim 0 padded to a multiple of the shard), AdamW's moments of the rows
    held and its step counters, no masters and no buckets: equal on every rank of every case, bytes for bytes."""
    from boost_hf.perf.memory import static_memory

    bad = []
    for case in held:
        config, parallel, data_parallel, precision = _model_of(case)
        ranks = case["ranks"]
        model = static_memory(config, parallel, dp_size=case["dp_size"], precision=precision,
                              data_parallel=data_parallel)[ranks["pp"]][ranks["dp"]]
        measured = {name: case.get(name, 0) for name in FIELDS}
        if {name: getattr(model, name) for name in FIELDS} != measured:
            bad.append((case["case"], ranks, measured, model))
    assert not bad, bad


def test_units_are_what_fully_shard_makes(held):
    """The memory model's units (TP-local shapes, reshard after forward) are ``units_of``'s on the built parts."""
    from boost_hf.perf.memory import fully_shard_units

    bad = []
    for case in held:
        config, parallel, data_parallel, _ = _model_of(case)
        parts = fully_shard_units(config, parallel, data_parallel)[case["ranks"]["pp"]]
        model = [[sorted(map(list, u.shapes)), u.reshards_after_forward] for part in parts for u in part.units]
        if model != case["units"]:
            bad.append((case["case"], case["ranks"], model, case["units"]))
    assert not bad, bad
