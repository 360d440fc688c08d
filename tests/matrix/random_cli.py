"""Random combinations of the matrix's settings, each launched through the public command line in a launch of its own,
as a user runs them (issue 42's last target), and compared with the same command in one process:

    python -m tests.matrix.random_cli --seed 7 --cases 10            # a soak: any seed, any count
    python -m tests.matrix.random_cli --seed 7 --cases 10 --out DIR  # keep the runs' folders

The covering array (``test_matrix.py``) holds every pair of values, each case run by ``boost-hf train``'s own entry
inside a launched group of many cases, without checkpoints. This draws whole cases at random instead (each factor of
:mod:`tests.matrix.factors` uniformly among its values where it is active, :data:`factors.CONSTRAINTS` holding), and
runs each one as a user does:

* ``accelerate launch --config_file C -m boost_hf.cli train demo ARGS`` on 4 CPU processes, ``ARGS`` the case's
  matrix arguments (the tiny model, 3 optimizer steps of 8 blocks) and a checkpoint after step 2, in a launch of its own.
  ``C`` is the entry point a user would take for the case's data parallelism: ``cpu-4proc-zero<N>.yaml`` for DeepSpeed's
  ZeRO stage N (the stage from the accelerate config, not ``--deepspeed``), for FSDP2 / HSDP either ``--data_parallel
  fsdp2`` under ``cpu-4proc.yaml`` or ``cpu-4proc-fsdp2.yaml`` (drawn), else ``cpu-4proc.yaml``;
* ``boost-hf train demo REFERENCE_ARGS``: the same model, precision and accumulation in one process, the global batch
  at once (:func:`factors.reference_arguments`).

A case passes when it trained as one process did, within ``bounds.py``'s bounds: the loss and the gradient norm
(before clipping, the trainer's log) of each step, every weight of ``final/`` (the matrix's parameter bound, with the
largest clipped gradient element taken at the clipping norm), ``final/``'s ``architectures`` the model's own class,
and the step-2 checkpoint complete. Or when it was refused: each rank exits with status 2 after ``boost-hf: error:``
(the same message on every rank; the launcher exits 1), no step trained, and a case ``boost-hf train``'s checks refuse in one process (:func:`cli_validation.refusal`) must be
refused. Anything else fails: a crash, a hang (past :data:`TIMEOUT`), other numbers. The bf16 bounds are loose (0.11 of a
gradient's scale): what a bf16 case shows here is that it runs and saves; its gradients are the matrix's to judge.

``tests/matrix/test_random_cli.py`` runs :data:`CI_SEED`'s first :data:`CI_CASES` in ``make test``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.training.launcher import REPO, free_port, kill_group, start_command, training_environment

from . import cli_validation, factors
from .bounds import CLIP, STEPS, bounds, parameter_bound
from .covering import INACTIVE

SAVE_STEPS = 2  # a checkpoint inside the run (the matrix saves none)
CI_SEED, CI_CASES = 0, 2
TIMEOUT = 900  # seconds for one launch


def draw(rng: random.Random) -> dict:
    """One case: each factor's value drawn uniformly where the factor is active (``INACTIVE`` where not), redrawn until
    :data:`factors.CONSTRAINTS` hold."""
    while True:
        case: dict = {}
        for factor in factors.FACTORS:
            active = factor.active is None or factor.active({p: case[p] for p in factor.parents})
            case[factor.name] = rng.choice(factor.values) if active else INACTIVE
        if all(c.allowed({n: case[n] for n in c.factors}) for c in factors.CONSTRAINTS):
            return case


#: what ``cpu-4proc-fsdp2.yaml`` sets of FSDP2's settings (``fsdp_reshard_after_forward: true``: torchtitan's default;
#: ``TRANSFORMER_BASED_WRAP``: each decoder layer a unit): a case launched with it has these values, set by the config
FSDP2_CONFIG = {"fsdp_reshard_after_forward": "default", "fsdp_units": "decoder_layers"}


def draws(seed: int, count: int, trainable: bool = False) -> list[dict]:
    """``count`` cases of ``seed``, each with the entry point it is launched through (``"config"``); with
    ``trainable``, only cases ``boost-hf train``'s checks accept in one process (:func:`cli_validation.refusal`)."""
    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        case = draw(rng)
        stage = factors.deepspeed_stage(case)
        if stage is not None:
            config = f"cpu-4proc-zero{stage}.yaml"
        elif case["dp_backend"] in factors.FULLY_SHARDED:
            config = rng.choice(["cpu-4proc.yaml", "cpu-4proc-fsdp2.yaml"])
        else:
            config = "cpu-4proc.yaml"
        if config == "cpu-4proc-fsdp2.yaml":
            case.update(FSDP2_CONFIG)
        if not (trainable and cli_validation.refusal(case)):
            cases.append({"case": case, "config": config})
    return cases


OVERRIDES = ["--report_to", "none", "--save_strategy", "steps", "--save_steps", str(SAVE_STEPS)]


def launch_arguments(drawn: dict) -> list[str]:
    """The case's ``boost-hf train demo`` arguments under its accelerate config: the matrix's, the FSDP2 settings the
    config sets left to it (``--data_parallel``, ``--fsdp_*`` dropped under the FSDP2 config), a checkpoint after step
    2, and for a tensor train the demo recipe's ``rank`` set to its ``--tt_rank`` (as the refusal of the two
    disagreeing says)."""
    argv = factors.training_arguments(drawn["case"])
    if drawn["config"] == "cpu-4proc-fsdp2.yaml":
        for flag in ("--data_parallel", *(f"--{name}" for name in FSDP2_CONFIG)):
            i = argv.index(flag)
            argv = argv[:i] + argv[i + 2:]
    return argv + OVERRIDES + tensor_train_rank(drawn["case"])


def tensor_train_rank(case: dict) -> list[str]:
    """``--rank`` at a tensor train's ``--tt_rank`` (the demo recipe's ``rank: 32`` would disagree with it)."""
    if case["bottleneck"] != "tt":
        return []
    argv = factors.model_arguments(case)
    return ["--rank", argv[argv.index("--tt_rank") + 1]]


def run(args: list, env: dict, log: Path, timeout: float) -> tuple[int | None, str]:
    """``args`` from the repository root in a session of its own, killed as a group after ``timeout`` (status
    ``None``); its status and output (also in ``log``)."""
    proc = start_command(args, env, log)
    try:
        status = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        status = None
    finally:
        kill_group(proc)
    return status, log.read_text(errors="replace")


def log_by_step(folder: Path, key: str) -> dict[int, float]:
    history = json.loads((folder / "trainer_state.json").read_text())["log_history"]
    return {entry["step"]: entry[key] for entry in history if key in entry}


def exactness_problems(case: dict, folder: Path, reference: Path) -> list[str]:
    """Where the run in ``folder`` differs from the one-process run in ``reference`` beyond the matrix's bounds."""
    import torch
    from safetensors.torch import load_file

    from tests.tolerances import scaled_error

    problems = []
    loss_bound, grad_bound = bounds(case)
    for key, bound in (("loss", loss_bound), ("grad_norm", grad_bound)):
        logged, expected = log_by_step(folder, key), log_by_step(reference, key)
        if logged.keys() != expected.keys() or len(expected) != STEPS:
            problems.append(f"{key} logged at steps {sorted(logged)}, one process at {sorted(expected)}")
            continue
        for step, value in expected.items():
            error = abs(logged[step] - value) / abs(value)
            if error > bound:
                problems.append(f"{key} of step {step}: {logged[step]:.7g} vs one process's {value:.7g} "
                                f"(error {error:.2g} > {bound:.2g})")
    config = json.loads((folder / "final" / "config.json").read_text())
    if config.get("architectures") != ["BoostLlamaForCausalLM"]:
        problems.append(f"final/ names {config.get('architectures')}")
    weights, expected = load_file(folder / "final" / "model.safetensors"), load_file(reference / "final" / "model.safetensors")
    if weights.keys() != expected.keys():
        problems.append(f"final/ holds {sorted(set(weights) ^ set(expected))[:6]} on one side only")
    for name in sorted(set(weights) & set(expected)):
        w, ref = weights[name].to(torch.float32), expected[name].to(torch.float32)
        scale = float(ref.abs().max()) or 1.0
        # the matrix's parameter bound, the largest clipped gradient element at most the clipping norm
        bound = parameter_bound(grad_bound, CLIP, scale)
        if weights[name].dtype == torch.bfloat16:  # a bf16 save: one rounding of the trained weight more
            bound += 2.0 ** -8
        error = scaled_error(w, ref)
        if error > bound:
            problems.append(f"final/ {name}: error {error:.3g} > {bound:.3g}")
    if not (folder / f"checkpoint-{SAVE_STEPS}").is_dir():
        problems.append(f"no checkpoint-{SAVE_STEPS}")
    return problems


def refusal_problems(case: dict, status: int | None, output: str) -> list[str]:
    """What keeps a failed launch from being a clean refusal: every rank that ended by itself exited with status 2
    after ``boost-hf: error: ...`` (the launcher then exits 1 and stops the others with SIGTERM), the ranks' messages
    alike, no step trained."""
    if status is None:
        return [f"ran past {TIMEOUT} s (killed)"]
    problems = []
    messages = {line.split("boost-hf: error:", 1)[1].strip() for line in output.splitlines() if "boost-hf: error:" in line}
    codes = [int(code) for code in re.findall(r"exitcode\s*:\s*(-?\d+)", output)]
    if status == 2 and not codes:  # one process, no launcher
        codes = [2]
    if not messages or 2 not in codes or set(codes) - {2, -15}:
        problems.append(f"no clean refusal: launcher status {status}, the ranks' exit codes {codes}, "
                        f"{len(messages)} 'boost-hf: error:' message(s)")
    if len(messages) > 1:
        problems.append(f"the ranks refused with different messages: {sorted(messages)}")
    if "'loss':" in output:
        problems.append("refused after training steps")
    return problems


def judge(drawn: dict, index: int, out: Path, env: dict, corpus: str, timeout: float = TIMEOUT) -> dict:
    """Run one drawn case and its one-process reference; the verdict (``problems`` empty: it passed)."""
    case = drawn["case"]
    name = factors.case_name(index, case)
    folder, reference = out / name, out / f"{name}-one-process"
    started = time.monotonic()
    status, output = run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                          REPO / "accelerate_configs" / drawn["config"], "--main_process_port", str(free_port()),
                          "-m", "boost_hf.cli", "train", "demo", *launch_arguments(drawn), "--dataset", corpus,
                          "--output_dir", folder], env, out / f"{name}.log", timeout)
    seconds = time.monotonic() - started
    predicted = cli_validation.refusal(case)
    verdict = {"name": name, "config": drawn["config"], "status": status, "seconds": round(seconds, 1),
               "predicted_refusal": predicted}
    if status != 0:
        problems = refusal_problems(case, status, output)
        errors = [line for line in output.splitlines() if "boost-hf: error:" in line]
        verdict.update(outcome="refused", message=errors[0][-600:] if errors else output[-3000:], problems=problems)
        return verdict
    problems = [f"trained, but boost-hf train refuses it in one process: {predicted}"] if predicted else []
    ref_status, ref_output = run([sys.executable, "-m", "boost_hf.cli", "train", "demo",
                                  *factors.reference_arguments(case), *OVERRIDES, *tensor_train_rank(case), "--dataset", corpus,
                                  "--output_dir", reference], env, out / f"{name}-one-process.log", timeout)
    if ref_status != 0:
        problems.append(f"the one-process run failed ({ref_status}): {ref_output[-2000:]}")
    else:
        problems += exactness_problems(case, folder, reference)
    verdict.update(outcome="trained", problems=problems)
    return verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=CI_SEED)
    parser.add_argument("--cases", type=int, default=CI_CASES)
    parser.add_argument("--first", type=int, default=0, help="skip the seed's first FIRST cases")
    parser.add_argument("--trainable", action="store_true", help="only cases boost-hf train's checks accept in one process")
    parser.add_argument("--out", type=Path, help="the runs' folder (default: a temporary one)")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="boost-hf-random-cli-"))
    out.mkdir(parents=True, exist_ok=True)
    env = training_environment(out / "cache")
    corpus = env["CORPUS"]
    failed = 0
    for index, drawn in enumerate(draws(args.seed, args.first + args.cases, args.trainable)):
        if index < args.first:
            continue
        verdict = judge(drawn, index, out, env, corpus)
        failed += bool(verdict["problems"])
        print(json.dumps(verdict), flush=True)
    print(f"{args.cases} cases of seed {args.seed}: {args.cases - failed} passed, {failed} failed ({out})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
