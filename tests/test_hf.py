"""The Hugging Face bridge: to-hf / from-hf against real transformers, safetensors and DeepSpeed."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from deepspeed_ext.checkpoint import serialization
from deepspeed_ext.checkpoint.hf import HFCheckpoint
from deepspeed_ext.cli import main
from deepspeed_ext.demo.models import FAMILIES, batch, build_model, eval_batch
from deepspeed_ext.demo.runner import read_losses, torchrun_train
from e2e import KV2_SCENARIOS, universal_in

SHARD = "30KB"  # tiny models: several shards each


def cli(*args: str) -> None:
    assert main([*args, "--quiet"]) == 0, args


def read_files(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in ``directory``, read by the safetensors library."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():
                assert name not in tensors, f"{name} in two files"
                tensors[name] = handle.get_tensor(name)
    return tensors


def load_hf(directory: Path, caplog) -> torch.nn.Module:
    """``from_pretrained``, asserting that transformers found no missing, unexpected or mismatched keys."""
    from transformers import AutoModelForCausalLM
    with caplog.at_level(logging.WARNING):
        model, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True,
                                                           attn_implementation="eager")
    assert not any(info.values()), info
    complaints = [r.getMessage() for r in caplog.records if any(
        word in r.getMessage().lower() for word in ("missing", "unexpected", "not initialized", "mismatch"))]
    assert not complaints, complaints
    return model.eval()


def save_pretrained(model: torch.nn.Module, directory: Path) -> None:
    model.save_pretrained(directory, max_shard_size=SHARD)
    assert (directory / "model.safetensors.index.json").is_file()  # sharded, as real checkpoints are


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hf_to_universal_to_hf_gives_back_the_files(tmp_path, caplog, family, dtype):
    """save_pretrained -> from-hf -> to-hf: the same tensor names, dtypes and bits, loadable without complaint;
    the universal form keeps the files' dtype (no fp32 blow-up) and has no optimizer state."""
    model = build_model(family, seed=7).to(dtype).eval()
    save_pretrained(model, tmp_path / "hf")
    cli("from-hf", str(tmp_path / "hf"), "-o", str(tmp_path / "universal"))
    cli("to-hf", str(tmp_path / "universal"), "-o", str(tmp_path / "out"), "--max-shard-size", SHARD)

    zero = universal_in(tmp_path / "universal") / "zero"
    params = dict(model.named_parameters())
    assert sorted(p.name for p in zero.iterdir() if p.is_dir()) == sorted(params)
    for name, param in params.items():
        assert sorted(f.name for f in (zero / name).iterdir()) == ["fp32.pt"], name  # fresh optimizer
        stored = serialization.load(zero / name / "fp32.pt")["param"]
        assert stored.dtype == dtype and torch.equal(stored, param.detach()), name

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
            assert handle.metadata() == {"format": "pt"}
            names = list(handle.keys())
        data = sum(written[n].numel() * written[n].element_size() for n in names)
        # A shard exceeds the limit only when one tensor alone does (as huggingface_hub splits).
        assert file.name.startswith("model-000") and (data <= 30_000 or len(names) == 1), file.name

    loaded = load_hf(tmp_path / "out", caplog)
    # The reference is loaded the same way: an in-memory model cast with .to(bf16) also casts its RoPE buffers.
    reference = load_hf(tmp_path / "hf", caplog)
    assert loaded.dtype == dtype
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=eval_batch()).logits, reference(input_ids=eval_batch()).logits)


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

    # Below --max-shard-size: one model.safetensors and no index, as save_pretrained writes; from-hf reads it.
    cli("to-hf", str(tmp_path / "fp32"), "-o", str(tmp_path / "single"))
    assert sorted(p.name for p in (tmp_path / "single").iterdir()) == ["config.json", "deepspeed_ext.manifest.json",
                                                                        "model.safetensors"]
    cli("from-hf", str(tmp_path / "single"), "-o", str(tmp_path / "universal"))
    stored = serialization.load(universal_in(tmp_path / "universal") / "zero" / "lm_head.weight" / "fp32.pt")
    stored = stored["param"]
    assert stored.dtype == torch.float32 and torch.equal(stored, model.lm_head.weight.detach().float())


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max())


@pytest.mark.parametrize("family, scan_layers", [("llama", True), ("llama3.1", False), ("mistral", True),
                                                 ("qwen3", True), ("qwen3-moe", True)])
def test_hf_to_maxtext_to_hf_is_exact_but_the_scaled_query(tmp_path, caplog, family, scan_layers):
    """HF -> to-maxtext (fp32) -> to-hf, one command each: bit-exact except the query kernel of families
    that bake 1/sqrt(head_dim) into it (within 1 ulp; head_dim 8 makes the rounding real)."""
    from deepspeed_ext.checkpoint.families import get_family
    from test_maxtext import hf_model
    model = hf_model(family, head_dim=8)
    save_pretrained(model, tmp_path / "hf")
    cli("to-maxtext", str(tmp_path / "hf"), "-o", str(tmp_path / "maxtext"), "--dtype", "float32",
        "--scan-layers" if scan_layers else "--no-scan-layers")
    cli("to-hf", str(tmp_path / "maxtext"), "-o", str(tmp_path / "out"), "--max-shard-size", SHARD)
    original, written = read_files(tmp_path / "hf"), read_files(tmp_path / "out")
    assert sorted(written) == sorted(original)
    inexact = []
    for name, tensor in original.items():
        assert written[name].dtype == torch.float32 and written[name].shape == tensor.shape, name
        if not torch.equal(written[name], tensor):
            inexact.append(name)
            assert name.endswith("q_proj.weight") and get_family(family).query_scaled, name
            assert _ulps(written[name], tensor) <= 1, name
    assert bool(inexact) == get_family(family).query_scaled
    load_hf(tmp_path / "out", caplog)


# --------------------------------------------------------------------------- with the DeepSpeed engine
LIVE = [("tp2_zero1_fp32", dict(tp=2, dtype="fp32")), ("tp2_zero1_bf16", dict(tp=2)),
        ("qwen2_tp2", dict(tp=2, family="qwen2")), ("qwen3_tied_tp2", dict(tp=2, family="qwen3")),
        ("qwen3_moe_tp2", dict(tp=2, family="qwen3_moe")), ("tp2_dp2_zero3_bf16", dict(tp=2, dp=2, zero=3)),
        # TP=3 with 2 KV heads: rank 2 holds empty attention shards
        ("kv2_llama_tp3", KV2_SCENARIOS["kv2_llama_tp3"]), ("kv2_qwen3_tp3", KV2_SCENARIOS["kv2_qwen3_tp3"])]


@pytest.mark.e2e
@pytest.mark.parametrize("name, kwargs", LIVE, ids=[name for name, _ in LIVE])
def test_deepspeed_tp2_to_hf_matches_the_live_model(scenarios, tmp_path, caplog, name, kwargs):
    """DeepSpeed TP=2 training -> to-hf (straight from the DeepSpeed checkpoint) -> transformers:

    * every weight, cut into the two TP slices, equals bit for bit what each TP rank's live model held
      (the module weights in its model-states file: bf16 runs keep bf16; ZeRO-3 saves none, so there the
      merged fp32 master cast to bf16, which the ZeRO-3 test files check against the live engine);
    * the logits equal the live TP=2 model's up to the order of TP's partial sums (fp32: 1e-5 absolute,
      bf16: bf16 rounding), with the same argmax almost everywhere.
    """
    scenario = scenarios(name, **kwargs)
    cli("to-hf", str(scenario.save_dir), "-o", str(tmp_path / "hf"), "--max-shard-size", SHARD)
    dtype = torch.float32 if scenario.dtype == "fp32" else torch.bfloat16

    from deepspeed_ext.checkpoint.deepspeed import DeepSpeedCheckpoint
    source = DeepSpeedCheckpoint(scenario.save_dir)
    written = HFCheckpoint(tmp_path / "hf")
    assert sorted(written.layouts) == sorted(source.layouts)
    for param, layout in source.layouts.items():
        full = written.load(param)
        assert full.dtype == dtype, param
        for tp in range(scenario.tp):
            live = source.rank_model_states(tp)["module"][param]
            if live.numel() == 0:  # ZeRO-3 saves empty placeholders: compare with the merged master, cast
                live = layout.slice(source.full_tensor(param), tp).to(dtype)
            assert torch.equal(layout.slice(full, tp), live), (param, tp)

    model = load_hf(tmp_path / "hf", caplog)
    assert model.dtype == dtype
    with torch.no_grad():
        logits = model(input_ids=eval_batch()).logits.float()
    shards = [torch.load(scenario.dump_dir / f"logits_tp_rank_{r:02d}.pt", weights_only=True)
              for r in range(scenario.tp)]
    vocab = model.config.vocab_size  # a vocab-parallel head without gather_output leaves each rank its shard
    live = shards[0] if shards[0].shape[-1] == vocab else torch.cat(shards, dim=-1)
    difference = (logits - live).abs().max().item()
    print(f"{name}: max |logits - live TP=2 logits| = {difference:.3g} (|logits| max {live.abs().max():.3g})")
    if dtype == torch.float32:
        assert difference <= 1e-5
        assert torch.equal(logits.argmax(-1), live.argmax(-1))
    else:
        assert difference <= 2 * 2**-7 * live.abs().max().item()  # two bf16 ulps at the largest logit
        assert (logits.argmax(-1) == live.argmax(-1)).float().mean() >= 0.9


@pytest.mark.e2e
def test_deepspeed_tp2_to_hf_through_universal_is_the_same(scenarios, tmp_path):
    """to-hf from the universal checkpoint writes the same files as to-hf from the DeepSpeed checkpoint."""
    scenario = scenarios("tp2_zero1_bf16", tp=2)
    cli("to-hf", str(scenario.save_dir), "-o", str(tmp_path / "direct"))
    cli("to-hf", str(scenario.universal_dir), "-o", str(tmp_path / "via_universal"))
    direct, via = read_files(tmp_path / "direct"), read_files(tmp_path / "via_universal")
    assert sorted(direct) == sorted(via)
    assert all(direct[n].dtype == torch.bfloat16 and torch.equal(direct[n], via[n]) for n in direct)


@pytest.mark.e2e
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_training_starts_from_hf_weights_at_tp2(tmp_path, family):
    """A transformers-saved model -> from-hf -> DeepSpeed AutoTP TP=2 (fp32): the first step's loss is the
    transformers model's loss on the same batch, and training goes on from there."""
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
