"""LORO as its authors train it (``mzf666/LORO-main``): their ``cosine_restart`` schedule, their Adam epsilon
placement and their factor init, each against a reference written here from their code, and the ``loro-*`` recipes.

The schedule reference below is a transcription of ``_get_cosine_schedule_with_multiple_warmups_lambda``
(``peft_pretraining/training_utils.py``) in its own words: one branch per case of their code, their variable roles
kept, evaluated independently of :mod:`boost_hf.optim.loro_schedule`.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import TrainerCallback

from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM, BoostTrainer
from boost_hf.optim.loro import loro_optimizer
from boost_hf.optim.loro_schedule import authors_multiplier
from boost_hf.training.recipe import parse_recipe
from tests.optim.test_loro import dense_exact_step
from tests.training.launcher import REPO

FLOOR = 1e-6
SCRIPTS = {  # size: (num_training_steps, warmup_steps, cosine_restart_freq, lr_adjust_steps), scripts/loro_c4/llama_<size>.sh
    "60m": (10_000, 1_000, 500, -1_000),
    "130m": (20_000, 2_000, 500, -2_000),
    "350m": (60_000, 2_000, 500, -6_000),
    "1b": (100_000, 10_000, 200, -10_000),
}


def their_schedule(step: int, total: int, warmup: int, every: int, adjust: int, restart_warmup: int = 5, low: float = 0.1) -> float:
    """Their multiplier at ``step``: inside warm-up a line from ``low`` to the value their cosine *without* ``low``
    has at ``-adjust``; after it the cosine at ``step + adjust`` (peak at ``warmup``); ``restart_warmup`` steps of
    re-warm-up from 1e-6 after every positive multiple of ``every`` of ``step`` (warm-up) or ``step + adjust`` (after)."""
    span = max(1, total - warmup)
    if step < warmup:
        end_of_line = (1 + math.cos(math.pi * (-adjust) / span)) / 2
        line = lambda s: low + (end_of_line - low) * s / max(1, warmup)  # noqa: E731
        cycle, inside = step // every, step % every
        if cycle != 0 and inside < restart_warmup:
            return FLOOR + (line(cycle * every) - FLOOR) * inside / max(1, restart_warmup)
        return line(step)
    cosine = lambda t: low + (1 - low) * (1 + math.cos(math.pi * (t - warmup) / span)) / 2  # noqa: E731
    moved = step + adjust
    cycle, inside = math.floor(moved / every), moved - math.floor(moved / every) * every
    if cycle > 0 and inside < restart_warmup:
        return FLOOR + (cosine(cycle * every) - FLOOR) * inside / max(1, restart_warmup)
    return cosine(moved)


def ours(step: int, total: int, warmup: int, every: int, adjust: int) -> float:
    return authors_multiplier(step, training_steps=total, warmup_steps=warmup, restart_every=every, restart_warmup_steps=5,
                              min_ratio=0.1, shift=adjust)


@pytest.mark.parametrize("size", SCRIPTS)
def test_schedule_equals_theirs_at_every_step_of_their_scripts(size):
    total, warmup, every, adjust = SCRIPTS[size]
    worst = max(abs(ours(s, *SCRIPTS[size]) - their_schedule(s, *SCRIPTS[size])) / their_schedule(s, *SCRIPTS[size])
                for s in range(total + 1))
    assert worst < 1e-12, size


def test_schedule_shape_as_documented():
    """60m: from 0.1x, a restart at the floor after the exact step of step 500 (0-based 499), none after the one
    that ends warm-up (step 1000), the peak at 2 x warm-up (where a restart falls), near 0.127x at the end; 350m: no restart after the exact
    steps of steps 2000-6000, the peak at step 8000."""
    m60 = lambda s: ours(s, *SCRIPTS["60m"])  # noqa: E731
    top = (1 + math.cos(math.pi / 9)) / 2  # their warm-up ends at cos(pi W / (N - W)) without the 0.1 floor
    line = lambda s: 0.1 + s / 1000 * (top - 0.1)  # noqa: E731
    assert m60(0) == pytest.approx(0.1) and m60(499) == pytest.approx(line(499)) and m60(999) == pytest.approx(line(999))
    assert m60(500) == pytest.approx(FLOOR) and m60(504) == pytest.approx(FLOOR + 4 / 5 * (line(500) - FLOOR))
    assert m60(505) == pytest.approx(line(505))
    assert m60(1000) == pytest.approx(0.1 + 0.9 * top) and m60(1000) > 0.97  # no restart where warm-up ends
    assert m60(1500) == pytest.approx(FLOOR) and m60(2000) == pytest.approx(FLOOR)
    rates = [m60(s) for s in range(10_000)]  # the peak t = W falls on the restart at s = 2000: the highest is s = 1999
    assert max(rates) == rates[1999] == pytest.approx(1.0, abs=1e-6) and rates[2005] == pytest.approx(1.0, abs=1e-6)
    assert m60(9_999) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi * 7999 / 9000)) / 2) and 0.126 < m60(9_999) < 0.128
    m350 = lambda s: ours(s, *SCRIPTS["350m"])  # noqa: E731
    assert all(m350(s) > 0.9 for s in range(2_000, 6_500))
    assert m350(6_500) == pytest.approx(FLOOR) and m350(8_005) == pytest.approx(1.0, abs=1e-6)


def test_bad_schedule_settings_are_refused(tmp_path):
    from boost_hf.training import BoostTrainingArguments

    common = dict(output_dir=str(tmp_path), lowrank_optimizer="loro", loro_schedule="authors", max_steps=100)
    with pytest.raises(ValueError, match="lr_scheduler_type cosine_with_min_lr"):
        BoostTrainingArguments(**common, lr_scheduler_type="linear", lr_scheduler_kwargs={})
    with pytest.raises(ValueError, match="loro_schedule_shift"):
        BoostTrainingArguments(**common, warmup_steps=10, loro_schedule_shift=95)
    with pytest.raises(ValueError, match="add --loro_schedule authors"):
        BoostTrainingArguments(output_dir=str(tmp_path), lowrank_optimizer="loro", loro_schedule_shift=-10)
    with pytest.raises(ValueError, match="with --lowrank_optimizer loro"):
        BoostTrainingArguments(output_dir=str(tmp_path), adam_epsilon_placement="transformers")


# ---------------------------------------------------------------------- the optimizer step
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, rank=8, max_position_embeddings=32, bottleneck="svd")


def backward(model, seed: int) -> None:
    ids = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(seed))
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids).loss.backward()


@pytest.mark.parametrize("exact", [False, True], ids=["lazy", "exact"])
def test_their_epsilon_placement_step_equals_the_formula(exact):
    """float64, the second of two steps (non-trivial moments): every parameter moves by
    ``lr sqrt(bc2) / bc1 m / (sqrt(v) + eps)`` (the factors at ``lr r / d``), as their LOROAdamW; at an exact step
    ``B A`` becomes the rank-r truncated SVD of ``W - lr sqrt(bc2) / bc1 P_T(D)``, ``D`` the factors' directions
    ``m / (sqrt(v) + eps)`` (the dense reference of tests/optim/test_loro.py), the other parameters as lazy."""
    torch.manual_seed(0)
    model = BoostLlamaForCausalLM(BoostLlamaConfig(**TINY)).double()
    lr, eps, (beta1, beta2) = 0.02, 1e-6, (0.9, 0.999)
    optimizer = loro_optimizer(model, lr=lr, eps=eps, exact_every=2 if exact else 100, epsilon_placement="transformers")
    scale = TINY["rank"] / TINY["hidden_size"]
    pairs = [name for name, module in model.named_modules() if hasattr(module, "A")]
    factors = {f"{name}.{f}" for name in pairs for f in ("A", "B")}
    moments = {n: (torch.zeros_like(p), torch.zeros_like(p)) for n, p in model.named_parameters()}
    for step in (1, 2):
        backward(model, seed=step)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
        direction = {}
        for name, p in model.named_parameters():
            m, v = moments[name]
            moments[name] = m, v = beta1 * m + (1 - beta1) * p.grad, beta2 * v + (1 - beta2) * p.grad**2
            direction[name] = m / (v.sqrt() + eps)
        optimizer.step()
        params = dict(model.named_parameters())
        for name, p in params.items():
            if exact and step == 2 and name in factors:
                continue
            rate = size * scale if name in factors else size
            assert torch.allclose(p.detach(), before[name] - rate * direction[name], rtol=1e-12, atol=1e-15), (step, name)
    if exact:
        for name in pairs:
            W, _ = dense_exact_step(before[f"{name}.B"], before[f"{name}.A"], direction[f"{name}.B"], direction[f"{name}.A"], size, 0.0)
            product = params[f"{name}.B"].detach() @ params[f"{name}.A"].detach()
            assert (product - W).abs().max() / W.abs().max() < 1e-10, name


def test_torch_placement_is_unchanged():
    """The default stays torch's AdamW arithmetic (bitwise on lazy steps: tests/optim/test_loro.py); here its
    documented difference: theirs is torch's with eps / sqrt(bc2) (one step, float64)."""
    results = {}
    for placement, eps in (("torch", 1e-6 / math.sqrt(1 - 0.999)), ("transformers", 1e-6)):
        torch.manual_seed(0)
        model = BoostLlamaForCausalLM(BoostLlamaConfig(**TINY)).double()
        backward(model, seed=1)
        loro_optimizer(model, lr=0.02, eps=eps, exact_every=100, epsilon_placement=placement).step()
        results[placement] = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.allclose(results["torch"], results["transformers"], rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------------- factor init
def test_xavier_factor_init_per_factor():
    """``factor_init="xavier"``: each factor ``N(0, 2 / (rows + columns))`` of its own shape (their
    ``xavier_normal_``), drawn at the unsharded shape like every boost-hf weight; CoLA's init is another scale."""
    shape = dict(TINY, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=4, rank=64)
    for init in ("xavier", "cola"):
        torch.manual_seed(0)
        model = BoostLlamaForCausalLM(BoostLlamaConfig(**shape, factor_init=init))
        for name, module in model.named_modules():
            if not hasattr(module, "A"):
                continue
            cola = module.rank**-0.25 * (module.in_features + module.out_features) ** -0.25
            for factor in (module.A, module.B):
                expected = math.sqrt(2 / sum(factor.shape)) if init == "xavier" else cola
                assert factor.std().item() == pytest.approx(expected, rel=0.03), (init, name)
    with pytest.raises(ValueError, match="factor_init"):
        BoostLlamaConfig(**TINY, factor_init="kaiming")


# ---------------------------------------------------------------------- the loro-60m recipe's logged rates
class StopAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step >= self.step


def test_loro_60m_logs_the_authors_learning_rate_at_every_step(tmp_path):
    """The loro-60m recipe's training settings (10,000 steps, warm-up 1000, exact steps every 500, shift -1000) run
    on a tiny svd model until step 1006: across the restart after the exact step of step 500 and the exact step of
    step 1000 that ends warm-up (not followed by a restart), into the cosine. The logged rate of each step equals
    ``1e-2`` x their multiplier at that step (1e-9 relative); their multiplier at every step of the whole run is
    checked against ours above. Only what cannot run here is overridden (model size, data, bf16 on CPU, logging
    every step, no evaluation or checkpoints)."""
    _, _, args = parse_recipe([str(REPO / "recipes" / "loro-60m.yaml"), "--output_dir", str(tmp_path), "--bf16", "false",
                               "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
                               "--logging_steps", "1", "--eval_strategy", "no", "--save_strategy", "no",
                               "--report_to", "none", "--dataloader_num_workers", "0", "--disable_tqdm", "true",
                               "--sample_max_new_tokens", "0", "--hang_timeout_s", "0"])
    torch.manual_seed(0)
    model = BoostLlamaForCausalLM(BoostLlamaConfig(**TINY, factor_init="xavier"))
    ids = torch.randint(0, TINY["vocab_size"], (64, 12), generator=torch.Generator().manual_seed(1))
    trainer = BoostTrainer(model=model, args=args, train_dataset=[{"input_ids": row, "labels": row} for row in ids],
                           callbacks=[StopAt(1006)])
    trainer.train()
    logged = {entry["step"]: entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry}
    assert sorted(logged) == list(range(1, 1007))
    worst = max(abs(rate - 1e-2 * their_schedule(step - 1, *SCRIPTS["60m"])) / (1e-2 * their_schedule(step - 1, *SCRIPTS["60m"]))
                for step, rate in logged.items())
    assert worst < 1e-9
    assert logged[501] == pytest.approx(1e-2 * FLOOR) and logged[502] == pytest.approx(1e-2 * (FLOOR + (logged[500] / 1e-2 - FLOOR) / 5), rel=1e-2)
    assert all(logged[step] > 0.97e-2 for step in range(1001, 1007))  # the exact step that ends warm-up: no restart
