"""Frozen parameters (``requires_grad=False``: in no optimizer partition, only in the model states) come back at
any degree, from the universal form and straight from the DeepSpeed checkpoint, into a model built with other
initial weights (the resumes' ``--init-seed``): every weight equals the saved one and the next losses are the
uninterrupted run's. Their weights are in the universal form (``fp32`` alone), in the resume fingerprints and in
what the exporters write.

Two saved runs of the tiny Llama: ZeRO-1 at DP=2 with the embedding frozen (the run the issue reported, resumed at
DP=1 before: 1e-2 off, exit 0), and ZeRO-3 at DP=2 with sharded projections frozen too (their ZeRO-3 fragments),
resumed at TP=2 under ZeRO-2 (cut into column and row slices).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from deepspeed_ext.checkpoint import serialization
from harness.environments import REPO, unavailable
from harness.runner import cli, torchrun_train
from harness.scenario import RESUMED_INIT, Load

EMBEDDING = "model.embed_tokens.weight"
#: Sharded by AutoTP at TP=2: column (q_proj), row (down_proj).
SHARDED = r"embed_tokens|layers\.0\.self_attn\.q_proj|layers\.1\.mlp\.down_proj"
#: The losses of a resume at another degree agree with the uninterrupted run's to bf16's summation-order noise.
RTOL = 2e-4
OLD_PYTHON = REPO / ".venv-deepspeed-0.18.8" / "bin" / "python"


@pytest.fixture(scope="module")
def zero1(scenarios):
    return scenarios("frozen_embedding_dp2_zero1", tp=1, dp=2, zero=1, freeze="embed_tokens")


@pytest.fixture(scope="module")
def zero3(scenarios):
    return scenarios("frozen_sharded_dp2_zero3", tp=1, dp=2, zero=3, freeze=SHARDED)


def frozen_names(scenario) -> list[str]:
    """The parameters the saved run froze, as the universal form lists them."""
    info = json.loads((scenario.universal_dir / "deepspeed_ext.json").read_text())
    return info["frozen_params"]


def close(resumed: dict[int, float], baseline: dict[int, float]) -> bool:
    return all(abs(loss - baseline[step]) <= RTOL * abs(baseline[step]) for step, loss in resumed.items())


def test_zero1_frozen_embedding_resumes_at_dp1_with_every_weight(zero1):
    """The universal form carries the frozen embedding as weights only; a resume at DP=1 from it and from the
    original holds every saved weight right after the load, and its losses are the uninterrupted run's."""
    assert frozen_names(zero1) == [EMBEDDING]
    files = sorted(p.name for p in (zero1.universal_dir / "zero" / EMBEDDING).iterdir())
    assert files == ["fp32.pt"], files
    saved = zero1.live_state()[0]
    universal = serialization.load(zero1.universal_dir / "zero" / EMBEDDING / "fp32.pt")["param"]
    assert torch.equal(universal, saved[EMBEDDING]["fp32"])
    loads = [Load(1, 1, zero1.universal_dir), Load(1, 1, zero1.tag_dir, load_universal=False)]
    for (ranks, losses), load in zip(zero1.loaded_many(loads), loads, strict=True):
        loaded = ranks[0]
        assert set(loaded) == set(saved), load
        for name, states in saved.items():
            assert torch.equal(loaded[name]["fp32"], states["fp32"]), (load, name)
        assert losses and close(losses, zero1.baseline), (load, losses, zero1.baseline)


def test_zero3_frozen_shards_resume_at_tp2_zero2(zero3):
    """ZeRO-3's frozen fragments, merged over DP and cut into TP=2's column and row slices under ZeRO-2: the
    losses after the resume, from the universal form and from the original, are the uninterrupted run's."""
    names = frozen_names(zero3)
    assert len(names) == 3 and EMBEDDING in names
    saved = zero3.live_state()[0]
    from deepspeed_ext.checkpoint.universal import UniversalCheckpoint
    universal = UniversalCheckpoint(zero3.universal_dir)
    for name in names:  # the bare flat tensor upstream writes from ZeRO-3 at TP=1, shaped by the recorded shape
        assert torch.equal(universal.load(name), saved[name]["fp32"]), name
    loads = [Load(2, 1, zero3.universal_dir, extra=("--zero", "2")),
             Load(2, 1, zero3.tag_dir, load_universal=False, extra=("--zero", "2"))]
    for (_, losses), load in zip(zero3.loaded_many(loads), loads, strict=True):
        assert losses and close(losses, zero3.baseline), (load, losses, zero3.baseline)


@pytest.mark.parametrize("python", [sys.executable, str(OLD_PYTHON)], ids=["deepspeed-0.19.8", "deepspeed-0.18.8"])
def test_zero0_frozen_masters_are_restored_too(scenarios, python):
    """Without ZeRO, DeepSpeed 0.18.8's bf16 wrapper keeps an fp32 master of every parameter it was handed, frozen
    ones too (0.19.8 leaves them out), steps it with a zero gradient (so it saves Adam moments for it) and copies
    the masters into the weights at each step: a resume that set only the weights would have them back at the
    model's initial values one step later, and the weights (bf16) are not what the master (fp32) holds. Two steps
    after a resume at DP=1, from both forms, the losses are the uninterrupted run's."""
    if not Path(python).exists():
        unavailable(f"{python} (scripts/setup.sh builds it)")
    zero0 = scenarios("frozen_dp2_zero0", tp=1, dp=2, zero=0, freeze=r"embed_tokens|layers\.1\.mlp", python=python)
    info = json.loads((zero0.universal_dir / "deepspeed_ext.json").read_text())
    assert len(info.get("frozen_params", [])) == (4 if python == sys.executable else 0)
    for load_dir in (zero0.universal_dir, zero0.tag_dir):
        resumed = zero0.resume(1, 1, load_dir=load_dir)
        assert sorted(resumed) == [4, 5] and close(resumed, zero0.baseline), (load_dir, resumed, zero0.baseline)


def test_a_frozen_weight_changed_on_disk_stops_the_resume_naming_it(zero1, tmp_path):
    """The resume fingerprints cover frozen weights: one changed in the universal form after it was written stops
    the resume, naming it."""
    copy = tmp_path / "uni"
    shutil.copytree(zero1.universal_dir, copy)
    path = copy / "zero" / EMBEDDING / "fp32.pt"
    entry = serialization.load(path)
    tensor = entry["param"].clone()
    tensor[0] += 1.0
    torch.save({**entry, "param": tensor}, path)
    log = tmp_path / "resume.log"
    proc = torchrun_train(1, zero1.common(1) + RESUMED_INIT + ["--load-dir", str(copy)], log, check=False)
    assert proc.returncode != 0
    assert "resume fingerprints disagree" in log.read_text() and EMBEDDING in log.read_text()


def test_exporters_and_inspect_see_frozen_parameters(zero1, tmp_path):
    """to-hf writes the frozen embedding (it refused the checkpoint, blaming the config), verify checks it and
    inspect counts it, for the DeepSpeed checkpoint and its universal form; to-maxtext writes it too, and refuses
    --with-optimizer in one line (MaxText's optimizer would train it)."""
    for source, name in ((zero1.tag_dir, "ds"), (zero1.universal_dir, "uni")):
        summary = json.loads(cli(["inspect", str(source), "--json"], tmp_path / f"inspect-{name}.log").stdout)
        assert summary["frozen_parameters"].startswith("1 of 21 parameters"), summary
        out = tmp_path / f"hf-{name}"
        cli(["to-hf", str(source), "-o", str(out), "-q"], tmp_path / f"to-hf-{name}.log")
        from safetensors.torch import load_file
        weights = {key: value for file in sorted(out.glob("*.safetensors")) for key, value in load_file(file).items()}
        saved = zero1.live_state()[0][EMBEDDING]["fp32"]
        assert weights[EMBEDDING].dtype == torch.bfloat16 and torch.equal(weights[EMBEDDING].float(), saved)
        cli(["verify", str(source)], tmp_path / f"verify-{name}.log")
    cli(["to-maxtext", str(zero1.tag_dir), "-o", str(tmp_path / "maxtext"), "-q"], tmp_path / "to-maxtext.log")
    proc = cli(["to-maxtext", str(zero1.tag_dir), "-o", str(tmp_path / "maxtext-full"), "--with-optimizer", "-q"],
               tmp_path / "to-maxtext-full.log", check=False)
    assert proc.returncode == 2 and f"are frozen (e.g. {EMBEDDING})" in proc.stderr, proc.stderr
    assert not (tmp_path / "maxtext-full").exists()


def test_to_universal_records_what_upstream_leaves_out(zero1, tmp_path):
    """The frozen weight is listed in the universal form's record with its fingerprint (upstream's converter
    drops it without --inject_missing_state, and upstream's loader drops it either way)."""
    info = json.loads((zero1.universal_dir / "deepspeed_ext.json").read_text())
    assert set(info["fingerprints"]["tensors"][EMBEDDING]) == {"fp32"}
    assert info["params"][EMBEDDING]["shape"] == [101, 64]
    assert Path(zero1.universal_dir / "zero" / "lm_head.weight" / "exp_avg.pt").is_file()
