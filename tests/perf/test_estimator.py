"""The iteration-time estimator: calibration against the paper, and its internal consistency."""

from __future__ import annotations

import json

import pytest

from boost_hf.configuration_boost_llama import BoostLlamaConfig
from boost_hf.perf.comm_formula import layer_communication
from boost_hf.perf.estimator import (
    CALIBRATED_EFFICIENCY,
    COMPONENTS,
    KernelEfficiency,
    Workload,
    estimate,
    layer_gemms,
    parameter_count,
)
from boost_hf.perf.flops import attention_flops_per_token, crossing_flops_per_token, linear_flops_per_token
from boost_hf.perf.hardware import get_hardware

# BOOST.md section 6: A100, seq 4096, bf16; seconds per iteration (megatron, vanilla, btp).
PAPER = {
    ("3b", 2, 1): (1.14, 1.41, 0.78),
    ("7b", 4, 1): (1.06, 1.64, 0.72),
    ("13b", 4, 2): (2.07, 2.42, 1.30),
}


@pytest.fixture(scope="module")
def paper_estimates():
    return {
        case: estimate(BoostLlamaConfig.from_preset(f"cola-{case[0]}"), Workload(tp=case[1], pp=case[2]), "a100")
        for case in PAPER
    }


@pytest.mark.parametrize("case", list(PAPER), ids=lambda c: f"{c[0]}-tp{c[1]}-pp{c[2]}")
@pytest.mark.parametrize("baseline", ["megatron", "vanilla"])
def test_calibrated_ratios_within_15_percent_of_the_paper(paper_estimates, case, baseline):
    megatron, vanilla, btp = PAPER[case]
    paper_ratio = btp / (megatron if baseline == "megatron" else vanilla)
    predicted = paper_estimates[case].ratio("btp", baseline)
    assert predicted == pytest.approx(paper_ratio, rel=0.15)


def test_btp_is_fastest_in_every_paper_case(paper_estimates):
    for est in paper_estimates.values():
        assert est.ratio("btp", "megatron") < 1 and est.ratio("btp", "vanilla") < 1


def test_tp1_vanilla_and_btp_are_the_same_computation():
    est = estimate(BoostLlamaConfig.from_preset("cola-1b"), Workload(tp=1), "a100")
    assert est.layouts["btp"].step_time_s == pytest.approx(est.layouts["vanilla"].step_time_s)
    assert est.layouts["btp"].comm_bytes_per_layer_fwd == 0


def test_communication_comes_from_the_formula():
    config = BoostLlamaConfig.from_preset("cola-7b")
    workload = Workload(tp=4, rmsnorm="sync", group_linears=False)
    est = estimate(config, workload, "h100")
    for layout in ("vanilla", "btp"):
        comm = layer_communication(config, workload.parallel(layout), workload.tokens)
        assert est.layouts[layout].comm_bytes_per_layer_fwd == comm.forward.bytes(2)
        assert est.layouts[layout].comm_bytes_per_layer_bwd == comm.backward.bytes(2)
        assert est.layouts[layout].collectives_per_layer_fwd == comm.forward.calls
    # 7B, batch 4 x 4096: ~0.22 / 0.25 / 1.30 GiB per layer forward (BOOST.md)
    est = estimate(config, Workload(tp=4), "a100")
    gib = {name: e.comm_bytes_per_layer_fwd / 2**30 for name, e in est.layouts.items()}
    assert gib["btp"] == pytest.approx(0.21875, abs=1e-3)
    assert gib["megatron"] == 0.25
    assert gib["vanilla"] == pytest.approx(1.30, abs=0.01)
    assert {name: e.collectives_per_layer_fwd for name, e in est.layouts.items()} == {
        "megatron": 2, "vanilla": 7, "btp": 4
    }


@pytest.mark.parametrize("style", ["megatron", "vanilla", "btp"])
@pytest.mark.parametrize("grouped", [True, False])
def test_gemms_split_the_linear_flops_over_the_ranks(style, grouped):
    config = BoostLlamaConfig.from_preset("llama-7b" if style == "megatron" else "cola-7b")
    p, n = 4, 1000
    parallel = Workload(tp=p, group_linears=grouped).parallel(style)
    gemms = layer_gemms(config, parallel, n)
    assert sum(g.flops for g in gemms) * p == linear_flops_per_token(config) * n


@pytest.mark.parametrize("gate", ["dense", "kronecker", "identity"])
@pytest.mark.parametrize("style", ["vanilla", "btp"])
def test_lax_crossing_is_replicated(gate, style):
    config = BoostLlamaConfig.from_preset("lax-7b", lax_gate=gate)
    parallel = Workload(tp=4).parallel(style)
    with_crossing = sum(g.flops for g in layer_gemms(config, parallel, 10))
    without = sum(g.flops for g in layer_gemms(config, parallel, 10, crossing=False))
    assert with_crossing - without == crossing_flops_per_token(config) * 10  # every rank runs the full r x r gates


def test_more_stages_than_layers_is_an_error():
    config = BoostLlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, bottleneck="cola", rank=8)
    with pytest.raises(ValueError, match="pp"):
        estimate(config, Workload(tp=1, pp=3, seq_len=16), "a100")


def test_per_layer_work_per_rank():
    est = estimate(BoostLlamaConfig.from_preset("cola-7b"), Workload(tp=4), "a100")
    n, d, f, r = 16384, 4096, 11008, 1024
    attention = attention_flops_per_token(BoostLlamaConfig.from_preset("cola-7b"), 4096) * n
    btp, vanilla, megatron = est.layouts["btp"], est.layouts["vanilla"], est.layouts["megatron"]
    # BOOST.md section 6 table: linear FLOPs per rank, attention on all heads under vanilla
    assert btp.gemm_flops_per_layer_fwd == vanilla.gemm_flops_per_layer_fwd == 2 * n * (8 * d * r + 3 * r * (d + f)) / 4
    assert megatron.gemm_flops_per_layer_fwd == 2 * n * (4 * d * d + 3 * d * f) / 4
    assert vanilla.attention_flops_per_layer_fwd == 4 * btp.attention_flops_per_layer_fwd == attention
    assert (btp.min_gemm_dim, vanilla.min_gemm_dim) == (1024, 256)
    assert megatron.parameters == parameter_count(BoostLlamaConfig.from_preset("llama-7b")) == 6_738_415_616


def test_gemm_efficiency():
    eff = KernelEfficiency(gemm_max=0.8, gemm_half_dim=256, attention=0.5, memory=0.8)
    huge = 10**12
    assert eff.gemm(huge, huge, huge) == pytest.approx(0.8)
    assert eff.gemm(huge, 256, huge) == pytest.approx(0.4)
    assert eff.gemm(16384, 4096, 256) < eff.gemm(16384, 1024, 1024) < eff.gemm(16384, 4096, 4096)
    with pytest.raises(ValueError, match="gemm_max"):
        KernelEfficiency(gemm_max=1.5, gemm_half_dim=0, attention=0.5, memory=0.5)


def test_step_time_is_the_sum_of_its_parts():
    est = estimate(BoostLlamaConfig.from_preset("cola-13b"), Workload(tp=4, pp=2, num_micro_batches=3), "a100")
    for e in est.layouts.values():
        assert set(e.breakdown_s) == set(COMPONENTS)
        assert sum(e.breakdown_s.values()) == pytest.approx(e.step_time_s)
        assert e.breakdown_s["pp_comm"] > 0 and e.bubble_s > 0
        assert 0 < e.mfu < 1


def test_pipeline_1f1b_schedule():
    config = BoostLlamaConfig.from_preset("cola-7b")  # 32 layers: two equal stages but for the head
    one = estimate(config, Workload(tp=2, pp=2, num_micro_batches=1), "h100").layouts["btp"]
    four = estimate(config, Workload(tp=2, pp=2, num_micro_batches=4), "h100").layouts["btp"]
    stage = max(one.stage_times_s)
    assert one.step_time_s == pytest.approx(sum(one.stage_times_s) + one.breakdown_s["optimizer"])
    assert four.step_time_s == pytest.approx(sum(one.stage_times_s) + 3 * stage + one.breakdown_s["optimizer"])
    assert one.bubble_s == pytest.approx(min(one.stage_times_s))
    assert four.tokens_per_s > one.tokens_per_s  # more micro-batches amortise the bubble


def test_checkpointing_costs_recompute():
    config = BoostLlamaConfig.from_preset("cola-7b")
    times = {
        mode: estimate(config, Workload(tp=4, activation_checkpointing=mode), "a100").layouts
        for mode in ("none", "lowrank", "full")
    }
    for layout in ("btp", "vanilla"):
        assert times["none"][layout].step_time_s < times["lowrank"][layout].step_time_s < times["full"][layout].step_time_s
    # btp's low-rank recomputation issues no collective; vanilla's re-runs its B all-reduces
    assert times["lowrank"]["btp"].comm_bytes_per_layer_bwd == times["none"]["btp"].comm_bytes_per_layer_bwd
    assert times["lowrank"]["vanilla"].comm_bytes_per_layer_bwd > times["none"]["vanilla"].comm_bytes_per_layer_bwd
    assert times["lowrank"]["megatron"].step_time_s == times["full"]["megatron"].step_time_s


def test_faster_hardware_is_faster_and_full_rank_presets_work():
    config = BoostLlamaConfig.from_preset("llama-3b")  # the low-rank counterpart is CoLA at r = d/4
    a100 = estimate(config, Workload(tp=2), "a100")
    h100 = estimate(config, Workload(tp=2), get_hardware("h100"))
    assert a100.layouts["btp"].model.startswith("cola r=768")
    for layout in a100.layouts:
        assert h100.layouts[layout].step_time_s < a100.layouts[layout].step_time_s


def test_json_ready():
    est = estimate(BoostLlamaConfig.from_preset("cola-7b"), Workload(tp=4), "a100", CALIBRATED_EFFICIENCY)
    out = json.loads(json.dumps(est.to_dict()))
    assert set(out["layouts"]) == {"megatron", "vanilla", "btp"}
    for layout in out["layouts"].values():
        for key in ("comm_bytes_per_layer_fwd", "collectives_per_layer_fwd", "flops_per_layer_fwd", "step_time_s"):
            assert key in layout
    assert out["assumptions"]["workload"]["tokens_per_micro_batch"] == 16384
    assert out["assumptions"]["hardware"]["name"] == "a100"


def test_unknown_layout():
    with pytest.raises(ValueError, match="Unknown layout"):
        estimate(BoostLlamaConfig.from_preset("cola-7b"), Workload(tp=4), "a100", layouts=("zero",))
