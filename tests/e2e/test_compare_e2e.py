"""``deepspeed-ext compare`` on real engine checkpoints: a DeepSpeed checkpoint equals each of its conversions
(universal, HF, MaxText with Adam moments and back), moments and steps included where both sides have them."""

from __future__ import annotations

import json

import pytest

from harness.runner import cli


@pytest.fixture(scope="module")
def converted(scenarios, tmp_path_factory):
    scenario = scenarios("tp2_zero1_bf16", tp=2)
    root = tmp_path_factory.mktemp("compare")
    log = root / "convert.log"
    cli(["to-hf", str(scenario.save_dir), "-o", str(root / "hf"), "-q"], log)
    cli(["to-maxtext", str(scenario.save_dir), "-o", str(root / "maxtext"), "--with-optimizer", "-q"], log)
    cli(["to-maxtext", str(scenario.save_dir), "-o", str(root / "maxtext32"), "--with-optimizer", "--dtype",
         "float32", "-q"], log)
    cli(["from-maxtext", str(root / "maxtext32"), "-o", str(root / "back"), "-q"], log)
    return scenario, root


def _compare(a, b, log, *extra: str) -> dict:
    proc = cli(["compare", str(a), str(b), "--json", "-q", *extra], log, check=False)
    report = json.loads(proc.stdout)
    assert proc.returncode == (0 if report["ok"] else 1), proc.stderr[-2000:]
    return report


@pytest.mark.parametrize("other, states", [("universal", 4), ("hf", 1), ("maxtext", 4), ("maxtext32", 4),
                                           ("back", 4)])
def test_a_deepspeed_checkpoint_equals_each_conversion(converted, tmp_path, other, states):
    scenario, root = converted
    target = scenario.universal_dir if other == "universal" else root / other
    report = _compare(scenario.tag_dir, target, tmp_path / "compare.log")
    assert report["ok"] and report["beyond"] == 0, [s for s in report["states"] if not s["ok"]][:3]
    tensors = len(json.loads((scenario.tag_dir / "deepspeed_ext.json").read_text())["params"])
    assert report["compared"] == states * tensors
    exact = {s["precision"] for s in report["states"] if s["state"] == "fp32"}
    # The fp32 masters against fp32 files are compared in fp32; HF and MaxText's bf16 weights in bf16.
    assert exact == ({"bfloat16"} if other in ("hf", "maxtext") else {"float32"})


def test_a_zero3_checkpoint_equals_its_universal_form(scenarios, tmp_path):
    zero3 = scenarios("tp2_dp2_zero3_bf16", tp=2, dp=2, zero=3)
    report = _compare(zero3.tag_dir, zero3.universal_dir, tmp_path / "compare.log")
    assert report["ok"] and report["compared"] > 0 and all(s["max_ulp"] == 0 for s in report["states"])


def test_logits_of_a_deepspeed_checkpoint_and_its_hf_form(converted, tmp_path):
    scenario, root = converted
    report = _compare(scenario.tag_dir, root / "hf", tmp_path / "compare.log", "--logits")
    # The fp32 masters against the bf16 weights written from them: the same tokens win.
    assert report["logits"]["argmax_agreement"] >= 0.9 and report["logits"]["max_kl"] < 1e-2
