"""The final folder of a run is publishable: model card with Hub metadata, inference settings, tokenizer
context and special tokens consistent with how training packed documents, remote code."""

from __future__ import annotations

import json

import yaml


def test_final_folder_holds_a_hub_repo(trained_run):
    trainer, final = trained_run
    import os
    names = set(os.listdir(final))
    assert {"config.json", "generation_config.json", "model.safetensors", "README.md", "configuration_boost_llama.py",
            "modeling_boost_llama.py", "tokenizer.json", "tokenizer_config.json", "manifest.json"} <= names, names
    print(open(os.path.join(final, "README.md")).read())
    print(json.load(open(os.path.join(final, "config.json"))))
    print(json.load(open(os.path.join(final, "tokenizer_config.json"))))
