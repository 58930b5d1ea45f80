"""Helpers shared by tests/unit/test_hf.py and tests/e2e/test_hf_e2e.py: the CLI in this process, safetensors
files read back, and models saved and loaded as transformers does."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open

from deepspeed_ext.cli import main

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


def assert_to_hf_matches_live(scenario, tmp_path: Path, caplog) -> float:
    """DeepSpeed TP training -> to-hf (straight from the DeepSpeed checkpoint) -> transformers:

    * every weight, cut into the TP slices, equals bit for bit what each TP rank's live model held
      (the module weights in its model-states file: bf16 runs keep bf16; ZeRO-3 saves none, so there the
      merged fp32 master cast to bf16, which the ZeRO-3 test files check against the live engine);
    * the logits equal the live TP model's up to the order of TP's partial sums (fp32: 1e-5 absolute,
      bf16: bf16 rounding), with the same argmax almost everywhere.

    Returns the largest logit difference.
    """
    from deepspeed_ext.checkpoint.deepspeed import DeepSpeedCheckpoint
    from deepspeed_ext.checkpoint.hf import HFCheckpoint
    from deepspeed_ext.demo.models import eval_batch
    cli("to-hf", str(scenario.save_dir), "-o", str(tmp_path / "hf"), "--max-shard-size", SHARD)
    dtype = torch.float32 if scenario.dtype == "fp32" else torch.bfloat16
    source = DeepSpeedCheckpoint(scenario.save_dir)
    written = HFCheckpoint(tmp_path / "hf")
    assert sorted(written.layouts) == sorted(source.layouts)
    for param, layout in source.layouts.items():
        full = written.load(param)
        saved = source.rank_model_states(0)["module"][param]
        # The weights keep the training dtype; a buffer its own (DeepSeek's router bias stays fp32).
        assert full.dtype == (saved.dtype if param in source.buffers else dtype), param
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
    print(f"{scenario.root.name}: max |logits - live TP={scenario.tp} logits| = {difference:.3g} "
          f"(|logits| max {live.abs().max():.3g})")
    if dtype == torch.float32:
        assert difference <= 1e-5
        assert torch.equal(logits.argmax(-1), live.argmax(-1))
    else:
        # The same bf16 weights, computed whole here and in TP slices there: the roundings differ per layer and
        # with the CPU's bf16 kernels (an MoE's router mixes them in once more: 2.5 ulps on an AMX machine).
        # Four bf16 ulps at the largest logit; a wrong slice moves the logits by their own size.
        assert difference <= 4 * 2**-7 * live.abs().max().item()
        assert (logits.argmax(-1) == live.argmax(-1)).float().mean() >= 0.9
    return difference
