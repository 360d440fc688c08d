"""Done-when test of remote code: a checkpoint saved by boost-hf (the trainer's ``final/`` and plain
``save_pretrained`` folders of every bottleneck) loads with ``trust_remote_code=True`` in a fresh virtual
environment holding only torch + transformers + safetensors (see :mod:`tests.hub.isolated_env` for how it is
built and why), gives the fp32 logits of boost-hf bit for bit, generates the same greedy tokens (with a dynamic or a static cache,
without one, and as the argmax of the forward), warns of no deprecated name, runs in a
``text-generation`` pipeline, and its tokenizer loads with ``AutoTokenizer``."""

from __future__ import annotations

import json
import sys

import torch

from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM

from ..tolerances import TINY_FORWARD, assert_scaled_close
from . import isolated_env

INPUT_IDS = [[5, 17, 42, 99, 7, 64, 12, 250], [9, 8, 7, 6, 5, 4, 3, 200]]

ISOLATED_SCRIPT = r"""
import json, logging, sys, torch, warnings
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, pipeline
warned = []  # deprecation warnings and transformers' deprecation log lines while the remote code runs
logging.getLogger("transformers").addHandler(type("Keep", (logging.Handler,), {"emit": lambda self, r: warned.append(r.getMessage())})())
warnings.simplefilter("always")
warnings.showwarning = lambda message, *args, **kwargs: warned.append(str(message))
report = {}
for name, folder in json.loads(sys.argv[1] if len(sys.argv) > 1 else FOLDERS).items():
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    ids = torch.tensor(INPUT_IDS)
    with torch.no_grad():
        logits = model(ids).logits
    torch.save(logits, f"{name}.logits.pt")
    generated = model.generate(ids[:1], max_new_tokens=6, do_sample=False)
    argmax = ids[:1]
    with torch.no_grad():
        for _ in range(6):
            argmax = torch.cat([argmax, model(argmax, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    entry = {"class_module": type(model).__module__, "config_class": type(AutoConfig.from_pretrained(folder, trust_remote_code=True)).__name__,
             "generated": generated.tolist(), "use_cache": model.generation_config.use_cache,
             "generated_uncached": model.generate(ids[:1], max_new_tokens=6, do_sample=False, use_cache=False).tolist(),
             "generated_static": model.generate(ids[:1], max_new_tokens=6, do_sample=False, cache_implementation="static").tolist(),
             "argmax": argmax.tolist()}
    if name == "final":
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
        generator = pipeline("text-generation", model=folder, trust_remote_code=True)
        entry["pipeline"] = generator("The river", max_new_tokens=5, do_sample=False)[0]["generated_text"]
        entry["tokenized"] = tokenizer("The river city").input_ids
    report[name] = entry
import importlib.util
report["forbidden_modules"] = [m for m in ("boost_hf", "deepspeed", "gensim", "peft", "datasets") if m in sys.modules or importlib.util.find_spec(m)]
report["versions"] = [torch.__version__, __import__("transformers").__version__]
report["deprecations"] = sorted({m for m in warned if "deprecat" in m.lower()})
print("REPORT" + json.dumps(report))
"""


def saved_plain(tmp_path, bottleneck, **fields):
    torch.manual_seed(3)
    config = BoostLlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=64, bottleneck=bottleneck, rank=8, **fields)
    folder = tmp_path / f"plain-{bottleneck}"
    BoostLlamaForCausalLM(config).save_pretrained(folder)
    return folder


def converted_from_authors_cola(tmp_path):
    """A CoLA authors' checkpoint (biases, pad_token_id 0, no GQA), loaded by boost-hf and saved canonically."""
    from tests.test_authors_checkpoint import write_authors_checkpoint

    torch.manual_seed(3)
    config = BoostLlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              bottleneck="cola", rank=8, pad_token_id=0, attention_bias=True, mlp_bias=True)
    write_authors_checkpoint(BoostLlamaForCausalLM(config), tmp_path / "authors-cola")
    folder = tmp_path / "converted-cola"
    BoostLlamaForCausalLM.from_pretrained(tmp_path / "authors-cola").save_pretrained(folder)
    return folder


def boost_hf_outputs(folder):
    model = BoostLlamaForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor(INPUT_IDS)
    with torch.no_grad():
        logits = model(ids).logits
    return logits, model.generate(ids[:1], max_new_tokens=6, do_sample=False).tolist()


def check_in_a_fresh_environment(tmp_path, folders: dict[str, str]) -> dict:
    """Load each folder with plain transformers (no boost-hf) in a fresh environment of this leg's versions; its report,
    after checking that each logits tensor equals boost-hf's bit for bit and each greedy generation boost-hf's."""
    python = isolated_env.create(tmp_path / "venv")
    script = ISOLATED_SCRIPT.replace("INPUT_IDS", repr(INPUT_IDS)).replace("FOLDERS", repr(json.dumps(folders)))
    result = isolated_env.run(python, script, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.split("REPORT", 1)[1])
    assert report.pop("forbidden_modules") == []  # not installed there, so not imported
    import transformers

    assert report.pop("versions") == [torch.__version__, transformers.__version__]
    assert report.pop("deprecations") == []  # the remote code speaks the running transformers' names
    for name, folder in folders.items():
        entry = report[name]
        # the cached decodings (dynamic and static cache) equal the uncached one and the argmax of the forward
        assert entry["generated"] == entry["generated_static"] == entry["generated_uncached"] == entry["argmax"], name
        assert entry["class_module"].startswith("transformers_modules."), entry  # the shipped file, not boost_hf
        assert entry["config_class"] == "BoostLlamaConfig"
        logits, generated = boost_hf_outputs(folder)
        remote = torch.load(tmp_path / f"{name}.logits.pt")
        assert remote.dtype == torch.float32 and torch.equal(remote, logits), name
        assert entry["generated"] == generated, name
    return report


def test_remote_code_of_every_bottleneck_in_a_fresh_environment_without_boost_hf(tmp_path):
    folders = {"full": str(saved_plain(tmp_path, None)), "lax": str(saved_plain(tmp_path, "lax", lax_gate="kronecker")),
               "svd": str(saved_plain(tmp_path, "svd")), "cola": str(saved_plain(tmp_path, "cola")),
               "lax-dense-biases": str(saved_plain(tmp_path, "lax", lax_gate="dense", attention_bias=True, mlp_bias=True)),
               "converted-cola": str(converted_from_authors_cola(tmp_path)), "tt": str(saved_plain(tmp_path, "tt"))}
    check_in_a_fresh_environment(tmp_path, folders)


def test_the_same_logits_on_every_supported_version(tmp_path):
    """Checkpoints of every bottleneck, saved with this checkout's model file as remote code, give the logits written on
    the pinned stack (tests/hub/reference_logits.py) within fp32 rounding (tests/tolerances.py), in boost-hf and with plain transformers, on whichever
    versions this leg runs (make test runs it at the pinned and at the minimum versions)."""
    from safetensors.torch import load_file

    from .reference_logits import CHECKPOINTS, INPUT_IDS as REFERENCE_IDS, REFERENCE

    assert REFERENCE_IDS == INPUT_IDS
    expected = load_file(REFERENCE / "logits.safetensors")
    folders = {}
    for name in CHECKPOINTS:
        folders[name] = str(tmp_path / name)
        BoostLlamaForCausalLM.from_pretrained(REFERENCE / name).save_pretrained(folders[name])
    check_in_a_fresh_environment(tmp_path, folders)
    for name, folder in folders.items():
        assert_scaled_close(torch.load(tmp_path / f"{name}.logits.pt"), expected[name], TINY_FORWARD, name)


def test_a_trained_final_folder_in_a_fresh_environment_without_boost_hf(tmp_path, trained_run):
    _, final = trained_run
    report = check_in_a_fresh_environment(tmp_path, {"final": str(final)})
    assert report["final"]["use_cache"] is True
    assert report["final"]["pipeline"].startswith("The river") and len(report["final"]["pipeline"]) > len("The river")
    tokenizer = trained_run[0].processing_class
    assert report["final"]["tokenized"] == tokenizer("The river city").input_ids


def test_full_rank_checkpoint_loads_as_plain_llama(tmp_path):
    """What the model card of a ``bottleneck=None`` model says: ``LlamaConfig`` + ``LlamaForCausalLM``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = saved_plain(tmp_path, None)
    config = LlamaConfig.from_pretrained(folder)
    llama = LlamaForCausalLM.from_pretrained(folder, config=config).eval()
    ids = torch.tensor(INPUT_IDS)
    with torch.no_grad():
        assert torch.equal(llama(ids).logits, boost_hf_outputs(folder)[0])


def test_saved_files_are_registered_without_asking(tmp_path):
    folder = saved_plain(tmp_path, "cola")
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == {"AutoConfig": "configuration_boost_llama.BoostLlamaConfig",
                                  "AutoModelForCausalLM": "modeling_boost_llama.BoostLlamaForCausalLM"}
    assert (folder / "modeling_boost_llama.py").read_text() == (sys.modules[BoostLlamaForCausalLM.__module__].__file__ and
                                                                 open(sys.modules[BoostLlamaForCausalLM.__module__].__file__).read())


def test_export_refreshes_the_remote_code_of_an_older_folder_in_place(tmp_path, trained_run, capsys):
    """A published folder keeps the remote code of the boost-hf that wrote it; ``boost-hf export FOLDER
    --refresh-remote-code`` replaces exactly the code files that differ from this installation's, renews their
    manifest entries (the folder still verifies), leaves the weights alone, and refuses a folder whose other files do
    not match its manifest, or a folder that is not boost-hf's, changing nothing."""
    import shutil

    import pytest

    from boost_hf.checkpoint.integrity import CheckpointIntegrityError, verify_manifest
    from boost_hf.checkpoint.remote_code import refresh_remote_code, remote_code_sources
    from boost_hf.cli import main

    folder = tmp_path / "published"
    shutil.copytree(trained_run[1], folder)
    sources = remote_code_sources()
    assert {"modeling_boost_llama.py", "configuration_boost_llama.py"} <= set(sources) <= {p.name for p in folder.glob("*.py")}
    old = (folder / "modeling_boost_llama.py").read_text().replace("CACHE_NAME = ", "# written by an older boost-hf\nCACHE_NAME = ")
    (folder / "modeling_boost_llama.py").write_text(old)
    weights = {p.name: p.read_bytes() for p in folder.glob("*.safetensors")}

    assert main(["export", str(folder), "--refresh-remote-code"]) == 0
    assert f"refreshed modeling_boost_llama.py in {folder}" in capsys.readouterr().out
    assert all((folder / name).read_bytes() == open(path, "rb").read() for name, path in sources.items())
    assert {p.name: p.read_bytes() for p in folder.glob("*.safetensors")} == weights
    verify_manifest(str(folder))
    assert refresh_remote_code(str(folder)) == []  # already current
    check_in_a_fresh_environment(tmp_path, {"final": str(folder)})  # cached generation == uncached == argmax there

    (folder / "configuration_boost_llama.py").write_text("# older\n")
    damaged = next(folder.glob("*.safetensors"))
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"\x00")
    with pytest.raises(CheckpointIntegrityError, match="corrupted"):
        refresh_remote_code(str(folder))
    assert (folder / "configuration_boost_llama.py").read_text() == "# older\n"  # nothing changed
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="not a boost-hf model"):
        refresh_remote_code(str(tmp_path / "other"))
    with pytest.raises(SystemExit):
        main(["export", str(folder), str(tmp_path / "out"), "--refresh-remote-code"])


def test_refresh_gives_a_folder_saved_under_fsdp2s_class_the_models_own_names_and_code(tmp_path):
    """What boost-hf saved from an FSDP2 run before it named the model's own class: ``fully_shard``'s
    ``FSDPBoostLlamaForCausalLM`` (made in torch) as ``architectures``, an ``auto_map`` into copies of torch's FSDP
    files, and no model file. ``boost-hf export FOLDER --refresh-remote-code`` names the model's class, ships its code,
    removes torch's copies and leaves the weights alone: the folder then loads without boost-hf, bit for bit."""
    import torch.distributed.fsdp._fully_shard._fsdp_init  # noqa: F401 (the module the class names)
    from torch.distributed.fsdp import FSDPModule
    from transformers.dynamic_module_utils import custom_object_save

    from boost_hf.checkpoint.remote_code import remote_code_sources
    from boost_hf.cli import main

    folder = saved_plain(tmp_path, "cola")
    for name in remote_code_sources():
        (folder / name).unlink()
    # fully_shard makes FSDP<Class> in torch's _fsdp_init (torch 2.11 to 2.14)
    fsdp_class = type("FSDPBoostLlamaForCausalLM", (FSDPModule, BoostLlamaForCausalLM),
                      {"__module__": "torch.distributed.fsdp._fully_shard._fsdp_init"})
    config = BoostLlamaConfig.from_pretrained(folder)
    config.architectures = [fsdp_class.__name__]
    custom_object_save(object.__new__(fsdp_class), folder, config=config)  # the save of a model under FSDP2, before the fix
    config.save_pretrained(folder)
    torch_files = {p.name for p in folder.glob("*.py")} - {"configuration_boost_llama.py"}
    assert torch_files and "modeling_boost_llama.py" not in torch_files
    weights = (folder / "model.safetensors").read_bytes()

    assert main(["export", str(folder), "--refresh-remote-code"]) == 0
    saved = json.loads((folder / "config.json").read_text())
    assert saved["architectures"] == ["BoostLlamaForCausalLM"]
    assert saved["auto_map"]["AutoModelForCausalLM"] == "modeling_boost_llama.BoostLlamaForCausalLM"
    assert {p.name for p in folder.glob("*.py")} == set(remote_code_sources())
    assert (folder / "model.safetensors").read_bytes() == weights
    check_in_a_fresh_environment(tmp_path, {"refreshed": str(folder)})
