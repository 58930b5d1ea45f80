"""Interoperability with upstream DeepSpeed's own universal checkpointing (the installed 0.19.8), both ways."""

import sys

import pytest

from harness.runner import run_logged
from harness.scenario import assert_losses_continue


@pytest.fixture(scope="module")
def tp2(scenarios):
    return scenarios("tp2_zero1_bf16", tp=2)


def test_our_universal_loads_in_plain_upstream_deepspeed_at_tp3(tp2):
    """deepspeed.initialize + "checkpoint": {"load_universal": true}, no deepspeed-ext at all on resume."""
    upstream = tp2.resume(3, upstream=True)
    assert_losses_continue(tp2, upstream)
    ours = tp2.resume(3)
    # Both loaders put the same bits into the engine, so the continued losses agree to the last digit.
    assert upstream == ours


def test_upstream_ds_to_universal_output_restores_through_deepspeed_ext_at_tp3(tp2, tmp_path):
    out = tmp_path / "upstream_universal"
    run_logged([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tp2.tag_dir),
                "--output_folder", str(out), "--num_extract_workers", "1", "--num_merge_workers", "1"],
               tmp_path / "upstream.log")
    assert (tmp_path / "latest_universal").read_text().strip() == out.name
    assert_losses_continue(tp2, tp2.resume(3, load_dir=tmp_path))


def test_gradient_accumulation_tp2_to_tp3(scenarios):
    ga = scenarios("tp2_zero1_bf16_ga2", tp=2, grad_accum=2)
    assert_losses_continue(ga, ga.resume(3))
