"""peft LoRA adapters trained through deepspeed_ext.initialize (the tiny Llama, LoRA r=4 on every linear layer, the
base frozen): every state of every adapter comes back at another DP degree and ZeRO stage, from the universal form
and straight from the DeepSpeed checkpoint, into a model built with other initial weights; the PEFT adapter and the
merged model to-hf writes load in peft and transformers with the live model's logits; a PEFT adapter goes into
DeepSpeed and comes back out bit for bit; bad input gets one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from harness.adapters import assert_every_state_restored, live_logits, logits, merged_loaded, peft_loaded, save_base
from harness.runner import cli, read_losses, torchrun_train
from harness.scenario import RESUMED_INIT, Load

#: fp32 runs: the exports' logits agree with the live model's to float rounding.
LORA = dict(tp=1, dp=2, dtype="fp32", lora=4)
LOGITS_ATOL = 1e-5
#: The next losses after a resume agree with the uninterrupted run's (bf16 included).
LOSS_RTOL = 2e-3


@pytest.fixture(scope="module")
def zero1(scenarios):
    return scenarios("lora_llama_zero1", zero=1, **LORA)


def close(resumed: dict[int, float], baseline: dict[int, float]) -> bool:
    return bool(resumed) and all(abs(loss - baseline[step]) <= LOSS_RTOL * abs(baseline[step])
                                 for step, loss in resumed.items())


@pytest.mark.parametrize("zero,dtype", [(1, "fp32"), (2, "bf16"), (3, "fp32")])
def test_adapters_resume_at_dp1_from_both_forms(scenarios, zero, dtype):
    """ZeRO-1/2/3 at DP=2 -> DP=1 (ZeRO-3 also -> ZeRO-1), from the universal form and the DeepSpeed checkpoint."""
    scenario = scenarios(f"lora_llama_zero{zero}_{dtype}", zero=zero, **{**LORA, "dtype": dtype})
    loads = [Load(1, 1, scenario.universal_dir), Load(1, 1, scenario.tag_dir, load_universal=False)]
    if zero == 3:
        loads += [Load(1, 1, scenario.universal_dir, extra=("--zero", "1")),
                  Load(1, 1, scenario.tag_dir, load_universal=False, extra=("--zero", "1"))]
    assert_every_state_restored(scenario, loads, LOSS_RTOL)


def test_a_resumed_adapter_run_continues_the_uninterrupted_one(zero1):
    resumed = zero1.resume(1, 1)
    assert sorted(resumed) == [4, 5] and close(resumed, zero1.baseline), (resumed, zero1.baseline)


def test_inspect_says_it_is_an_adapter_checkpoint(zero1, tmp_path):
    for source in (zero1.tag_dir, zero1.universal_dir):
        summary = json.loads(cli(["inspect", str(source), "--json"], tmp_path / "inspect.log").stdout)
        assert summary["adapters"] == ["default: LORA r=4 alpha=8, targets down_proj, gate_proj, k_proj, o_proj, "
                                       "q_proj, up_proj, v_proj (14 modules)"], summary
        assert summary["adapted_modules"].startswith("14 layers"), summary
        assert summary["adapter_parameters"].startswith("28 adapter tensors"), summary
        assert summary["frozen_parameters"].startswith("21 of 49 parameters"), summary


def test_peft_adapter_and_merged_exports_have_the_live_logits(zero1, tmp_path):
    """From the DeepSpeed checkpoint and from its universal form: the PEFT adapter loads onto the base with peft
    (no missing or unexpected keys) and the merged model with transformers, each with the live model's logits."""
    live = live_logits(zero1)
    for source, name in ((zero1.tag_dir, "ds"), (zero1.universal_dir, "uni")):
        adapter, merged = tmp_path / f"adapter-{name}", tmp_path / f"merged-{name}"
        out = cli(["to-hf", str(source), "-o", str(adapter)], tmp_path / f"adapter-{name}.log").stdout
        assert "wrote PEFT adapter" in out and "PeftModel.from_pretrained" in out, out
        assert sorted(p.name for p in adapter.iterdir()) == [
            "adapter_config.json", "adapter_model.safetensors", "deepspeed_ext.manifest.json"]
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA", config
        got = logits(peft_loaded(zero1, adapter))
        assert (got - live).abs().max().item() <= LOGITS_ATOL, name
        cli(["to-hf", str(source), "-o", str(merged), "--merge", "-q"], tmp_path / f"merged-{name}.log")
        got = logits(merged_loaded(merged))
        assert (got - live).abs().max().item() <= LOGITS_ATOL, name
        assert "lora" not in (merged / "config.json").read_text().lower()
        cli(["verify", str(merged)], tmp_path / f"verify-{name}.log")
        cli(["verify", str(adapter)], tmp_path / f"verify-adapter-{name}.log")


def test_merging_onto_a_named_base_checks_it_against_the_checkpoints(zero1, tmp_path):
    """--base: the base model's weights are used, checked against the checkpoint's frozen copy; another model's
    weights, or another shape, are refused in one line."""
    base = save_base(zero1, tmp_path / "base")
    out = tmp_path / "merged"
    cli(["to-hf", str(zero1.tag_dir), "-o", str(out), "--merge", "--base", str(base), "-q"], tmp_path / "m.log")
    assert (logits(merged_loaded(out)) - live_logits(zero1)).abs().max().item() <= LOGITS_ATOL
    from deepspeed_ext.demo.models import build_model, tiny_config
    build_model("llama", seed=99).save_pretrained(tmp_path / "other")
    proc = cli(["to-hf", str(zero1.tag_dir), "-o", str(tmp_path / "x"), "--merge", "--base", str(tmp_path / "other"), "-q"],
               tmp_path / "other.log", check=False)
    assert proc.returncode != 0 and "differs from the base weights" in proc.stderr and "--base" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    build_model("llama", config=tiny_config("llama", kv_heads=2)).save_pretrained(tmp_path / "narrow")
    proc = cli(["to-hf", str(zero1.tag_dir), "-o", str(tmp_path / "y"), "--merge", "--base", str(tmp_path / "narrow"), "-q"],
               tmp_path / "narrow.log", check=False)
    assert proc.returncode != 0 and "wrong --base?" in proc.stderr, proc.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_a_peft_adapter_goes_into_deepspeed_and_comes_back_exact(zero1, tmp_path):
    """PEFT adapter -> from-hf (on its base) -> a DeepSpeed run (ZeRO-2, DP=2, other initial weights) that loads it
    and saves before its first step -> to-hf: the same adapter, bit for bit, and the same config."""
    adapter = tmp_path / "adapter"
    cli(["to-hf", str(zero1.tag_dir), "-o", str(adapter), "-q"], tmp_path / "adapter.log")
    base = save_base(zero1, tmp_path / "base")
    imported = tmp_path / "imported"
    out = cli(["from-hf", str(adapter), "--base", str(base), "-o", str(imported)], tmp_path / "from-hf.log").stdout
    assert "fresh optimizer" in out, out
    run = tmp_path / "run"
    args = zero1.common(1) + RESUMED_INIT + ["--zero", "2", "--load-dir", str(imported), "--save-dir", str(run),
                                             "--save-at", "0", "--steps", "1", "--result", str(tmp_path / "r.json")]
    torchrun_train(2, args, tmp_path / "run.log")
    assert read_losses(tmp_path / "r.json")
    back = tmp_path / "back"
    cli(["to-hf", str(run), "--tag", "global_step0", "-o", str(back), "-q"], tmp_path / "back.log")
    from safetensors.torch import load_file
    a, b = load_file(adapter / "adapter_model.safetensors"), load_file(back / "adapter_model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((adapter / "adapter_config.json").read_text()) == json.loads(
        (back / "adapter_config.json").read_text())


def test_maxtext_gets_the_merged_weights(zero1, tmp_path):
    """to-maxtext of an adapter checkpoint writes the merged model: the same arrays as to-maxtext of to-hf --merge's
    output; --with-optimizer is refused in one line (MaxText's optimizer would train the whole model)."""
    merged = tmp_path / "merged"
    cli(["to-hf", str(zero1.tag_dir), "-o", str(merged), "--merge", "-q"], tmp_path / "m.log")
    for source, name in ((zero1.tag_dir, "adapter"), (merged, "merged")):
        cli(["to-maxtext", str(source), "-o", str(tmp_path / f"mt-{name}"), "--dtype", "float32", "-q"],
            tmp_path / f"mt-{name}.log")
    proc = cli(["compare", str(tmp_path / "mt-adapter"), str(tmp_path / "mt-merged")], tmp_path / "cmp.log",
               check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = cli(["to-maxtext", str(zero1.tag_dir), "-o", str(tmp_path / "opt"), "--with-optimizer"],
               tmp_path / "opt.log", check=False)
    assert proc.returncode != 0 and "an adapter checkpoint" in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_bad_adapter_input_gets_one_line(zero1, tmp_path):
    adapter = tmp_path / "adapter"
    cli(["to-hf", str(zero1.tag_dir), "-o", str(adapter), "-q"], tmp_path / "adapter.log")
    cases = [
        (["from-hf", str(adapter), "-o", str(tmp_path / "a")], "pass --base"),
        (["to-hf", str(zero1.tag_dir), "-o", str(tmp_path / "b"), "--adapter", "nope"], "no adapter 'nope'"),
        (["to-hf", str(zero1.tag_dir), "-o", str(tmp_path / "c"), "--base", str(adapter)], "--base is for --merge"),
    ]
    merged = tmp_path / "merged"
    cli(["to-hf", str(zero1.tag_dir), "-o", str(merged), "--merge", "-q"], tmp_path / "m.log")
    cases.append((["to-hf", str(merged), "-o", str(tmp_path / "d"), "--merge"], "not an adapter checkpoint"))
    before = sorted(p.name for p in adapter.iterdir())
    for args, expected in cases:
        proc = cli(args + ["-q"], tmp_path / "bad.log", check=False)
        assert proc.returncode != 0 and expected in proc.stderr, (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, (args, proc.stderr)
        assert not Path(args[args.index("-o") + 1]).exists()
    assert sorted(p.name for p in adapter.iterdir()) == before
    shutil.rmtree(merged)
