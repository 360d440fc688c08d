"""``--lowrank_optimizer loro`` in the trainer (one process): the optimizer and restarted schedule it builds, the
exact step at step ``K`` of training (balanced factors), and the runs it refuses with the reason."""

from __future__ import annotations

import pytest
import torch

from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM, BoostTrainer, BoostTrainingArguments
from boost_hf.optim.loro import LORO_WITHOUT_DEEPSPEED, RESTART_FLOOR, LoroAdamW

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rank=8, max_position_embeddings=32)
LR = 1e-2


def loro_trainer(tmp_path, bottleneck="svd", **overrides) -> BoostTrainer:
    torch.manual_seed(0)
    model = BoostLlamaForCausalLM(BoostLlamaConfig(bottleneck=bottleneck, **TINY))
    ids = torch.randint(0, TINY["vocab_size"], (8, 12), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = BoostTrainingArguments(
        output_dir=str(tmp_path), lowrank_optimizer="loro", loro_exact_every=3, max_steps=3, per_device_train_batch_size=2,
        learning_rate=LR, warmup_steps=0, lr_scheduler_type="constant", report_to="none", hang_timeout_s=0,
        save_strategy="no", disable_tqdm=True, sample_max_new_tokens=0, **overrides,
    )
    return BoostTrainer(model=model, args=args, train_dataset=data)


def test_trainer_builds_loro_with_scaled_factor_rate_and_restarting_schedule(tmp_path):
    trainer = loro_trainer(tmp_path)
    optimizer = trainer.create_optimizer()
    assert isinstance(optimizer, LoroAdamW) and optimizer.exact_every == 3
    factor_group = next(g for g in optimizer.param_groups if g["lr_scale"] != 1.0)
    assert factor_group["lr_scale"] == TINY["rank"] / TINY["hidden_size"]
    assert factor_group["lr"] == pytest.approx(LR * TINY["rank"] / TINY["hidden_size"])
    assert len(factor_group["params"]) == 2 * 7 * TINY["num_hidden_layers"]
    schedule = trainer.create_scheduler(num_training_steps=10)
    for multiplier in schedule.lr_lambdas:  # one per param group
        assert [multiplier(step) for step in (2, 3, 6)] == pytest.approx([1.0, RESTART_FLOOR, RESTART_FLOOR])
        assert multiplier(4) == pytest.approx(RESTART_FLOOR + 1 / 5 * (1 - RESTART_FLOOR))


def test_training_takes_the_exact_step_at_step_k(tmp_path):
    trainer = loro_trainer(tmp_path)
    trainer.train()
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
    assert isinstance(optimizer, LoroAdamW) and optimizer.steps_in_period == 0
    for name, module in trainer.model.named_modules():
        if isinstance(getattr(module, "A", None), torch.nn.Parameter):
            B, A = module.B.detach().double(), module.A.detach().double()
            gram_B, gram_A = B.T @ B, A @ A.T
            scale = gram_B.abs().max()
            assert (gram_B - gram_A).abs().max() / scale < 1e-5, name  # balanced
            assert (gram_B - torch.diag(torch.diagonal(gram_B))).abs().max() / scale < 1e-5, name  # B^T B = Sigma


@pytest.mark.parametrize("bottleneck", ["cola", "lax"])
def test_trainer_refuses_loro_with_something_between_the_factors(tmp_path, bottleneck):
    with pytest.raises(ValueError, match="only valid for bottleneck='svd'.*changes this function"):
        loro_trainer(tmp_path, bottleneck=bottleneck)  # at set-up, before any collective


def test_loro_under_deepspeed_is_refused_with_the_reason(tmp_path):
    with pytest.raises(ValueError) as error:
        BoostTrainingArguments(output_dir=str(tmp_path), lowrank_optimizer="loro", deepspeed={"zero_optimization": {"stage": 2}})
    assert str(error.value) == LORO_WITHOUT_DEEPSPEED and "cut" in LORO_WITHOUT_DEEPSPEED


@pytest.mark.parametrize("field, value", [("lowrank_optimizer", "sgd"), ("loro_exact_every", 0), ("loro_lr_scale", -1.0)])
def test_bad_loro_arguments_are_refused(tmp_path, field, value):
    with pytest.raises(ValueError, match=field):
        BoostTrainingArguments(output_dir=str(tmp_path), **{"lowrank_optimizer": "loro", field: value})
