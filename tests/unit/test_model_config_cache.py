"""What transformers says about a model config (its files, its model's parameters) is kept between commands
(``DEEPSPEED_EXT_CACHE_DIR``): a later command reads it without importing transformers, a damaged or unwritable
cache costs only time, and a wrong config is refused the same way from the cache as from transformers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from deepspeed_ext.checkpoint.model_config import CACHE_DIR_ENV, ConfigFit, config_facts, hf_config
from deepspeed_ext.errors import CheckpointError

CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96, "tie_word_embeddings": False}


def _entries(cache):
    return sorted((cache / "model-configs").glob("*.json"))


def _transformers_files(tmp_path, dtype):
    """config.json and generation_config.json as transformers' own save_pretrained writes them."""
    from transformers import GenerationConfig
    config = hf_config(CONFIG, dtype, "test")
    config.save_pretrained(tmp_path / "reference")
    GenerationConfig.from_model_config(config).save_pretrained(tmp_path / "reference")
    return ((tmp_path / "reference" / "config.json").read_text(),
            (tmp_path / "reference" / "generation_config.json").read_text())


def test_the_facts_are_transformers_own_and_a_later_command_reads_them_without_transformers(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv(CACHE_DIR_ENV, str(cache))
    facts = config_facts(CONFIG, torch.bfloat16, "test")
    assert (facts.config_json, facts.generation_config_json) == _transformers_files(tmp_path, torch.bfloat16)
    assert facts.config_class == "LlamaConfig" and facts.parameters["model.layers.1.mlp.down_proj.weight"] == (64, 160)
    (entry, ) = _entries(cache)
    assert config_facts(CONFIG, torch.bfloat16, "test") == facts
    # Another dtype is another entry (config.json names the dtype).
    assert config_facts(CONFIG, torch.float32, "test").config_json != facts.config_json
    assert len(_entries(cache)) == 2

    # A fresh process in which transformers cannot be imported at all gets the same facts from the cache.
    script = ("import sys, json, torch; sys.modules['transformers'] = None\n"
              "from deepspeed_ext.checkpoint.model_config import ConfigFit\n"
              f"config = json.loads({json.dumps(json.dumps(CONFIG))})\n"
              "fit = ConfigFit(config, {'model.embed_tokens.weight': (96, 64)}, 'src', torch.bfloat16)\n"
              "try:\n    fit.result()\nexcept Exception as exc:\n    print(exc)\n"
              "shapes = {name: tuple(shape) for name, shape in json.loads(sys.argv[1]).items()}\n"
              "fit = ConfigFit(config, shapes, 'src', torch.bfloat16)\n"
              "print(fit.result().config_class, sys.modules.get('transformers') is not None)\n")
    shapes = json.dumps({name: list(shape) for name, shape in facts.parameters.items()})
    proc = subprocess.run([sys.executable, "-c", script, shapes], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", CACHE_DIR_ENV: str(cache)})
    assert proc.returncode == 0, proc.stderr
    refused, fitted = proc.stdout.strip().splitlines()
    assert refused.startswith("src: parameters do not fit LlamaConfig's model (missing [") and \
        refused.endswith("; wrong --config?")
    assert fitted == "LlamaConfig False"


def test_a_wrong_config_is_refused_alike_from_transformers_and_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    shapes = dict(config_facts(CONFIG, None, "src").parameters)
    shapes["model.layers.0.mlp.down_proj.weight"] = (64, 96)
    messages = []
    for cache in ("off", str(tmp_path / "cache")):
        monkeypatch.setenv(CACHE_DIR_ENV, cache)
        with pytest.raises(CheckpointError) as refused:
            ConfigFit(CONFIG, shapes, "src").result()
        messages.append(str(refused.value))
    assert messages[0] == messages[1] == ("src: parameters do not fit LlamaConfig's model (model.layers.0.mlp.down_proj"
                                          ".weight is [64, 96], the config says [64, 160]); wrong --config?")


@pytest.mark.parametrize("damage", ["torn", "not-an-entry", "wrong-types"])
def test_a_damaged_entry_is_found_again_and_rewritten(tmp_path, monkeypatch, damage):
    cache = tmp_path / "cache"
    monkeypatch.setenv(CACHE_DIR_ENV, str(cache))
    facts = config_facts(CONFIG, None, "src")
    (entry, ) = _entries(cache)
    text = entry.read_text()
    entry.write_text({"torn": text[:len(text) // 2], "not-an-entry": "[1, 2]",
                      "wrong-types": json.dumps({**json.loads(text), "parameters": {"a": "b"}})}[damage])
    assert config_facts(CONFIG, None, "src") == facts
    assert json.loads(entry.read_text()) == json.loads(text)


def test_a_cache_that_cannot_be_written_or_is_off_costs_only_time(tmp_path, monkeypatch):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(CACHE_DIR_ENV, str(blocked))  # the cache's directory cannot be made under a file
    facts = config_facts(CONFIG, None, "src")
    monkeypatch.setenv(CACHE_DIR_ENV, "off")
    assert config_facts(CONFIG, None, "src") == facts
    assert blocked.read_text() == "" and not (tmp_path / "off").exists()
