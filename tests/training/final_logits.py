"""The trained model's logits beside its ``final/``, and the same folder's logits with plain transformers where
boost-hf cannot be imported.

* Inside a training launch (a case script): :func:`record_final_logits` patches ``BoostTrainer.save_final_model`` so
  that, after writing ``final/``, every rank runs the trained model (as the run holds it: its TP shards, FSDP2's units,
  DeepSpeed's module; not a pipeline's stages) on :data:`INPUT_IDS` and global rank 0 saves the full fp32 logits as
  ``<output_dir>/final-logits.pt``.
* In the test: :func:`load_without_boost_hf` loads each folder with ``AutoModelForCausalLM.from_pretrained(...,
  trust_remote_code=True)`` in a fresh environment holding only torch, transformers and safetensors
  (:mod:`tests.hub.isolated_env`), and reports its logits on :data:`INPUT_IDS`, its class, its config's
  ``architectures`` and ``auto_map``, the Python files of the folder, and whether its LM head is its embedding.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.hub import isolated_env

INPUT_IDS = [[5, 17, 42, 99, 7, 64, 12, 250], [9, 8, 7, 6, 5, 4, 3, 200]]
LOGITS_FILE = "final-logits.pt"


def record_final_logits() -> None:
    """Make every ``BoostTrainer.save_final_model`` of this process also save the trained model's logits (see the
    module docstring). Collective, like the save."""
    import torch.distributed as dist

    from boost_hf.parallel.fully_shard import reshard
    from boost_hf.training import BoostTrainer

    save_final_model = BoostTrainer.save_final_model

    def saving_logits(self, output_dir=None):
        target = save_final_model(self, output_dir)
        model = self.model
        if getattr(model, "pipeline", None) is not None:  # (a stage's forward is not the model's)
            return target
        was_training = model.training
        model.eval()
        with torch.no_grad():
            logits = model(torch.tensor(INPUT_IDS, device=self.args.device)).logits.float().cpu()
        reshard(model)
        model.train(was_training)
        if not dist.is_initialized() or dist.get_rank() == 0:
            torch.save(logits, Path(self.args.output_dir) / LOGITS_FILE)
        return target

    BoostTrainer.save_final_model = saving_logits


SCRIPT = r"""
import importlib.util, json, os, sys, torch
from transformers import AutoModelForCausalLM
report = {"boost_hf_importable": importlib.util.find_spec("boost_hf") is not None}
for name, folder in json.loads(sys.argv[1]).items():
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.save(model(torch.tensor(INPUT_IDS)).logits, f"{name}.logits.pt")
    config = json.load(open(os.path.join(folder, "config.json")))
    head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    report[name] = {"class": type(model).__module__ + "." + type(model).__name__, "architectures": config.get("architectures"),
                    "auto_map": config.get("auto_map"), "python_files": sorted(f for f in os.listdir(folder) if f.endswith(".py")),
                    "head_is_embedding": head.data_ptr() == embedding.data_ptr()}
print("REPORT" + json.dumps(report))
"""


def load_without_boost_hf(tmp_path: Path, folders: dict[str, Path]) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(report, {name: logits})`` of each folder loaded with plain transformers in an environment without boost-hf
    (see the module docstring); one interpreter for all of them."""
    python = isolated_env.create(tmp_path / "venv")
    result = isolated_env.run(python, SCRIPT.replace("INPUT_IDS", repr(INPUT_IDS)), tmp_path, timeout=600,
                              args=(json.dumps({name: str(folder) for name, folder in folders.items()}),))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.split("REPORT", 1)[1])
    return report, {name: torch.load(tmp_path / f"{name}.logits.pt") for name in folders}


__all__ = ["INPUT_IDS", "LOGITS_FILE", "load_without_boost_hf", "record_final_logits"]
