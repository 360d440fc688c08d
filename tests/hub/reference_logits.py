"""Reference logits of a small checkpoint of every bottleneck, written once on the pinned stack (torch 2.13,
transformers 5.23) and committed under ``tests/hub/reference/``: ``<name>/config.json``, ``<name>/model.safetensors``
(the weights) and ``logits.safetensors`` (fp32 logits of :data:`INPUT_IDS`, one tensor per name). Both legs of ``make
test`` load each checkpoint with the model file of this checkout and compare with them, so the model file computes
the same logits on every transformers version in the supported range (tests/hub/test_remote_code.py).

    python -m tests.hub.reference_logits      # rewrite them (only when the model's function changes on purpose)
"""

from __future__ import annotations

from pathlib import Path

import torch

REFERENCE = Path(__file__).resolve().parent / "reference"
INPUT_IDS = [[5, 17, 42, 99, 7, 64, 12, 250], [9, 8, 7, 6, 5, 4, 3, 200]]
SHAPE = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rank=8)
#: name -> BoostLlamaConfig fields: every bottleneck (LaX with a dense gate and biases, and with a Kronecker gate)
CHECKPOINTS = {
    "full": dict(bottleneck=None),
    "svd": dict(bottleneck="svd"),
    "cola": dict(bottleneck="cola"),
    "lax-kronecker": dict(bottleneck="lax", lax_gate="kronecker"),
    "lax-dense-biases": dict(bottleneck="lax", lax_gate="dense", attention_bias=True, mlp_bias=True),
    "tt": dict(bottleneck="tt"),
}


def write() -> None:
    from safetensors.torch import save_file

    from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM

    logits = {}
    for name, fields in CHECKPOINTS.items():
        torch.manual_seed(3)
        model = BoostLlamaForCausalLM(BoostLlamaConfig(**SHAPE, **fields)).eval()
        model.save_pretrained(REFERENCE / name)
        for code in (REFERENCE / name).glob("*.py"):
            code.unlink()  # the test ships this checkout's model file, not a stale copy
        (REFERENCE / name / "generation_config.json").unlink(missing_ok=True)
        with torch.no_grad():
            logits[name] = model(torch.tensor(INPUT_IDS)).logits.contiguous()
    save_file(logits, REFERENCE / "logits.safetensors")
    import transformers

    (REFERENCE / "README.md").write_text(
        f"Written by `python -m tests.hub.reference_logits` with torch {torch.__version__}, transformers "
        f"{transformers.__version__}: see that module.\n")


if __name__ == "__main__":
    write()
