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


def _v4_release(tmp_path):
    from harness.deepseek_v4_release import write_release
    model = build_model("deepseek-v4", seed=7).to(torch.bfloat16)
    return model, write_release(model, tmp_path / "release", block=BLOCK)


def _assert_same_bytes(written: dict, original: dict, names) -> None:
    for name in names:
        assert written[name].dtype == original[name].dtype and written[name].shape == original[name].shape, name
        assert written[name].view(torch.uint8).equal(original[name].view(torch.uint8)), name


def test_deepseek_v4_release_written_back_in_its_own_format_byte_for_byte(tmp_path, capsys):
    """A DeepSeek-V4 release (its names, FP8 with E8M0 ``.scale``, FP4 experts, ``mtp.0``) read into the universal
    form and written back with to-hf --like it --quantize fp8, or straight from it with --mtp keep, is every tensor of
    the release, name, dtype and byte (scales and the MTP layer included), and its quantization_config. DeepSeek's
    rule alone would not do: some tiles (FP8 and FP4) were written at twice the scale their values need, which the
    release's own scales give back."""
    import json

    from deepspeed_ext.checkpoint import quantization as q
    from deepspeed_ext.cli import main
    _, release = _v4_release(tmp_path)
    raw = read_files(release)
    cli("from-hf", str(release), "-o", str(tmp_path / "u"), "--mtp", "drop")
    capsys.readouterr()
    assert main(["to-hf", str(tmp_path / "u"), "-o", str(tmp_path / "refused"), "--like", str(release), "--quantize",
                 "fp8", "-q"]) == 2  # the default tile, 128x128, is not this release's
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--fp8-block 16x16" in error, error
    assert not (tmp_path / "refused").exists()
    cli("to-hf", str(tmp_path / "u"), "-o", str(tmp_path / "back"), "--like", str(release), "--quantize", "fp8",
        "--fp8-block", "16x16")
    cli("to-hf", str(release), "-o", str(tmp_path / "kept"), "--mtp", "keep", "--quantize", "fp8", "--fp8-block",
        "16x16")
    config = json.loads((release / "config.json").read_text())["quantization_config"]
    for out in ("back", "kept"):
        written = read_files(tmp_path / out)
        assert sorted(written) == sorted(raw), out
        _assert_same_bytes(written, raw, raw)
        assert json.loads((tmp_path / out / "config.json").read_text())["quantization_config"] == config

    scales = {name: name[:-len(".weight")] + ".scale" for name, tensor in raw.items()
              if tensor.dtype in (q.FP8_DTYPE, torch.int8)}
    other_scale = {q.FP8: 0, q.FP4: 0}
    for name, scale in scales.items():
        element, block = (q.FP4, (1, 32)) if raw[name].dtype == torch.int8 else (q.FP8, BLOCK)
        exponents = raw[scale].view(torch.uint8)
        values = raw[name].float() if element == q.FP8 else q.unpack_e2m1(raw[name].view(torch.uint8))
        dequantized = q.fp8_dequantize(values, exponents, block)
        stored, by_rule = q.quantize_pow2(dequantized, element, block)
        again = stored.float() if element == q.FP8 else q.e2m1_values(stored)
        assert torch.equal(q.fp8_dequantize(again, by_rule, block), dequantized), name
        assert bool((by_rule <= exponents).all()), name  # where they differ, the release's is the larger scale
        other_scale[element] += int((by_rule != exponents).sum())
    assert min(other_scale.values()) > 0, other_scale
    assert any(name.startswith("mtp.") for name in scales)


def test_deepseek_v4_rule_gives_transformers_and_deepseeks_bytes():
    """The power-of-two quantizer equals transformers' ``ue8m0`` FP8 quantizer byte for byte (values and scales),
    and the reference FP4 quantizer of DeepSeek's rule, on bf16 weights spanning 2^-20 .. 2^4, with all-zero tiles
    and partial ones (FP8 at the edges, as DeepSeek's format has them)."""
    from deepspeed_ext.checkpoint import quantization as q
    from harness.deepseek_v4_release import _fp8, fp4_reference
    generator = torch.Generator().manual_seed(3)
    spread = torch.exp2(torch.randint(-20, 5, (256, 1), generator=generator).float())
    weight = (torch.randn(256, 512, generator=generator) * spread).to(torch.bfloat16)
    weight[:16, :16] = 0
    theirs = _fp8("w.weight", weight, BLOCK)
    values, exponents = q.quantize_pow2(weight, q.FP8, BLOCK)
    assert values.view(torch.uint8).equal(theirs["w.weight"].view(torch.uint8))
    assert exponents.equal(theirs["w.scale"].view(torch.uint8))
    packed, scales = fp4_reference(weight)
    codes, exponents = q.quantize_pow2(weight, q.FP4, (1, 32))
    assert q.pack_e2m1(codes).view(torch.int8).equal(packed) and exponents.equal(scales.view(torch.uint8))
    edge = weight[:250, :500]  # partial tiles: the rule per tile over the values there are
    values, exponents = q.quantize_pow2(edge, q.FP8, BLOCK)
    full_values, full_exponents = q.quantize_pow2(torch.nn.functional.pad(edge, (0, 12, 0, 6)), q.FP8, BLOCK)
    assert values.view(torch.uint8).equal(full_values[:250, :500].view(torch.uint8))
    assert exponents.equal(full_exponents)


def test_a_model_trained_from_a_deepseek_v4_release_is_written_in_its_format(tmp_path):
    """Changed weights written --like the release --quantize fp8: the release's names, dtypes and shapes, its MTP
    layer byte for byte, and transformers loads the model to the values quantization gives, the same as it loads
    the weights quantized by transformers' own FP8 quantizer and DeepSeek's FP4 rule (the harness's release of the
    changed model)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    from deepspeed_ext.checkpoint.hf import HFCheckpoint
    from harness.deepseek_v4_release import write_release
    from harness.hf import save_pretrained
    _, release = _v4_release(tmp_path)
    trained = build_model("deepseek-v4", seed=7).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for parameter in trained.parameters():
            if parameter.is_floating_point():
                spread = parameter.float().std() if parameter.numel() > 1 else parameter.float().abs()
                noise = torch.randn(parameter.shape, generator=generator) * spread.clamp(min=1e-3) * 0.1
                parameter.add_(noise.to(parameter.dtype))
    save_pretrained(trained, tmp_path / "trained")
    cli("to-hf", str(tmp_path / "trained"), "-o", str(tmp_path / "out"), "--like", str(release), "--quantize",
        "fp8", "--fp8-block", "16x16")
    raw, written = read_files(release), read_files(tmp_path / "out")
    assert sorted(written) == sorted(raw)
    assert all(written[n].dtype == t.dtype and written[n].shape == t.shape for n, t in raw.items())
    _assert_same_bytes(written, raw, [name for name in raw if name.startswith("mtp.")])
    changed = [n for n, t in raw.items() if not n.startswith("mtp.") and not written[n].view(torch.uint8).equal(
        t.view(torch.uint8))]
    assert any(raw[n].dtype == torch.int8 for n in changed) and any(raw[n].dtype == torch.float8_e4m3fn
                                                                    for n in changed)

    expected = write_release(trained, tmp_path / "expected", block=BLOCK)
    dequantize = FineGrainedFP8Config(dequantize=True)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", quantization_config=dequantize,
                                                  dtype=torch.float32).state_dict()
    wanted = AutoModelForCausalLM.from_pretrained(expected, quantization_config=dequantize,
                                                  dtype=torch.float32).state_dict()
    assert sorted(loaded) == sorted(wanted)
    for name, tensor in wanted.items():
        assert torch.equal(loaded[name], tensor), name
    ours = {t.name: t.load_tensor() for t in HFCheckpoint(tmp_path / "out", mtp="drop").tensors()}
    assert all(torch.equal(tensor.to(loaded[name].dtype), loaded[name]) for name, tensor in ours.items())
