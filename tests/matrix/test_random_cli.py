"""Random combinations through the public command line (:mod:`tests.matrix.random_cli`): the draws are valid cases
that reach every value, and :data:`~tests.matrix.random_cli.CI_SEED`'s first cases, each in a launch of its own
(``accelerate launch ... -m boost_hf.cli train demo``), train as one process or are refused. Other seeds are a soak:
``python -m tests.matrix.random_cli --seed S --cases N``."""

from __future__ import annotations

import random

import pytest

from . import factors, random_cli
from .covering import INACTIVE


def test_draws_are_cases_of_the_factors_and_reach_every_value():
    rng = random.Random(1)
    seen = {f.name: set() for f in factors.FACTORS}
    for _ in range(400):
        case = random_cli.draw(rng)
        for f in factors.FACTORS:
            active = f.active is None or f.active({p: case[p] for p in f.parents})
            assert (case[f.name] in f.values) if active else case[f.name] == INACTIVE, (f.name, case)
            seen[f.name].add(case[f.name])
        assert all(c.allowed({n: case[n] for n in c.factors}) for c in factors.CONSTRAINTS)
    assert {f.name: set(f.values) - seen[f.name] for f in factors.FACTORS if set(f.values) - seen[f.name]} == {}


def test_each_entry_point_is_drawn():
    configs = {d["config"] for d in random_cli.draws(1, 200)}
    stages = [b.removeprefix("deepspeed-zero") for b in factors.dp_backends() if b.startswith("deepspeed-zero")]
    assert stages and {"cpu-4proc.yaml", "cpu-4proc-fsdp2.yaml", *(f"cpu-4proc-zero{s}.yaml" for s in stages)} <= configs


@pytest.mark.parametrize("index", range(random_cli.CI_CASES))
def test_a_random_case_through_the_cli_trains_as_one_process_or_is_refused(training_env, tmp_path, index):
    drawn = random_cli.draws(random_cli.CI_SEED, random_cli.CI_CASES, trainable=True)[index]
    verdict = random_cli.judge(drawn, index, tmp_path, training_env, training_env["CORPUS"])
    assert not verdict["problems"], verdict
