"""The Hugging Face bridge with the DeepSpeed engine (TP=2 training -> to-hf; from-hf -> TP=2 training), and
from-hf in a subprocess. The rest is in tests/unit/test_hf.py."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors import safe_open

from deepspeed_ext.cli import main
from deepspeed_ext.demo.models import batch, build_model
from harness.cli import universal_in
from harness.hf import assert_to_hf_matches_live, cli, read_files, save_pretrained
from harness.runner import read_losses, torchrun_train
from harness.scenario import KV2_SCENARIOS


def test_from_hf_reads_lazily_and_builds_no_model(tmp_path):
    """from-hf imports no transformers modelling code, and a tied lm_head in the files is checked and left out."""
    model = build_model("qwen3", seed=3)
    save_pretrained(model, tmp_path / "hf")
    # Some exporters write the tied head anyway: it must equal the embedding and becomes no parameter.
    shard = sorted((tmp_path / "hf").glob("*.safetensors"))[0]
    from safetensors.torch import save_file
    save_file({"lm_head.weight": model.lm_head.weight.detach().clone()}, tmp_path / "hf" / "extra.safetensors")
    index_path = tmp_path / "hf" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["lm_head.weight"] = "extra.safetensors"
    index_path.write_text(json.dumps(index))
    code = ("import sys; from deepspeed_ext.cli import main; rc = main(sys.argv[1:]); "
            "assert 'transformers.modeling_utils' not in sys.modules, 'a transformers model was built'; "
            "sys.exit(rc)")
    subprocess.run([sys.executable, "-c", code, "from-hf", str(tmp_path / "hf"), "-o", str(tmp_path / "u"), "-q"],
                   check=True)
    zero = universal_in(tmp_path / "u") / "zero"
    assert (zero / "model.embed_tokens.weight").is_dir() and not (zero / "lm_head.weight").exists()
    assert shard.is_file()

    with safe_open(str(tmp_path / "hf" / "extra.safetensors"), "pt") as handle:
        head = handle.get_tensor("lm_head.weight")
    save_file({"lm_head.weight": head + 1}, tmp_path / "hf" / "extra.safetensors")
    assert main(["from-hf", str(tmp_path / "hf"), "-o", str(tmp_path / "u2"), "-q"]) == 2
    assert not (tmp_path / "u2").exists()


# --------------------------------------------------------------------------- with the DeepSpeed engine
LIVE = [("tp2_zero1_fp32", dict(tp=2, dtype="fp32")), ("tp2_zero1_bf16", dict(tp=2)),
        ("qwen2_tp2", dict(tp=2, family="qwen2")), ("qwen3_tied_tp2", dict(tp=2, family="qwen3")),
        ("qwen3_moe_tp2", dict(tp=2, family="qwen3_moe")), ("tp2_dp2_zero3_bf16", dict(tp=2, dp=2, zero=3)),
        # TP=3 with 2 KV heads: rank 2 holds empty attention shards
        ("kv2_llama_tp3", KV2_SCENARIOS["kv2_llama_tp3"]), ("kv2_qwen3_tp3", KV2_SCENARIOS["kv2_qwen3_tp3"])]


@pytest.mark.parametrize("name, kwargs", LIVE, ids=[name for name, _ in LIVE])
def test_deepspeed_tp2_to_hf_matches_the_live_model(scenarios, tmp_path, caplog, name, kwargs):
    """DeepSpeed TP=2 training -> to-hf (straight from the DeepSpeed checkpoint) -> transformers:

    * every weight, cut into the two TP slices, equals bit for bit what each TP rank's live model held
      (the module weights in its model-states file: bf16 runs keep bf16; ZeRO-3 saves none, so there the
      merged fp32 master cast to bf16, which the ZeRO-3 test files check against the live engine);
    * the logits equal the live TP=2 model's up to the order of TP's partial sums (fp32: 1e-5 absolute,
      bf16: bf16 rounding), with the same argmax almost everywhere.
    """
    assert_to_hf_matches_live(scenarios(name, **kwargs), tmp_path, caplog)


def test_deepspeed_tp2_to_hf_through_universal_is_the_same(scenarios, tmp_path):
    """to-hf from the universal checkpoint writes the same files as to-hf from the DeepSpeed checkpoint."""
    scenario = scenarios("tp2_zero1_bf16", tp=2)
    cli("to-hf", str(scenario.save_dir), "-o", str(tmp_path / "direct"))
    cli("to-hf", str(scenario.universal_dir), "-o", str(tmp_path / "via_universal"))
    direct, via = read_files(tmp_path / "direct"), read_files(tmp_path / "via_universal")
    assert sorted(direct) == sorted(via)
    assert all(direct[n].dtype == torch.bfloat16 and torch.equal(direct[n], via[n]) for n in direct)


@pytest.mark.parametrize("family", ["llama", "qwen3", "deepseek_v3"])
def test_training_starts_from_hf_weights_at_tp2(tmp_path, family):
    """A transformers-saved model -> from-hf -> DeepSpeed AutoTP TP=2 (fp32): the first step's loss is the
    transformers model's loss on the same batch, and training goes on from there. (DeepSeek-V3: its router bias,
    a buffer, comes from the files too: seed 7's, not the one the training script built.)"""
    model = build_model(family, seed=7).eval()  # not train.py's initial weights (seed 1234)
    save_pretrained(model, tmp_path / "hf")
    tokens = batch(1, 0, 1)
    with torch.no_grad():
        expected = model(input_ids=tokens, labels=tokens).loss.item()
    cli("from-hf", str(tmp_path / "hf"), "-o", str(tmp_path / "universal"))
    result = tmp_path / "resume.json"
    torchrun_train(2, ["--tp", "2", "--dtype", "fp32", "--family", family, "--steps", "3", "--load-dir",
                       str(tmp_path / "universal"), "--result", str(result)], tmp_path / "train.log")
    losses = read_losses(result)
    print(f"{family}: transformers loss {expected:.7f}, DeepSpeed TP=2 first-step loss {losses[1]:.7f}; "
          f"steps 2, 3: {losses[2]:.5f}, {losses[3]:.5f}")
    assert sorted(losses) == [1, 2, 3]
    assert losses[1] == pytest.approx(expected, rel=1e-6)
    untouched = build_model(family)  # what a load that did nothing would have trained from
    with torch.no_grad():
        assert abs(untouched(input_ids=tokens, labels=tokens).loss.item() - expected) > 1e-3
    assert np.isfinite(losses[3]) and losses[3] < losses[1]
