"""DeepSpeed keeps the grouped projections' storage, in fp32 and in its bf16 mode (tp 2, ZeRO-2, one launch).

DeepSpeed casts each parameter on its own in bf16 mode and copies the trainable ones into its flat buffers in the
optimizer's order; boost-hf's hooks (:mod:`boost_hf.training.deepspeed`) cast them in groups first and order the
optimizer's groups so that each grouped projection's parameters stay consecutive rows of one buffer: the grouped
GEMMs read them without a copy (no ``cat`` or ``stack`` inside the decoder layers, forward or backward). Before,
BTP's A's and B's lost their shared storage under ZeRO and every forward concatenated them.

Losses are compared with the single-device model trained by the same AdamW steps: fp32 within 1e-5 relative (the
test's usual tolerance: any misplaced gradient or parameter would show), bf16 (bf16 parameters, fp32 master weights,
written out in the reference) within ``2^-8`` relative, bf16's rounding of a value: the losses come from bf16
logits computed in another order (TP 2 against one device), which moves them by ~1e-4 relative here.
"""

from __future__ import annotations

import pytest

from tests.distributed import launch
from tests.training import deepspeed_grouped_cases

pytest.importorskip("deepspeed")

RUNS = [f"{model}-{precision}" for model in deepspeed_grouped_cases.MODELS for precision in ("fp32", "bf16")]
TOLERANCE = {"fp32": 1e-5, "bf16": 2.0 ** -8}


@pytest.fixture(scope="module")
def runs():
    return launch(deepspeed_grouped_cases.everything, 2, timeout=1500)


@pytest.mark.parametrize("run", RUNS)
def test_grouped_parameters_stay_stored_together(runs, run):
    for rank in runs:
        assert rank[run]["stored_together"]
        assert rank[run]["dtypes"] == ["torch.bfloat16" if run.endswith("bf16") else "torch.float32"]


@pytest.mark.parametrize("run", RUNS)
def test_grouped_gemms_concatenate_nothing(runs, run):
    for rank in runs:
        assert rank[run]["copies"] == [[0, 0]] * deepspeed_grouped_cases.STEPS, "[forward, backward] cat/stack per step"


@pytest.mark.parametrize("run", RUNS)
def test_losses_equal_the_single_device_model(runs, run):
    tolerance = TOLERANCE[run.rsplit("-", 1)[1]]
    for rank in runs:
        assert rank[run]["losses"] == pytest.approx(rank[run]["reference"], rel=tolerance)
