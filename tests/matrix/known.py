"""The failures the exactness matrix finds that are someone's to fix, in one place: each entry names the bug, the
check it fails (``"exact"``: the case trains as one process or is refused; ``"final"``: its ``final/`` loads without
boost-hf) and the cases it applies to. ``test_matrix.py`` xfails a trained case an entry applies to while the bug
shows, and fails it when it no longer does (strict): then remove the entry here. A refused case is no sign of a bug,
so entries apply to trained cases only."""

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
    Known("known (issue 42 item 1): FSDP2 x LaX trains wrong where LaX has gates (kronecker, dense): the crossing's "
          "reduction comes from a tensor hook on a parameter fully_shard replaces. The matrix sees it wider than "
          "reported (btp + SP at tp 2): also tp 2 btp without SP (c000), tp 1 (c031) and vanilla under HSDP (c017, "
          "its A and B gradients 0.2 off); not under a pipeline (c012, c041 equal one process)", "exact",
          lambda c: _fully_sharded(c) and c["bottleneck"] == "lax" and c["lax_gate"] != "identity"
          and factors.sizes(c["layout"])["pp"] == 1),
    Known("found by the matrix, not filed yet: LaX with gates (kronecker, dense) at tp 2 x pp 2 trains other gradients "
          "than one process, 0.15-0.39 of their scale (gates, B, biases, the embedding; c016, c048, c081, all bf16: "
          "autocast or bf16_params, no DP); the identity gate there (c027) and every gated LaX at tp 1 x pp 2/4 equal "
          "one process", "exact",
          lambda c: c["bottleneck"] == "lax" and c["lax_gate"] != "identity" and factors.sizes(c["layout"])["tp"] > 1
          and factors.sizes(c["layout"])["pp"] > 1),
]


def reasons(case: dict, check: str) -> list[str]:
    """The known bugs ``case`` hits in ``check``."""
    return [k.reason for k in KNOWN if k.check == check and k.applies(case)]


__all__ = ["KNOWN", "Known", "reasons"]
