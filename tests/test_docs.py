"""The README and the pages of docs/ are true as written: every relative link resolves, every fenced shell command
names real subcommands, recipes, files and flags (the quick ones run), and every Python example runs (the model in
process, the tensor-parallel script on 2 CPU processes under torchrun) or, where it is marked as a fragment, at
least compiles and imports what it names.

A fenced block may carry a marker on the line above it: ``<!-- fragment: why -->`` (needs a context the page
describes: a launched group, a trained folder) or ``<!-- torchrun: SCRIPT -->`` (a complete script for 2 processes).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINKED = [*PAGES, ROOT / "benchmarks" / "README.md"]  # pages whose links must resolve
BLOCK = re.compile(r"(?:<!-- ([^\n]*?) -->\n)?```(\w*)\n(.*?)```", flags=re.S)
PLACEHOLDERS = {"N": "2", "8N": "16"}  # numbers the commands leave to the reader
PAGE_LIMIT = 250


def fenced_blocks(language: str) -> list[tuple[Path, str, str]]:
    """``(page, marker, code)`` of every fenced block of ``language`` in the README and docs/."""
    return [(page, m.group(1) or "", m.group(3)) for page in PAGES for m in BLOCK.finditer(page.read_text())
            if m.group(2) == language]


def python_blocks() -> list[str]:
    return [code for _, _, code in fenced_blocks("python")]


def shell_commands() -> list[tuple[Path, str]]:
    """Every command of the fenced bash blocks: continuation lines joined, comments dropped."""
    commands = []
    for page, _, code in fenced_blocks("bash"):
        for line in code.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*", "", line).strip()
            if line:
                commands.append((page, line))
    return commands


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, flags=re.M)}


# ---- links ------------------------------------------------------------------------------------------------------

def test_readme_is_short_and_links_resolve():
    assert len(README.read_text().splitlines()) < PAGE_LIMIT
    broken = []
    for page in LINKED:
        text = page.read_text()
        assert "/work/" not in text, f"{page.name} names a file outside the repository"
        for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"```.*?```", "", text, flags=re.S)):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists() or ROOT not in (resolved, *resolved.parents):
                broken.append(f"{page.name}: {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


# ---- shell commands ---------------------------------------------------------------------------------------------

def _argv(command: str) -> list[str]:
    """The command's words, optional parts' brackets dropped and placeholders replaced by values."""
    while (unbracketed := re.sub(r"(^|\s)\[([^\[\]]*)\]", r"\1\2", command)) != command:  # innermost first
        command = unbracketed
    words = shlex.split(command)
    return [PLACEHOLDERS.get(w, "0" if w.startswith("$") else w) for w in words]


def _parse(parser, argv: list[str], what: str):
    """The parsed arguments; ``None`` for a command that asks for help (and gets it)."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_args(argv)
    except SystemExit as exit:
        if exit.code != 0:
            pytest.fail(f"{what}: {errors.getvalue().strip()}")


def _check_recipe_command(argv: list[str], command: str) -> None:
    """``RECIPE [--field value ...]``: the recipe is a shipped file and every field parses with the recipe parser."""
    from boost_hf.training.recipe import recipe_parser, recipe_to_argv, resolve_recipe

    recipe = resolve_recipe(str(ROOT / argv[0]) if (ROOT / argv[0]).is_file() else argv[0])
    with open(recipe) as f:
        _parse(recipe_parser(), recipe_to_argv(yaml.safe_load(f)) + argv[1:], command)


def _check_boost_hf(argv: list[str], command: str) -> None:
    from boost_hf import cli

    args = _parse(cli.build_parser(), argv, command)
    if args is None:
        return
    if args.command == "train":
        _check_recipe_command([args.recipe, *args.overrides], command)
    elif args.command == "estimate" and "--measured" not in argv:  # quick and self-contained: run it as written
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli.main(argv) == 0, command
        assert "btp" in out.getvalue(), command


def _check_python(argv: list[str], command: str) -> None:
    if argv[0] == "-m":
        assert argv[1] == "boost_hf.cli", command
        _check_boost_hf(argv[2:], command)
    elif argv[0] == "recipes/pretrain.py":
        _check_recipe_command(argv[1:], command)
    else:  # a benchmark script: it exists and defines every flag the command gives it
        script = ROOT / argv[0]
        assert script.is_file() and script.parts[-2] == "benchmarks", command
        source = script.read_text() + (ROOT / "benchmarks" / "common.py").read_text()
        for flag in (w for w in argv[1:] if w.startswith("--")):
            assert f'"{flag}"' in source, f"{command}: {script.name} has no {flag}"


def _check_accelerate(argv: list[str], command: str) -> None:
    from accelerate.commands.launch import launch_command_parser

    assert argv[0] == "launch", command
    args = _parse(launch_command_parser(), argv[1:], command)
    assert (ROOT / args.config_file).is_file(), f"{command}: no {args.config_file}"
    script = ["-m", args.training_script] if args.module else [args.training_script]
    _check_python([*script, *args.training_script_args], command)


def _check_make(argv: list[str], command: str) -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = re.findall(r"^([\w-]+):", makefile, flags=re.M)
    variables = [word.split("=")[0] for word in argv if "=" in word]
    assert all(f"$({name})" in makefile for name in variables), f"{command}: the Makefile reads none of {variables}"
    assert {w for w in argv if "=" not in w} <= set(targets), f"{command}: the Makefile's targets are {targets}"


def _check_pip(argv: list[str], command: str) -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert argv[0] == "install", command
    for word in argv[1:]:
        named = re.search(r"\[([\w,]+)\]$", word)
        for extra in named.group(1).split(",") if named else ():
            assert extra in extras, f"{command}: no extra {extra!r}"


def _check_lm_eval(argv: list[str], command: str) -> None:
    assert importlib.util.find_spec("lm_eval"), command


CHECKERS = {"boost-hf": _check_boost_hf, "python": _check_python, "accelerate": _check_accelerate,
            "make": _check_make, "pip": _check_pip, "lm_eval": _check_lm_eval}


def test_shell_commands_are_real():
    """Every fenced command: ``boost-hf estimate`` runs as written; the rest parse with the parsers that would read
    them (launcher flags, subcommands, recipes and their fields), name files that exist and Makefile targets."""
    commands = shell_commands()
    assert len(commands) > 20
    for page, command in commands:
        argv = _argv(command)
        if argv[0] == "...":  # "... recipes/pretrain.py ARGS": the end of a launch shown above it
            argv = ["python", *argv[1:]]
        assert argv[0] in CHECKERS, f"{page.name}: no check for {command!r}; add one to tests/test_docs.py"
        CHECKERS[argv[0]](argv[1:], f"{page.name}: {command}")


def test_inline_boost_hf_commands_are_real():
    """A ``boost-hf ...`` span in the text names a real subcommand; a whole one (arguments, no placeholder) is checked as a
    fenced command is."""
    from boost_hf.cli import SUBCOMMANDS

    spans = [(page, span) for page in PAGES for span in re.findall(r"`boost-hf ([a-z][^`]*)`", page.read_text())]
    assert len(spans) > 10
    for page, span in spans:
        argv = span.split()
        if argv[0].endswith(":"):  # a message boost-hf prints, not a command
            continue
        assert argv[0] in SUBCOMMANDS, f"{page.name}: `boost-hf {span}`"
        if len(argv) > 1 and not re.search(r"[A-Z<\[]|\.\.\.", span):  # a whole command, not a name
            _check_boost_hf(argv, f"{page.name}: `boost-hf {span}`")


# ---- Python examples --------------------------------------------------------------------------------------------

def test_python_fragments_compile_and_import():
    """A fragment compiles and every name it imports exists."""
    fragments = [(page, code) for page, marker, code in fenced_blocks("python") if marker.startswith("fragment:")]
    assert fragments
    for page, code in fragments:
        tree = ast.parse(code, filename=page.name)
        imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
        exec(compile(ast.Module(body=imports, type_ignores=[]), page.name, "exec"), {})


def test_python_examples_run(tmp_path, monkeypatch):
    """Every unmarked example runs as written, each once (the README and a page may show the same one)."""
    examples = {code: page for page, marker, code in fenced_blocks("python") if not marker}
    assert any("generate" in code for code in examples)
    monkeypatch.chdir(tmp_path)
    for code, page in examples.items():
        exec(compile(code, page.name, "exec"), {})
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()


def test_torchrun_example_runs(tmp_path):
    scripts = {code: marker.split(":", 1)[1].strip() for _, marker, code in fenced_blocks("python")
               if marker.startswith("torchrun:")}
    assert len(scripts) == 1, "one torchrun script, shown on several pages"
    (block, name), = scripts.items()
    script = tmp_path / name
    script.write_text(block)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240, start_new_session=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "forward collectives" in run.stdout
    assert (tmp_path / "ckpt-tp2" / "model.safetensors").is_file()
    # a TP-saved checkpoint ships the single-device remote code too
    config = json.loads((tmp_path / "ckpt-tp2" / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_boost_llama.BoostLlamaForCausalLM"
    assert (tmp_path / "ckpt-tp2" / "modeling_boost_llama.py").is_file() and (tmp_path / "ckpt-tp2" / "configuration_boost_llama.py").is_file()
