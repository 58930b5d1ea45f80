"""``deepspeed-ext compare``: equal after conversions, a one-ulp change found and named, JSON, --logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from deepspeed_ext.checkpoint.compare import Tolerance, _ulp_distance
from harness.cli import cli_result, make_sources, universal_in


@pytest.fixture(scope="module")
def formats(tmp_path_factory) -> Path:
    """The tiny Llama as HF (sharded), universal (from-hf), HF again (to-hf), MaxText bf16 and fp32."""
    root = make_sources(tmp_path_factory.mktemp("compare"))
    assert cli_result("from-hf", str(root / "hf"), "-o", str(root / "uni"), "-q").returncode == 0
    assert cli_result("to-hf", str(universal_in(root / "uni")), "-o", str(root / "hf2"), "-q").returncode == 0
    assert cli_result("to-maxtext", str(root / "hf"), "-o", str(root / "mt32"), "--dtype", "float32",
                      "-q").returncode == 0
    return root


@pytest.mark.parametrize("a, b", [("hf", "uni"), ("uni", "hf2"), ("hf", "hf2"), ("hf", "maxtext"),
                                  ("uni", "mt32"), ("maxtext", "mt32")])
def test_equal_after_conversions(formats, a, b):
    proc = cli_result("compare", str(formats / a), str(formats / b), "--json", "-q")
    report = json.loads(proc.stdout)
    assert proc.returncode == 0 and report["ok"], proc.stdout[-3000:]
    assert report["compared"] == 21 and report["beyond"] == 0  # the tiny Llama's 21 tensors, weights only
    assert not report["only_in_a"] and not report["only_in_b"]


def test_a_one_ulp_change_to_one_element_is_found_and_named(formats, tmp_path):
    copy = tmp_path / "uni"
    shutil.copytree(formats / "uni", copy)
    target = universal_in(copy) / "zero" / "model.layers.1.mlp.down_proj.weight" / "fp32.pt"
    entry = torch.load(target, weights_only=True)
    flat = entry["param"].view(-1)
    flat[17] = torch.nextafter(flat[17], torch.tensor(float("inf"), dtype=flat.dtype))
    torch.save(entry, target)
    proc = cli_result("compare", str(formats / "uni"), str(copy), "-q")
    assert proc.returncode == 1, proc.stdout
    beyond = [line for line in proc.stdout.splitlines() if line.startswith("BEYOND")]
    assert len(beyond) == 1, proc.stdout
    assert "model.layers.1.mlp.down_proj.weight fp32" in beyond[0] and "max 1 ulp" in beyond[0]
    assert "1 element(s) beyond" in beyond[0] and proc.stdout.rstrip().endswith("DIFFERENT")
    assert cli_result("compare", str(formats / "uni"), str(copy), "--ulp", "1", "-q").returncode == 0
    assert cli_result("compare", str(formats / "uni"), str(copy), "--rtol", "1e-6", "-q").returncode == 0


def test_names_only_one_side_has_are_listed(formats, tmp_path):
    copy = tmp_path / "uni"
    shutil.copytree(formats / "uni", copy)
    # A checkpoint of a model without that parameter (its own record agrees: a directory merely missing from
    # a checkpoint that lists it is refused as damaged, test_reliability.py).
    shutil.rmtree(universal_in(copy) / "zero" / "model.norm.weight")
    record = universal_in(copy) / "deepspeed_ext.json"
    info = json.loads(record.read_text())
    del info["params"]["model.norm.weight"]
    record.write_text(json.dumps(info))
    proc = cli_result("compare", str(formats / "uni"), str(copy), "--json", "-q")
    report = json.loads(proc.stdout)
    assert proc.returncode == 1 and report["only_in_a"] == ["model.norm.weight"] and not report["only_in_b"]


def test_logits(formats):
    proc = cli_result("compare", str(formats / "hf"), str(formats / "maxtext"), "--logits", "--json", "-q")
    logits = json.loads(proc.stdout)["logits"]
    assert proc.returncode == 0 and logits["tokens"] == 32
    # Equal in bf16; MaxText undoes its layout in fp32, so the fp32 logits differ a little.
    assert logits["argmax_agreement"] == 1.0 and logits["max_kl"] < 1e-5


def test_ulp_distance_orders_floats_across_zero():
    x = torch.tensor([1.0, -1.0, 0.0, -0.0, 1.0], dtype=torch.bfloat16)
    y = torch.tensor([1.0078125, -1.0078125, -0.0, 0.0, -1.0], dtype=torch.bfloat16)
    assert _ulp_distance(x, y).tolist() == [1, 1, 0, 0, 2 * 16256]
    assert Tolerance().ulp == 0


def test_bad_tolerances_are_one_line(formats):
    proc = cli_result("compare", str(formats / "hf"), str(formats / "uni"), "--ulp", "-1")
    assert proc.returncode == 2 and "must not be negative" in proc.stderr
