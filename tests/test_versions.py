"""The version ranges pyproject.toml declares are the versions CI tests: each core dependency's lower bound is the pin
of constraints-min.txt (the second leg of ``make test``: the lent GPU machine's stack), each extra's lower bound the
pin of constraints.txt (the first leg, the only one that installs the extras), and every pin of either file lies in
its declared range."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def pins(name: str) -> dict[str, Version]:
    """``{package: version}`` of a constraints file's ``package==version`` lines."""
    found = {}
    for line in (REPO / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            package, version = line.split("==")
            found[canonicalize_name(package)] = Version(version)
    return found


def lower_bound(requirement: Requirement) -> Version | None:
    bounds = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "==")]
    return max(bounds) if bounds else None


def requirements(strings: list[str]) -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in map(Requirement, strings)}


CORE = requirements(PROJECT["dependencies"])
EXTRAS = {name: requirements(strings) for name, strings in PROJECT["optional-dependencies"].items()}


def test_every_core_lower_bound_is_the_minimum_leg_pin():
    minimum = pins("constraints-min.txt")
    bounded = {name: lower_bound(r) for name, r in CORE.items() if lower_bound(r) is not None}
    assert bounded == minimum, "pyproject's core lower bounds and constraints-min.txt must name the same versions"


def test_every_extra_lower_bound_is_the_pinned_leg_pin():
    pinned = pins("constraints.txt")
    for extra, packages in EXTRAS.items():
        for name, requirement in packages.items():
            bound = lower_bound(requirement)
            if bound is not None and name in pinned:
                assert bound == pinned[name], f"[{extra}] {requirement}: CI tests {name} {pinned[name]} only"


def test_every_pin_lies_in_its_declared_range():
    declared = {**{n: r for packages in EXTRAS.values() for n, r in packages.items()}, **CORE}
    for file in ("constraints.txt", "constraints-min.txt"):
        for name, version in pins(file).items():
            if name in declared:
                assert declared[name].specifier.contains(version, prereleases=True), f"{file}: {name} {version} vs {declared[name]}"


def test_the_minimum_leg_lacks_what_the_gpu_machine_lacks():
    """The second leg installs the core at its minimums and none of the [train] extra's data, evaluation or DeepSpeed
    packages, as the lent GPU machine (and a user of the core install) has them."""
    assert not {"datasets", "evaluate", "deepspeed"} & set(pins("constraints-min.txt"))
    assert not {"datasets", "evaluate", "deepspeed"} & set(CORE)
    assert {"datasets", "evaluate", "deepspeed"} <= set(EXTRAS["train"])


def test_training_refuses_the_stack_it_is_not_tested_on(monkeypatch):
    """Training's floors (boost_hf/training/stack.py) are the [train] extra's, and an older transformers or torch is
    refused when the training arguments are built, naming the extra that fixes it."""
    import pytest

    from boost_hf.training import stack

    assert {name: Version(floor) for name, floor in stack.TRAINING_FLOORS.items()} == {
        name: lower_bound(EXTRAS["train"][name]) for name in stack.TRAINING_FLOORS}
    monkeypatch.setattr(stack.torch, "__version__", "2.13.0+cpu")
    monkeypatch.setattr(stack.transformers, "__version__", "5.23.0")
    stack.check_training_stack()
    monkeypatch.setattr(stack.transformers, "__version__", "5.17.0")
    with pytest.raises(RuntimeError, match=r"needs transformers>=5\.23; this environment has transformers 5\.17\.0.*boost-hf\[train\]"):
        stack.check_training_stack()
