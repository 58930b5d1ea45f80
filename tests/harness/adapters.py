"""What the adapter tests check an export against: the live peft model's logits (dumped at save time), peft's own
state dict of a loaded adapter, transformers' model of a merged export."""

from __future__ import annotations

from pathlib import Path

import torch


def base_model(scenario) -> torch.nn.Module:
    """The base model the scenario's run wrapped with peft: the same family, config and initial weights."""
    from deepspeed_ext.demo.models import build_model, tiny_config
    return build_model(scenario.family, seed=1234, config=tiny_config(scenario.family, scenario.kv_heads))


def save_base(scenario, out: Path) -> Path:
    """The base model as an HF directory (what a user's ``--base`` and ``PeftModel.from_pretrained`` start from)."""
    if not (out / "config.json").is_file():
        base_model(scenario).save_pretrained(out)
    return out


def logits(model: torch.nn.Module) -> torch.Tensor:
    from deepspeed_ext.demo.models import eval_batch
    with torch.no_grad():
        return model(input_ids=eval_batch()).logits.float()


def live_logits(scenario) -> torch.Tensor:
    return torch.load(scenario.dump_dir / "logits_tp_rank_00.pt", weights_only=True)


def peft_loaded(scenario, adapter_dir: Path) -> torch.nn.Module:
    """``PeftModel.from_pretrained(base, adapter_dir)``, checked to load with no missing or unexpected adapter keys:
    peft's own state dict of the loaded adapter has exactly the file's keys and values."""
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    model = PeftModel.from_pretrained(base_model(scenario), adapter_dir)
    saved = load_file(adapter_dir / "adapter_model.safetensors")
    loaded = get_peft_model_state_dict(model)
    assert sorted(saved) == sorted(loaded), (sorted(set(saved) ^ set(loaded)))
    for key, value in saved.items():
        assert torch.equal(loaded[key].to(value.dtype), value), key
    return model


def merged_loaded(directory: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    model, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    return model


def assert_every_state_restored(scenario, loads: list, rtol: float) -> None:
    """Right after each load: every saved tensor (the frozen base's weights; each adapter's master and Adam
    moments) equals the live one at save time, bit for bit; the next loss is the uninterrupted run's."""
    saved = scenario.live_state()[0]
    adapters = [name for name in saved if ".lora_" in name]
    assert adapters and all(set(saved[name]) >= {"fp32", "exp_avg", "exp_avg_sq"} for name in adapters)
    for (ranks, losses), load in zip(scenario.loaded_many(loads), loads, strict=True):
        loaded = ranks[0]
        assert set(loaded) == set(saved), (load, set(loaded) ^ set(saved))
        for name, states in saved.items():
            for state, value in states.items():
                assert torch.equal(loaded[name][state], value), (load, name, state)
        assert losses and all(abs(loss - scenario.baseline[step]) <= rtol * abs(scenario.baseline[step])
                              for step, loss in losses.items()), (load, losses, scenario.baseline)
