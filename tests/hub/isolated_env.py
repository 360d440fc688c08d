"""A fresh virtual environment holding only torch, transformers, safetensors and their dependencies.

:func:`create` makes a venv ``--without-pip`` (``python -m venv``: it does *not* see the outer environment's
site-packages) whose site-packages receives symlinks to exactly the installed files of the dependency closure of
those three packages (``Requires-Dist`` metadata, markers evaluated, extras not followed; ``.dist-info`` folders
included so version checks work): the outer environment's versions, in about 1 s. (A ``pip install`` of the same
pins into a fresh venv installs the same packages, at the index's versions of the dependencies, and cost this
test about 75 s more on 2 cores from a local wheel cache.) So boost-hf, DeepSpeed, gensim, peft, datasets and
everything else are absent, and the interpreter runs with ``-I`` (no ``PYTHONPATH``, no user site, no current
directory on ``sys.path``).
"""

from __future__ import annotations

import os
import subprocess
import venv
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOTS = ("torch", "transformers", "safetensors")


def dependency_closure(roots=ROOTS) -> list[metadata.Distribution]:
    """Installed distributions reachable from ``roots`` through their (unconditional or matching-marker) requirements."""
    seen: dict[str, metadata.Distribution] = {}
    todo = list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional dependency that is not installed
        seen[name] = dist
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return list(seen.values())


def top_level_entries(dist: metadata.Distribution) -> set[Path]:
    """The top-level files and folders of ``dist`` in its site-packages (packages, modules, .dist-info, .libs)."""
    base = Path(dist.locate_file(""))
    entries = set()
    for file in dist.files or []:
        parts = Path(file).parts
        if parts and parts[0] != ".." and not parts[0].endswith(".pth"):
            entries.add(base / parts[0])
    return entries


def create(target: Path, roots=ROOTS) -> Path:
    """A ``--without-pip`` venv at ``target`` whose site-packages links the installed closure of ``roots``;
    returns its python executable."""
    venv.EnvBuilder(with_pip=False, system_site_packages=False, symlinks=True).create(target)
    python = target / "bin" / "python"
    site = Path(subprocess.check_output([str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True).strip())
    for dist in dependency_closure(roots):
        for entry in top_level_entries(dist):
            if entry.exists() and not (site / entry.name).exists():
                os.symlink(entry, site / entry.name)
    return python


def run(python: Path, script: str, cwd: Path, timeout: int = 300, args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run ``script`` (with ``sys.argv[1:] == args``) in the isolated interpreter, offline, with a private module cache
    for remote code."""
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(cwd), "HF_HUB_OFFLINE": "1", "HF_HOME": str(cwd / "hf_home"),
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(python), "-I", "-c", script, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


__all__ = ["ROOTS", "dependency_closure", "create", "run"]
