"""The Hugging Face bridge: to-hf / from-hf against real transformers and safetensors. With the DeepSpeed engine,
and from-hf in a subprocess: tests/e2e/test_hf_e2e.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from deepspeed_ext.checkpoint import serialization
from deepspeed_ext.cli import main
from deepspeed_ext.checkpoint.families import maxtext_family_names
from harness.families import RECENT
from deepspeed_ext.demo.models import FAMILIES, build_model, eval_batch
from harness.cli import universal_in
from harness.hf import SHARD, cli, load_hf, read_files, save_pretrained
from harness.tiers import sampled


#: Every family in bf16 (how releases ship), and the ten of 2025 in fp32 too (the dtype path is the same for all).
ROUND_TRIP_CASES = [(family, dtype) for family in FAMILIES for dtype in (torch.float32, torch.bfloat16)
                    if dtype == torch.bfloat16 or family not in RECENT]


@pytest.mark.parametrize("family, dtype", sampled(
    ROUND_TRIP_CASES, [("llama", torch.float32), ("mixtral", torch.bfloat16), (RECENT[0], torch.bfloat16)],
    ids=lambda case: f"{'bf16' if case[1] == torch.bfloat16 else 'fp32'}-{case[0]}"))
def test_hf_to_universal_to_hf_gives_back_the_files(tmp_path, caplog, family, dtype):
    """save_pretrained -> from-hf -> to-hf: the same tensor names, dtypes and bits, loadable without complaint;
    the universal form keeps the files' dtype (no fp32 blow-up) and has no optimizer state."""
    model = build_model(family, seed=7).to(dtype).eval()
    save_pretrained(model, tmp_path / "hf")
    cli("from-hf", str(tmp_path / "hf"), "-o", str(tmp_path / "universal"))
    cli("to-hf", str(tmp_path / "universal"), "-o", str(tmp_path / "out"), "--max-shard-size", SHARD)

    zero = universal_in(tmp_path / "universal") / "zero"
    params = dict(model.named_parameters())
    # Persistent buffers (DeepSeek's router bias) are in the files and carried as tensors.
    params.update((name, b) for name, b in model.named_buffers() if name in model.state_dict())
    assert sorted(p.name for p in zero.iterdir() if p.is_dir()) == sorted(params)
    for name, param in params.items():
        assert sorted(f.name for f in (zero / name).iterdir()) == ["fp32.pt"], name  # fresh optimizer
        stored = serialization.load(zero / name / "fp32.pt")["param"]
        # an integer buffer (DeepSeek-V4's hash-routing table) keeps its own dtype
        assert stored.dtype == (dtype if param.is_floating_point() else param.dtype), name
        assert torch.equal(stored, param.detach()), name

    original, written = read_files(tmp_path / "hf"), read_files(tmp_path / "out")
    assert sorted(written) == sorted(original)
    for name, tensor in original.items():
        assert written[name].dtype == tensor.dtype and torch.equal(written[name], tensor), name
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(original)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in original.values())
    assert index["metadata"]["total_parameters"] == sum(p.numel() for p in params.values())
    for file in (tmp_path / "out").glob("*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            metadata = handle.metadata()
            names = list(handle.keys())
        # save_pretrained's format entry, plus the fingerprints of the weights that start in this file.
        assert metadata["format"] == "pt" and set(metadata) == {"format", "deepspeed_ext.fingerprints"}
        data = sum(written[n].numel() * written[n].element_size() for n in names)
        # A shard exceeds the limit only when one tensor alone does (as huggingface_hub splits).
        assert file.name.startswith("model-000") and (data <= 30_000 or len(names) == 1), file.name

    loaded = load_hf(tmp_path / "out", caplog)
    # The reference is loaded the same way: an in-memory model cast with .to(bf16) also casts its RoPE buffers.
    reference = load_hf(tmp_path / "hf", caplog)
    assert loaded.dtype == dtype
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=eval_batch()).logits, reference(input_ids=eval_batch()).logits)


def test_to_hf_dtype_choice_and_refusals(tmp_path, capsys):
    """--dtype casts on request only; parameters that do not fit the config are refused before writing."""
    model = build_model("llama", seed=5).to(torch.bfloat16)
    save_pretrained(model, tmp_path / "hf")
    cli("to-hf", str(tmp_path / "hf"), "-o", str(tmp_path / "fp32"), "--dtype", "float32")
    written = read_files(tmp_path / "fp32")
    for name, param in model.named_parameters():
        assert written[name].dtype == torch.float32 and torch.equal(written[name], param.detach().float()), name
    assert json.loads((tmp_path / "fp32" / "config.json").read_text())["dtype"] == "float32"

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "wrong.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    capsys.readouterr()
    assert main(["to-hf", str(tmp_path / "hf"), "-o", str(tmp_path / "bad"), "--config", str(tmp_path / "wrong.json"),
                 "-q"]) == 2
    error = capsys.readouterr().err
    assert "mlp" in error and "wrong --config" in error and len(error.strip().splitlines()) == 1
    assert not (tmp_path / "bad").exists() and not (tmp_path / "bad.partial").exists()
    assert main(["to-hf", str(tmp_path / "hf"), "-o", str(tmp_path / "fp32"), "-q"]) == 2  # exists, no --overwrite

    # Below --max-shard-size: one model.safetensors and no index, as save_pretrained writes; from-hf reads it. The
    # source's generation config comes along (as save_pretrained writes it).
    cli("to-hf", str(tmp_path / "fp32"), "-o", str(tmp_path / "single"))
    assert sorted(p.name for p in (tmp_path / "single").iterdir()) == ["config.json", "deepspeed_ext.manifest.json",
                                                                        "generation_config.json", "model.safetensors"]
    cli("from-hf", str(tmp_path / "single"), "-o", str(tmp_path / "universal"))
    stored = serialization.load(universal_in(tmp_path / "universal") / "zero" / "lm_head.weight" / "fp32.pt")
    stored = stored["param"]
    assert stored.dtype == torch.float32 and torch.equal(stored, model.lm_head.weight.detach().float())


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max())


#: Written unscanned in the HF -> MaxText -> HF round trip (every other family scanned; both ways for each family:
#: tests/unit/test_maxtext.py::test_round_trip_is_exact_but_the_scaled_query).
UNSCANNED = {"llama3.1", "mixtral", "gpt-oss"}


@pytest.mark.parametrize("family, scan_layers", sampled(
    [(family, family not in UNSCANNED) for family in maxtext_family_names()], [("llama", True), ("mixtral", False)]))
def test_hf_to_maxtext_to_hf_is_exact_but_the_scaled_query(tmp_path, caplog, family, scan_layers):
    """HF -> to-maxtext (fp32) -> to-hf, one command each: bit-exact except the query kernel of families
    that bake 1/sqrt(head_dim) into it (within 1 ulp; head_dim 8 makes the rounding real)."""
    from deepspeed_ext.checkpoint.families import get_family
    from harness.maxtext import hf_model
    model = hf_model(family, head_dim=8)
    save_pretrained(model, tmp_path / "hf")
    cli("to-maxtext", str(tmp_path / "hf"), "-o", str(tmp_path / "maxtext"), "--dtype", "float32",
        "--scan-layers" if scan_layers else "--no-scan-layers")
    cli("to-hf", str(tmp_path / "maxtext"), "-o", str(tmp_path / "out"), "--max-shard-size", SHARD)
    original, written = read_files(tmp_path / "hf"), read_files(tmp_path / "out")
    assert sorted(written) == sorted(original)
    inexact = []
    for name, tensor in original.items():
        # fp32, but indices (DeepSeek-V4's hash table), which keep their int64
        dtype = torch.float32 if tensor.is_floating_point() else tensor.dtype
        assert written[name].dtype == dtype and written[name].shape == tensor.shape, name
        if not torch.equal(written[name], tensor):
            inexact.append(name)
            if family == "gemma3" and name.endswith("norm.weight"):  # MaxText stores 1 + w
                assert (written[name] - tensor).abs().max() <= 2**-23 * (1 + tensor.abs().max()), name
                continue
            assert name.endswith("q_proj.weight") and get_family(family).query_scaled, name
            assert _ulps(written[name], tensor) <= 1, name
    assert any(".q_proj." in name for name in inexact) == get_family(family).query_scaled
    load_hf(tmp_path / "out", caplog)


def test_check_finite_names_the_parameters_and_writes_nothing(tmp_path, capsys):
    """--check-finite on every conversion from a checkpoint with NaN and Inf weights: one line naming the
    parameters, exit 2, no output (not even a .partial); without the flag the weights convert as they are."""
    model = build_model("llama", seed=7)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
        model.model.norm.weight[3] = float("inf")
    save_pretrained(model, tmp_path / "hf")
    cli("from-hf", str(tmp_path / "hf"), "-o", str(tmp_path / "universal"))  # no check asked: converts
    zero = universal_in(tmp_path / "universal") / "zero"
    assert torch.isnan(serialization.load(zero / "model.layers.1.mlp.down_proj.weight" / "fp32.pt")["param"]).any()
    for command, source in (("from-hf", "hf"), ("to-hf", "hf"), ("to-maxtext", "hf"), ("to-hf", "universal")):
        out = tmp_path / f"{command}_{source}_checked"
        capsys.readouterr()
        assert main([command, str(tmp_path / source), "-o", str(out), "--check-finite", "-q"]) == 2, command
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1, error
        assert (f"{tmp_path / source}: NaN/Inf in 2 parameter(s): model.layers.1.mlp.down_proj.weight (fp32), "
                "model.norm.weight (fp32); nothing was written") in error, (command, error)
        assert not out.exists() and not out.with_name(out.name + ".partial").exists(), command


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_files_in_either_layout_read_the_same(tmp_path, caplog, family):
    """transformers writes MoE experts one by one by default (Mixtral under its original names,
    block_sparse_moe.experts.<e>.w1/w3/w2 and block_sparse_moe.gate) and fused with save_original_format=False;
    from-hf reads both to the same universal tensors, and to-hf writes what save_pretrained writes by default."""
    model = build_model(family, seed=7).eval()
    save_pretrained(model, tmp_path / "per_expert")
    model.save_pretrained(tmp_path / "fused", max_shard_size=SHARD, save_original_format=False)
    per_expert, fused = read_files(tmp_path / "per_expert"), read_files(tmp_path / "fused")
    assert any(".experts.0." in name for name in per_expert) and not any(".experts.0." in name for name in fused)
    if family == "mixtral":
        assert "model.layers.0.block_sparse_moe.gate.weight" in per_expert
        assert "model.layers.0.mlp.gate.weight" in fused
    for layout in ("per_expert", "fused"):
        cli("from-hf", str(tmp_path / layout), "-o", str(tmp_path / f"universal_{layout}"))
    zero = {layout: universal_in(tmp_path / f"universal_{layout}") / "zero" for layout in ("per_expert", "fused")}
    params = dict(model.named_parameters())
    for name, param in params.items():
        for layout in zero:
            assert torch.equal(serialization.load(zero[layout] / name / "fp32.pt")["param"], param.detach()), name
    cli("to-hf", str(tmp_path / "universal_fused"), "-o", str(tmp_path / "out"), "--max-shard-size", SHARD)
    written = read_files(tmp_path / "out")
    assert sorted(written) == sorted(per_expert)
    assert all(torch.equal(written[name], tensor) for name, tensor in per_expert.items())
    load_hf(tmp_path / "out", caplog)
