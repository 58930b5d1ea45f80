"""Helpers shared by tests/unit/test_hf.py and tests/e2e/test_hf_e2e.py: the CLI in this process, safetensors
files read back, and models saved and loaded as transformers does."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open

from deepspeed_ext.cli import main

SHARD = "30KB"  # tiny models: several shards each


def cli(*args: str) -> None:
    assert main([*args, "--quiet"]) == 0, args


def read_files(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in ``directory``, read by the safetensors library."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():
                assert name not in tensors, f"{name} in two files"
                tensors[name] = handle.get_tensor(name)
    return tensors


def load_hf(directory: Path, caplog) -> torch.nn.Module:
    """``from_pretrained``, asserting that transformers found no missing, unexpected or mismatched keys."""
    from transformers import AutoModelForCausalLM
    with caplog.at_level(logging.WARNING):
        model, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True,
                                                           attn_implementation="eager")
    assert not any(info.values()), info
    complaints = [r.getMessage() for r in caplog.records if any(
        word in r.getMessage().lower() for word in ("missing", "unexpected", "not initialized", "mismatch"))]
    assert not complaints, complaints
    return model.eval()


def save_pretrained(model: torch.nn.Module, directory: Path) -> None:
    model.save_pretrained(directory, max_shard_size=SHARD)
    assert (directory / "model.safetensors.index.json").is_file()  # sharded, as real checkpoints are
