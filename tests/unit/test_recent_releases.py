"""The 2025-26 families as their releases ship them: block FP8 (DeepSeek-V3.2, GLM-5, GLM-4.5, Qwen3.5 / Qwen3-Next
FP8, MiniMax-M2, Llama 4 Maverick FP8), with the experts one by one as the files hold them, read as transformers
dequantizes them and written back byte for byte; the multi-token-prediction layer past the decoder of the releases
that have one (DeepSeek-V3.2, GLM-5, GLM-4.5), read only when asked for, as DeepSeek-V3's. Families from the
registry (harness.families.RECENT). DeepSeek-V4 also in its own release format (its names, E8M0 scales, FP4 experts,
``mtp.<i>`` layers)."""

from __future__ import annotations

import pytest
import torch

from deepspeed_ext.api import open_checkpoint
from deepspeed_ext.demo.models import build_model
from harness import releases
from harness.families import RECENT
from harness.hf import cli, read_files

BLOCK = (16, 16)
#: The families whose releases put a multi-token-prediction layer past num_hidden_layers.
WITH_MTP = {"deepseek-v3.2", "glm-5", "glm-4.5"}


@pytest.mark.parametrize("family", RECENT)
def test_fp8_release_reads_as_transformers_dequantizes_and_writes_back_byte_for_byte(family, tmp_path):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    model = build_model(family, seed=7).to(torch.bfloat16)
    release = releases.write_fp8(model, tmp_path / "release", block=BLOCK)
    raw = read_files(release)
    quantized = [name for name, tensor in raw.items() if tensor.dtype == torch.float8_e4m3fn]
    assert quantized, "the tiny model should have whole FP8 tiles"
    ours = {t.name: t.load_tensor() for t in open_checkpoint(release).tensors()}
    theirs = AutoModelForCausalLM.from_pretrained(release, quantization_config=FineGrainedFP8Config(dequantize=True),
                                                  dtype=torch.float32).state_dict()
    assert set(ours) <= set(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor.float(), theirs[name]), name
    cli("to-hf", str(release), "-o", str(tmp_path / "back"), "--quantize", "fp8", "--fp8-block", "16x16")
    written = read_files(tmp_path / "back")
    assert sorted(written) == sorted(raw)
    for name, tensor in raw.items():
        assert written[name].dtype == tensor.dtype and written[name].view(torch.uint8).equal(
            tensor.view(torch.uint8)), name


@pytest.mark.parametrize("family", sorted(WITH_MTP))
def test_the_mtp_layer_of_a_release_is_an_explicit_choice(family, tmp_path, capsys):
    """A release with its MTP layer (FP8, partial tiles at the edges, as DeepSeek's format has them): from-hf refuses
    in one line naming --mtp; with --mtp drop it converts, and to-hf --like the release writes the release's files
    back byte for byte (the trained decoder, the MTP layer copied)."""
    from deepspeed_ext.cli import main
    model = build_model(family, seed=7).to(torch.bfloat16)
    release = releases.write_fp8(model, tmp_path / "release", block=BLOCK, edge_tiles=True)
    extra = releases.add_mtp_layer(release, model.config, block=BLOCK)
    layer = f"model.layers.{model.config.num_hidden_layers}."
    capsys.readouterr()
    assert main(["from-hf", str(release), "-o", str(tmp_path / "refused"), "-q"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"{layer}*" in error and "--mtp drop" in error, error
    assert not (tmp_path / "refused").exists()
    cli("from-hf", str(release), "-o", str(tmp_path / "u"), "--mtp", "drop")
    cli("to-hf", str(tmp_path / "u"), "-o", str(tmp_path / "back"), "--like", str(release), "--quantize", "fp8",
        "--fp8-block", "16x16", "--fp8-edge-tiles")
    original, written = read_files(release), read_files(tmp_path / "back")
    assert sorted(written) == sorted(original) and set(extra) <= set(written)
    assert all(written[n].dtype == t.dtype and written[n].view(torch.uint8).equal(t.view(torch.uint8))
               for n, t in original.items())


def test_deepseek_v4_release_reads_as_transformers_dequantizes_and_goes_back_to_hf(tmp_path, capsys, caplog):
    """DeepSeek-V4 as its release ships it (harness.deepseek_v4_release: the release's names, FP8 with E8M0 ``.scale``
    tensors, FP4 experts, the MTP layer under ``mtp.0``): from-hf refuses the MTP layer in one line naming --mtp;
    read with --mtp drop, every tensor is what transformers dequantizes (the hash-routing table in int64);
    from-hf -> to-hf writes save_pretrained's names, which transformers loads without complaint to the same
    model; to-hf --mtp keep writes the release's names back, the MTP layer with them."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    from deepspeed_ext.checkpoint.hf import HFCheckpoint
    from deepspeed_ext.cli import main
    from harness.deepseek_v4_release import write_release
    from harness.hf import load_hf
    model = build_model("deepseek-v4", seed=7).to(torch.bfloat16)
    release = write_release(model, tmp_path / "release", block=BLOCK)
    raw = read_files(release)
    assert {tensor.dtype for tensor in raw.values()} >= {torch.float8_e4m3fn, torch.int8, torch.float8_e8m0fnu}
    capsys.readouterr()
    assert main(["from-hf", str(release), "-o", str(tmp_path / "refused"), "-q"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "mtp.0.*" in error and "--mtp drop" in error, error
    ours = {t.name: t.load_tensor() for t in HFCheckpoint(release, mtp="drop").tensors()}
    theirs = AutoModelForCausalLM.from_pretrained(release, quantization_config=FineGrainedFP8Config(dequantize=True),
                                                  dtype=torch.float32).state_dict()
    assert sorted(ours) == sorted(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor.to(theirs[name].dtype), theirs[name]), name
    assert ours["model.layers.0.mlp.gate.tid2eid"].dtype == torch.int64

    cli("from-hf", str(release), "-o", str(tmp_path / "u"), "--mtp", "drop")
    cli("to-hf", str(tmp_path / "u"), "-o", str(tmp_path / "hf"))
    loaded = load_hf(tmp_path / "hf", caplog).state_dict()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in ours.items())

    cli("to-hf", str(release), "-o", str(tmp_path / "kept"), "--mtp", "keep")
    written = read_files(tmp_path / "kept")
    assert sorted(written) == sorted(name for name in raw if not name.endswith(".scale"))
    dequantized = HFCheckpoint(release, mtp="keep")
    for name in (name for name in written if name.startswith("mtp.")):
        assert torch.equal(written[name], dequantized.read_stored_tensor(name)), name
    loaded = load_hf(tmp_path / "kept", caplog).state_dict()  # transformers reads the release's names, skips mtp.*
    assert all(torch.equal(loaded[name], tensor) for name, tensor in ours.items())
