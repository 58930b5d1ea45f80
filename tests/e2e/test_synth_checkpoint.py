"""The benchmark's generated checkpoint (``bench/synth_checkpoint.py``) against what the real engine writes.

The memory benchmark at Llama-3-8B's shapes runs on a checkpoint written without training (the engine cannot
train that model on the benchmark machine), so its layout must be DeepSpeed's own. Here the real DeepSpeed
engine trains one step of a small Llama (GQA 8 / 2 heads, a vocabulary TP=2 splits unevenly) at TP=2, ZeRO-1,
bf16 with deepspeed-ext enabled; the generator writes the same model; the two must have the same files, the same
keys at every depth, the same tensor shapes, dtypes, strides and storages, and the same non-tensor values, all
but the values of the weights and their sums. Then ``to-universal`` of the generated one (which checks its
fingerprints) must give back exactly the full tensors the generator meant.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.runner import cli, torchrun_train

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import synth_checkpoint as synth  # noqa: E402

TAG = "global_step1"


def _compare(real: Any, generated: Any, where: str, problems: list[str]) -> None:
    """Recursively: same types, keys (in order), lengths, tensor metadata, and equal non-tensor values."""
    if type(real) is not type(generated):
        problems.append(f"{where}: type {type(real).__name__} vs {type(generated).__name__}")
    elif torch.is_tensor(real):
        for attr in ("shape", "dtype", "stride", "storage_offset"):
            a, b = getattr(real, attr), getattr(generated, attr)
            a, b = (a(), b()) if callable(a) else (a, b)
            if a != b:
                problems.append(f"{where}: tensor {attr} {a} vs {b}")
        if real.untyped_storage().nbytes() != generated.untyped_storage().nbytes():
            problems.append(f"{where}: storage of {real.untyped_storage().nbytes()} vs "
                            f"{generated.untyped_storage().nbytes()} bytes")
        if real.ndim == 0 and not torch.equal(real, generated):  # the Adam step: a value both must agree on
            problems.append(f"{where}: {real.item()} vs {generated.item()}")
    elif isinstance(real, dict):
        if list(real) != list(generated):
            problems.append(f"{where}: keys {list(real)} vs {list(generated)}")
        for key in real:
            if key in generated:
                _compare(real[key], generated[key], f"{where}[{key!r}]", problems)
    elif isinstance(real, (list, tuple)):
        if len(real) != len(generated):
            problems.append(f"{where}: length {len(real)} vs {len(generated)}")
        for i, (a, b) in enumerate(zip(real, generated, strict=False)):
            _compare(a, b, f"{where}[{i}]", problems)
    elif hasattr(real, "__dict__") and not isinstance(real, type):  # DeepSpeed's data classes
        _compare(vars(real), vars(generated), f"{where}.__dict__", problems)
    elif real != generated:
        problems.append(f"{where}: {real!r} vs {generated!r}")


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path, synth.Plan]:
    root = tmp_path_factory.mktemp("synth")
    config = synth.llama_config_dict(synth.SHAPES["small"])
    (root / "config.json").write_text(json.dumps(config))
    real = root / "real"
    torchrun_train(2, ["--tp", "2", "--zero", "1", "--dtype", "bf16", "--steps", "1", "--save-dir", str(real),
                       "--save-at", "1", "--model-config", str(root / "config.json")], root / "train.log")
    plan = synth.make_plan(config, tp=2, seed=7)
    generated = root / "generated"
    synth.write_checkpoint(plan, generated, TAG, log=False)
    return real, generated, plan


def test_generated_checkpoint_has_the_real_engines_layout(checkpoints):
    real, generated, _ = checkpoints
    assert _files(real) == _files(generated)
    problems: list[str] = []
    for name in _files(real):
        a, b = real / name, generated / name
        if name.endswith(".pt"):
            _compare(torch.load(a, mmap=True, weights_only=False), torch.load(b, mmap=True, weights_only=False),
                     name, problems)
        elif name.endswith("deepspeed_ext.commit.json"):
            ours, theirs = json.loads(a.read_text()), json.loads(b.read_text())
            # The files' sizes and CRC-32s follow the values (pickled numbers, the fingerprints' digits), the time is
            # the save's; which files it lists and the rest may not differ.
            for marker in (ours, theirs):
                marker.pop("committed_at")
                marker["files"] = sorted(marker["files"])
            _compare(ours, theirs, name, problems)
        elif name.endswith(".json"):
            ours, theirs = json.loads(a.read_text()), json.loads(b.read_text())
            # The fingerprints' sums are of the values, which legitimately differ; everything else may not.
            for sums in (ours["fingerprints"]["tensors"], theirs["fingerprints"]["tensors"]):
                for states in sums.values():
                    for state, (numel, _, _) in states.items():
                        states[state] = numel
            _compare(ours, theirs, name, problems)
        elif a.read_bytes() != b.read_bytes():  # latest, DeepSpeed's recovery scripts
            problems.append(f"{name}: contents differ")
    assert not problems, "\n".join(problems)


def test_generated_checkpoint_converts_to_the_tensors_it_meant(checkpoints, tmp_path):
    _, generated, plan = checkpoints
    out = tmp_path / "universal"
    cli(["to-universal", str(generated / TAG), "-o", str(out), "--quiet"], tmp_path / "convert.log")
    zero = out / f"{TAG}_universal" / "zero"
    for param in plan.params:
        for state in synth.STATES:
            converted = torch.load(zero / param.name / f"{state}.pt", weights_only=True)["param"]
            assert torch.equal(converted, synth.full_tensor(plan, param.name, state)), (param.name, state)
