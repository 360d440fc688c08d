"""The failures the exactness matrix finds that are someone's to fix, in one place: each entry names the bug, the
check it fails (``"exact"``: the case trains as one process or is refused; ``"final"``: its ``final/`` loads without
boost-hf) and the cases it applies to. ``test_matrix.py`` marks those cases ``xfail(strict=True)``, so a fix shows as
an XPASS, which fails the run: then remove the entry here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import factors


@dataclass(frozen=True)
class Known:
    reason: str
    check: str  # "exact" or "final"
    applies: Callable[[dict], bool]


def _fully_sharded(case: dict) -> bool:
    return case["dp_backend"] in factors.FULLY_SHARDED


KNOWN: list[Known] = [
    Known("known (issue 42 item 1): FSDP2 x LaX x btp trains wrong: the LaX crossing's TP sum comes from a tensor hook "
          "on the parameter fully_shard replaces, so it never fires", "exact",
          lambda c: _fully_sharded(c) and c["bottleneck"] == "lax" and c["tp_style"] == "btp"
          and factors.sizes(c["layout"])["tp"] > 1),
    Known("known (issue 42 item 1): FSDP2's saved folders name the FSDP wrapper class (FSDPBoostLlamaForCausalLM) "
          "instead of the model's, so final/ does not load without boost-hf", "final",
          lambda c: _fully_sharded(c) and factors.sizes(c["layout"])["pp"] == 1),
    Known("known (issue 42 item 2): a model with tied embeddings cannot be published (final/: missing lm_head.weight)",
          "final", lambda c: c["tie_word_embeddings"] is True),
]


def reasons(case: dict, check: str) -> list[str]:
    """The known bugs ``case`` hits in ``check``."""
    return [k.reason for k in KNOWN if k.check == check and k.applies(case)]


__all__ = ["KNOWN", "Known", "reasons"]
