"""The iteration-time estimator: calibration against the paper, and its internal consistency."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from boost_hf.configuration_boost_llama import BoostLlamaConfig
from boost_hf.perf.activation_memory import saved_bytes_per_layer
from boost_hf.perf.comm_formula import layer_communication, stage_boundary_communication
from boost_hf.perf.estimator import COMPONENTS, estimate
from boost_hf.perf.flops import attention_flops_per_token, contraction_flops, crossing_flops_per_token, linear_flops_per_token
from boost_hf.parallel.layouts import LAYOUTS
from boost_hf.perf.hardware import get_hardware
from boost_hf.perf.kernels import CALIBRATED_EFFICIENCY, KernelEfficiency, layer_gemms
from boost_hf.perf.micro_batches import micro_batch_options, recommend_micro_batches
from boost_hf.perf.parameters import parameter_count
from boost_hf.perf.workload import Workload

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


def test_tensor_train_layers_add_their_contractions_and_whole_cores():
    """tt-7b at TP4: the token GEMMs split as any bottleneck's; BTP splits the rows of every chain contracting the
    factors (1/p of the contraction FLOPs per rank); the optimizer touches the cores every rank holds whole."""
    config = BoostLlamaConfig.from_preset("tt-7b")
    p, n = 4, 1000
    gemms = layer_gemms(config, Workload(tp=p).parallel("btp"), n)
    assert sum(g.flops for g in gemms if g.role != "contraction") * p == linear_flops_per_token(config) * n
    assert sum(g.flops for g in gemms if g.role == "contraction") * p == contraction_flops(config)
    est = estimate(config, Workload(tp=p), "a100").layouts
    assert est["btp"].parameters == parameter_count(config) == est["vanilla"].parameters
    cola = estimate(BoostLlamaConfig.from_preset("cola-7b"), Workload(tp=p), "a100").layouts["btp"]
    ratio = parameter_count(config) / parameter_count(BoostLlamaConfig.from_preset("cola-7b"))
    assert est["btp"].breakdown_s["optimizer"] > 1.5 * ratio * cola.breakdown_s["optimizer"]


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


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 4)])
def test_pipeline_critical_path(schedule, v):
    config = BoostLlamaConfig.from_preset("cola-7b")
    m = 8
    e = estimate(config, Workload(tp=2, pp=4, num_micro_batches=m, pp_schedule=schedule, stages_per_rank=v), "h100").layouts["btp"]
    times = e.stage_times_s
    pipeline = m * max(times) + (sum(times) - max(times)) / v  # the slowest rank runs every micro-batch
    assert e.step_time_s == pytest.approx(pipeline + e.breakdown_s["optimizer"])
    assert e.bubble_s == pytest.approx((sum(times) - max(times)) / v)
    assert e.bubble_fraction == pytest.approx(e.bubble_s / pipeline)
    # the stages are nearly equal (the last holds the LM head): close to (p-1)/(v m+p-1)
    assert e.bubble_fraction == pytest.approx(3 / (v * m + 3), rel=0.1)


def test_interleaving_shrinks_the_bubble_and_gpipe_times_like_1f1b():
    config = BoostLlamaConfig.from_preset("cola-13b")
    steps = {
        schedule: estimate(config, Workload(tp=4, pp=2, num_micro_batches=4, pp_schedule=schedule), "a100").layouts["btp"]
        for schedule in ("1f1b", "gpipe", "interleaved-1f1b")
    }
    assert steps["gpipe"].step_time_s == steps["1f1b"].step_time_s
    assert steps["interleaved-1f1b"].bubble_s < steps["1f1b"].bubble_s
    assert steps["interleaved-1f1b"].breakdown_s["pp_comm"] > steps["1f1b"].breakdown_s["pp_comm"]  # twice the boundaries


@pytest.mark.parametrize("preset, layout, sends", [("cola-13b", "btp", 1), ("llama-13b", "megatron", 1), ("lax-13b", "btp", 2)])
def test_pipeline_transfers_come_from_the_formula(preset, layout, sends):
    config = BoostLlamaConfig.from_preset(preset)
    workload, m = Workload(tp=4, pp=2, num_micro_batches=3), 3
    e = estimate(config, workload, "a100", layouts=(layout,)).layouts[layout]
    boundary = stage_boundary_communication(config, workload.parallel(layout), workload.tokens)
    assert boundary.sends == sends and e.p2p_bytes_per_boundary == boundary.bytes(2)
    # 8 A100s are two 4-GPU nodes: the boundary crosses the 25 GB/s network, once each way per micro-batch;
    # the critical path runs m micro-batches on the slowest stage plus one on the other
    transfer = sends * 15e-6 + boundary.bytes(2) / 25e9
    # LaX: plus the all-gather of the shared latents inside the node (ring traffic 3/4 of 7 N r at 230 GB/s)
    gathered = boundary.tp_collectives["all_gather"].elements
    transfer += (15e-6 + 3 / 4 * gathered * 2 / 230e9) if gathered else 0.0
    assert (gathered > 0) == (preset == "lax-13b")
    assert e.breakdown_s["pp_comm"] == pytest.approx((m + 1) * 2 * transfer)


@pytest.mark.parametrize("schedule, in_flight", [("1f1b", (2, 1)), ("gpipe", (4, 4)), ("interleaved-1f1b", (2.5, 1.5))])
def test_peak_activation_memory_per_stage(schedule, in_flight):
    config = BoostLlamaConfig.from_preset("lax-7b")  # 32 layers; layer 0 carries no LaX latents
    workload = Workload(tp=4, pp=2, num_micro_batches=4, pp_schedule=schedule, activation_checkpointing="lowrank")
    e = estimate(config, workload, "a100", layouts=("btp",)).layouts["btp"]
    assert e.micro_batches_in_flight == in_flight
    parallel = workload.parallel("btp")
    layers = [range(0, 16), range(16, 32)] if schedule != "interleaved-1f1b" else [
        [*range(0, 8), *range(16, 24)], [*range(8, 16), *range(24, 32)]]
    saved = [sum(saved_bytes_per_layer(config, parallel, workload.tokens, i) for i in rank) for rank in layers]
    assert e.peak_activation_bytes == tuple(round(n * k) for n, k in zip(saved, in_flight))
    unchecked = estimate(config, Workload(tp=4, pp=2, num_micro_batches=4), "a100", layouts=("btp",)).layouts["btp"]
    assert unchecked.peak_activation_bytes is None  # without checkpointing: not modelled


def test_micro_batch_recommendation():
    config = BoostLlamaConfig.from_preset("cola-13b")
    workload = Workload(tp=4, pp=2, micro_batch=2, num_micro_batches=4, activation_checkpointing="lowrank")
    options = micro_batch_options(config, workload, "a100")
    assert [(o.num_micro_batches, o.micro_batch) for o in options] == [(2, 4), (4, 2), (8, 1)]  # 1F1B needs m >= 2
    for option in options:
        split = Workload(tp=4, pp=2, micro_batch=option.micro_batch, num_micro_batches=option.num_micro_batches,
                         activation_checkpointing="lowrank")
        e = estimate(config, split, "a100", layouts=("btp",)).layouts["btp"]
        assert (option.step_time_s, option.bubble_fraction) == (e.step_time_s, e.bubble_fraction)
        assert option.peak_activation_bytes == max(e.peak_activation_bytes)
    best = recommend_micro_batches(options)
    assert best.step_time_s == min(o.step_time_s for o in options)
    assert [o.num_micro_batches for o in micro_batch_options(config, replace(workload, pp_schedule="gpipe"), "a100")] == [1, 2, 4, 8]
    too_few = micro_batch_options(config, Workload(tp=4, pp=4, micro_batch=1, num_micro_batches=2), "a100")
    assert too_few == [] and recommend_micro_batches(too_few) is None  # 1F1B at pp 4 needs 4 micro-batches


def test_engine_refusals_are_noted():
    config = BoostLlamaConfig.from_preset("cola-13b")
    est = estimate(config, Workload(tp=4, pp=2, num_micro_batches=1), "a100")  # the calibrated case
    assert any("would refuse" in note and "at least as many micro-batches" in note for note in est.notes)
    est = estimate(config, Workload(tp=4, pp=2, num_micro_batches=2), "a100")
    assert not any("would refuse" in note for note in est.notes)


def test_pipeline_workload_errors():
    with pytest.raises(ValueError, match="pp_schedule"):
        Workload(pp=2, pp_schedule="zbv")
    with pytest.raises(ValueError, match="runs one stage per rank"):
        Workload(pp=2, stages_per_rank=2)
    tiny = BoostLlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                            num_attention_heads=4, bottleneck="cola", rank=8)
    with pytest.raises(ValueError, match=r"pp x stages per rank \(6\) exceeds num_hidden_layers \(4\)"):
        estimate(tiny, Workload(pp=2, seq_len=16, pp_schedule="interleaved-1f1b", stages_per_rank=3), "a100")


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


def test_sequence_parallelism_runs_the_repeated_work_on_token_shards():
    """Per token, SP takes megatron's 2 norms (read, write) and 2 residual adds (2 reads, 1 write) on d to d/p,
    and BTP's latent work (7 activations, read + write of r; the online norm's 1/rms scale of the 5r-wide qkv
    and gate/up latents) to 1/p of it; the GEMMs, attention and the ring bytes stay; vanilla has no SP."""
    config = BoostLlamaConfig.from_preset("cola-7b")
    p, d, r, n = 4, config.hidden_size, config.rank, 8192
    plain, sp = (estimate(config, Workload(tp=p, micro_batch=2, sequence_parallel=on), "h100").layouts for on in (False, True))
    latent = 7 * 2 * r + 2 * 5 * r
    for layout, repeated in (("megatron", 10 * d), ("btp", latent)):
        assert sp[layout].sequence_parallel and not plain[layout].sequence_parallel
        saved = plain[layout].elementwise_bytes_per_layer_fwd - sp[layout].elementwise_bytes_per_layer_fwd
        assert saved == repeated * (p - 1) // p * n * 2
        assert sp[layout].gemm_flops_per_layer_fwd == plain[layout].gemm_flops_per_layer_fwd
        assert sp[layout].attention_flops_per_layer_fwd == plain[layout].attention_flops_per_layer_fwd
        assert sp[layout].comm_sent_bytes_per_layer_fwd == pytest.approx(plain[layout].comm_sent_bytes_per_layer_fwd, rel=0.01)
        assert 2 * plain[layout].collectives_per_layer_fwd == sp[layout].collectives_per_layer_fwd
        assert sp[layout].step_time_s < plain[layout].step_time_s
    assert not sp["vanilla"].sequence_parallel and sp["vanilla"].step_time_s == plain["vanilla"].step_time_s
    assert any("vanilla has none" in note for note in estimate(config, Workload(tp=p, sequence_parallel=True), "h100").notes)


@pytest.mark.parametrize("mode", ["full", "lowrank"])
def test_sequence_parallel_activation_memory_is_activation_memorys(mode):
    config = BoostLlamaConfig.from_preset("lax-7b")
    workload = Workload(tp=4, micro_batch=2, activation_checkpointing=mode, sequence_parallel=True)
    est = estimate(config, workload, "h100", layouts=("megatron", "btp"))
    for layout, e in est.layouts.items():
        model = config if layout == "btp" else BoostLlamaConfig.from_preset("llama-7b")
        assert e.saved_bytes_per_layer == saved_bytes_per_layer(model, workload.parallel(layout), workload.tokens)
    # megatron keeps N d / p of its fp32 residual (full checkpointing, its only one); btp's low-rank checkpoint
    # keeps 1/p of the bf16 latents
    assert est.layouts["megatron"].saved_bytes_per_layer == 4 * workload.tokens * 4096 // 4
    if mode == "lowrank":
        n, r = workload.tokens, config.rank
        assert est.layouts["btp"].saved_bytes_per_layer == 4 * 2 * n * 4096 // 4 + 2 * ((7 * n * r + 16 * n) // 4 + 7 * n * r // 4)


def test_sequence_parallel_workload_errors():
    with pytest.raises(ValueError, match="pad it to a multiple of 4"):
        Workload(tp=4, seq_len=4098, sequence_parallel=True)
    parallel = Workload(tp=1, seq_len=4097, sequence_parallel=True).parallel("btp")  # tp 1: nothing to split
    assert LAYOUTS["btp"](parallel).sequence_parallel is False


def test_sequence_parallel_pipeline_sends_megatrons_token_shard():
    """Under pp > 1 with sequence parallelism a megatron stage sends its ``[mb, S/p, d]`` residual shard (1/p of the
    replicated residual); btp's boundary (already sharded along ``d``) is unchanged."""
    config = BoostLlamaConfig.from_preset("cola-13b")
    full_rank = BoostLlamaConfig.from_preset("llama-13b")
    plain, sp = (Workload(tp=4, pp=2, num_micro_batches=8, sequence_parallel=on) for on in (False, True))
    assert estimate(full_rank, sp, "h100", layouts=("megatron",)).layouts["megatron"].p2p_bytes_per_boundary * 4 == (
        estimate(full_rank, plain, "h100", layouts=("megatron",)).layouts["megatron"].p2p_bytes_per_boundary)
    assert estimate(config, sp, "h100", layouts=("btp",)).layouts["btp"].p2p_bytes_per_boundary == (
        estimate(config, plain, "h100", layouts=("btp",)).layouts["btp"].p2p_bytes_per_boundary)


def test_megatron_sequence_parallel_regather_runs_beside_the_input_gradient_gemms(monkeypatch):
    """Megatron with sequence parallelism re-gathers each column group's input in backward beside the group's
    input-gradient GEMM (``Layout.backward_overlaps``). At 7B TP4 (N = 8192) each gather (~0.15 ms on H100) hides
    behind its GEMM (~0.34 ms q/k/v, ~0.59 ms gate/up): the layer's backward takes as long as without the
    re-gathers. At 60m (N = 256) the GEMMs are too short: the backward grows, by less than the gathers' time."""
    from boost_hf.parallel.communication import Collective, Communication, PassCommunication, ring_traffic_bytes
    from boost_hf.parallel.layouts import MegatronLayout

    hardware = get_hardware("h100")
    cases = {"llama-7b": 4096, "llama-60m": 128}

    def backward_s(preset: str) -> float:
        workload = Workload(tp=4, micro_batch=2, seq_len=cases[preset], sequence_parallel=True)
        return estimate(BoostLlamaConfig.from_preset(preset), workload, hardware, layouts=("megatron",)).layouts["megatron"].layer_time_bwd_s

    with_regather = {preset: backward_s(preset) for preset in cases}
    keeping = MegatronLayout.layer_communication

    def keeping_the_gathered_input(self, config, tokens):  # the former layout: no re-gather, nothing to overlap
        layer = keeping(self, config, tokens)
        gathers = layer.backward["all_gather"]
        fewer = Collective(gathers.calls - 2, gathers.elements - 2 * tokens * config.hidden_size)
        return PassCommunication(layer.forward, Communication({**layer.backward.by_kind, "all_gather": fewer}))

    monkeypatch.setattr(MegatronLayout, "layer_communication", keeping_the_gathered_input)
    monkeypatch.setattr(MegatronLayout, "backward_overlaps", lambda self, config, tokens: [])
    without = {preset: backward_s(preset) for preset in cases}
    assert with_regather["llama-7b"] == pytest.approx(without["llama-7b"], rel=1e-12)
    n, d = 2 * cases["llama-60m"], BoostLlamaConfig.from_preset("llama-60m").hidden_size
    gather_s = hardware.latency_us * 1e-6 + ring_traffic_bytes("all_gather", 2 * n * d, 4) / (hardware.collective_gbps(4) * 1e9)
    assert without["llama-60m"] < with_regather["llama-60m"] < without["llama-60m"] + 2 * gather_s


# ------------------------------------------------------------------------------------------------ FSDP2
def _fsdp2_estimate(data_parallel, *, tp=2, pp=1, dp=4, micro_batches=1, precision="bf16_params", hardware="h100"):
    from boost_hf.perf.estimator import estimate_layout

    workload = Workload(tp=tp, pp=pp, micro_batch=1, num_micro_batches=micro_batches, dp_size=dp, precision=precision,
                        data_parallel=data_parallel, pp_microbatches=None)
    return workload, estimate_layout(BoostLlamaConfig.from_preset("cola-7b"), "btp", workload, get_hardware(hardware))


def _collective_seconds(kind, calls, nbytes, group, gbps, hardware):
    from boost_hf.parallel.communication import ring_traffic_bytes

    return calls * hardware.latency_us * 1e-6 + ring_traffic_bytes(kind, nbytes, group) / (gbps * 1e9)


def test_fsdp2_times_the_formulas_collectives_with_ddps_overlap():
    """FSDP2 at pp 2 x tp 2 x dp 4 (a node of 8 H100: NVLink): the DP time is the exposed part of
    ``fully_shard_communication``'s collectives, timed as rings over the shard group of 4; under PP the all-gathers run
    once per step beside the first forward (here hidden but for the first unit's, which nothing precedes) and the
    reduce-scatters after the stage's last backward, in full."""
    from boost_hf.data_parallel_config import DataParallelConfig
    from boost_hf.perf.comm_formula import fully_shard_communication
    from boost_hf.perf.memory import fully_shard_units

    h100 = get_hardware("h100")
    fsdp2 = DataParallelConfig("fsdp2")
    workload, est = _fsdp2_estimate(fsdp2, pp=2, micro_batches=4)
    exposed = []
    for parts, stage_seconds in zip(fully_shard_units(BoostLlamaConfig.from_preset("cola-7b"), workload.parallel("btp"), fsdp2),
                                    est.stage_times_s):
        units = [u for part in parts for u in part.units]
        traffic = fully_shard_communication(units, 4, pipeline=True, param_bytes=2, reduce_bytes=4).collectives.by_kind
        gathers = _collective_seconds("all_gather", traffic["all_gather"].calls, 2 * traffic["all_gather"].elements, 4,
                                      h100.link_gbps, h100)
        reductions = _collective_seconds("reduce_scatter", traffic["reduce_scatter"].calls,
                                         4 * traffic["reduce_scatter"].elements, 4, h100.link_gbps, h100)
        first = parts[0].root if parts[0].root is not None else parts[0].units[0]
        assert gathers < stage_seconds / 6  # well inside one micro-batch's forward
        exposed.append(_collective_seconds("all_gather", 1, 2 * first.padded_elements(4), 4, h100.link_gbps, h100)
                       + reductions)
    assert est.breakdown_s["dp_comm"] == pytest.approx(max(exposed), rel=1e-9)
    # the optimizer steps a quarter of the parameters: less time than DDP's whole step
    _, ddp = _fsdp2_estimate(DataParallelConfig(), pp=2, micro_batches=4)
    assert est.breakdown_s["optimizer"] < ddp.breakdown_s["optimizer"]


def test_hsdp_keeps_the_gathers_in_a_node_when_fsdp2s_cross_nodes():
    """tp 2 x dp 8 spans 2 nodes of 8: FSDP2's all-gathers and reduce-scatters cross the network; HSDP 2 x 4 keeps
    them on NVLink and sends only a quarter of the gradients across nodes, once per step."""
    from boost_hf.data_parallel_config import DataParallelConfig

    _, fsdp2 = _fsdp2_estimate(DataParallelConfig("fsdp2"), pp=2, dp=8, micro_batches=4)
    _, hsdp = _fsdp2_estimate(DataParallelConfig("fsdp2", dp_replicate_size=2), pp=2, dp=8, micro_batches=4)
    assert 0 < hsdp.breakdown_s["dp_comm"] < fsdp2.breakdown_s["dp_comm"] / 2
    with pytest.raises(ValueError, match="zero1_optimizer is refused"):
        Workload(dp_size=8, zero1_optimizer=True, data_parallel=DataParallelConfig("fsdp2"))


def test_fsdp2_gathers_every_micro_batch_and_hides_them_behind_compute():
    """At pp 1 each micro-batch gathers every unit (twice the units that reshard): with more micro-batches the gathers
    grow with the compute that hides them, and what shows is at least the root's gather of each forward."""
    from boost_hf.data_parallel_config import DataParallelConfig

    one = _fsdp2_estimate(DataParallelConfig("fsdp2"), micro_batches=1)[1].breakdown_s["dp_comm"]
    eight = _fsdp2_estimate(DataParallelConfig("fsdp2"), micro_batches=8)[1].breakdown_s["dp_comm"]
    assert 0 < one <= eight <= 8 * one
