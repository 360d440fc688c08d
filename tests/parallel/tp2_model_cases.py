"""The 2-rank cases of several test files in one 2-rank process group (each launch costs an interpreter start with
torch and boost_hf per rank): token ids out of range (tests/parallel/test_token_ids.py), loading in every layout
(tests/parallel/test_load_pretrained.py), the authors' CoLA checkpoint at TP 2 (tests/test_authors_checkpoint.py),
the gradient norm under TP (tests/training/test_components.py) and ``torch.compile`` under TP
(tests/parallel/test_compile.py, last: it resets dynamo between its cases). Run once per session by the
``tp2_model_results`` fixture (tests/conftest.py); each file's tests read their own section with :func:`section`."""

from __future__ import annotations

import traceback


def _run(fn, *args) -> dict:
    """``fn``'s result, or its traceback: a failing section fails only its own file's tests."""
    try:
        return {"ok": True, "value": fn(*args)}
    except Exception:  # noqa: BLE001 - reported to the test that reads this section
        return {"ok": False, "error": traceback.format_exc()}


def everything(world_size: int) -> dict:
    from tests import test_authors_checkpoint
    from tests.parallel import compile_cases, load_cases, token_id_cases
    from tests.training import test_components

    return {
        "token_ids": _run(token_id_cases.everything, world_size),
        "load": _run(load_cases.everything, world_size),
        "authors": _run(test_authors_checkpoint.authors_checkpoint_at_tp),
        "grad_norm": _run(test_components._norm_case),
        "compile": _run(compile_cases.compile_parity),
    }


def section(results: list[dict], name: str) -> list:
    """Per rank, the value of section ``name``; raises with the rank's traceback if it failed there."""
    failures = [f"rank {rank}:\n{r[name]['error']}" for rank, r in enumerate(results) if not r[name]["ok"]]
    if failures:
        raise AssertionError("\n".join(failures))
    return [r[name]["value"] for r in results]
