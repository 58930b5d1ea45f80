"""The Python API without the CLI: open_checkpoint, convert and verify on every format, and the typed joint
between sources and writers (SourceInfo, the format registry, the options classes)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import deepspeed_ext
from deepspeed_ext.checkpoint.formats import FORMATS, detect_all
from deepspeed_ext.checkpoint.source import MASTER_WEIGHTS, CheckpointSource, SourceInfo
from deepspeed_ext.demo.models import build_model
from deepspeed_ext.errors import CheckpointError, MissingConfigError


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    root = tmp_path_factory.mktemp("api")
    model = build_model("llama", seed=11)
    model.save_pretrained(root / "hf", max_shard_size="40KB")
    return root / "hf", model


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters()}


def test_open_reports_what_the_checkpoint_holds(hf):
    path, model = hf
    source = deepspeed_ext.open_checkpoint(path)
    assert isinstance(source, CheckpointSource)
    info = source.info
    assert isinstance(info, SourceInfo)
    assert (info.format, info.given, info.tp_degree, info.global_step, info.states) == (
        "huggingface", path, 1, 0, (MASTER_WEIGHTS, ))
    assert not info.has_optimizer and info.model_config["model_type"] == "llama"
    assert {name: tuple(p.shape) for name, p in model.named_parameters()} == {
        name: layout.shape for name, layout in info.layouts.items()}
    streamed = {t.name: t.load() for t in source.tensors()}
    assert all(torch.equal(streamed[name], value) for name, value in state(model).items())
    assert source.summary()["num_parameters"] == sum(p.numel() for p in model.parameters())


def test_convert_round_trips_through_every_written_format(hf, tmp_path):
    """HF -> universal -> HF and HF -> MaxText -> HF, through the API alone: the weights come back exactly
    (float32 end to end), and each output verifies."""
    path, model = hf
    universal = deepspeed_ext.convert(path, tmp_path / "uni", to="universal", progress=False)
    assert universal == tmp_path / "uni" / "global_step0_universal"
    assert (tmp_path / "uni" / "latest_universal").read_text() == universal.name
    opened = deepspeed_ext.open_checkpoint(tmp_path / "uni")
    assert opened.info.format == "universal" and opened.info.model_config["model_type"] == "llama"

    back = deepspeed_ext.convert(opened, tmp_path / "hf_again", to="hf", dtype="float32", progress=False)
    items = deepspeed_ext.convert(path, tmp_path / "mt", to="maxtext", dtype="float32", progress=False)
    assert items == tmp_path / "mt" / "0" / "items"
    from_maxtext = deepspeed_ext.convert(tmp_path / "mt", tmp_path / "hf_from_mt", to="hf", progress=False)
    for out in (back, from_maxtext):
        files = sorted(out.glob("*.safetensors"))
        weights = {}
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                weights.update({name: handle.get_tensor(name) for name in handle.keys()})
        assert weights.keys() == state(model).keys()
        assert all(torch.equal(weights[name], value) for name, value in state(model).items()), out
    for written in (tmp_path / "uni", back, tmp_path / "mt", from_maxtext):
        report = deepspeed_ext.verify(written)
        assert report.ok, report.lines()
        assert report.tensors == len(state(model)) and report.lines()[-1].startswith(f"{report.root}: OK: ")


def test_verify_reports_damage_instead_of_raising(hf, tmp_path):
    path, _ = hf
    out = deepspeed_ext.convert(path, tmp_path / "hf_copy", to="hf", progress=False)
    shard = sorted(out.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-8])
    report = deepspeed_ext.verify(out)
    assert not report.ok and any(str(shard.name) in problem for problem in report.problems), report.lines()
    assert report.lines()[-1].startswith(f"{out}: FAILED: ")


def test_options_are_checked_per_writer(hf, tmp_path):
    path, _ = hf
    with pytest.raises(ValueError, match="to='onnx'"):
        deepspeed_ext.convert(path, tmp_path / "x", to="onnx")
    with pytest.raises(TypeError, match="max_shard_size"):
        deepspeed_ext.convert(path, tmp_path / "x", to="universal", max_shard_size="1GB")
    with pytest.raises(ValueError, match="needs an output"):
        deepspeed_ext.convert(path, None, to="hf")
    assert not (tmp_path / "x").exists()


def test_the_source_is_protected_through_the_api_too(hf, tmp_path):
    path, _ = hf
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    for out in (path, path / "inside", path.parent):
        with pytest.raises(CheckpointError, match="never writes into its input"):
            deepspeed_ext.convert(path, out, to="hf", overwrite=True, progress=False)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before


def test_config_given_as_a_dict_or_a_path(hf, tmp_path):
    path, _ = hf
    weights_only = tmp_path / "weights_only"
    weights_only.mkdir()
    for file in path.glob("*.safetensors*"):
        (weights_only / file.name).write_bytes(file.read_bytes())
    with pytest.raises(MissingConfigError, match="config.json: missing"):
        deepspeed_ext.open_checkpoint(weights_only)
    config = json.loads((path / "config.json").read_text())
    for given in (config, path / "config.json", str(path / "config.json")):
        assert deepspeed_ext.open_checkpoint(weights_only, config=given).info.model_config == config


def test_the_registry_names_every_format_once(hf, tmp_path):
    """Each format is one registry entry whose module has the reader (and the writer with its options)."""
    assert list(FORMATS) == ["universal", "deepspeed", "huggingface", "maxtext"]
    for fmt in FORMATS.values():
        module = fmt.load()
        assert callable(module.open_source), fmt.name
        if fmt.options is not None:
            assert callable(module.write) and hasattr(module, fmt.options), fmt.name
    path, _ = hf
    assert detect_all(path) == ["huggingface"]
    with pytest.raises(CheckpointError, match="not a DeepSpeed checkpoint"):
        deepspeed_ext.open_checkpoint(path, format="deepspeed")


def test_the_documented_example_prints_and_writes_what_the_page_says(tmp_path, monkeypatch, capsys):
    """docs/python-api.md's runnable example, as written there, does what the page says: it prints the source's
    info (an HF model at TP=1, step 0, every parameter, fp32 only), then one verify summary per checkpoint it wrote
    (OK, every parameter checked, no problem), and ``universal`` and ``items`` are where the page says they are.
    Its output is checked, not only that it runs: an example whose output went wrong would still run."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "python-api.md").read_text()
    example = text.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its tempfile.mkdtemp() in tmp_path, removed after
    # The page: DS_ACCELERATOR=cpu silences DeepSpeed's "Setting accelerator to CPU" line, which DeepSpeed prints
    # where transformers (the example's build_model) imports it first in this process.
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    namespace: dict = {}
    exec(compile(example, "docs/python-api.md", "exec"), namespace)
    work = namespace["work"]
    assert work.parent == tmp_path
    with safe_open(work / "hf" / "model.safetensors", "pt") as saved:
        parameters = len(list(saved.keys()))
    assert parameters > 0
    # "`universal` is `work/uni/global_step0_universal`; `engine.load_checkpoint(work / "uni")` resumes from it"
    assert namespace["universal"] == work / "uni" / "global_step0_universal"
    assert (work / "uni" / "latest_universal").read_text().strip() == "global_step0_universal"
    assert namespace["items"] == work / "maxtext" / "0" / "items"  # "`items` is `work/maxtext/0/items`"
    assert namespace["back"] == work / "hf_again"
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"huggingface 1 0 {parameters} parameters, states: ('fp32',)", printed
    # a report's lines(): its problems (none), then the summary line
    assert len(printed) == 4, printed
    for line, written in zip(printed[1:], (namespace["universal"], work / "maxtext", work / "hf_again"), strict=True):
        assert line.startswith(f"{written}: OK: ") and f" {parameters} tensors " in line, line
        assert line.endswith(" 0 problem(s)"), line


def test_the_family_registry_holds_everything_about_each_family():
    """Every family module exports FAMILIES; each family is found by its name (and the HF spelling of it) and
    inferred from a config of its own model_type; the HF expert splits come from the family that has them."""
    from deepspeed_ext.checkpoint.families import (FAMILY_MODULES, family_names, get_family, hf_expert_splits,
                                                   infer_family)
    assert family_names() == ["llama", "llama3.1", "mistral", "qwen2", "qwen3", "qwen3-moe", "mixtral", "gemma3",
                              "gpt-oss", "deepseek-v3", "qwen3.5", "qwen3.5-moe", "qwen3-next", "gemma4",
                              "deepseek-v3.2", "glm-5", "llama4", "olmo3", "glm-4.5", "minimax-m2", "deepseek-v4"]
    assert len(FAMILY_MODULES) == 16
    for name in family_names():
        family = get_family(name)
        config = {"model_type": family.model_type}
        if family.rope_type:
            config["rope_scaling"] = {"rope_type": family.rope_type, "factor": 8.0}
        assert infer_family(config) is family, name
    assert get_family("qwen3_moe") is get_family("qwen3-moe") and get_family("gpt_oss") is get_family("gpt-oss")
    # An HF model_type finds its family, a text model's type without its "_text" too.
    assert get_family("glm4_moe").name == "glm-4.5" and get_family("qwen3_5_moe").name == "qwen3.5-moe"
    assert get_family("llama4_text").name == "llama4" and get_family("glm_moe_dsa").name == "glm-5"
    assert infer_family({"model_type": "llama", "rope_scaling": {"rope_type": "linear"}}).name == "llama"
    assert hf_expert_splits("qwen3_moe") == get_family("qwen3-moe").hf_expert_splits != ()
    assert hf_expert_splits("llama") == ()
    with pytest.raises(CheckpointError, match="model_type 'gpt2' has no MaxText mapping"):
        infer_family({"model_type": "gpt2"})
    with pytest.raises(CheckpointError, match="unknown model family 'gpt2'"):
        get_family("gpt2")
