"""Fuzz: damaged checkpoint files make the readers raise only deepspeed-ext's documented errors.

Each example copies a small, valid checkpoint (HF safetensors, universal, a real DeepSpeed TP=2 engine
checkpoint), damages one file (truncation, a flipped bit, a renamed key), and reads everything: the source is
opened as the CLI opens it and every state of every tensor is loaded. The only acceptable outcomes are
success (the damage hit bytes nothing reads, or made another valid value) or a DeepSpeedExtError subclass,
whose message names the file. Anything else (a raw library exception, a crash) fails.

Quick mode runs in the suite; ``python bench/fuzz.py`` runs the long mode (DEEPSPEED_EXT_FUZZ_EXAMPLES).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepspeed_ext.checkpoint.formats import open_checkpoint
from deepspeed_ext.demo.models import build_model
from deepspeed_ext.errors import DeepSpeedExtError

EXAMPLES = int(os.environ.get("DEEPSPEED_EXT_FUZZ_EXAMPLES", "25"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 25,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

#: Keys the readers look up, renamed in place (same length, so offsets in the file stay valid).
KEYS = [b"param", b"exp_avg", b"single_partition_of_fp32_groups", b"param_slice_mappings", b"dtype", b"shape",
        b"data_offsets", b"global_steps", b"mp_world_size", b"base_optimizer_state", b"param_shapes"]


@st.composite
def damage(draw):
    kind = draw(st.sampled_from(["truncate", "flip", "rename"]))
    return kind, draw(st.integers(0, 10**9)), draw(st.integers(0, 7)), draw(st.sampled_from(KEYS))


def _damage(root: Path, choice: int, spec) -> Path:
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".pt", ".safetensors", ".json"))
    target = files[choice % len(files)]
    kind, where, bit, key = spec
    data = bytearray(target.read_bytes())
    if kind == "truncate":
        data = data[:where % max(len(data), 1)]
    elif kind == "flip" and data:
        data[where % len(data)] ^= 1 << bit
    elif kind == "rename":
        at = data.find(key)
        if at >= 0:
            data[at] = ord("X")
    target.write_bytes(bytes(data))
    return target


def read_everything(path: Path) -> None:
    ckpt = open_checkpoint(path)
    for tensor in ckpt.tensors():
        for state in tensor.states:
            tensor.load(state)


def _fuzz(pristine: Path, scratch: Path, choice: int, spec) -> None:
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(pristine, scratch)
    target = _damage(scratch, choice, spec)
    try:
        read_everything(scratch)
    except DeepSpeedExtError as exc:
        assert str(scratch) in str(exc) or target.name in str(exc), (spec, target, exc)


@pytest.fixture(scope="module")
def hf_and_universal(tmp_path_factory) -> tuple[Path, Path]:
    from deepspeed_ext.cli import main
    root = tmp_path_factory.mktemp("fuzz_sources")
    build_model("llama", seed=11).save_pretrained(root / "hf", max_shard_size="30KB")
    assert main(["from-hf", str(root / "hf"), "-o", str(root / "universal"), "-q"]) == 0
    return root / "hf", root / "universal"


@FUZZ
@given(choice=st.integers(0, 10**6), spec=damage())
def test_damaged_hf_files_raise_only_our_errors(hf_and_universal, tmp_path, choice, spec):
    _fuzz(hf_and_universal[0], tmp_path / "hf", choice, spec)


@FUZZ
@given(choice=st.integers(0, 10**6), spec=damage())
def test_damaged_universal_files_raise_only_our_errors(hf_and_universal, tmp_path, choice, spec):
    _fuzz(hf_and_universal[1], tmp_path / "universal", choice, spec)


@pytest.mark.e2e
@FUZZ
@given(choice=st.integers(0, 10**6), spec=damage())
def test_damaged_deepspeed_files_raise_only_our_errors(scenarios, tmp_path, choice, spec):
    tp2 = scenarios("tp2_zero1_bf16", tp=2)
    _fuzz(tp2.tag_dir, tmp_path / "deepspeed", choice, spec)
