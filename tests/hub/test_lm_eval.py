"""lm-evaluation-harness runs on a boost-hf checkpoint unchanged (``lm_eval --model hf --model_args
pretrained=DIR,trust_remote_code=True``, no wrapper) on a local rolling-loglikelihood task, and its bits per
byte equal the model's own (documents scored after an EOS, as training packed them: the published tokenizer
declares no BOS for lm_eval to prepend)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lm_eval")

TASK = """task: boost_hf_local_text
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
metadata:
  version: 1.0
"""


def own_bits_per_byte(final, texts) -> float:
    """Sum over documents of the NLL of their tokens after an EOS, over ln 2 x their UTF-8 bytes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import boost_hf  # noqa: F401

    tokenizer = AutoTokenizer.from_pretrained(final)
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    nll = 0.0
    for text in texts:
        ids = torch.tensor([[tokenizer.eos_token_id] + tokenizer(text, add_special_tokens=False).input_ids])
        with torch.no_grad():
            nll += model(ids, labels=ids, num_items_in_batch=1).loss.item()
    return nll / (math.log(2) * sum(len(t.encode("utf-8")) for t in texts))


def test_lm_eval_cli_on_a_local_task(trained_run, hub_texts, tmp_path):
    _, final = trained_run
    texts = hub_texts["validation"][:6]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "boost_hf_local_text.yaml").write_text(TASK.format(data=data))
    out = tmp_path / "results"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"),
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)  # lm_eval sees the checkpoint's remote code, not boost_hf
    command = [os.path.join(os.path.dirname(sys.executable), "lm_eval"), "--model", "hf", "--model_args",
               f"pretrained={final},trust_remote_code=True,dtype=float32", "--tasks", "boost_hf_local_text",
               "--include_path", str(tasks), "--device", "cpu", "--batch_size", "2", "--output_path", str(out)]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    found = [os.path.join(d, f) for d, _, files in os.walk(out) for f in files if f.startswith("results")]
    scores = json.load(open(found[0]))["results"]["boost_hf_local_text"]
    assert scores["bits_per_byte,none"] == pytest.approx(own_bits_per_byte(final, texts), rel=1e-4)
