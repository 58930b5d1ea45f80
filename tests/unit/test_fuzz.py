"""Fuzz: damaged checkpoint files are detected, or the damage is of a class no reader can detect.

Each example copies a small, valid checkpoint (HF safetensors as transformers writes them, a universal and a
MaxText output of deepspeed-ext; a real DeepSpeed TP=2 engine checkpoint in tests/e2e/test_fuzz_e2e.py), damages
one file (truncation, a flipped bit, a renamed key), reads it as the converters do (every state of every tensor,
then their checksum check) and checks it with ``verify``. Readers and ``verify`` may raise only a
DeepSpeedExtError naming the file; a change to a file a manifest or commit marker lists must be detected; damage
that goes undetected passes only if the harness shows it to be one of the named classes no reader can detect
(unread bytes, a tensor's bytes or a JSON value in a file nothing checksums: tests/harness/fuzz.py,
UNDETECTABLE). Anything else fails, naming the file and the damage.

Quick mode runs in the suite; ``python bench/fuzz.py`` runs the long mode (DEEPSPEED_EXT_FUZZ_EXAMPLES) and counts
the outcomes.
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

