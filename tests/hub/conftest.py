"""A tiny trained run shared by the hub tests: a byte-level BPE on generated text, a CoLA model trained a few
steps by ``BoostTrainer``, evaluated, and saved to ``final/`` exactly as a recipe run saves it."""

from __future__ import annotations

import random

import pytest
import torch

WORDS = ("the river city north old music school light stone green early war king song water field paper "
         "people small house long road winter summer market bridge church island mountain station language").split()
BLOCK = 32


def documents(count: int, seed: int) -> list[str]:
    """Generated sentences (seeded), a few per document."""
    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9))).capitalize() + "." for _ in range(rng.randint(1, 3))]
        docs.append(" ".join(sentences))
    return docs


def packed(tokenizer, texts: list[str]):
    from datasets import Dataset

    from boost_hf.data.pipeline import pack_blocks, tokenize_documents

    return pack_blocks(tokenize_documents(Dataset.from_dict({"text": texts}), tokenizer), BLOCK)


@pytest.fixture(scope="session")
def hub_texts() -> dict[str, list[str]]:
    return {"train": documents(300, 0), "validation": documents(40, 1)}


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, hub_texts):
    """``(trainer, final folder)`` of a CoLA model trained 6 steps (cola, d=32, 2 layers, rank 8, vocab 320)."""
    pytest.importorskip("datasets", reason="needs the [train] extra (datasets): a trained run")
    from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM
    from boost_hf.data import train_bpe_tokenizer
    from boost_hf.training import BoostTrainer, BoostTrainingArguments

    root = tmp_path_factory.mktemp("hub_run")
    tokenizer = train_bpe_tokenizer(hub_texts["train"], vocab_size=300, cache_dir=root / "cache")
    torch.manual_seed(0)
    config = BoostLlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=64, bottleneck="cola", rank=8,
                              bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    args = BoostTrainingArguments(output_dir=str(root / "run"), max_steps=6, per_device_train_batch_size=4, learning_rate=3e-3,
                                  logging_steps=2, save_strategy="no", report_to="none", disable_tqdm=True,
                                  sample_max_new_tokens=0, warmup_steps=0, per_device_eval_batch_size=8)
    trainer = BoostTrainer(model=BoostLlamaForCausalLM(config), args=args, train_dataset=packed(tokenizer, hub_texts["train"]),
                           eval_dataset=packed(tokenizer, hub_texts["validation"]), processing_class=tokenizer)
    trainer.card_metadata["datasets"] = ["generated-test-text"]
    trainer.train()
    trainer.evaluate()
    return trainer, trainer.save_final_model()
