"""A checkpoint saved before the first optimizer step, and refusals that one rank makes and every rank hears.

One real save serves both (the cheapest a real engine writes: no training step before it). Saved at step 0,
torch's Adam has created no state: ZeRO-1 saves an empty ``base_optimizer_state`` beside the fp32 masters.
Upstream's ``ds_to_universal`` (0.19.8) fails on it (ZeRO-1/2: no fragment extracted, a ``StopIteration``;
ZeRO-3: ``KeyError: 'exp_avg'``), but DeepSpeed resumes it at its own degrees with a fresh optimizer. Ours
converts it as weights alone (``fp32.pt`` per parameter, no moments, no step: upstream's universal loader reads
the files there are) and resumes it at any degree with the optimizer fresh, as a resume from weights does; the
run then trains as the uninterrupted one did.

The refusals: a rank that cannot read its checkpoint (here rank 0 is given one whose model states claim three
pipeline stages over its two model-parallel files, which every reader refuses; its neighbours a good one) must not leave the others waiting at their next collective. Each rank
is a process of its own, with its own arguments, and a deadline: a rank left waiting fails the test instead of
hanging it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from deepspeed_ext.checkpoint import serialization
from deepspeed_ext.checkpoint.deepspeed import keys
from harness.runner import child_env, cli, read_losses, torchrun_train, torchrun_train_runs
from harness.scenario import without_commit_marker

ONE_RANK = Path(__file__).resolve().parents[1] / "harness" / "workers" / "one_rank.py"
#: A rank left waiting for one that gave up would wait out gloo's 30-minute timeout; a refusal heard by every
#: rank ends each in seconds (the DeepSpeed engine's start included).
DEADLINE_S = 240
COMMON = ["--family", "llama", "--dtype", "fp32", "--zero", "1"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """TP=2, ZeRO-1, fp32 saved at step 0, then two steps trained on (the uninterrupted losses)."""
    root = tmp_path_factory.mktemp("before_first_step")
    torchrun_train(2, ["--tp", "2", *COMMON, "--steps", "2", "--save-dir", str(root / "ckpt"), "--save-at", "0",
                       "--result", str(root / "baseline.json")], root / "train.log")
    return root


def test_the_save_holds_no_optimizer_state(saved):
    """What makes it a fresh optimizer's save: no step and no moments anywhere, the fp32 masters all there."""
    tag = saved / "ckpt" / "global_step0"
    for path in sorted(tag.glob("*_optim_states.pt")):
        state = serialization.load(path)[keys.OPTIMIZER_STATE_DICT]
        assert not any(state[keys.BASE_OPTIMIZER_STATE][keys.STATE].values()), path
        assert state[keys.SINGLE_PARTITION_OF_FP32_GROUPS][0].numel() > 0


def test_converts_to_weights_alone_and_resumes_at_another_degree(saved, tmp_path):
    """to-universal writes fp32.pt alone per parameter (no exp_avg, no step: there is none), exactly the fp32
    masters; a resume at TP=1 from the universal checkpoint (into ZeRO-3) and straight from the DeepSpeed one
    trains on as the run that saved it did."""
    universal = tmp_path / "universal"
    cli(["to-universal", str(saved / "ckpt"), "-o", str(universal), "-q"], tmp_path / "convert.log")
    zero = universal / "global_step0_universal" / "zero"
    files = {p.name: sorted(f.name for f in p.iterdir()) for p in zero.iterdir() if p.is_dir()}
    assert files and all(names == ["fp32.pt"] for names in files.values()), files
    # The masters merged over TP are the ones the engine saved (each TP rank's flat partition, in order).
    from deepspeed_ext.checkpoint.deepspeed import DeepSpeedCheckpoint
    source = DeepSpeedCheckpoint(saved / "ckpt")
    assert not source.has_optimizer_states and source.info.states == ("fp32", )
    for tensor in source.tensors():
        written = serialization.load(zero / tensor.name / "fp32.pt")["param"]
        assert torch.equal(written, tensor.load_tensor("fp32")), tensor.name

    baseline = read_losses(saved / "baseline.json")
    resumes = (("universal", universal, "3"), ("deepspeed", saved / "ckpt", "1"))
    torchrun_train_runs(1, [["--tp", "1", "--family", "llama", "--dtype", "fp32", "--zero", zero_stage, "--steps", "2",
                             "--load-dir", str(load_dir), "--result", str(tmp_path / f"resumed_{name}.json")]
                            for name, load_dir, zero_stage in resumes], tmp_path / "resume.log")
    for name, _, _ in resumes:
        resumed = read_losses(tmp_path / f"resumed_{name}.json")
        assert sorted(resumed) == [1, 2], resumed
        for step in (1, 2):  # TP=1 sums in another order than TP=2: equal to fp32 rounding
            assert resumed[step] == pytest.approx(baseline[step], rel=1e-5), (name, step, resumed, baseline)


# ----------------------------------------------------------------------------------------------- the refusals
def _pipeline_parallel(saved: Path, root: Path) -> Path:
    """A copy of the save whose model states say it was saved with three pipeline stages, which its model-parallel
    files cannot be (refused by every reader)."""
    copy = root / "pipeline"
    shutil.copytree(saved / "ckpt", copy)
    tag = without_commit_marker(copy / "global_step0")
    for path in sorted(tag.glob("mp_rank_*_model_states.pt")):
        states = serialization.load(path)
        states[keys.CHECKPOINT_PARALLEL_DIMS] = {**(states.get(keys.CHECKPOINT_PARALLEL_DIMS) or {}),
                                                 keys.CHECKPOINT_PP_DEGREE: 3}
        temporary = path.with_suffix(".tmp")  # the loaded tensors map the file: write beside it, then replace it
        torch.save(states, temporary)
        os.replace(temporary, path)
    return copy


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_ranks(kind: str, rank_args: list[list[str]], root: Path) -> list[dict]:
    """Start one process per rank (its own arguments), wait for all until the deadline; kill what is left then and
    fail. Returns each rank's result."""
    port, world = _free_port(), len(rank_args)
    procs, logs = [], []
    for rank, args in enumerate(rank_args):
        env = {**child_env(), "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        log = open(root / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(ONE_RANK), kind, str(root / f"rank{rank}.json"), "--",
                                       *args], env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + DEADLINE_S
    waiting = []
    try:
        for rank, proc in enumerate(procs):
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                waiting.append(rank)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    tails = {rank: (root / f"rank{rank}.log").read_text()[-1500:] for rank in range(world)}
    assert not waiting, f"ranks {waiting} still waiting after {DEADLINE_S} s: {tails}"
    results = []
    for rank in range(world):
        path = root / f"rank{rank}.json"
        assert path.is_file(), f"rank {rank} wrote no result: {tails[rank]}"
        results.append(json.loads(path.read_text()))
    return results


def test_to_universal_distributed_refused_on_rank_0_stops_every_rank(saved, tmp_path):
    """``to-universal --distributed`` where rank 0 is handed a checkpoint whose pipeline record its files contradict and ranks 1-3 a good
    one: every rank stops with status 2, rank 0 says why in one line, and nothing is written."""
    pipeline = _pipeline_parallel(saved, tmp_path)
    out = tmp_path / "out"
    rank_args = [["to-universal", str(pipeline if rank == 0 else saved / "ckpt"), "-o", str(out), "--distributed",
                  "-q"] for rank in range(4)]
    results = _run_ranks("cli", rank_args, tmp_path)
    assert [r["returncode"] for r in results] == [2, 2, 2, 2], results
    errors = [line for line in (tmp_path / "rank0.log").read_text().splitlines()
              if line.startswith("deepspeed-ext: error:")]
    assert len(errors) == 1 and "checkpoint_parallel_dimensions says PP=3" in errors[0], errors
    assert "rank 0" in errors[0], errors
    assert not out.exists() and not any(tmp_path.glob("out.partial*"))


def test_a_resume_refused_on_rank_0_is_refused_on_every_rank(saved, tmp_path):
    """A training job of two ranks resuming at TP=1 x DP=2: rank 0 cannot read its checkpoint (a pipeline record its files contradict),
    rank 1 restores from a good one. Both raise the same one-line refusal from ``load_checkpoint`` and meet at
    their next barrier, instead of rank 1 going on to the resume's fingerprint check (a collective) and waiting
    there for rank 0."""
    pipeline = _pipeline_parallel(saved, tmp_path)
    rank_args = [["--tp", "1", *COMMON, "--steps", "1", "--load-dir", str(pipeline if rank == 0 else saved / "ckpt")]
                 for rank in range(2)]
    results = _run_ranks("train", rank_args, tmp_path)
    errors = [r["error"] for r in results]
    assert all(error is not None for error in errors), results
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("RefusedOnEveryRank: ") and "checkpoint_parallel_dimensions says PP=3" in errors[0]
    assert "refused on rank 0" in errors[0] and "\n" not in errors[0], errors
