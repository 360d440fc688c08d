"""The exactness matrix (issue 42): every generated case either trains what one process trains, and publishes a
``final/`` that plain transformers loads, or is refused before any collective, by the checks ``boost-hf train``
runs, with a message naming the setting. A case that does neither fails.

The cases are the covering array of :mod:`tests.matrix.factors` (every pair of values of every setting, every triple
of TP style x sequence parallelism x DP backend; built by :mod:`tests.matrix.covering`), each run by
``boost-hf train``'s own entry with its arguments (:mod:`tests.matrix.matrix_cases`) on 4 gloo processes, all in as
few launched groups as run (a run that kills its group is recorded and the next launch starts after it). Each distinct
model, precision and accumulation is trained once in one process, the global batch at once (the reference). Then:

* **trains as one process** (``test_case_trains_as_one_process_or_is_refused``): the loss of each of the 3 steps, every
  parameter's gradient at the first step after the DP reduction (before clipping) and every parameter after the 3 AdamW
  steps equal the reference's, each compared relative to its tensor's scale (``tests/tolerances.py``) within the
  bounds below;
* **or is refused**: every rank raised the same ``ValueError`` / ``TypeError`` with no collective issued before it, and
  the message names a setting of the case;
* **its final/ loads without boost-hf** (``test_final_folder_loads_without_boost_hf``): in one environment where
  boost-hf cannot be imported (:mod:`tests.hub.isolated_env`), every trained case's ``final/`` loads with
  ``AutoModelForCausalLM.from_pretrained(trust_remote_code=True)`` and gives the logits of the case's trained
  parameters (computed here by the single-device model), within fp32 rounding.

Bounds (this model: 4 blocks, d_ff = 128: a block's forward chains ~10 reductions, the longest of 128 terms):
fp32 loss ``fp32_rounding(4 x 10 x 128)`` (2.6e-5), gradients ``fp32_rounding(2 x 4 x 10 x 128)`` (3.6e-5). Parameters:
AdamW's update ``m / (sqrt(v) + eps)`` changes by at most ``|dg| / eps`` when the gradient changes by ``dg``; with
``eps = 1`` (``--adam_epsilon 1``, so that this holds at every gradient the clipping to 0.5 leaves) and the clipped
gradient's error at most twice the gradient bound (the clip factor's norm carries it once more), 3 steps of learning
rate ``lr`` move a parameter by at most ``3 lr 2 bound G / eps`` off, ``G`` the tensor's largest clipped first-step
gradient (the steps are small: to first order the gradients of steps 2 and 3 are the first's), relative to the
tensor's largest element. bf16 (``autocast``, ``bf16_params``; compared with one process under the same policy): a
bf16 rounding (unit 2^-8) where each operation writes its output, none inside a GEMM's fp32 accumulation, so
``3 sqrt(n) 2^-8`` with n = 4 x 10 bf16 roundings for the loss and 2 x 4 x 10 for a gradient (+2 for a bf16 DP
reduction): 7.4e-2 and 0.11 relative to the scale, far above what two orders of the same bf16 computation differ by
and far below what a missing or doubled reduction changes (its size, ~1).

Where a case's gradients exceed these bounds, the rounding is measured instead of counted: the reference's model is
trained once more in float64 (the truth: the fp32 reference's arguments, the model cast to float64, through bf16 where
the policy is ``bf16_params``, whose runs compute at bf16 weights; ``matrix_cases.as_float64``), and the case passes
when its largest gradient error from the truth (over every tensor, each relative to its scale) is at most
:data:`TRUTH_FACTOR` times the one-process run's own. A counted bound can be too small: LaX's latents cross every
block (and its latent LayerNorm divides by the latents' deviation), so that the one-process bf16 run itself is 0.06 to
0.28 of the scale from the truth, fp32 LaX on an svd base without the norm 2.2e-5
(``benchmarks/results/matrix_rounding_floor.md``: the parallel runs there as far from the truth as one process, 0.9 to
1.2 x, but one, c016, 3.4 x, in :mod:`tests.matrix.known`; and all equal to one process in fp32). The price is the resolution where the floor is high: a doubled reduction (an error of
1) stays beyond 3 x LaX's highest floor, 0.28, a missing one (half a gradient: 0.5) only beyond floors up to 0.17; the
fp32 cases keep the counted bound's resolution (3.6e-5).

Known failures are xfailed through :data:`tests.matrix.known.KNOWN`, each naming the bug, strictly: a case that no
longer shows its bug fails, so that the entry is removed.
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import pytest
import torch

from tests.tolerances import scaled_error
from tests.training.launcher import accelerate_command, kill_group, python_command, start_command

from . import cli_validation, factors, generated, known
from .bounds import BACKWARD, CLIP, FORWARD, STEPS, TRUTH_FACTOR, bounds, parameter_bound  # bounds.py: derived above
from .covering import INACTIVE

# ---------------------------------------------------------------------- the cases
ARRAY = generated.array()
CASES: dict[str, dict] = {factors.case_name(i, case): case for i, case in enumerate(ARRAY.cases)}

def truth_key(case: dict) -> tuple:
    """What the float64 truth of ``case`` depends on: its fp32 reference, and whether its runs compute at bf16 weights."""
    return factors.reference_key(fp32_twin(case)), case["precision_policy"] == "bf16_params"


def fp32_twin(case: dict) -> dict:
    """``case`` at ``--precision_policy fp32`` (the bf16 policies' own settings inactive)."""
    return {**case, "precision_policy": "fp32", "grad_reduce_dtype": INACTIVE, "fp32_residual": INACTIVE}


# ---------------------------------------------------------------------- known failures (known.py)
def expect_known(case: dict, check: str, problems: list[str], what: str) -> None:
    """Judge ``problems`` of a trained ``case`` in ``check`` against the known bugs (:mod:`tests.matrix.known`): a case
    a known bug applies to xfails when it still shows (strictly: it fails when it no longer does, so that the entry is
    removed); any other problem fails. Judged at run time because whether a case trains is the launch's outcome: a
    refusal is no sign of the bug."""
    reasons = known.reasons(case, check)
    if reasons and problems:
        pytest.xfail("; ".join(reasons) + f" -- seen: {problems[0][:300]}")
    if reasons:
        pytest.fail(f"XPASS(strict): {what} no longer shows the known bug {reasons}: remove its entry from tests/matrix/known.py")
    assert not problems, f"{what}: {problems}"


# ---------------------------------------------------------------------- running the matrix
LAUNCH_TIMEOUT = 2400  # seconds for all launches together
STALL = 300  # seconds without a run finishing: the group is stuck, killed, and the next launch starts after that run


def plan_entry(name: str, argv: list[str], stage: int | None, corpus: str) -> dict:
    return {"name": name, "argv": [*argv, "--dataset", corpus], "deepspeed": stage,
            "deepspeed_config": factors.deepspeed_config(stage) if stage is not None else None}


def done(out: Path, name: str, world: int) -> bool:
    return all((out / name / f"done-rank{r}.json").exists() for r in range(world)) or (out / name / "crashed.json").exists()


def launch_all(entries: list[dict], out: Path, env: dict, world: int, command: Callable[[Path], list]) -> None:
    """Run ``entries`` in launched groups: one launch, and after a run that ended its group (a crash, a hang), another
    starting after it; that run's output is kept in its ``crashed.json``."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    remaining = list(entries)
    attempt = 0
    while remaining:
        plan = out / f"plan-{attempt}.json"
        plan.write_text(json.dumps(remaining))
        log = out / f"launch-{attempt}.log"
        proc = start_command(command(plan), env, log)
        last_progress, finished = time.monotonic(), 0
        while proc.poll() is None:
            time.sleep(2)
            now_done = sum(done(out, e["name"], world) for e in remaining)
            if now_done > finished:
                finished, last_progress = now_done, time.monotonic()
            if time.monotonic() - last_progress > STALL or time.monotonic() > deadline:
                kill_group(proc)
        proc.wait()
        kill_group(proc)  # what the launch left behind
        output = log.read_text(errors="replace")
        first = next((i for i, e in enumerate(remaining) if not done(out, e["name"], world)), None)
        if first is None:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the matrix ran past {LAUNCH_TIMEOUT} s; last output:\n{output[-4000:]}")
        (out / remaining[first]["name"]).mkdir(parents=True, exist_ok=True)
        (out / remaining[first]["name"] / "crashed.json").write_text(json.dumps({"returncode": proc.returncode,
                                                                                  "output": output[-8000:]}))
        remaining = remaining[first + 1:]
        attempt += 1


def run_one_process(entries: list[dict], out: Path, env: dict, what: str) -> None:
    """The one-process runs ``entries`` in two processes (this machine's two cores)."""
    procs = []
    for i, half in enumerate([entries[0::2], entries[1::2]]):
        plan = out / f"{what}-{i}.json"
        plan.write_text(json.dumps(half))
        procs.append(start_command(python_command("tests/matrix/matrix_cases.py", "references", out, plan), env, out / f"{what}-{i}.log"))
    for i, proc in enumerate(procs):
        try:
            proc.wait(timeout=1800)
        finally:
            kill_group(proc)
        assert proc.returncode == 0, (out / f"{what}-{i}.log").read_text()[-6000:]


ISOLATED_SCRIPT = r"""
import importlib.util, json, torch
from transformers import AutoModelForCausalLM
folder = open("folder.txt").read()
ids = torch.load("input_ids.pt")
report = {"boost_hf_importable": importlib.util.find_spec("boost_hf") is not None}
try:
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.save(model(ids).logits, f"{folder}/../final_logits.pt")
    report.update({"class": type(model).__name__, "module": type(model).__module__})
except Exception as error:
    report["error"] = f"{type(error).__name__}: {str(error)[:2000]}"
print("REPORT" + json.dumps(report))
"""
INPUT_IDS = torch.randint(3, 500, (2, 32), generator=torch.Generator().manual_seed(0))


def selected_cases(session) -> list[str]:
    """The cases whose tests this session runs (``-k c07`` runs case c07 alone), in the array's order."""
    chosen = {item.callspec.params["name"] for item in session.items
              if hasattr(item, "callspec") and "name" in item.callspec.params and item.module.__name__ == __name__}
    return [name for name in CASES if name in chosen] if chosen else list(CASES)


@pytest.fixture(scope="module")
def matrix(training_env, tmp_path_factory, request) -> dict:
    """Every selected case run (``out/<case>``), the reference of each (``out/<reference>``), the isolated loads
    (``report``)."""
    from tests.hub import isolated_env

    out = tmp_path_factory.mktemp("matrix")
    corpus = training_env["CORPUS"]
    env = {**training_env, "BOOST_HF_DEEPSPEED_SHM_COMM": "0"}
    started = time.monotonic()
    names = selected_cases(request.session)
    entries = [plan_entry(name, factors.training_arguments(CASES[name]), factors.deepspeed_stage(CASES[name]), corpus)
               for name in names]
    entries.sort(key=lambda e: (e["deepspeed"] is not None, e["name"]))  # DeepSpeed's runs last
    launch_all(entries, out, env, factors.WORLD,
               lambda plan: accelerate_command("cpu-4proc.yaml", "tests/matrix/matrix_cases.py", "cases", out, plan))
    cases_seconds = time.monotonic() - started
    references: dict[tuple, str] = {}
    for name in names:
        if (out / name / "run.json").exists():
            references.setdefault(factors.reference_key(CASES[name]), f"reference-{len(references):02d}")
    by_key = {key: next(c for c in CASES.values() if factors.reference_key(c) == key) for key in references}
    ref_entries = [plan_entry(ref, factors.reference_arguments(by_key[key]), None, corpus) for key, ref in references.items()]
    run_one_process(ref_entries, out, env, "references")
    truths: dict[tuple, str] = {}  # the float64 truths of the cases whose gradients exceed the counted bound
    for name in names:
        if (out / name / "run.json").exists() and gradient_problems(out, name, matrix_reference(references, name), CASES[name]):
            truths.setdefault(truth_key(CASES[name]), f"truth-{len(truths):02d}")
    truth_entries = [{**plan_entry(truth, factors.reference_arguments(fp32_twin(CASES[name])), None, corpus),
                      "float64": {"through_bf16": key[1]}}
                     for key, truth in truths.items() for name in [next(n for n in names if truth_key(CASES[n]) == key)]]
    run_one_process(truth_entries, out, env, "truths")
    references_seconds = time.monotonic() - started - cases_seconds
    trained = {name: str(out / name / "final") for name in names if (out / name / "final" / "config.json").exists()}
    workdir = tmp_path_factory.mktemp("isolated")
    python = isolated_env.create(workdir / "venv")

    def load(name: str) -> dict:
        """``name``'s final/ loaded in a process of its own (a process that loaded one folder's remote code, its
        module cache and registrations, must not decide whether another loads)."""
        folder = workdir / name
        folder.mkdir()
        (folder / "folder.txt").write_text(trained[name])
        torch.save(INPUT_IDS, folder / "input_ids.pt")
        result = isolated_env.run(python, ISOLATED_SCRIPT, folder, timeout=300)
        assert result.returncode == 0 and "REPORT" in result.stdout, result.stderr[-4000:]
        return json.loads(result.stdout.split("REPORT", 1)[1])

    with ThreadPoolExecutor(2) as pool:  # this machine's two cores
        report = dict(zip(trained, pool.map(load, trained)))
    (out / "final-loads.json").write_text(json.dumps(report, indent=1))
    seconds = {"cases": cases_seconds, "references": references_seconds,
               "isolated loads": time.monotonic() - started - cases_seconds - references_seconds}
    (out / "seconds.json").write_text(json.dumps(seconds))
    print(f"\nthe matrix: {len(names)} cases, {len(references)} references, seconds {seconds}")
    return {"out": out, "references": references, "truths": truths, "report": report, "names": names}


# ---------------------------------------------------------------------- judging a case
def ranks(out: Path, name: str) -> list[dict]:
    return [json.loads((out / name / f"done-rank{r}.json").read_text()) for r in range(factors.WORLD)
            if (out / name / f"done-rank{r}.json").exists()]


def load_tensors(folder: Path, kind: str) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob(f"{kind}-pp*.pt")):
        tensors.update(torch.load(path))
    return tensors


def refusal_problems(outcomes: list[dict], case: dict) -> list[str]:
    """What keeps a case's errors from being a clean refusal (empty: refused as it must be)."""
    problems = []
    if len(outcomes) != factors.WORLD or any(o["outcome"] != "error" for o in outcomes):
        problems.append(f"not every rank raised: {[o['outcome'] for o in outcomes]}")
        return problems
    first = outcomes[0]
    if any((o["type"], o["message"]) != (first["type"], first["message"]) for o in outcomes):
        problems.append("the ranks raised different errors: " + "; ".join(f"{o['type']}: {o['message'][:200]}" for o in outcomes))
    if first["type"] not in ("ValueError", "TypeError"):
        problems.append(f"{first['type']} is no refusal")
    late = [o["collectives_before"] for o in outcomes if o["collectives_before"]]
    if late:
        problems.append(f"refused after {max(late)} collectives (not before any)")
    if first.get("after_training"):
        problems.append("raised after training")
    if not ({n for n in factors.FACTOR_NAMES if case[n] not in (INACTIVE,)} & cli_validation.named_factors(first["message"])):
        problems.append("the message names none of the case's settings")
    return problems


def counted_gradient_problems(grads: dict, ref_grads: dict, grad_bound: float) -> list[str]:
    """The (at most 3) gradients farther from the reference's than the counted bound."""
    worst = sorted(((scaled_error(grads[n], g), n) for n, g in ref_grads.items() if n in grads), reverse=True)
    return [f"gradient of {n}: error {e:.3g} > {grad_bound:.3g}" for e, n in worst[:3] if e > grad_bound]


def gradient_problems(out: Path, name: str, reference: str, case: dict) -> list[str]:
    """The case's gradients beyond the counted bound of its precision (:func:`bounds`)."""
    grads, ref_grads = load_tensors(out / name, "grads"), load_tensors(out / reference, "grads")
    return counted_gradient_problems(grads, ref_grads, bounds(case)[1]) if grads and ref_grads else []


def truth_problems(grads: dict, ref_grads: dict, truth_grads: dict, truth: str) -> list[str]:
    """Whether the case's gradients are farther from the float64 truth than :data:`TRUTH_FACTOR` times the
    one-process run's (the largest scaled error over every tensor of each)."""
    if not truth_grads:
        return [f"the float64 truth {truth} recorded no gradients"]
    case_error = max((scaled_error(grads[n], t), n) for n, t in truth_grads.items() if n in grads)
    reference_error = max((scaled_error(ref_grads[n], t), n) for n, t in truth_grads.items() if n in ref_grads)
    if case_error[0] <= TRUTH_FACTOR * reference_error[0]:
        return []
    return [f"gradients {case_error[0]:.3g} of their scale from the float64 truth ({truth}; worst {case_error[1]}), "
            f"{case_error[0] / reference_error[0]:.2g} x the one-process run's {reference_error[0]:.3g} "
            f"({reference_error[1]}) > {TRUTH_FACTOR} x"]


def exactness_problems(out: Path, name: str, reference: str, case: dict, truth: str | None = None) -> list[str]:
    """Where the case's run differs from its reference beyond the bounds (empty: equal); gradients beyond the counted
    bound are judged against ``truth``, the float64 truth of the case, when it has one."""
    problems = []
    loss_bound, grad_bound = bounds(case)
    run, ref = json.loads((out / name / "run.json").read_text()), json.loads((out / reference / "run.json").read_text())
    if run["losses"].keys() != ref["losses"].keys():
        return [f"logged steps {sorted(run['losses'])} vs the reference's {sorted(ref['losses'])}"]
    for step, loss in ref["losses"].items():
        error = abs(run["losses"][step] - loss) / abs(loss)
        if error > loss_bound:
            problems.append(f"loss of step {step}: {run['losses'][step]:.7g} vs {loss:.7g} (error {error:.2g} > {loss_bound:.2g})")
    grads, ref_grads = load_tensors(out / name, "grads"), load_tensors(out / reference, "grads")
    params, ref_params = load_tensors(out / name, "params"), load_tensors(out / reference, "params")
    if not (grads and ref_grads and params and ref_params):  # nothing recorded is nothing proven
        return [f"no gradients or parameters recorded: {len(grads)}, {len(ref_grads)}, {len(params)}, {len(ref_params)}"]
    if grads.keys() != ref_grads.keys():
        problems.append(f"gradients of {sorted(set(grads) ^ set(ref_grads))[:6]} missing on one side")
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in ref_grads.values()))
    clip = min(1.0, CLIP / norm) if norm > 0 else 1.0
    beyond = counted_gradient_problems(grads, ref_grads, grad_bound)
    if beyond and truth is not None:
        beyond = truth_problems(grads, ref_grads, load_tensors(out / truth, "grads"), truth)
    problems += beyond
    if params.keys() != ref_params.keys():
        problems.append(f"parameters {sorted(set(params) ^ set(ref_params))[:6]} missing on one side")
    errors = []
    for n, p in ref_params.items():
        if n not in params:
            continue
        scale = float(p.abs().max()) or 1.0
        largest_gradient = clip * float(ref_grads[n].abs().max()) if n in ref_grads else 0.0
        bound = parameter_bound(grad_bound, largest_gradient, scale)
        errors.append((scaled_error(params[n], p) / bound, scaled_error(params[n], p), bound, n))
    errors.sort(reverse=True)
    problems += [f"parameter {n} after {STEPS} steps: error {e:.3g} > {b:.3g}" for ratio, e, b, n in errors[:3] if ratio > 1]
    return problems


def matrix_reference(references: dict, name: str) -> str:
    return references[factors.reference_key(CASES[name])]


def judge(matrix: dict, name: str) -> None:
    out, case = matrix["out"], CASES[name]
    if (out / name / "crashed.json").exists():
        crash = json.loads((out / name / "crashed.json").read_text())
        pytest.fail(f"{name} ended its launched group (return code {crash['returncode']}):\n{crash['output'][-3000:]}")
    outcomes = ranks(out, name)
    trained = (out / name / "run.json").exists()
    if not trained:
        problems = refusal_problems(outcomes, case)
        assert not problems, f"{name} neither trained nor was refused cleanly: {problems}\n" + "\n".join(
            f"rank {r}: {o.get('type')}: {o.get('message', '')[:600]}\n{o.get('traceback', '')[-1500:]}" for r, o in enumerate(outcomes[:2]))
        return
    reference = matrix_reference(matrix["references"], name)
    problems = exactness_problems(out, name, reference, case, matrix["truths"].get(truth_key(case)))
    expect_known(case, "exact", problems, f"{name} trained other numbers than one process ({reference})")


@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_case_trains_as_one_process_or_is_refused(matrix, name):
    judge(matrix, name)


@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_final_folder_loads_without_boost_hf(matrix, name):
    from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM

    out = matrix["out"]
    if not (out / name / "run.json").exists():
        pytest.skip("refused (or stopped before training ended): no final/ to load")
    errors = [o for o in ranks(out, name) if o["outcome"] == "error"]
    entry = matrix["report"].get(name)
    if errors or entry is None:
        problems = [f"trained but ended with {errors[0]['type']}: {errors[0]['message'][:1500]}" if errors else "no final/ written"]
        expect_known(CASES[name], "final", problems, f"{name}'s final/")
    problems = []
    if entry.get("boost_hf_importable", True):
        problems.append("boost_hf was importable where final/ was loaded")
    if "error" in entry:
        problems.append(f"final/ does not load without boost-hf: {entry['error']}")
    else:
        config = json.loads((out / name / "run.json").read_text())["config"]
        model = BoostLlamaForCausalLM(BoostLlamaConfig.from_dict(config))
        params = load_tensors(out / name, "params")
        missing, unexpected = model.load_state_dict(params, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        with torch.no_grad():
            expected = model.eval()(INPUT_IDS).logits
        error = scaled_error(torch.load(out / name / "final_logits.pt"), expected)
        if error > FORWARD:
            problems.append(f"final/'s logits {error:.3g} of their scale off the trained model's (> {FORWARD:.3g})")
    expect_known(CASES[name], "final", problems, f"{name}'s final/")


def test_every_selected_case_ran(matrix):
    """Every rank of every case run wrote its outcome, or the case ended its launched group (judged by its tests)."""
    out = matrix["out"]
    for name in matrix["names"]:
        assert (out / name / "crashed.json").exists() or len(ranks(out, name)) == factors.WORLD, name
