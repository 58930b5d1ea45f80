"""Adapter checkpoints against peft itself (no DeepSpeed): a peft model with three adapters (rsLoRA with an
alpha_pattern, an embedding adapter and a module saved whole; DoRA; lora_bias), saved whole as safetensors beside
its adapter configs. What to-hf writes of it is what peft writes and merges."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from deepspeed_ext.checkpoint.adapters import find_adapters, live_name, peft_key


def _peft_model():
    from peft import LoraConfig, get_peft_model

    from deepspeed_ext.demo.models import build_model
    torch.manual_seed(0)
    model = get_peft_model(build_model("llama", seed=1), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "embed_tokens"], use_rslora=True,
        alpha_pattern={"v_proj": 3}, modules_to_save=["lm_head"]))
    model.add_adapter("second", LoraConfig(r=2, lora_alpha=4, target_modules=["o_proj", "down_proj"], use_dora=True))
    model.add_adapter("third", LoraConfig(r=3, lora_alpha=5, target_modules=["k_proj", "up_proj"], lora_bias=True))
    with torch.no_grad():  # peft starts lora_B at zero: give every adapter tensor values that change the output
        for name, param in model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                param.add_(0.05 * torch.randn_like(param))
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The model's whole state dict as an HF directory, with peft's own save of both adapters beside it."""
    from safetensors.torch import save_file
    model = _peft_model()
    directory = tmp_path_factory.mktemp("peft_whole")
    reference = tmp_path_factory.mktemp("peft_reference")
    model.save_pretrained(reference, selected_adapters=["default", "second", "third"])
    for name in ("default", "second", "third"):  # the configs beside the weights, as save_pretrained lays them out
        source = reference if name == "default" else reference / name
        (directory / (name if name != "default" else "")).mkdir(exist_ok=True)
        (directory / (name if name != "default" else "") / "adapter_config.json").write_text(
            (source / "adapter_config.json").read_text())
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / "model.safetensors"))
    model.get_base_model().config.to_json_file(directory / "config.json")
    return model, directory, reference


def test_the_names_are_read_as_peft_writes_them(saved):
    """peft_key gives the keys peft's save_pretrained writes, for each adapter; live_name undoes it."""
    from safetensors.torch import load_file
    model, _, reference = saved
    names = list(model.state_dict())
    found = find_adapters(names)
    assert found is not None and sorted(found.adapters) == ["default", "second", "third"]
    assert found.prefix == "base_model.model."
    for adapter, folder in (("default", reference), ("second", reference / "second"), ("third", reference / "third")):
        written = load_file(folder / "adapter_model.safetensors")
        ours = {peft_key(name, adapter, found.prefix): name for name in found.parameters_of(adapter)}
        assert sorted(ours) == sorted(written), (adapter, sorted(set(ours) ^ set(written)))
        saved_modules = json.loads((folder / "adapter_config.json").read_text()).get("modules_to_save") or []
        for key, name in ours.items():
            assert live_name(key, adapter, saved_modules) == name, (key, name)


def _logits(model) -> torch.Tensor:
    from deepspeed_ext.demo.models import eval_batch
    with torch.no_grad():
        return model(input_ids=eval_batch()).logits.float()


@pytest.mark.parametrize("adapter", ["default", "second"])
def test_merged_export_is_peft_merge_and_unload(saved, tmp_path, adapter):
    import deepspeed_ext
    from transformers import AutoModelForCausalLM
    model, directory, _ = saved
    out = deepspeed_ext.convert(directory, tmp_path / "merged", to="hf", merge=True, adapters=[adapter],
                                progress=False)
    ours = AutoModelForCausalLM.from_pretrained(out)
    live = copy.deepcopy(model)
    live.set_adapter(adapter)  # the model as it runs with this adapter (a module saved by another: its original)
    assert (_logits(ours) - _logits(live)).abs().max().item() <= 1e-5
    theirs = live.merge_and_unload(adapter_names=[adapter])
    assert (_logits(ours) - _logits(theirs)).abs().max().item() <= 1e-5


def test_a_bias_with_nowhere_to_go_is_not_merged(saved, tmp_path):
    """lora_bias on layers without a bias (Llama's): peft cannot merge it, nor can we; one line, nothing written."""
    import deepspeed_ext
    from deepspeed_ext.errors import CheckpointError
    _, directory, _ = saved
    with pytest.raises(CheckpointError, match="lora_bias") as raised:
        deepspeed_ext.convert(directory, tmp_path / "out", to="hf", merge=True, adapters=["third"], progress=False)
    assert "\n" not in str(raised.value) and not (tmp_path / "out").exists()


def test_peft_adapter_export_is_peft_save_pretrained(saved, tmp_path):
    """Every adapter: default at OUT, the others in OUT/<name>, each file's tensors and config as peft's own."""
    import deepspeed_ext
    from safetensors.torch import load_file
    _, directory, reference = saved
    out = deepspeed_ext.convert(directory, tmp_path / "adapters", to="hf", adapters=["default", "second", "third"],
                                progress=False)
    for ours, theirs in ((out, reference), (out / "second", reference / "second"), (out / "third", reference / "third")):
        a, b = load_file(ours / "adapter_model.safetensors"), load_file(theirs / "adapter_model.safetensors")
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
        assert json.loads((ours / "adapter_config.json").read_text()) == json.loads(
            (theirs / "adapter_config.json").read_text())


def test_an_adapter_without_its_config_is_refused_where_it_is_needed(saved, tmp_path):
    """Without a recorded config, the scale is unknown: merging says how to give it (--adapter-config)."""
    import shutil

    import deepspeed_ext
    from deepspeed_ext.errors import CheckpointError
    _, directory, reference = saved
    bare = tmp_path / "bare"
    shutil.copytree(directory, bare)
    (bare / "adapter_config.json").unlink()
    shutil.rmtree(bare / "second")
    shutil.rmtree(bare / "third")
    with pytest.raises(CheckpointError, match="--adapter-config"):
        deepspeed_ext.convert(bare, tmp_path / "out", to="hf", merge=True, adapters=["default"], progress=False)
    with pytest.raises(CheckpointError, match="one adapter's config"):
        deepspeed_ext.convert(bare, tmp_path / "out", to="hf", merge=True,
                              adapter_config=Path(reference) / "adapter_config.json", progress=False)
    assert not (tmp_path / "out").exists()
