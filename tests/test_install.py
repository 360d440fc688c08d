"""boost-hf as a library: importing it and loading / running a saved model needs neither DeepSpeed nor gensim
(they are only imported by training with DeepSpeed and by the demo corpus)."""

from __future__ import annotations

import subprocess
import sys

import torch

from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM

SCRIPT = """
import sys, torch
import boost_hf
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False)
print(sorted({m.split('.')[0] for m in sys.modules} & {'deepspeed', 'gensim'}))
"""


def test_loading_a_model_imports_neither_deepspeed_nor_gensim(tmp_path):
    torch.manual_seed(0)
    config = BoostLlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                              bottleneck="cola", rank=8)
    BoostLlamaForCausalLM(config).save_pretrained(tmp_path)
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
