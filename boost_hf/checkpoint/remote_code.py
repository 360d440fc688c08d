"""A saved folder's remote code brought up to this boost-hf's, in place.

Every folder boost-hf saves (``save_pretrained``, a checkpoint, ``final/``, ``boost-hf export``) ships the model file
and its siblings as remote code (``trust_remote_code=True`` loads it without boost-hf). A folder keeps the code of
the boost-hf that wrote it: one published before a fix (e.g. before the model read the KV cache under transformers
5.24's name ``cache``) keeps the old behaviour wherever it is loaded as remote code. :func:`refresh_remote_code`
replaces those files with this installation's copies, each atomically, and the manifest's entries for them
(``boost-hf export FOLDER --refresh-remote-code``). The weights are not touched, nor is the config, but where it names
a wrapper's class in the model's place (the ``final/``, checkpoints and exports of FSDP2 runs saved before boost-hf
named the model's own class: ``FSDPBoostLlamaForCausalLM`` and copies of torch's ``_fsdp_*.py``). One process.
"""

from __future__ import annotations

import json
import os
import shutil

from transformers.dynamic_module_utils import get_relative_import_files

from .. import configuration_boost_llama, modeling_boost_llama
from .integrity import MANIFEST_NAME, check_files, file_digests, read_manifest, write_manifest


def remote_code_sources() -> dict[str, str]:
    """``{file name: path in this installation}`` of the remote code a save ships: the model file, the siblings it
    imports and the configuration file (what ``save_pretrained`` copies)."""
    paths = [modeling_boost_llama.__file__, *get_relative_import_files(modeling_boost_llama.__file__),
             configuration_boost_llama.__file__]
    return {os.path.basename(path): path for path in sorted(set(map(os.path.realpath, paths)))}


def _identical(a: str, b: str) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


MODEL_CLASSES = (modeling_boost_llama.BoostLlamaForCausalLM.__name__, modeling_boost_llama.BoostLlamaModel.__name__)
CODE_MODULES = {"modeling_boost_llama": MODEL_CLASSES, "configuration_boost_llama": (configuration_boost_llama.BoostLlamaConfig.__name__,)}


def _own_name(name: str, classes=MODEL_CLASSES) -> str:
    """The boost-hf class a saved class name stands for: itself, or the one a wrapper's class name ends with
    (FSDP2's ``FSDPBoostLlamaForCausalLM``, which boost-hf before its fix saved in the model's place)."""
    return name if name in classes else next((own for own in classes if name.endswith(own)), name)


def own_class_names(config: dict) -> tuple[dict, list[str]]:
    """``config`` (a saved ``config.json``) with its ``architectures`` and ``auto_map`` naming boost-hf's classes where
    they name a wrapper's (see :func:`_own_name`), and the code modules the wrapper's ``auto_map`` entries named (the
    files saved in place of the model's: torch's ``_fsdp_init`` and what it imports)."""
    config = json.loads(json.dumps(config))
    if config.get("architectures"):
        config["architectures"] = [_own_name(name) for name in config["architectures"]]
    stale = []
    for auto, reference in (config.get("auto_map") or {}).items():
        module, _, name = reference.rpartition(".") if isinstance(reference, str) else ("", "", "")
        if not module or module in CODE_MODULES:
            continue
        for own_module, classes in CODE_MODULES.items():
            if _own_name(name, classes) in classes:
                config["auto_map"][auto] = f"{own_module}.{_own_name(name, classes)}"
                stale.append(module)
    return config, stale


def refresh_remote_code(folder: str) -> list[str]:
    """Replace the remote code of the saved boost-hf folder ``folder`` with this installation's; return the names of
    the files that changed (empty when it is already current). Each file is written beside its target and renamed
    over it. A folder saved under a wrapper's name (an FSDP2 run's, by boost-hf before its fix: ``architectures``
    ``FSDPBoostLlamaForCausalLM``, an ``auto_map`` into copies of torch's ``_fsdp_*.py``) gets the model's own names in
    its ``config.json`` and loses those copies (:func:`own_class_names`); nothing else of the config changes. A folder
    with a manifest gets new entries for exactly those files, after its other entries are checked (a damaged folder
    is not blessed). ``ValueError`` naming the fix if ``folder`` is not a boost-hf folder."""
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{folder!r} holds no config.json: give the folder of a saved boost-hf model (e.g. outputs/demo/final).")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    if config.get("model_type") != configuration_boost_llama.BoostLlamaConfig.model_type:
        raise ValueError(f"{folder!r} holds a model of type {config.get('model_type')!r}, not a boost-hf model "
                         f"({configuration_boost_llama.BoostLlamaConfig.model_type!r}): its remote code is not boost-hf's.")
    sources = remote_code_sources()
    renamed, stale_modules = own_class_names(config)
    stale = sorted({os.path.basename(path) for module in stale_modules if os.path.isfile(os.path.join(folder, f"{module}.py"))
                    for path in (os.path.join(folder, f"{module}.py"), *get_relative_import_files(os.path.join(folder, f"{module}.py")))
                    if os.path.isfile(path)} - set(sources))
    manifest = read_manifest(folder) if os.path.isfile(os.path.join(folder, MANIFEST_NAME)) else None
    rewritten = ["config.json"] if renamed != config else []
    if manifest is not None:  # the rest of the folder as its manifest says, before anything is replaced
        check_files(folder, manifest, [name for name in manifest["files"] if name not in sources and name not in rewritten])
    changed = []
    for name, source in sources.items():
        target = os.path.join(folder, name)
        if os.path.isfile(target) and _identical(source, target):
            continue
        staging = os.path.join(folder, f".{name}.refresh")
        shutil.copyfile(source, staging)
        os.replace(staging, target)
        changed.append(name)
    if rewritten:
        staging = os.path.join(folder, ".config.json.refresh")
        with open(staging, "w", encoding="utf-8") as f:
            f.write(json.dumps(renamed, indent=2, sort_keys=True) + "\n")
        os.replace(staging, config_path)
        changed.append("config.json")
    for name in stale:
        os.remove(os.path.join(folder, name))
    if manifest is not None and (changed or stale):
        kept = {name: entry for name, entry in manifest["files"].items() if name not in stale}
        write_manifest(folder, configuration_boost_llama.BoostLlamaConfig.from_pretrained(folder) if manifest["architecture"] else None,
                       files={**kept, **file_digests(folder, changed)})
    return changed + stale


__all__ = ["own_class_names", "refresh_remote_code", "remote_code_sources"]
