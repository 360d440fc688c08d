"""Shared test settings: offline hub, quiet tokenizers, and tiny model configurations."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# The test models are tiny: one intra-op thread is ~10x faster than the per-op thread start-up of many.
# BOOST_HF_TEST_THREADS sets another count: `make test`'s reduction-order leg runs the exactness tests with 2 threads
# (and another CPU capability), so that a tolerance cannot hold only for one order of fp32 summation.
torch.set_num_threads(int(os.environ.get("BOOST_HF_TEST_THREADS", "1")))

# The minimum-versions leg of `make test` (BOOST_HF_MINIMUM_VERSIONS=1: torch 2.11, transformers 5.17, no [train]
# extra) may skip a test only for what that stack lacks by design; any other skip fails there. An expected failure
# (``xfail(strict=True)``: a target written down as not met, which fails the run the day it passes) is not a skip.
MINIMUM_VERSIONS_SKIPS = ("needs the [train] extra", "needs a CUDA device")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail") and os.environ.get("BOOST_HF_MINIMUM_VERSIONS"):
        reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
        if not any(allowed in reason for allowed in MINIMUM_VERSIONS_SKIPS):
            report.outcome = "failed"
            report.longrepr = f"skipped on the minimum versions, where a test may skip only for {MINIMUM_VERSIONS_SKIPS}: {reason}"


# Tiny LLaMA shape: d=32, 4 heads of 8, GQA with 2 kv heads (kv width 16), d_ff=64, vocab 96, rank 8.
TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)

# name -> BoostLlamaConfig fields of every model variant the tests cover
VARIANTS: dict[str, dict] = {
    "full": dict(bottleneck=None),
    "svd": dict(bottleneck="svd"),
    "cola": dict(bottleneck="cola"),
    "cola-swiglu": dict(bottleneck="cola", only_lr_act=False),
    "lax-dense": dict(bottleneck="lax", lax_gate="dense"),
    "lax-kronecker": dict(bottleneck="lax", lax_gate="kronecker"),
    "lax-identity": dict(bottleneck="lax", lax_gate="identity"),
    "lax-no-norm": dict(bottleneck="lax", lax_latent_norm=False),
    "lax-svd": dict(bottleneck="lax", lax_base="svd"),
    "tt": dict(bottleneck="tt"),  # 4 cores, tt_rank 8: modes of 32 (8, 4) / (4, 8), of 64 (8, 8), of 16 (4, 4)
}
LOW_RANK_VARIANTS = [name for name, fields in VARIANTS.items() if fields["bottleneck"] is not None]


@pytest.fixture
def make_config():
    """``make_config(variant="full", **overrides)`` -> a tiny ``BoostLlamaConfig`` (rank 8)."""
    from boost_hf import BoostLlamaConfig

    def make(variant: str = "full", **overrides):
        return BoostLlamaConfig(**{**TINY, "rank": 8, **VARIANTS[variant], **overrides})

    return make


@pytest.fixture(params=list(VARIANTS))
def variant(request) -> str:
    """Every model variant: full rank, svd, cola (both MLP forms) and the LaX gates / norm / bases."""
    return request.param


@pytest.fixture(params=LOW_RANK_VARIANTS)
def low_rank_variant(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def tp2_model_results() -> list[dict]:
    """Per rank: the results of tests/parallel/tp2_model_cases.py, one 2-rank launch for the 2-rank cases of five test
    files (read with ``tp2_model_cases.section``)."""
    from tests.distributed import launch
    from tests.parallel import tp2_model_cases

    return launch(tp2_model_cases.everything, 2, 2, timeout=1800)
