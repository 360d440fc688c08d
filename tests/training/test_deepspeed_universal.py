"""A DeepSpeed ZeRO-1/2 checkpoint resumes at another TP x DP size or ZeRO stage through DeepSpeed's universal
checkpoint (:mod:`boost_hf.checkpoint.deepspeed_universal`), for every layout; what cannot be converted is refused
with the fix, before any collective.

One launch of 4 processes (``deepspeed_universal_cases.py``; about 2 minutes on 2 cores): btp (CoLA and LaX),
vanilla (CoLA and tensor-train, whose cores split along dims 0 and 2), megatron, each saved at tp 2 x dp 2 with
ZeRO-2 and resumed at tp 1 x dp 4 (ZeRO-2), tp 4 x dp 1 (ZeRO-1) and tp 2 x dp 2 (ZeRO-1); btp and vanilla-tt also
saved at tp 1 x dp 4 with ZeRO-1 and resumed at tp 2 and tp 4 with ZeRO-2; btp in DeepSpeed's bf16 mode from
tp 2 x dp 2 to tp 1 x dp 4. After loading, every parameter's fp32
master, AdamW moments and value are exactly this layout's slice of the saved ones (no arithmetic is involved), and
the next step's loss is the uninterrupted run's within 1e-6 relative (another TP size sums in another order: ~1e-7
here; a fresh optimizer would be off by percents; bf16: within ``2^-8``, bf16's rounding of a value, as
test_deepspeed_grouped.py). The trainer end to end (the ZeRO-2 demo run at tp 2 x dp 2
resumed at tp 1 x dp 4 with ZeRO-2: the uninterrupted run's losses) is in ``test_distributed.py``.
"""

from __future__ import annotations

import re

import pytest
import torch

from boost_hf.training.deepspeed import DEEPSPEED_PARAMETER_ORDER
from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM
from boost_hf.checkpoint.deepspeed_universal import AUTOTP_META, UNIVERSAL_INFO_RECORD, UniversalResume, universal_resume
from boost_hf.checkpoint.resume import ResumeLayoutError, check_resume_layout, write_training_layout
from tests.distributed import launch
from tests.training import deepspeed_universal_cases as cases

pytest.importorskip("deepspeed")

RUNS = [(model, save, resume) for model, save, resumes, _ in cases.PLAN for resume in resumes]
BF16 = {save for _, save, _, bf16 in cases.PLAN if bf16}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launch(cases.everything, 4, str(tmp_path_factory.mktemp("universal")), timeout=1500)


@pytest.mark.parametrize("model,save,resume", RUNS)
def test_resumed_state_is_the_saved_state(runs, model, save, resume):
    for rank in runs:
        record = rank[model][save][resume]
        assert record["unequal"] == [], "fp32 masters, moments or parameters that are not the saved ones' slices"
        assert record["steps"] == [2]
        assert record["lrs"] == [cases.LR, cases.LR] and record["weight_decays"] == [0.01, 0.0]
        assert not record["converted_folder_left"], "the converted checkpoint is removed once every rank loaded it"


@pytest.mark.parametrize("model,save,resume", RUNS)
def test_next_step_has_the_uninterrupted_runs_loss(runs, model, save, resume):
    for rank in runs:
        run = rank[model][save]
        assert run[resume]["loss"] == pytest.approx(run["losses"][2], rel=2.0 ** -8 if save in BF16 else 1e-6)
        assert run[resume]["dtypes"] == run["dtypes"] == ["torch.bfloat16" if save in BF16 else "torch.float32"]


def categories(info: dict, name: str) -> list[str]:
    """The lists of ``info`` (a universal_checkpoint_info) with a pattern matching ``name``, as DeepSpeed matches."""
    lists = {"replicated": "tp_replicated_parameter_patterns", "row": "parameter_with_row_parallelism_patterns",
             "vocabulary": "vocabulary_parameter_patterns"}
    found = [kind for kind, key in lists.items() if any(re.match(p, name) for p in info[key])]
    found += [f"split{s['partition_dim']}" for s in info["parameter_with_sub_params"] if any(re.match(p, name) for p in s["patterns"])]
    return found or ["column"]


# what each layout splits (docs/parallelism.md): its parameters as DeepSpeed's universal checkpoint must merge them
EXPECTED = {
    "megatron": {"model.layers.0.self_attn.q_proj.weight": "column", "model.layers.1.self_attn.o_proj.weight": "row",
                 "model.layers.1.mlp.up_proj.weight": "column", "model.layers.0.mlp.down_proj.weight": "row",
                 "model.layers.0.input_layernorm.weight": "replicated", "model.norm.weight": "replicated",
                 "model.embed_tokens.weight": "vocabulary", "lm_head.weight": "vocabulary"},
    "btp": {"model.layers.0.self_attn.q_proj.A": "row", "model.layers.1.self_attn.q_proj.B": "column",
            "model.layers.0.mlp.down_proj.A": "row", "model.layers.0.mlp.down_proj.B": "column",
            "model.layers.1.post_attention_layernorm.weight": "column", "model.norm.weight": "replicated",
            "model.embed_tokens.weight": "row", "lm_head.weight": "vocabulary"},
    "vanilla": {"model.layers.0.self_attn.k_proj.A": "column", "model.layers.0.self_attn.k_proj.B": "row",
                "model.layers.1.input_layernorm.weight": "replicated", "model.embed_tokens.weight": "vocabulary"},
}


@pytest.mark.parametrize("model", EXPECTED)
def test_info_describes_how_each_layout_splits(runs, model):
    info = runs[0][model]["tp2-dp2-zero2"]["info"]
    for name, category in EXPECTED[model].items():
        assert categories(info, name) == [category], name
    assert info["pipeline_replicated_parameter_patterns"] == []
    assert info["original_vocab_size"] == cases.TINY["vocab_size"]


def test_info_of_other_splits(runs):
    """LaX's crossing parameters are replicated; a tensor-train core split along dim 2 (vanilla: the last input core
    along its output rank) is one sub-parameter along that dim; at tp 1 every parameter is replicated."""
    lax = runs[0]["btp-lax"]["tp2-dp2-zero2"]["info"]
    for name in ("model.layers.1.mlp.up_proj.gate_left", "model.layers.0.self_attn.o_proj.latent_norm.bias"):
        assert categories(lax, name) == ["replicated"], name
    assert categories(lax, "model.layers.0.self_attn.o_proj.A") == ["row"]
    tt = runs[0]["vanilla-tt"]["tp2-dp2-zero2"]["info"]
    assert {s["partition_dim"] for s in tt["parameter_with_sub_params"]} == {2}
    assert categories(tt, "model.layers.0.self_attn.q_proj.cores.1") == ["split2"]  # A^T's last core: [r_1, i_2, r]
    assert categories(tt, "model.layers.0.self_attn.q_proj.cores.2") == ["column"]  # B^T's first core: [r, o_0, r_3]
    assert categories(tt, "model.layers.0.self_attn.q_proj.cores.0") == ["replicated"]
    assert all(len(widths) == 1 and len(widths[0]) == 2 for widths in tt["sub_param_shard_widths"].values())
    whole = runs[0]["btp"]["tp1-dp4-zero1"]["info"]
    assert whole["parameter_with_row_parallelism_patterns"] == [] and whole["vocabulary_parameter_patterns"] == []


# ---------------------------------------------------------------------------------------------------- refusals
def layout(tp: int, dp: int, zero: int | None, universal: bool = True) -> dict:
    recorded = {"deepspeed_parameter_order": DEEPSPEED_PARAMETER_ORDER} if zero is not None else {}
    if universal and zero is not None:
        recorded["deepspeed_universal_info"] = UNIVERSAL_INFO_RECORD
    return {"tp_size": tp, "dp_size": dp, "zero_stage": zero, "global_batch_size": 8, **recorded}


def deepspeed_files(checkpoint, tp: int, dp: int, state: dict | None = None) -> None:
    """The files of a DeepSpeed ZeRO-1/2 checkpoint at tp x dp (their contents only where read: one optimizer file)."""
    folder = checkpoint / "global_step3"
    folder.mkdir(parents=True)
    (checkpoint / "latest").write_text("global_step3")
    for t in range(tp):
        (folder / f"mp_rank_{t:02d}_model_states.pt").write_bytes(b"")
        for d in range(dp):
            (folder / f"zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt").write_bytes(b"")
    state = state or {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}}
    torch.save({"optimizer_state_dict": {"base_optimizer_state": {"state": state, "param_groups": [{}]}}},
               folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")


def test_a_zero12_checkpoint_is_let_through_to_another_layout_or_stage(tmp_path):
    deepspeed_files(tmp_path, 2, 2)
    write_training_layout(str(tmp_path), layout(2, 2, 2))
    for tp, dp, zero in ((1, 4, 2), (4, 1, 1), (2, 2, 1), (1, 8, 2)):
        check_resume_layout(str(tmp_path), layout(tp, dp, zero))
    # the same layout converts nothing (no collective, no folder)
    assert universal_resume(str(tmp_path), str(tmp_path / "out"), layout(2, 2, 2), layout(2, 2, 2)) is None
    assert universal_resume(None, str(tmp_path / "out"), None, layout(1, 4, 2)) is None


def test_what_cannot_be_converted_is_refused_with_the_fix(tmp_path):
    deepspeed_files(tmp_path, 2, 2)
    saved = str(tmp_path)
    write_training_layout(saved, layout(2, 2, 3))
    with pytest.raises(ResumeLayoutError, match=r"ZeRO-1/2 checkpoints resumed with ZeRO-1/2 only .* Resume at tp_size=2 "
                                                r"on 4 processes with ZeRO-3, or start from its weights only with --init_from"):
        check_resume_layout(saved, layout(1, 4, 3))
    write_training_layout(saved, layout(2, 2, 2))
    with pytest.raises(ResumeLayoutError, match="ZeRO-1/2 checkpoints resumed with ZeRO-1/2 only .* with ZeRO-2"):
        check_resume_layout(saved, layout(1, 4, 3))
    with pytest.raises(ResumeLayoutError, match="ZeRO-1/2 checkpoints resumed with ZeRO-1/2 only"):
        check_resume_layout(saved, layout(1, 4, 0))
    write_training_layout(saved, layout(2, 2, 2, universal=False))  # written before the description existed
    with pytest.raises(ResumeLayoutError, match=r"do not describe how each parameter is split .*universal_checkpoint_info.* "
                                                r"Resume at tp_size=2 on 4 processes with ZeRO-2, or start from its weights"):
        check_resume_layout(saved, layout(1, 4, 2))
    check_resume_layout(saved, layout(2, 2, 2))  # at its own layout it resumes as before


def test_missing_or_foreign_zero_files_are_refused(tmp_path):
    write_training_layout(str(tmp_path), layout(2, 2, 2))
    with pytest.raises(ResumeLayoutError, match=r"has no DeepSpeed folder \(global_step<N>\)"):
        check_resume_layout(str(tmp_path), layout(1, 4, 2))
    deepspeed_files(tmp_path, 2, 2)
    (tmp_path / "global_step3" / "zero_pp_rank_1_mp_rank_01_optim_states.pt").unlink()
    with pytest.raises(ResumeLayoutError, match=r"zero_pp_rank_1_mp_rank_01_optim_states.pt is missing: .* Resume from a complete"):
        check_resume_layout(str(tmp_path), layout(1, 4, 2))


def test_optimizer_state_other_than_adams_is_refused(tmp_path):
    deepspeed_files(tmp_path, 1, 4, state={0: {"momentum_buffer": torch.zeros(4)}})
    write_training_layout(str(tmp_path), layout(1, 4, 2))
    with pytest.raises(ResumeLayoutError, match=r"optimizer state holds \['momentum_buffer'\].* converts Adam's moments "
                                                r"\(exp_avg, exp_avg_sq\) only\. Resume at tp_size=1 on 4 processes"):
        check_resume_layout(str(tmp_path), layout(2, 2, 2))


def test_frozen_parameters_are_refused(tmp_path):
    """DeepSpeed's universal load restores what its optimizer holds: a frozen parameter would keep this run's values."""
    model = BoostLlamaForCausalLM(BoostLlamaConfig(**cases.TINY, bottleneck="cola"))
    resume = UniversalResume(str(tmp_path / "checkpoint-3"), str(tmp_path / ".universal-checkpoint-3"))
    (tmp_path / ".universal-checkpoint-3").mkdir()
    model.model.embed_tokens.weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"1 parameters are frozen \(requires_grad=False: model.embed_tokens.weight\).* "
                                         r"Resume at the layout the checkpoint was saved at, or start from its weights only"):
        resume.prepare_model(model)
    assert not (tmp_path / ".universal-checkpoint-3").exists()
    model.model.embed_tokens.weight.requires_grad_(True)
    resume.prepare_model(model)
    assert getattr(model.lm_head.weight, AUTOTP_META) == {"replicated": True, "partition_dim": None}
