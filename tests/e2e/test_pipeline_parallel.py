"""Pipeline-parallel checkpoints on the real engine: DeepSpeed's ``PipelineModule`` with
``PipeModelDataParallelTopology`` (``deepspeed_ext.demo.pipeline``: CPU, gloo, ZeRO-1, bf16), saved at PP=2 x TP=2
on 4 processes (``layer_XX-model_YY`` files, ``mp_rank`` files numbered stage-major), converted and resumed at other
PP / TP degrees, against upstream's converter and upstream's own pipeline loader."""

import json
import sys
from pathlib import Path

import pytest
import torch

from harness.runner import cli, run_logged

TOLERANCE = 2e-3
STATES = ("fp32", "exp_avg", "exp_avg_sq")


def pipeline(nproc: int, args: list[str], log: Path, check: bool = True):
    """``torchrun --nproc_per_node N -m deepspeed_ext.demo.pipeline ARGS``."""
    return run_logged([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                       "-m", "deepspeed_ext.demo.pipeline", *args], log, check=check)


def losses(path: Path) -> dict[int, float]:
    return {int(step): loss for step, loss in json.loads(path.read_text())["losses"].items()}


@pytest.fixture(scope="module")
def pp2_tp2(tmp_path_factory):
    """PP=2 x TP=2 on 4 processes, saved after step 3 of 4; the uninterrupted run's losses."""
    root = tmp_path_factory.mktemp("pp2_tp2")
    pipeline(4, ["--pp", "2", "--tp", "2", "--steps", "4", "--save-dir", str(root / "ckpt"), "--save-at", "3",
                 "--result", str(root / "baseline.json")], root / "train.log")
    cli(["to-universal", str(root / "ckpt"), "--quiet"], root / "convert.log")
    return root, losses(root / "baseline.json")


def _resume(root: Path, name: str, nproc: int, args: list[str]) -> dict[int, float]:
    result = root / f"{name}.json"
    pipeline(nproc, [*args, "--steps", "4", "--result", str(result)], root / f"{name}.log")
    return losses(result)


def test_pp2_tp2_inspects_and_converts_with_upstreams_tensors(pp2_tp2, tmp_path):
    """Our universal form equals upstream's converter on every tensor and step, except where upstream is wrong: with
    no TP metadata (``--inject_missing_state``, the only way it reads this checkpoint) it concatenates the two TP
    ranks' replicas of each plain ``nn.Linear`` along dim 0, doubling its shape; ours holds the tensor once."""
    from deepspeed_ext.checkpoint import serialization
    root, _ = pp2_tp2
    summary = json.loads(cli(["inspect", str(root / "ckpt"), "--json"], tmp_path / "inspect.log").stdout)
    assert (summary["pp_degree"], summary["tp_degree"], summary["dp_degree"]) == (2, 2, 1)
    ours = root / "ckpt" / "global_step3_universal"
    upstream = upstream_ds_to_universal_injected(root / "ckpt" / "global_step3", tmp_path / "upstream")
    names = sorted(p.name for p in (ours / "zero").iterdir() if p.is_dir())
    assert names == sorted(p.name for p in (upstream / "zero").iterdir() if p.is_dir())
    assert len(names) == 35  # both stages: embedding, 5 blocks, norm, head
    for name in names:
        for state in STATES:
            mine = serialization.load(ours / "zero" / name / f"{state}.pt")["param"]
            theirs = serialization.load(upstream / "zero" / name / f"{state}.pt")["param"]
            assert torch.equal(theirs, torch.cat([mine, mine])), f"{name}/{state}"
        assert float(serialization.load(ours / "zero" / name / "step.pt")) == 3.0


def test_pp2_tp2_resumes_at_other_pipeline_and_tp_degrees(pp2_tp2):
    """Straight from the DeepSpeed checkpoint (our restore, each stage reading its layers) at PP=1 x TP=1, and from
    the universal form by upstream's own pipeline loader at PP=1: the next loss is the uninterrupted run's, and the
    fingerprints recorded across both stages match. (PP=4, PP=2 x TP=1 and PP=1 x TP=2 resume the same way: the
    restore is per parameter, whatever stage holds it.)"""
    root, baseline = pp2_tp2
    ckpt = str(root / "ckpt")
    runs = {"pp1_tp1_direct": (1, ["--pp", "1", "--tp", "1", "--load-dir", ckpt]),
            "pp1_universal_upstream": (1, ["--pp", "1", "--tp", "1", "--load-dir", ckpt, "--load-universal",
                                           "--plain"])}
    for name, (nproc, args) in runs.items():
        resumed = _resume(root, name, nproc, args)
        assert sorted(resumed) == [4], (name, resumed)
        assert abs(resumed[4] - baseline[4]) <= TOLERANCE * abs(baseline[4]), (name, resumed, baseline)
    assert "resume fingerprints match" in (root / "pp1_tp1_direct.log").read_text()


def test_a_model_that_does_not_fit_is_refused_on_every_stage(pp2_tp2, tmp_path):
    """A pipeline of other layers (4 blocks where 5 were saved): every rank stops with the same line, none waits
    for the stage that found it."""
    root, _ = pp2_tp2
    proc = pipeline(2, ["--pp", "2", "--layers", "4", "--steps", "4", "--load-dir", str(root / "ckpt")],
                    tmp_path / "refused.log", check=False)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    lines = {line.split("]: ", 1)[1] for line in output.splitlines() if "RefusedOnEveryRank: " in line
             and line.startswith("[rank")}
    assert len(lines) == 1 and "no saved tensors for 2 model parameters" in lines.pop(), output[-3000:]
    assert sum(f"[rank{r}]: deepspeed_ext.checkpoint.collective.RefusedOnEveryRank" in output for r in (0, 1)) == 2


def upstream_ds_to_universal_injected(tag_dir: Path, out: Path) -> Path:
    """Upstream's converter on a checkpoint without its TP metadata (a pipeline of plain layers has none)."""
    run_logged([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag_dir),
                "--output_folder", str(out), "--num_extract_workers", "1", "--num_merge_workers", "1",
                "--inject_missing_state"], out.with_name(out.name + ".log"))
    return out



def test_frozen_layers_of_a_pipeline_come_back_at_pp1(tmp_path):
    """A pipeline engine keeps its module in layer files, not in the model states: the frozen layers (the embedding
    and a block, in no optimizer partition) are read from them, carried by the universal form and restored at
    PP=1 into a model built with other initial weights; the losses are the uninterrupted run's."""
    frozen = r"^0\.|^3\."
    pipeline(2, ["--pp", "2", "--freeze", frozen, "--steps", "5", "--save-dir", str(tmp_path / "ckpt"), "--save-at",
                 "3", "--result", str(tmp_path / "baseline.json")], tmp_path / "train.log")
    baseline = losses(tmp_path / "baseline.json")
    summary = json.loads(cli(["inspect", str(tmp_path / "ckpt"), "--json"], tmp_path / "inspect.log").stdout)
    assert summary["frozen_parameters"].startswith("7 of 35 parameters"), summary
    cli(["to-universal", str(tmp_path / "ckpt"), "-o", str(tmp_path / "uni"), "--quiet"], tmp_path / "convert.log")
    for source in ("ckpt", "uni"):
        result = tmp_path / f"resumed-{source}.json"
        pipeline(1, ["--pp", "1", "--freeze", frozen, "--init-seed", "77", "--steps", "5", "--load-universal",
                     "--load-dir", str(tmp_path / source), "--result", str(result)], tmp_path / f"{source}.log")
        resumed = losses(result)
        assert sorted(resumed) == [4, 5], resumed
        assert all(abs(loss - baseline[step]) <= TOLERANCE * abs(baseline[step]) for step, loss in resumed.items()), \
            (source, resumed, baseline)


@pytest.mark.parametrize("saved_by", ["deepspeed_ext", "plain"])
def test_tp_copies_that_differ_are_refused_naming_the_pipeline(saved_by, tmp_path):
    """Upstream's own TP x PP test saves a pipeline of plain layers whose model-parallel ranks each trained their own
    copy (here: initial weights seeded per rank). There is no one tensor to convert (upstream's converter
    concatenates the copies into one of twice the shape): refused in one line that names the pipeline and what to
    do, with our metadata (the copies are compared) and without it (nothing says slices or copies); no output."""
    extra = ["--plain"] if saved_by == "plain" else []
    pipeline(4, ["--pp", "2", "--tp", "2", "--steps", "1", "--save-dir", str(tmp_path / "ckpt"), "--save-at", "1",
                 "--seed-per-rank", *extra], tmp_path / "train.log")
    proc = cli(["to-universal", str(tmp_path / "ckpt"), "-o", str(tmp_path / "out"), "--quiet"],
               tmp_path / "convert.log", check=False)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert len(line.splitlines()) == 1 and "PP=2 x TP=2" in line and "train the pipeline at TP=1" in line, line
    if saved_by == "plain":
        assert "pipeline checkpoint has no tensor-parallel metadata" in line and "slices or copies" in line, line
    else:
        assert "of pipeline stage 0" in line and "hold different copies" in line, line
    assert not (tmp_path / "out").exists()
