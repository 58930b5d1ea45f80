"""Starting from a release: block-FP8 and MXFP4 checkpoints read as transformers dequantizes them and written back
byte for byte, multimodal Gemma 3 in both namings, DeepSeek-V3's multi-token-prediction layer, and the one-line
refusals. Training from them (DeepSpeed, MaxText's model code): tests/e2e/test_releases_e2e.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepspeed_ext.api import open_checkpoint
from deepspeed_ext.checkpoint import quantization
from deepspeed_ext.checkpoint.hf import HFCheckpoint
from deepspeed_ext.cli import main
from deepspeed_ext.demo.models import build_model
from harness.cli import digest, universal_in
from harness.hf import cli, read_files
from harness import releases

BLOCK = (16, 16)


def _model_tensors(directory, **options) -> dict[str, torch.Tensor]:
    return {t.name: t.load_tensor() for t in open_checkpoint(directory, **options).tensors()}


def _transformers_dequantized(directory, config) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(directory, quantization_config=config, dtype=torch.float32)
    return model.state_dict()


@pytest.fixture(scope="module")
def fp8_llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return releases.write_fp8(build_model("llama", seed=7).to(torch.bfloat16), root / "llama")


@pytest.fixture(scope="module")
def mxfp4_gpt_oss(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp4")
    return releases.write_mxfp4(build_model("gpt-oss", seed=7).to(torch.bfloat16), root / "gpt_oss")


@pytest.fixture(scope="module")
def fp8_deepseek(tmp_path_factory):
    """DeepSeek-V3 as released: FP8 with partial tiles at the edges (kv_a_proj_with_mqa's 20 rows in 16-row tiles,
    q_b_proj's 128 x 32), one multi-token-prediction layer past the decoder."""
    root = tmp_path_factory.mktemp("deepseek")
    model = build_model("deepseek-v3", seed=7).to(torch.bfloat16)
    directory = releases.write_fp8(model, root / "deepseek", edge_tiles=True)
    releases.add_mtp_layer(directory, model.config, block=BLOCK)
    return directory


def test_fp8_dequantized_bit_equal_to_transformers(fp8_llama):
    from transformers import FineGrainedFP8Config
    ours = _model_tensors(fp8_llama)
    theirs = _transformers_dequantized(fp8_llama, FineGrainedFP8Config(dequantize=True))
    raw = read_files(fp8_llama)
    quantized = [name for name in ours if raw[name].dtype == torch.float8_e4m3fn]
    assert len(quantized) == 14  # every linear weight but the output projection
    for name, tensor in ours.items():
        # transformers dequantizes fp32-scaled FP8 to fp32; the rest keep the files' bf16
        assert tensor.dtype == (torch.float32 if name in quantized else torch.bfloat16), name
        assert torch.equal(tensor.float(), theirs[name]), name
    as_bf16 = _model_tensors(fp8_llama, dtype="bfloat16")
    assert all(torch.equal(as_bf16[n], ours[n].to(torch.bfloat16)) for n in ours)  # a cast of the same values


def test_fp8_edge_tiles_follow_the_format(fp8_deepseek):
    """A partial tile takes its own scale (row r: scale row r // 128), as DeepSeek's format and transformers'
    block-size-aware helper compute it. transformers 5.22's load derives the tile from the grid instead (20 rows
    in 2 scale rows: tiles of 10), which misreads these weights: they are checked against the helper."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    raw = read_files(fp8_deepseek)
    ours = _model_tensors(fp8_deepseek, mtp="drop")
    edge = [n for n in ours if n in raw and raw[n].dtype == torch.float8_e4m3fn and raw[n].shape[0] % BLOCK[0]]
    assert edge and all("kv_a_proj_with_mqa" in n for n in edge)
    for name in [n for n in ours if n in raw and raw[n].dtype == torch.float8_e4m3fn]:
        expected = _dequantize_fp8_weight(raw[name], raw[name + "_scale_inv"], list(BLOCK), torch.float32)
        assert torch.equal(ours[name], expected), name


def test_mxfp4_dequantized_bit_equal_to_transformers(mxfp4_gpt_oss):
    from transformers import Mxfp4Config
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors
    ours = _model_tensors(mxfp4_gpt_oss)
    theirs = _transformers_dequantized(mxfp4_gpt_oss, Mxfp4Config(dequantize=True))
    experts = [n for n in ours if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(experts) == 4
    for name, tensor in ours.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor.float(), theirs[name]), name
    raw = read_files(mxfp4_gpt_oss)
    fp32 = _model_tensors(mxfp4_gpt_oss, dtype="float32")
    for name in experts:
        assert torch.equal(fp32[name], _convert_moe_packed_tensors(raw[name + "_blocks"], raw[name + "_scales"],
                                                                   dtype=torch.float32)), name


def test_every_e8m0_scale_and_nibble_dequantizes_like_transformers():
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors
    blocks = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 16, 16).expand(2, 256, 16, 16).contiguous()
    scales = torch.arange(256, dtype=torch.uint8).reshape(1, 256, 1).expand(2, 256, 16).contiguous()
    store = {"b": blocks, "s": scales}
    tensor = quantization.QuantizedTensor("w", quantization.MXFP4, "b", "s", (2, 512, 256), (1, 32), torch.bfloat16)
    ours = quantization.dequantize_rows(tensor, lambda n, i: store[n][i] if i else store[n], 0, 1024, torch.float32)
    theirs = _convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).reshape(1024, 256)
    assert torch.equal(torch.nan_to_num(ours, 1.0), torch.nan_to_num(theirs, 1.0))


def test_ranges_read_only_the_rows_that_hold_them(fp8_llama, mxfp4_gpt_oss):
    """A block of rows reads the packed rows and scale rows that hold it (memory follows the block, not the
    tensor), and blocks that cut tiles and MXFP4 blocks put together the whole tensor."""
    for directory in (fp8_llama, mxfp4_gpt_oss):
        source = HFCheckpoint(directory)
        read = []
        original = source._read_stored

        def counting(name, index=(), original=original):
            value = original(name, index)
            read.append(value.numel())
            return value

        source._read_stored = counting
        for tensor in source.tensors():
            if source.quantized_tensors.get(source._stored_name(tensor.name)) is None:
                continue
            whole = source.read_stored_tensor(tensor.name).reshape(-1)
            row = tensor.shape[-1]
            numel = whole.numel()
            for low, high in ((0, numel), (row + 5, numel // 3 + 1), (numel - row - 3, numel)):
                read.clear()
                part = tensor.range_loader("fp32", low, high)
                assert torch.equal(part, whole[low:high].to(part.dtype)), (tensor.name, low, high)
                if high - low < numel // 2 and numel >= 64 * row:  # whole rows and tiles: 2 x 16 of 64+ rows
                    assert sum(read) < numel // 2, (tensor.name, read)
            blocks = list(tensor.blocks("fp32", block_elements=3 * row))
            assert len(blocks) > 1 and torch.equal(torch.cat(blocks), whole.to(blocks[0].dtype)), tensor.name


def test_fp8_round_trip_is_byte_identical(fp8_llama, tmp_path, caplog):
    """release -> from-hf -> universal -> to-hf --quantize fp8: the same files' tensors, byte for byte (the scales
    recomputed to the same bits), loadable by transformers' FP8 config; without --quantize the config drops
    quantization_config."""
    from transformers import FineGrainedFP8Config
    cli("from-hf", str(fp8_llama), "-o", str(tmp_path / "u"))
    assert "quantization_config" not in open_checkpoint(tmp_path / "u").info.model_config
    cli("to-hf", str(tmp_path / "u"), "-o", str(tmp_path / "back"), "--quantize", "fp8", "--fp8-block", "16x16")
    cli("to-hf", str(fp8_llama), "-o", str(tmp_path / "direct"), "--quantize", "fp8", "--fp8-block", "16x16")
    original = read_files(fp8_llama)
    for out in ("back", "direct"):
        written = read_files(tmp_path / out)
        assert sorted(written) == sorted(original)
        for name, tensor in original.items():
            assert written[name].dtype == tensor.dtype and written[name].view(torch.uint8).equal(
                tensor.view(torch.uint8)), (out, name)
        config = json.loads((tmp_path / out / "config.json").read_text())["quantization_config"]
        assert config["quant_method"] == "fp8" and config["weight_block_size"] == list(BLOCK)
    theirs = _transformers_dequantized(tmp_path / "back", FineGrainedFP8Config(dequantize=True))
    ours = _model_tensors(fp8_llama)
    assert all(torch.equal(ours[n].float(), theirs[n]) for n in ours)
    cli("to-hf", str(tmp_path / "u"), "-o", str(tmp_path / "plain"), "--dtype", "bfloat16")
    assert "quantization_config" not in json.loads((tmp_path / "plain" / "config.json").read_text())
    assert {t.dtype for t in read_files(tmp_path / "plain").values()} == {torch.bfloat16}
    # compare, inspect and verify read the quantized files too
    assert main(["compare", str(fp8_llama), str(tmp_path / "back"), "-q"]) == 0
    assert main(["verify", str(tmp_path / "back"), "-q"]) == 0


def test_trained_weights_quantize_as_transformers_does():
    """Weights that were never FP8: the bytes transformers' own quantizer writes."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    torch.manual_seed(3)
    weight = torch.randn(64, 96) * torch.logspace(-3, 1, 64)[:, None]

    class _Quantizer:
        class quantization_config:  # noqa: N801
            weight_block_size = [32, 32]
            scale_fmt = None

    theirs = Fp8Quantize(_Quantizer())._quantize_one("w.weight", weight)
    packed, scales = quantization.quantize_fp8(weight, (32, 32))
    assert packed.view(torch.uint8).equal(theirs["w.weight"].view(torch.uint8))
    assert torch.equal(scales, theirs["w.weight_scale_inv"])


def test_mxfp4_round_trip_is_byte_identical(mxfp4_gpt_oss, tmp_path):
    from transformers import Mxfp4Config
    cli("from-hf", str(mxfp4_gpt_oss), "-o", str(tmp_path / "u"))
    cli("to-hf", str(tmp_path / "u"), "-o", str(tmp_path / "back"), "--quantize", "mxfp4")
    original, written = read_files(mxfp4_gpt_oss), read_files(tmp_path / "back")
    assert sorted(written) == sorted(original)
    assert all(written[n].dtype == t.dtype and written[n].view(torch.uint8).equal(t.view(torch.uint8))
               for n, t in original.items())
    theirs = _transformers_dequantized(tmp_path / "back", Mxfp4Config(dequantize=True))
    ours = _model_tensors(mxfp4_gpt_oss)
    assert all(torch.equal(ours[n].float(), theirs[n]) for n in ours)


def test_mxfp4_keeps_every_representable_block():
    """Any block of E2M1 values times a power of two comes back as the same values; its bytes too where its
    largest value is 4 or 6 (what the OCP MX rule makes)."""
    torch.manual_seed(5)
    blocks = torch.randint(0, 256, (40, 3, 16), dtype=torch.uint8)
    scales = torch.randint(90, 160, (40, 3), dtype=torch.uint8)
    values = torch.ldexp(quantization.unpack_e2m1(blocks), (scales.int() - 127).unsqueeze(-1)).reshape(40, 96).t()
    packed, exponents = quantization.quantize_mxfp4(values)
    again = torch.ldexp(quantization.unpack_e2m1(packed), (exponents.int() - 127).unsqueeze(-1)).reshape(40, 96).t()
    assert torch.equal(again, values)
    top = quantization.unpack_e2m1(blocks).abs().amax(-1)
    canonical = (top == 4) | (top == 6)
    assert canonical.any() and torch.equal(packed[canonical], blocks[canonical])


def test_deepseek_release_mtp_layer_is_an_explicit_choice(fp8_deepseek, tmp_path, capsys):
    assert main(["from-hf", str(fp8_deepseek), "-o", str(tmp_path / "refused"), "-q"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "model.layers.3.*" in error and "--mtp drop" in error
    assert not (tmp_path / "refused").exists()
    cli("from-hf", str(fp8_deepseek), "-o", str(tmp_path / "u"), "--mtp", "drop")
    assert "dropped: 7 tensors of the multi-token-prediction layer" in capsys.readouterr().err
    zero = universal_in(tmp_path / "u") / "zero"
    assert not any(p.name.startswith("model.layers.3.") for p in zero.iterdir())
    # Written back into the release's layout: the trained decoder, the MTP layer copied, every weight that was
    # FP8 (partial tiles included) quantized again to the same bytes.
    cli("to-hf", str(tmp_path / "u"), "-o", str(tmp_path / "back"), "--like", str(fp8_deepseek), "--quantize", "fp8",
        "--fp8-block", "16x16", "--fp8-edge-tiles")
    original, written = read_files(fp8_deepseek), read_files(tmp_path / "back")
    assert sorted(written) == sorted(original)
    assert all(written[n].dtype == t.dtype and written[n].view(torch.uint8).equal(t.view(torch.uint8))
               for n, t in original.items())
    # HF -> HF keeps it with --mtp keep
    cli("to-hf", str(fp8_deepseek), "-o", str(tmp_path / "kept"), "--mtp", "keep", "--dtype", "bfloat16")
    kept = read_files(tmp_path / "kept")
    assert sum(n.startswith("model.layers.3.") for n in kept) == 7


@pytest.mark.parametrize("naming", ["new", "legacy"])
def test_multimodal_gemma3_text_model_and_back(naming, tmp_path, capsys):
    from transformers import Gemma3ForConditionalGeneration
    model = releases.gemma3_multimodal()
    release = releases.write_multimodal(model, tmp_path / "release", naming)
    text = {f"model.{k}": v for k, v in model.model.language_model.state_dict().items()}
    cli("from-hf", str(release), "-o", str(tmp_path / "u"))
    note = capsys.readouterr().err
    assert "read the text model" in note and "vision_tower" in note and "multi_modal_projector" in note
    source = open_checkpoint(tmp_path / "u")
    assert source.info.model_config["model_type"] == "gemma3_text"
    ours = {t.name: t.load_tensor() for t in source.tensors()}
    assert sorted(ours) == sorted(text) and all(torch.equal(ours[n], text[n]) for n in text)
    cli("to-hf", str(tmp_path / "u"), "-o", str(tmp_path / "back"), "--like", str(release))
    original, written = read_files(release), read_files(tmp_path / "back")
    assert sorted(written) == sorted(original)  # the release's own naming
    assert all(torch.equal(written[n], t) for n, t in original.items())
    loaded = Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "back")
    assert all(torch.equal(loaded.state_dict()[n], t) for n, t in model.state_dict().items())


def test_like_refuses_another_model(fp8_llama, mxfp4_gpt_oss, tmp_path, capsys):
    cli("from-hf", str(fp8_llama), "-o", str(tmp_path / "u"))
    assert main(["to-hf", str(tmp_path / "u"), "-o", str(tmp_path / "out"), "--like", str(mxfp4_gpt_oss), "-q"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "not the model of" in error and not (tmp_path / "out").exists()


def _damaged(source, tmp_path, edit_tensors=None, edit_config=None):
    target = tmp_path / "damaged"
    shutil.copytree(source, target)
    if edit_tensors is not None:
        for file in sorted(target.glob("*.safetensors")):
            tensors = load_file(file)
            save_file(edit_tensors(tensors), file, metadata={"format": "pt"})
        index = target / "model.safetensors.index.json"
        data = json.loads(index.read_text())
        data["weight_map"] = {n: f.name for f in sorted(target.glob("*.safetensors")) for n in load_file(f)}
        index.write_text(json.dumps(data))
    if edit_config is not None:
        config = json.loads((target / "config.json").read_text())
        edit_config(config)
        (target / "config.json").write_text(json.dumps(config))
    return target


SCALE = "model.layers.0.self_attn.q_proj.weight_scale_inv"
DAMAGES = {
    "missing scale": (lambda t: {n: v for n, v in t.items() if n != SCALE}, None,
                      "has no scale tensor 'model.layers.0.self_attn.q_proj.weight_scale_inv'"),
    "wrong grid": (lambda t: {n: (v[:, :2].contiguous() if n == SCALE else v) for n, v in t.items()}, None,
                   "needs a grid of [4, 4]"),
    "block that does not tile": (None, lambda c: c["quantization_config"].update(weight_block_size=[24, 16]),
                                 "in tiles of 24x16 needs a grid of [3, 4]"),
    "unknown method": (None, lambda c: c["quantization_config"].update(quant_method="awq"),
                       "quant_method 'awq', which deepspeed-ext does not read"),
    "bad block size": (None, lambda c: c["quantization_config"].update(weight_block_size=[16]),
                       "weight_block_size is [16]"),
    "no quantization config": (None, lambda c: c.pop("quantization_config"),
                               "is F8_E4M3, a quantized weight, but config.json has no quantization_config"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_bad_quantized_input_gets_one_line(fp8_llama, tmp_path, capsys, damage):
    edit_tensors, edit_config, expected = DAMAGES[damage]
    source = _damaged(fp8_llama, tmp_path, edit_tensors, edit_config)
    before = digest(source)
    for command in (["from-hf", str(source), "-o", str(tmp_path / "u")], ["inspect", str(source)],
                    ["to-hf", str(source), "-o", str(tmp_path / "h")]):
        assert main([*command, "-q"]) == 2, command
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and expected in error, (command, error)
    assert digest(source) == before and not (tmp_path / "u").exists()


def test_bad_mxfp4_input_and_quantize_choice(mxfp4_gpt_oss, fp8_llama, tmp_path, capsys):
    name = "model.layers.0.mlp.experts.down_proj_scales"
    source = _damaged(mxfp4_gpt_oss, tmp_path, lambda t: {n: (v[..., :1].contiguous() if n == name else v)
                                                         for n, v in t.items()})
    assert main(["from-hf", str(source), "-o", str(tmp_path / "u"), "-q"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and name in error and "need U8 of shape" in error
    assert main(["to-hf", str(fp8_llama), "-o", str(tmp_path / "h"), "--quantize", "mxfp4", "-q"]) == 2
    assert "gpt-oss's experts" in capsys.readouterr().err
