"""The Hugging Face Trainer training a peft LoRA model with DeepSpeed and ``deepspeed_ext.enable()`` (the tiny Llama,
LoRA r=4 on every linear layer, fp32): a ``checkpoint-N`` the Trainer saved (adapters alone: it saves a peft model
without its frozen parameters) resumes at another TP and DP degree with the uninterrupted run's losses, and
``deepspeed-ext to-hf OUTPUT_DIR`` gives the PEFT adapter and, on the base model, the merged model, each with the
trained model's logits. The global batch is 4 sequences at every degree (each DP rank takes 4 / DP)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from harness.adapters import logits, merged_loaded
from harness.runner import cli, run_logged

WORKER = Path(__file__).resolve().parents[1] / "harness" / "workers" / "hf_trainer.py"
REL_TOL = 2e-3
LOGITS_ATOL = 1e-5


def trainer(tp: int, dp: int, zero: int, out: Path, result: Path, *extra: str) -> dict:
    run_logged([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={tp * dp}",
                str(WORKER), "--tp", str(tp), "--dp", str(dp), "--zero", str(zero), "--lora", "4", "--fp32",
                "--steps", "6", "--output-dir", str(out), "--result", str(result), *extra],
               result.with_suffix(".log"))
    return json.loads(result.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(tp, dp, zero)``: an uninterrupted 6-step run that saved checkpoint-3 and -6 and dumped its logits."""
    cache: dict[tuple[int, int, int], tuple[Path, dict]] = {}

    def get(tp: int, dp: int, zero: int) -> tuple[Path, dict]:
        if (tp, dp, zero) not in cache:
            root = tmp_path_factory.mktemp(f"lora_trainer_tp{tp}_dp{dp}_zero{zero}")
            result = trainer(tp, dp, zero, root / "out", root / "base.json", "--save-steps", "3", "--dump-logits",
                             str(root / "logits.pt"))
            cache[(tp, dp, zero)] = root, result
        return cache[(tp, dp, zero)]

    return get


@pytest.mark.parametrize("saved,resumed", [((2, 1, 2), (1, 2)), ((1, 2, 3), (2, 1))],
                         ids=["zero2-tp2-to-dp2", "zero3-dp2-to-tp2"])
def test_a_trainer_checkpoint_resumes_at_another_tp_and_dp(runs, saved, resumed, tmp_path):
    root, base = runs(*saved)
    tp, dp = resumed
    got = trainer(tp, dp, saved[2], tmp_path / "out", tmp_path / "resumed.json", "--save-steps", "100", "--resume",
                  str(root / "out" / "checkpoint-3"))
    assert sorted(int(step) for step in got["losses"]) == [4, 5, 6], got["losses"]
    for step, loss in got["losses"].items():
        want = base["losses"][step]
        assert abs(loss - want) <= REL_TOL * abs(want), (step, loss, want)


def test_to_hf_of_the_output_dir_gives_the_adapter_and_the_merged_model(runs, tmp_path):
    """TP=2 ZeRO-2: the Trainer's own adapter_model.safetensors there is empty (it saves under AutoTP what peft finds
    of the shards); to-hf gives the whole adapter, which peft loads with no missing or unexpected keys, and, with
    --base, the merged model; both with the trained model's logits."""
    root, _ = runs(2, 1, 2)
    live = torch.load(root / "logits.pt", weights_only=True)
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file

    from deepspeed_ext.demo.models import build_model
    base = tmp_path / "base"
    build_model("llama").save_pretrained(base)  # the model the worker wrapped with peft
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    out = cli(["to-hf", str(root / "out"), "-o", str(adapter)], tmp_path / "adapter.log")
    assert "checkpoint-6" in out.stderr and "wrote PEFT adapter" in out.stdout
    model = PeftModel.from_pretrained(build_model("llama"), adapter)
    saved = load_file(adapter / "adapter_model.safetensors")
    assert len(saved) == 28 and sorted(saved) == sorted(get_peft_model_state_dict(model))
    assert (logits(model) - live).abs().max().item() <= LOGITS_ATOL

    proc = cli(["to-hf", str(root / "out"), "-o", str(merged), "--merge"], tmp_path / "nobase.log", check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("deepspeed-ext: error")]
    assert proc.returncode != 0 and len(errors) == 1 and "pass --base" in errors[0], proc.stderr
    cli(["to-hf", str(root / "out"), "-o", str(merged), "--merge", "--base", str(base), "-q"], tmp_path / "m.log")
    assert (logits(merged_loaded(merged)) - live).abs().max().item() <= LOGITS_ATOL
    summary = json.loads(cli(["inspect", str(root / "out"), "--json"], tmp_path / "inspect.log").stdout)
    assert "--base BASE_MODEL_DIR" in summary["adapter_exports"], summary["adapter_exports"]
