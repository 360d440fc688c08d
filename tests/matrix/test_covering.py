"""The matrix's cases are generated from the settings' declarations and hold what they claim (fast; the runs are
``test_matrix.py``'s): every declared setting is a factor or excluded with its reason, every declared value a
factor's value, a value added to a declaration joins the matrix with no test edit, and the generated array holds
every feasible pair of values and every triple of TP style x sequence parallelism x DP backend, each in a case
``boost-hf train`` accepts wherever such a case exists."""

from __future__ import annotations

import importlib
import itertools
from typing import Literal

import pytest

from . import covering, factors, generated
from .covering import INACTIVE, Constraint, Factor


def test_every_declared_setting_is_a_factor_or_excluded_with_its_reason():
    declared = factors.declared_settings()
    accounted = set(factors.FACTOR_OF) | set(factors.EXCLUDED)
    assert not declared - accounted, f"declared settings the matrix neither varies nor excludes: {sorted(declared - accounted)}"
    assert not accounted - declared, f"settings the matrix names that are declared nowhere: {sorted(accounted - declared)}"
    assert not set(factors.FACTOR_OF) & set(factors.EXCLUDED)
    assert set(factors.FACTOR_OF.values()) <= set(factors.FACTOR_NAMES)
    assert all(len(reason) > 20 for reason in [*factors.EXCLUDED.values(), *factors.EXCLUDED_VALUES.values()])


def test_every_declared_value_is_a_value_of_its_factor_or_excluded_with_its_reason():
    by_name = {f.name: f for f in factors.FACTORS}
    for setting, factor in factors.FACTOR_OF.items():
        for value in factors.declared_values(setting):
            if setting.endswith(".zero1_optimizer"):
                continue
            assert value in by_name[factor].values or (factor, value) in factors.EXCLUDED_VALUES, (setting, value)
    for stage in factors.DEEPSPEED_STAGES:  # DeepSpeed's own declaration of its ZeRO stages
        backend = f"deepspeed-zero{stage}"
        assert backend in by_name["dp_backend"].values or ("dp_backend", backend) in factors.EXCLUDED_VALUES, backend
    assert {"ddp", "zero1", "fsdp2", "hsdp", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3"} <= set(by_name["dp_backend"].values)
    assert set(by_name["layout"].values) == {"tp1-pp1-dp4", "tp1-pp2-dp2", "tp1-pp4-dp1", "tp2-pp1-dp2", "tp2-pp2-dp1", "tp4-pp1-dp1"}


def test_a_value_added_to_a_declaration_joins_the_matrix_without_a_test_edit(monkeypatch):
    """A new TP style (a new ``Literal`` choice of ``ParallelConfig.tp_style``) is a value of the factor, the array
    built from the grown declarations is another one, and it holds every pair of the new value with every other
    factor's values (and the TP style x SP x DP backend triples with it), as every other tuple. Built without the
    CLI's checks (``blame``), which would refuse a style that has no code: the coverage is the generator's."""
    import boost_hf.parallel.config as config_module

    def built(module):
        return covering.build(module.FACTORS, module.CONSTRAINTS, triples=module.TRIPLES, seed=generated.SEED, candidates=4)

    before = built(factors)
    monkeypatch.setattr(config_module, "TPStyle", Literal["btp", "vanilla", "megatron", "newstyle"])
    try:
        grown = importlib.reload(factors)
        assert "newstyle" in next(f for f in grown.FACTORS if f.name == "tp_style").values
        after = built(grown)
    finally:
        monkeypatch.undo()
        importlib.reload(factors)
    assert "newstyle" not in next(f for f in factors.FACTORS if f.name == "tp_style").values
    assert after.cases != before.cases and any(case["tp_style"] == "newstyle" for case in after.cases)
    assert not covering.uncovered_tuples(after)
    new_pairs = {t for t in after.required if ("tp_style", "newstyle") in t and len(t) == 2}
    others = {n for t in new_pairs for n, _ in t} - {"tp_style"}
    # with every other factor's values, but the factors that mean something under another style only (BTP's norms)
    assert others == set(factors.FACTOR_NAMES) - {"tp_style"} - {f.name for f in factors.FACTORS if "tp_style" in f.parents}
    assert {t for t in after.required if ("tp_style", "newstyle") in t and len(t) == 3}, "and in the triples"
    assert before.required < after.required


def test_each_inactive_setting_and_constraint_says_why_it_is_meaningless():
    for f in factors.FACTORS:
        assert (f.active is None) == (not f.inactive_because), f.name
        assert f.default is None or f.default in f.values or f.name == "bottleneck", f.name
    assert all(c.reason for c in factors.CONSTRAINTS)


@pytest.fixture(scope="module")
def array() -> covering.CoveringArray:
    return generated.array()


def test_the_matrix_holds_every_pair_and_every_triple(array):
    assert not covering.uncovered_tuples(array)
    names = [f.name for f in factors.FACTORS]
    groups = {tuple(n for n, _ in t) for t in array.required}
    assert {tuple(sorted(p, key=names.index)) for p in itertools.combinations(names, 2)} <= {
        tuple(sorted(g, key=names.index)) for g in groups if len(g) == 2} | _never_active_together(array)
    # every triple of TP style x SP x DP backend that one case can hold: SP needs TP, a DP backend DP ranks, so tp2 x dp2
    triples = {tuple(v for _, v in t) for t in array.required if len(t) == 3}
    assert triples == {(style, sp, backend) for style in ("btp", "vanilla", "megatron") for sp in (False, True)
                       for backend in next(f for f in factors.FACTORS if f.name == "dp_backend").values}
    # refusals are outcomes: a combination the CLI refuses is still asked for
    assert (("tp_style", "vanilla"), ("sequence_parallel", True)) in array.required
    assert (("bottleneck", "cola"), ("tp_style", "megatron")) in array.required
    assert (("pp_schedule", "zbv"), ("dp_backend", "deepspeed-zero2")) in array.required


def _never_active_together(array) -> set:
    """Pairs of factors no case can hold active together (none in this matrix: each pair shares some case)."""
    active = {tuple(sorted(p)) for case in array.cases for p in itertools.combinations(
        [n for n, v in case.items() if v != INACTIVE], 2)}
    names = [f.name for f in factors.FACTORS]
    return {tuple(sorted(p, key=names.index)) for p in itertools.combinations(names, 2) if tuple(sorted(p)) not in active}


def test_every_case_is_a_valid_combination(array):
    for case in array.cases:
        for f in factors.FACTORS:
            if f.active is not None:
                assert (case[f.name] == INACTIVE) == (not f.active({p: case[p] for p in f.parents})), (f.name, case)
            if case[f.name] != INACTIVE:
                assert case[f.name] in f.values
        assert all(c.allowed({n: case[n] for n in c.factors}) for c in factors.CONSTRAINTS)


def test_every_tuple_that_trains_somewhere_is_in_a_case_that_trains(array):
    """A refused case shows its refusal only: a pair that some accepted case can hold is in one (the CLI's checks in
    this process, ``tests/matrix/cli_validation.py``); the pairs no accepted case holds are refused wherever they are."""
    accepted = [case for case, ok in zip(array.cases, array.accepted) if ok]
    for t in array.required - array.refused_only:
        assert any(all(case[n] == v for n, v in t) for case in accepted), t
    assert (("layout", "tp1-pp2-dp2"), ("tie_word_embeddings", True)) in array.refused_only  # refused under any pipeline
    trains = [(("tp_style", "megatron"), ("pp_schedule", schedule)) for schedule in ("gpipe", "interleaved-1f1b", "looped-bfs")]
    trains += [(("layout", "tp1-pp1-dp4"), ("dp_backend", "hsdp"))]  # HSDP 2 x 2 without TP (a world-size check)
    trains += [(("dp_backend", f"deepspeed-zero{stage}"), ("precision_policy", "bf16_params")) for stage in (1, 2, 3)]
    trains += [(("tp_style", style), ("sequence_parallel", True)) for style in ("btp", "megatron")]  # SP refuses a sample
    assert not array.refused_only & set(trains)  # each once only in refused cases: a generator that missed them


def test_the_construction_on_a_small_problem():
    """Every pair and the triple, the constraint and the inactive factor respected, the same array for the same seed,
    and with ``blame`` a refused pair found refused-only while every other is in an accepted case."""
    toy = [Factor("a", (0, 1, 2)), Factor("b", ("x", "y")), Factor("c", (True, False), ("a",), lambda v: v["a"] > 0, True, "a=0"),
           Factor("d", ("p", "q", "r"))]
    constraints = [Constraint(("b", "d"), lambda v: not (v["b"] == "y" and v["d"] == "r"), "y and r cannot meet")]
    refuse = lambda case: {"a", "d"} if case["a"] == 2 and case["d"] == "q" else None  # noqa: E731
    built = covering.build(toy, constraints, triples=(("a", "b", "d"),), seed=3, blame=refuse)
    again = covering.build(toy, constraints, triples=(("a", "b", "d"),), seed=3, blame=refuse)
    assert built.cases == again.cases and not covering.uncovered_tuples(built)
    assert (("b", "y"), ("d", "r")) not in built.required and ((("a", 0), ("c", True))) not in built.required
    assert all(not (c["b"] == "y" and c["d"] == "r") and (c["c"] == INACTIVE) == (c["a"] == 0) for c in built.cases)
    assert built.refused_only == {(("a", 2), ("d", "q")), (("a", 2), ("b", "x"), ("d", "q")), (("a", 2), ("b", "y"), ("d", "q"))}
    accepted = [c for c, ok in zip(built.cases, built.accepted) if ok]
    for t in built.required - built.refused_only:
        assert any(all(c[n] == v for n, v in t) for c in accepted), t
