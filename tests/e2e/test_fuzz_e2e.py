"""Fuzz: damaged files of a real DeepSpeed TP=2 engine checkpoint, saved through deepspeed-ext (so its commit
marker lists every file but itself): every change to a listed file is detected by the read (the converters' check)
and by ``verify``; damage to the marker is detected or touches nothing a reader uses (see tests/unit/test_fuzz.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from harness.fuzz import FUZZ, damage
from harness.fuzz import fuzz as _fuzz  # test bodies unchanged: derandomized hypothesis seeds from them


@FUZZ
@given(choice=st.integers(0, 10**6), spec=damage())
def test_damaged_deepspeed_files_raise_only_our_errors(scenarios, tmp_path, choice, spec):
    tp2 = scenarios("tp2_zero1_bf16", tp=2)
    _fuzz(tp2.tag_dir, tmp_path / "deepspeed", choice, spec)
