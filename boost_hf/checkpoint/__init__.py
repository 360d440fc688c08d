"""Checkpoints, in one package: what a checkpoint is and how it is written, checked, resharded and found.

* format and integrity: :mod:`.integrity` (the manifest of every file's digest, the architecture record),
  :mod:`.folders` (staging folder, manifest, rename; asynchronous saves; which checkpoints are complete),
  :mod:`.export` (the Hugging Face folder streamed out of a checkpoint's shards), :mod:`.weights_io` (canonical
  safetensors read as this rank's slices);
* distributed state and resharding: :mod:`.sharded_state` (the parameters as DTensors for
  ``torch.distributed.checkpoint``: each rank writes and reads its own shards, at any layout),
  :mod:`.optimizer_state` (the optimizer's shards, also ZeRO-1's), :mod:`.resume` (the layout record and what may
  resume where; checkpoints of boost-hf 0.x), :mod:`.deepspeed_universal` (a DeepSpeed ZeRO-1/2 checkpoint at another
  layout, through DeepSpeed's universal checkpoint);
* the run folder: :mod:`.run_folder` (the checkpoint a run resumes from, the run id, the writer, the earlier run a new
  one replaces), :mod:`.lock` (one run writes a folder);
* :mod:`.model_hooks`: what a model given a ``ParallelConfig`` runs to build, load and save its shard.

The trainer saves and loads through one call each (:mod:`boost_hf.training.checkpointing`).
"""
