"""A covering array: test cases (one value per factor) such that every required combination of values, every pair of
two factors' values and chosen triples, is in at least one case; built greedily and deterministically (a seeded
random generator), under constraints.

The construction is AETG's (Cohen, Dalal, Fredman, Patton 1997), with IPOG's bookkeeping of the uncovered tuples: each
new case is the best of ``candidates`` tries, each try starting from an uncovered tuple and giving every other factor,
in a random order, the value completing the most uncovered tuples that is consistent with the constraints (a
backtracking search proves that the case can still be completed). A factor may be *inactive* in a case (``active``
of its parents is false: the setting means nothing there, e.g. the pipeline schedule without a pipeline): it then
holds :data:`INACTIVE`, and no tuple asks for it.

Then, when an ``accepted`` predicate is given (a case the code under test runs rather than refuses), a second pass
adds cases until every tuple is also in an accepted case, for each tuple some accepted case holds at all: a refused
case shows only its refusal, so without it a pair of settings that trains together could be seen only in cases that
some third setting refuses. A tuple for which ``refused_tries`` tries find no accepted case is recorded as
refused-only (:attr:`CoveringArray.refused_only`).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Callable

INACTIVE = "-"
"""The value of a factor that means nothing in a case (see :class:`Factor`)."""


@dataclass(frozen=True)
class Factor:
    """A setting and its values; ``active(values)`` (``values``: the case's values of ``parents``, by name) says
    whether it means anything in a case (default: always; ``inactive_because`` says why not); ``default``: the value
    repairs give it (:func:`build`)."""

    name: str
    values: tuple
    parents: tuple[str, ...] = ()
    active: Callable[[dict], bool] | None = None
    default: object = None  # the value a case gets unless it asks for another (default: the first value)
    inactive_because: str = ""  # why the setting means nothing where ``active`` is false

    @property
    def preferred(self):
        return self.default if self.default in self.values else self.values[0]

    def domain(self) -> tuple:
        return self.values + ((INACTIVE,) if self.active is not None else ())


@dataclass(frozen=True)
class Constraint:
    """A combination that cannot exist: ``allowed(values)`` (by name, of ``factors``) is false for it; ``reason`` says
    why it is meaningless (not merely refused: a refusal is an outcome to test)."""

    factors: tuple[str, ...]
    allowed: Callable[[dict], bool]
    reason: str


Tuple = tuple[tuple[int, object], ...]  # ((factor index, value), ...) in factor order
_UNSET = object()  # a factor not assigned yet (``None`` is a value: the full-rank bottleneck)


@dataclass
class CoveringArray:
    factors: list[Factor]
    cases: list[dict]  # name -> value (INACTIVE where inactive)
    required: set  # the tuples asked for (feasible ones), as (name, value) pairs
    refused_only: set = field(default_factory=set)  # required tuples no accepted case was found for
    accepted: list[bool] | None = None  # per case, when the array was built with a predicate


class _Search:
    def __init__(self, factors: list[Factor], constraints: list[Constraint]):
        self.factors = factors
        self.index = {f.name: i for i, f in enumerate(factors)}
        self.domains = [f.domain() for f in factors]
        checks: list[tuple[tuple[int, ...], Callable[[dict], bool]]] = []
        for i, f in enumerate(factors):
            if f.active is not None:
                parents = tuple(self.index[p] for p in f.parents)
                checks.append(((i, *parents), _activity_check(f)))
        for c in constraints:
            checks.append((tuple(self.index[n] for n in c.factors), c.allowed))
        # the checks to run when factor i is assigned: those whose factors are all assigned then; each check's verdicts
        # are remembered by its factors' values (a few values each: the search asks the same ones over and over)
        self.checks_of: list[list[tuple[tuple[int, ...], Callable, dict]]] = [[] for _ in factors]
        for members, allowed in checks:
            entry = (members, allowed, {})
            for i in set(members):
                self.checks_of[i].append(entry)

    def consistent(self, assignment: list, i: int) -> bool:
        """The constraints over factor ``i`` whose factors are all assigned hold."""
        for members, allowed, verdicts in self.checks_of[i]:
            values = tuple(assignment[m] for m in members)
            if any(v is _UNSET for v in values):
                continue
            if not self._holds(members, allowed, verdicts, values):
                return False
        return True

    def _holds(self, members, allowed, verdicts, values) -> bool:
        verdict = verdicts.get(values)
        if verdict is None:
            verdict = verdicts[values] = bool(allowed({self.factors[m].name: v for m, v in zip(members, values)}))
        return verdict

    def forward_ok(self, assignment: list, i: int) -> bool:
        """Forward checking: each constraint over factor ``i`` that has one factor left unassigned still has a value of
        it that satisfies it (so that a dead end shows here, not after every factor in between was tried)."""
        for members, allowed, verdicts in self.checks_of[i]:
            free = [m for m in members if assignment[m] is _UNSET]
            if len(free) != 1:
                continue
            u = free[0]
            if not any(self._holds(members, allowed, verdicts, tuple(v if m == u else assignment[m] for m in members))
                       for v in self.domains[u]):
                return False
        return True

    def complete(self, assignment: list, prefer: list | None = None) -> list | None:
        """A complete consistent assignment extending ``assignment`` (``_UNSET`` where unassigned), or ``None``;
        ``prefer``: the value to try first for each factor."""
        assignment = list(assignment)
        todo = [i for i, v in enumerate(assignment) if v is _UNSET]
        assigned = [i for i, v in enumerate(assignment) if v is not _UNSET]
        if not all(self.consistent(assignment, i) and self.forward_ok(assignment, i) for i in assigned):
            return None

        def extend(k: int) -> bool:
            if k == len(todo):
                return True
            i = todo[k]
            domain = self.domains[i]
            if prefer is not None and prefer[i] in domain:
                domain = (prefer[i], *(v for v in domain if v != prefer[i]))
            for value in domain:
                assignment[i] = value
                if self.consistent(assignment, i) and self.forward_ok(assignment, i) and extend(k + 1):
                    return True
            assignment[i] = _UNSET
            return False

        return assignment if extend(0) else None


def _activity_check(f: Factor) -> Callable[[dict], bool]:
    def allowed(values: dict) -> bool:
        return (values[f.name] == INACTIVE) == (not f.active({p: values[p] for p in f.parents}))
    return allowed


def build(factors: list[Factor], constraints: list[Constraint], *, triples: tuple[tuple[str, str, str], ...] = (),
          seed: int = 0, candidates: int = 12, blame: Callable[[dict], set[str] | None] | None = None,
          repairs: int = 4, accepted_tries: int = 2, options_asked: int = 6) -> CoveringArray:
    """The covering array of ``factors`` (every feasible pair, and every feasible triple of each of ``triples``) under
    ``constraints``. ``blame(case)``: ``None`` when the code under test runs ``case``, else the factors its refusal
    names (maybe none); with it every tuple that some accepted case holds is held by an accepted case (see the
    module docstring): each try is repaired, up to ``repairs`` times, by giving a blamed factor outside the seed tuple
    another value (``options_asked`` asked, those keeping the most tuples first) or, when none is accepted, every
    blamed factor its preferred value."""
    search = _Search(factors, constraints)
    n = len(factors)
    rng = random.Random(seed)
    groups = [tuple(sorted(p)) for p in itertools.combinations(range(n), 2)]
    groups += [tuple(sorted(search.index[name] for name in t)) for t in triples]
    required: set[Tuple] = set()
    for members in groups:
        for values in itertools.product(*(factors[m].values for m in members)):
            partial: list = [_UNSET] * n
            for m, v in zip(members, values):
                partial[m] = v
            if search.complete(partial) is not None:
                required.add(tuple(zip(members, values)))
    by_member: dict[tuple[int, object], list[Tuple]] = {}
    for t in required:
        for member in t:
            by_member.setdefault(member, []).append(t)
    triple_groups = [g for g in groups if len(g) == 3]
    parents = {search.index[p] for f in factors for p in f.parents}
    preferred = [f.preferred for f in factors]
    descendants: dict[int, set[int]] = {i: set() for i in range(n)}  # the factors whose meaning depends on i's value
    for _ in range(n):
        for j, f in enumerate(factors):
            for p in f.parents:
                descendants[search.index[p]] |= {j} | descendants[j]

    def changed(case: list, values: dict[int, object], keep: set[int]) -> list | None:
        """``case`` with ``values`` (factor index -> value), the factors depending on them but ``keep`` completed again
        (keeping their values where they still fit); when that cannot be completed (the new value needs another value
        of a factor it does not depend on: the full-rank model's ``megatron`` needs ``tp_size`` > 1), every factor but
        ``values`` and ``keep`` completed again, preferring ``case``'s values; ``None`` when neither can."""
        free = set().union(*(descendants[i] for i in values)) - set(values) - keep if values else set()
        partial = [values.get(i, _UNSET if i in free else v) for i, v in enumerate(case)]
        new = search.complete(partial, prefer=case)
        if new is None and values:
            new = search.complete([values.get(i, case[i] if i in keep else _UNSET) for i in range(n)], prefer=case)
        return new
    as_dict = lambda case: {factors[i].name: case[i] for i in range(n)}  # noqa: E731

    def covered(case: list) -> set[Tuple]:
        found = {((a, case[a]), (b, case[b])) for a, b in itertools.combinations(range(n), 2)}
        found |= {tuple((m, case[m]) for m in g) for g in triple_groups}
        return found & required

    def candidate(uncovered: set[Tuple], seed_tuple: Tuple, careful: bool = False) -> list | None:
        """A case holding ``seed_tuple``, every other factor (the parents first, each in a random order) given the
        value completing the most ``uncovered`` tuples; ``careful``: each value chosen only if the case can still be
        completed (slow; otherwise forward checking, and a try that ends in a dead end is dropped)."""
        open_by_member = {member: [t for t in tuples if t in uncovered] for member, tuples in by_member.items()}
        assignment: list = [_UNSET] * n
        for m, v in seed_tuple:
            assignment[m] = v
        first = [i for i in range(n) if assignment[i] is _UNSET and i in parents]
        then = [i for i in range(n) if assignment[i] is _UNSET and i not in parents]
        rng.shuffle(first)
        rng.shuffle(then)
        for i in first + then:
            values = list(search.domains[i])
            rng.shuffle(values)
            scored = []
            for value in values:
                assignment[i] = value
                if search.consistent(assignment, i) and search.forward_ok(assignment, i):
                    scored.append((_gain(assignment, i, value, uncovered, triple_groups, open_by_member), value))
            assignment[i] = _UNSET
            scored.sort(key=lambda s: -s[0])  # stable: the shuffled order breaks ties
            for _, value in scored:
                assignment[i] = value
                if not careful or search.complete(assignment) is not None:
                    break
            else:
                return None
        return assignment if search.complete(assignment) is not None else None

    def repaired(case: list, seed_tuple: Tuple, uncovered: set[Tuple]) -> list | None:
        """``case``, or an accepted case it becomes within ``repairs`` rounds, each giving one factor its refusal blames
        (outside ``seed_tuple``) another value (the one keeping the most ``uncovered`` tuples that is accepted), or, when
        none is, every blamed factor its preferred value; ``None`` when no round is accepted."""
        fixed = {m for m, _ in seed_tuple}
        for _ in range(repairs + 1):
            blamed = blame(as_dict(case))
            if blamed is None:
                return case
            reset = sorted({search.index[name] for name in blamed} - fixed)
            if not reset:
                return None
            options = []
            for i in reset:
                for value in search.domains[i]:
                    if value != case[i]:
                        new = changed(case, {i: value}, fixed)
                        if new is not None:
                            options.append((-len(covered(new) & uncovered), repr(new), new))
            for _, _, new in sorted(options, key=lambda o: o[:2])[:options_asked]:
                if blame(as_dict(new)) is None:
                    return new
            new = changed(case, {i: preferred[i] for i in reset}, fixed)
            if new is None or new == case:
                return None
            case = new
        return None

    def ranked(uncovered: set[Tuple]) -> list[Tuple]:
        """The uncovered tuples, those whose values are in the most uncovered tuples first."""
        weight = {member: sum(t in uncovered for t in by_member[member]) for member in by_member}
        return sorted(uncovered, key=lambda t: (-sum(weight[m] for m in t), repr(t)))

    def best_case(uncovered: set[Tuple], seed_tuple: Tuple, tries: int) -> list | None:
        """The best of ``tries`` cases holding ``seed_tuple``."""
        best, best_gain = None, -1
        for attempt in range(tries):
            case = candidate(uncovered, seed_tuple) or (candidate(uncovered, seed_tuple, careful=True) if attempt == 0 else None)
            if case is not None and len(covered(case) & uncovered) > best_gain:
                best, best_gain = case, len(covered(case) & uncovered)
        return best

    def best_accepted_case(uncovered: set[Tuple], seed_tuple: Tuple, tries: int) -> list | None:
        """The best accepted case holding ``seed_tuple``: its completion by the preferred values, and ``tries`` cases of
        :func:`candidate`, each repaired; ``None`` at once when the first is refused for the seed's own factors."""
        fixed = {factors[m].name for m, _ in seed_tuple}
        first = search.complete([dict(seed_tuple).get(i, _UNSET) for i in range(n)], prefer=preferred)
        blamed = blame(as_dict(first))
        if blamed is not None and blamed <= fixed:
            return None
        found = [repaired(first, seed_tuple, uncovered)]
        found += [repaired(c, seed_tuple, uncovered) for c in (candidate(uncovered, seed_tuple) for _ in range(tries)) if c is not None]
        found = [c for c in found if c is not None and all(c[m] == v for m, v in seed_tuple)]
        return max(found, key=lambda c: len(covered(c) & uncovered), default=None)

    accepted_cases: list[list] = []
    refused_only: set[Tuple] = set()
    open_tuples = set(required)  # not yet in an accepted case, nor known refused-only
    while blame is not None and open_tuples:
        seed_tuple = ranked(open_tuples)[0]
        case = best_accepted_case(open_tuples, seed_tuple, accepted_tries)
        if case is None:
            refused_only.add(seed_tuple)
            open_tuples.discard(seed_tuple)
            continue
        accepted_cases.append(case)
        open_tuples -= covered(case)
    accepted_cases = _absorb_rows(search, accepted_cases, required - refused_only, covered,
                                  accept=lambda c: blame(as_dict(c)) is None)
    uncovered = set(required) - {t for c in accepted_cases for t in covered(c)}
    refused_cases: list[list] = []  # the rest (without ``blame``: every case)
    while uncovered:
        order = ranked(uncovered)
        case = None
        for seed_tuple in [order[0]] + [order[rng.randrange(min(len(order), 8))] for _ in range(2)]:
            case = best_case(uncovered, seed_tuple, candidates)
            if case is not None:
                break
        if case is None:  # cannot happen: every required tuple has a completion
            raise RuntimeError(f"no case holds {order[0]}")
        refused_cases.append(case)
        uncovered -= covered(case)
    refused_cases = _absorb_rows(search, refused_cases, required - {t for c in accepted_cases for t in covered(c)}, covered)
    named = lambda t: tuple((factors[m].name, v) for m, v in t)  # noqa: E731
    refused_only -= {t for c in accepted_cases for t in covered(c)}  # a later accepted case may hold one after all
    cases = accepted_cases + refused_cases
    return CoveringArray(factors, [as_dict(c) for c in cases], {named(t) for t in required},
                         refused_only={named(t) for t in refused_only},
                         accepted=[blame(as_dict(c)) is None for c in cases] if blame is not None else None)


def _absorb_rows(search: _Search, cases: list[list], required: set, covered, accept=None, asks: int = 3) -> list[list]:
    """Drop the rows whose tuples (of ``required``) the others can hold: from the last row up, each tuple only that row
    holds is put into another row by changing values that no tuple held by that row alone needs (the rest of the row
    re-completed, keeping its values where the constraints let it); the row goes when all of them fit. ``accept``: a
    changed row must satisfy it too (at most ``asks`` rows asked per tuple). Greedy constructions end with many rows of
    few new tuples each: this takes most of them back."""
    k = len(cases) - 1
    while k >= 0 and len(cases) > 1:
        trial = [list(c) for i, c in enumerate(cases) if i != k]
        counts: dict = {}
        for c in trial:
            for t in covered(c) & required:
                counts[t] = counts.get(t, 0) + 1
        placed_all = True
        for t in sorted((covered(cases[k]) & required) - {u for u, count in counts.items() if count > 0}, key=repr):
            if counts.get(t):
                continue
            asked = 0
            for row in trial:
                if asked >= asks:
                    placed_all = False
                    break
                mine = covered(row) & required
                protected = {m for u in mine if counts[u] == 1 for m, _ in u}
                if any(m in protected and row[m] != v for m, v in t):
                    continue
                partial = [row[i] if i in protected else _UNSET for i in range(len(row))]
                for m, v in t:
                    partial[m] = v
                new = search.complete(partial, prefer=row)
                if new is None:
                    continue
                if accept is not None:
                    asked += 1
                    if not accept(new):
                        continue
                for u in mine:
                    counts[u] -= 1
                for u in covered(new) & required:
                    counts[u] = counts.get(u, 0) + 1
                row[:] = new
                break
            else:
                placed_all = False
            if not placed_all:
                break
        if placed_all and {t for t, count in counts.items() if count > 0} >= required:
            cases = trial
        k -= 1
    return cases


def _gain(assignment: list, i: int, value, uncovered: set, triple_groups: list, open_by_member: dict) -> float:
    """Uncovered tuples that ``assignment`` (factor ``i`` given ``value``) completes, plus half the uncovered tuples
    holding ``(i, value)`` that the factors not assigned yet could still complete (the density of Bryce and Colbourn's
    deterministic construction: a value that opens many tuples is worth more than one that opens none)."""
    gain = 0.0
    for j, other in enumerate(assignment):
        if j != i and other is not _UNSET:
            pair = ((i, value), (j, other)) if i < j else ((j, other), (i, value))
            gain += pair in uncovered
    for g in triple_groups:
        if i in g and all(assignment[m] is not _UNSET for m in g):
            gain += tuple((m, assignment[m]) for m in g) in uncovered
    still_open = 0
    for t in open_by_member.get((i, value), ()):
        if all(assignment[m] is _UNSET or assignment[m] == v for m, v in t if m != i) and \
                any(assignment[m] is _UNSET for m, _ in t if m != i):
            still_open += 1
    return gain + 0.5 * still_open / max(len(assignment), 1)


def uncovered_tuples(array: CoveringArray, cases: list[dict] | None = None) -> set:
    """The required tuples that no case of ``cases`` (default: all the array's) holds: empty for a covering array."""
    cases = array.cases if cases is None else cases
    holds = set()
    for case in cases:
        for t in array.required:
            if all(case[name] == value for name, value in t):
                holds.add(t)
    return array.required - holds


__all__ = ["INACTIVE", "Constraint", "CoveringArray", "Factor", "build", "uncovered_tuples"]
