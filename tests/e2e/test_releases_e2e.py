"""Training from a release: block-FP8 Llama and DeepSeek-V3, MXFP4 gpt-oss and multimodal Gemma 3 -> from-hf ->
DeepSpeed AutoTP TP=2, whose first-step loss is transformers' loss on the dequantized model; and to-maxtext on
the FP8 / MXFP4 releases, whose MaxText forward (MaxText's own model code) gives transformers' logits. The
format details are in tests/unit/test_releases.py."""

from __future__ import annotations

import pytest
import torch

from deepspeed_ext.demo.models import batch, build_model
from harness import releases
from harness.hf import cli
from harness.maxtext import hf_model, max_kl, maxtext_logits, torch_logits
from harness.runner import read_losses, torchrun_train_runs


def _dequantized_model(release, family):
    """transformers' model of the release as it loads it dequantized (DeepSeek-V3's partial tiles, which
    transformers 5.22 misreads, set from the format's own rule)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config, Mxfp4Config
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    config = Mxfp4Config(dequantize=True) if family == "gpt-oss" else FineGrainedFP8Config(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(release, quantization_config=config, dtype=torch.float32,
                                                 attn_implementation="eager").float().eval()
    if family == "deepseek-v3":
        from harness.hf import read_files
        raw = read_files(release)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name in raw and raw[name].dtype == torch.float8_e4m3fn and raw[name].shape[0] % 16:
                    param.copy_(_dequantize_fp8_weight(raw[name], raw[name + "_scale_inv"], [16, 16], torch.float32))
    return model


def test_training_starts_from_releases_at_tp2(tmp_path):
    """One pooled TP=2 run per release (fp32): the first step's loss equals transformers' on the dequantized model
    (multimodal Gemma 3: its text model's), and the loss falls."""
    releases_made, expected = {}, {}
    tokens = batch(1, 0, 1)
    for family in ("llama", "deepseek-v3", "gpt-oss"):
        model = build_model(family, seed=7).to(torch.bfloat16)
        directory = tmp_path / f"{family}_release"
        if family == "gpt-oss":
            releases.write_mxfp4(model, directory)
        else:
            releases.write_fp8(model, directory, edge_tiles=family == "deepseek-v3")
        if family == "deepseek-v3":
            releases.add_mtp_layer(directory, model.config)
        with torch.no_grad():
            expected[family] = _dequantized_model(directory, family)(input_ids=tokens, labels=tokens).loss.item()
        releases_made[family] = directory
    multimodal = releases.gemma3_multimodal()
    releases_made["gemma3"] = releases.write_multimodal(multimodal.to(torch.bfloat16), tmp_path / "gemma3_release",
                                                        "new")
    from transformers import Gemma3ForCausalLM
    text_model = Gemma3ForCausalLM(multimodal.config.text_config).eval()  # the text model the release holds
    text_model.model.load_state_dict(multimodal.model.language_model.state_dict())
    text_model.tie_weights()
    with torch.no_grad():
        expected["gemma3"] = text_model.float()(input_ids=tokens, labels=tokens).loss.item()
    runs, results = [], {}
    for family, directory in releases_made.items():
        universal = tmp_path / f"{family}_universal"
        cli("from-hf", str(directory), "-o", str(universal), "--dtype", "float32",
            *(["--mtp", "drop"] if family == "deepseek-v3" else []))
        results[family] = tmp_path / f"{family}.json"
        runs.append(["--tp", "2", "--dtype", "fp32", "--family", family, "--steps", "2", "--load-dir",
                     str(universal), "--result", str(results[family])])
    torchrun_train_runs(2, runs, tmp_path / "train.log")
    for family, result in results.items():
        losses = read_losses(result)
        print(f"{family}: transformers loss on the dequantized release {expected[family]:.7f}, DeepSpeed TP=2 "
              f"first step {losses[1]:.7f}, second {losses[2]:.7f}")
        assert losses[1] == pytest.approx(expected[family], rel=1e-6), family
        assert losses[2] < losses[1], family


@pytest.mark.parametrize("family", ["llama", "gpt-oss"])
def test_maxtext_forward_on_a_release(family, tmp_path):
    """FP8 Llama / MXFP4 gpt-oss -> to-maxtext (fp32) -> MaxText's forward == transformers' on the dequantized
    model (per-token KL, argmax)."""
    model = hf_model(family).to(torch.bfloat16)
    release = tmp_path / "release"
    if family == "gpt-oss":
        releases.write_mxfp4(model, release)
    else:
        releases.write_fp8(model, release)
    dequantized = _dequantized_model(release, family)
    cli("to-maxtext", str(release), "-o", str(tmp_path / "maxtext"), "--dtype", "float32")
    logits = maxtext_logits(tmp_path / "maxtext" / "0" / "items", dequantized, family, True, tmp_path)
    reference = torch_logits(dequantized)
    kl = max_kl(reference, logits)
    print(f"{family} release: MaxText vs transformers (dequantized) max per-token KL {kl:.2e}")
    assert kl <= 1e-4
    assert (reference.argmax(-1).numpy() == logits.argmax(-1)).all()
