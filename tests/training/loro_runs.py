"""LORO training runs of ``recipes/pretrain.py`` inside one ``accelerate launch`` of 4 CPU processes:

    accelerate launch --config_file accelerate_configs/cpu-4proc.yaml tests/training/loro_runs.py OUT RECIPE.yaml [ARGS]

``ARGS`` select LORO on an svd model at tp 2 x dp 2 (exact step every 3 steps). Writes under ``OUT``: ``loro``
(trained, a checkpoint every step), and its checkpoints inside a period resumed at tp 4 x dp 1 (``checkpoint-2``:
``loro-tp4-resumed``) and tp 1 x dp 4 (``checkpoint-4``: ``loro-dp4-resumed``), same global batch.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
import pretrain  # noqa: E402


def main(out: str, *common: str) -> None:
    out, common = Path(out), list(common)
    pretrain.main(common + ["--save_strategy", "steps", "--save_steps", "1", "--save_total_limit", "6", "--output_dir", str(out / "loro")])
    for run, step, layout in (("loro-tp4-resumed", 2, ["--tp_size", "4", "--per_device_train_batch_size", "8"]),
                              ("loro-dp4-resumed", 4, ["--tp_size", "1", "--per_device_train_batch_size", "2"])):
        resume = ["--resume_from_checkpoint", str(out / "loro" / f"checkpoint-{step}")]
        pretrain.main(common + ["--output_dir", str(out / run), *layout, *resume])


if __name__ == "__main__":
    main(*sys.argv[1:])
