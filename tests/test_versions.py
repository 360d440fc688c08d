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


def test_the_train_extra_admits_only_the_tested_minor_releases():
    """The [train] extra's torch and transformers ranges are training's (boost_hf/training/stack.py), hold the pinned
    leg's release and stop before the next minor release: the trainer depends on private APIs of both."""
    from boost_hf.training import stack

    pinned = pins("constraints.txt")
    for name, (low, high) in stack.TRAINING_RANGE.items():
        requirement = EXTRAS["train"][name]
        assert lower_bound(requirement) == Version(low) == pinned[name]
        upper = [Version(s.version) for s in requirement.specifier if s.operator == "<"]
        assert upper == [Version(high)], f"[train] {requirement}: the first release it does not admit must be {high}"
        release = pinned[name].release
        assert not requirement.specifier.contains(f"{release[0]}.{release[1] + 1}.0"), requirement


def test_training_refuses_the_stack_it_is_not_tested_on(monkeypatch):
    """An older or newer transformers or torch, or a missing [train] package, is refused when the training arguments are
    built (and before a training module imports the extra's packages), naming the extra that fixes it."""
    import importlib.util

    import pytest

    from boost_hf.training import stack

    find_spec = importlib.util.find_spec
    present = lambda name: find_spec("json") if name in stack.TRAINING_PACKAGES else find_spec(name)  # noqa: E731
    monkeypatch.setattr(stack.importlib.util, "find_spec", present)  # (the minimum leg has no [train] extra)
    monkeypatch.setattr(stack.torch, "__version__", "2.14.1+cu130")  # a local tag is the same release
    monkeypatch.setattr(stack.transformers, "__version__", "5.24.0")
    stack.check_training_stack()
    for version, wording in (("5.17.0", r"transformers 5\.17\.0 \(training is tested on >=5\.24,<5\.25\)"),
                             ("5.25.0", r"transformers 5\.25\.0 \(training is tested on >=5\.24,<5\.25\)")):
        monkeypatch.setattr(stack.transformers, "__version__", version)
        with pytest.raises(RuntimeError, match=wording + r".*pip install 'boost-hf\[train\]'"):
            stack.check_training_stack()
    monkeypatch.setattr(stack.transformers, "__version__", "5.24.0")
    monkeypatch.setattr(stack.importlib.util, "find_spec", lambda name: None if name == "datasets" else present(name))
    with pytest.raises(RuntimeError, match=r"no datasets.*boost-hf\[train\]"):
        stack.check_training_stack()


def test_training_on_the_core_install_names_the_extra_before_any_import_fails(tmp_path):
    """On the core install (no datasets), ``boost-hf train`` and importing the trainer say which install fixes it, not
    ``ModuleNotFoundError: datasets``."""
    import subprocess
    import sys

    blocker = tmp_path / "datasets.py"
    blocker.write_text("raise ModuleNotFoundError(\"No module named 'datasets'\")\n")
    spec_hider = tmp_path / "sitecustomize.py"  # find_spec('datasets') -> None, as where it is not installed
    spec_hider.write_text("import importlib.util as u\n_f = u.find_spec\nu.find_spec = lambda n, *a: None if n in ('datasets',) else _f(n, *a)\n")
    env = {**__import__("os").environ, "PYTHONPATH": f"{tmp_path}:{REPO}"}
    for argv in (["-m", "boost_hf.cli", "train", "demo", "--max_steps", "1"], ["-c", "import boost_hf.training.trainer"]):
        result = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=300)
        assert result.returncode != 0
        assert "pip install 'boost-hf[train]'" in result.stderr and "no datasets" in result.stderr, result.stderr[-2000:]
        assert "ModuleNotFoundError" not in result.stderr, result.stderr[-2000:]
