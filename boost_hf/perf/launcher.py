"""Run a function on N local CPU processes (gloo, file rendezvous) and collect what each rank returns.

Used by ``boost-hf comm`` and by the multi-process tests; training runs use ``accelerate launch``.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, tmp: str, fn, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world_size)
    try:
        result = {"ok": True, "value": fn(*args)}
    except BaseException:  # report to the parent instead of leaving the others waiting
        result = {"ok": False, "error": traceback.format_exc()}
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    from ..parallel.state import reset_parallel_states

    reset_parallel_states()
    dist.destroy_process_group()


def launch(fn, world_size: int, *args, timeout: float = 600.0) -> list:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks (``fn`` importable, results JSON-serialisable);
    return the per-rank results. Raises with every failing rank's traceback, or on timeout."""
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(_entry, args=(world_size, tmp, fn, args), nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in context.processes:
                    p.kill()
                raise TimeoutError(f"distributed run of {fn.__name__} on {world_size} ranks exceeded {timeout}s")
        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                results.append(json.load(f))
    failures = [f"rank {i}:\n{r['error']}" for i, r in enumerate(results) if not r["ok"]]
    if failures:
        raise RuntimeError("\n".join(failures))
    return [r["value"] for r in results]


__all__ = ["launch"]
