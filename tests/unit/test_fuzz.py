"""Fuzz: damaged checkpoint files make the readers raise only deepspeed-ext's documented errors.

Each example copies a small, valid checkpoint (HF safetensors, universal, a real DeepSpeed TP=2 engine
checkpoint), damages one file (truncation, a flipped bit, a renamed key), and reads everything: the source is
opened as the CLI opens it and every state of every tensor is loaded. The only acceptable outcomes are
success (the damage hit bytes nothing reads, or made another valid value) or a DeepSpeedExtError subclass,
whose message names the file. Anything else (a raw library exception, a crash) fails.

Quick mode runs in the suite; ``python bench/fuzz.py`` runs the long mode (DEEPSPEED_EXT_FUZZ_EXAMPLES). The
strategies and the reading are in tests/harness/fuzz.py; the DeepSpeed reader's case (it trains first) is in
tests/e2e/test_fuzz_e2e.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepspeed_ext.demo.models import build_model
from harness.fuzz import FUZZ, damage
from harness.fuzz import fuzz as _fuzz  # test bodies unchanged: derandomized hypothesis seeds from them


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


@pytest.fixture(scope="module")
def maxtext(hf_and_universal, tmp_path_factory) -> Path:
    """A MaxText (Orbax, OCDBT + zarr3) checkpoint, from the universal one."""
    from deepspeed_ext.cli import main
    root = tmp_path_factory.mktemp("fuzz_maxtext") / "maxtext"
    assert main(["to-maxtext", str(hf_and_universal[1]), "-o", str(root), "-q"]) == 0
    return root


@FUZZ
@given(choice=st.integers(0, 10**6), spec=damage())
def test_damaged_orbax_files_raise_only_our_errors(maxtext, tmp_path, choice, spec):
    """Truncated or bit-flipped ``_METADATA``, step metadata, OCDBT manifests and data files."""
    _fuzz(maxtext, tmp_path / "maxtext", choice, spec)

