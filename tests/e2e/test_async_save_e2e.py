"""Saves written in the background (``"deepspeed_ext": {"async_save": true}``, docs/reliability.md): the same bytes
as a synchronous save, never a torn checkpoint where the background writer or the whole job is killed at any point
of its write, and a failure that stops training at the next step with one line, ``latest`` unmoved. Each with both
snapshots: a fork of the rank (the CPU's default) and host copies written by a thread (``{"snapshot": "copy"}``,
the accelerators' way, whose writer dies only with its training process: its faults are failed writes there).

The runs train the tiny Llama at TP=2 (ZeRO-1 unless said, bf16) with the real engine (torchrun, gloo, CPU).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from deepspeed_ext.checkpoint import commit
from harness.cli import cli_result
from harness.runner import read_losses, the_one_save_failure, torchrun_train, torchrun_train_runs


def _resume_at_tp1(save_dir: Path, root: Path, steps: int = 6) -> dict[int, float]:
    """Train at TP=1 from ``save_dir``'s ``latest`` (its resume fingerprints checked) to ``steps``; the losses."""
    result = root / "resumed.json"
    root.mkdir(parents=True, exist_ok=True)
    torchrun_train(1, ["--tp", "1", "--steps", str(steps), "--load-dir", str(save_dir), "--result", str(result)],
                   root / "resumed.log")
    return read_losses(result)


def _same_files(a: Path, b: Path) -> None:
    """Every file of tag ``a`` is byte for byte the one of tag ``b``; the commit markers differ only in the time."""
    names = sorted(path.name for path in a.iterdir())
    assert names == sorted(path.name for path in b.iterdir()), (a, b)
    for name in names:
        if name == commit.COMMIT_FILE:
            left, right = (json.loads((tag / name).read_text()) for tag in (a, b))
            left.pop("committed_at"), right.pop("committed_at")
            assert left == right, name
        else:
            assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_a_background_save_writes_the_bytes_a_synchronous_save_writes_and_training_resumes_from_it(tmp_path):
    """At each save the same engine saves synchronously into one directory, then in the background into another:
    every file is identical, at ZeRO-1 and ZeRO-3, with either snapshot (DeepSpeed's files, the UC info with its
    fingerprints, the marker's file list and CRC-32s); training resumes at TP=1 from each background save, its
    fingerprints checked."""
    cases = [(zero, snapshot) for zero in (1, 3) for snapshot in ("fork", "copy")]
    runs = []
    for zero, snapshot in cases:
        root = tmp_path / f"zero{zero}-{snapshot}"
        runs.append(["--tp", "2", "--zero", str(zero), "--steps", "5", "--save-at", "3", "--save-at", "5",
                     "--async-save", snapshot, "--save-dir", str(root / "async"), "--also-save-synchronously",
                     str(root / "sync")])
    torchrun_train_runs(2, runs, tmp_path / "train.log")
    for zero, snapshot in cases:
        root = tmp_path / f"zero{zero}-{snapshot}"
        for tag in ("global_step3", "global_step5"):
            _same_files(root / "sync" / tag, root / "async" / tag)
            assert commit.tag_status(root / "async" / tag).complete
        assert (root / "async" / "latest").read_text() == "global_step5"
        assert not commit.unfinished_saves(root / "async")
    for snapshot in ("fork", "copy"):
        losses = _resume_at_tp1(tmp_path / f"zero1-{snapshot}" / "async", tmp_path / snapshot, steps=7)
        assert sorted(losses) == [6, 7]


#: One save per step, each but the first broken at another point of its background write: (tag, fault).
FAULTS = [("global_step2", "mid-file@global_step2:1"),  # rank 1's writer, inside a file
          ("global_step3", "recovery-scripts@global_step3"),
          ("global_step4", "files-written@global_step4:0"),
          ("global_step5", "before-marker@global_step5"),
          ("global_step6", "before-publish@global_step6"),
          ("global_step7", "before-latest@global_step7"),
          ("global_step8", "before-cleanup@global_step8")]


@pytest.mark.parametrize("snapshot", ["fork", "copy"])
def test_a_background_writer_killed_at_each_point_never_leaves_a_torn_checkpoint(tmp_path, monkeypatch, snapshot):
    """Saves at steps 1-8, the writer of each from step 2 on stopped at another point of its write (on one rank or
    every rank): a forked writer killed (SIGKILL); a writer thread, which dies only with its training process,
    failing there (an I/O error). Each failure reaches every rank as the same one line, training goes on, and:

    * stopped before its tag was published (steps 2-6): nothing of the save is left, ``latest`` still names
      global_step1;
    * stopped after publishing, before ``latest`` (step 7): the line says the tag is complete but ``latest`` was
      not moved, and the tag verifies;
    * stopped after ``latest`` (step 8): the save counts as committed; its leftovers are removed.

    Then training resumes at TP=1 from ``latest``."""
    save_dir, errors = tmp_path / "save", tmp_path / "errors.jsonl"
    action = "=error" if snapshot == "copy" else ""
    monkeypatch.setenv("DEEPSPEED_EXT_FAULT", ",".join(fault + action for _, fault in FAULTS))
    args = ["--tp", "2", "--steps", "8", "--save-dir", str(save_dir), "--async-save", snapshot, "--save-errors",
            str(errors)]
    torchrun_train(2, args + [arg for step in range(1, 9) for arg in ("--save-at", str(step))],
                   tmp_path / "faults.log", check=False).check_returncode()
    monkeypatch.delenv("DEEPSPEED_EXT_FAULT")
    reported: dict[int, set[str]] = {}
    for line in errors.read_text().splitlines():
        entry = json.loads(line)
        reported.setdefault(entry["step"], set()).add(entry["message"])
    assert sorted(reported) == [2, 3, 4, 5, 6, 7], reported
    for step, messages in reported.items():
        assert len(messages) == 1, messages  # every rank raised the same line
        (message, ) = messages
        assert f"saving checkpoint 'global_step{step}'" in message and "in the background failed" in message
        assert ("injected I/O error" if snapshot == "copy" else "killed (SIGKILL)") in message, message
        if step == 2:
            assert "failed on rank 1:" in message, message  # the rank whose writer failed, not the coordinator
        if step < 7:
            assert "nothing of it was committed" in message and "still names 'global_step1'" in message, message
    assert "global_step7 was committed" in reported[7].pop() and commit.tag_status(save_dir / "global_step7").complete
    assert (save_dir / "latest").read_text() == "global_step8"
    assert sorted(path.name for path in save_dir.iterdir() if path.name.startswith("global_step")) == \
        ["global_step1", "global_step7", "global_step8"]
    assert not commit.unfinished_saves(save_dir)
    for tag in ("global_step1", "global_step7", "global_step8"):
        assert cli_result("verify", str(save_dir / tag)).returncode == 0, tag
    assert sorted(_resume_at_tp1(save_dir, tmp_path, steps=10)) == [9, 10]


@pytest.mark.parametrize("snapshot", ["fork", "copy"])
def test_a_job_killed_while_its_save_is_written_in_the_background_keeps_latest(tmp_path, monkeypatch, snapshot):
    """The training process of rank 0 is killed (SIGKILL) while its writer writes global_step5 (a forked writer
    kills its parent, then itself; a writer thread dies with its process): the writers die with their jobs,
    global_step5 is never committed, latest names global_step3, and training resumes from it."""
    save_dir = tmp_path / "save"
    monkeypatch.setenv("DEEPSPEED_EXT_FAULT", "files-written@global_step5:0" + ("=job" if snapshot == "fork" else ""))
    proc = torchrun_train(2, ["--tp", "2", "--steps", "6", "--save-dir", str(save_dir), "--save-at", "3",
                              "--save-at", "5", "--async-save", snapshot], tmp_path / "killed.log", check=False)
    monkeypatch.delenv("DEEPSPEED_EXT_FAULT")
    assert proc.returncode != 0
    assert (save_dir / "latest").read_text() == "global_step3"
    assert not (save_dir / "global_step5").exists() and "global_step5" in commit.unfinished_saves(save_dir)
    refusal = cli_result("inspect", str(save_dir), "--tag", "global_step5")
    assert refusal.returncode != 0 and "did not finish" in refusal.stderr
    resumed = tmp_path / "resumed"
    shutil.copytree(save_dir, resumed)
    assert sorted(_resume_at_tp1(resumed, tmp_path)) == [4, 5, 6]


@pytest.mark.parametrize("snapshot", ["fork", "copy"])
def test_a_full_disk_in_the_background_stops_training_at_the_next_step_and_keeps_latest(small_disk, tmp_path,
                                                                                         snapshot):
    """The disk fills while global_step5 is written in the background: training stops at the next step (not at the
    end) with one line on every rank naming the full disk; nothing of global_step5 is left, latest names
    global_step3, and training resumes from it. The writer is let end before step 6 (unreaped, unasked): the tiny
    model's steps can outrun it, and then the failure would surface only at the end."""
    save_dir = small_disk / "save"
    proc = torchrun_train(2, ["--tp", "2", "--steps", "12", "--save-dir", str(save_dir), "--save-at", "3",
                              "--save-at", "5", "--async-save", snapshot, "--writer-ends-before-next-step"],
                          tmp_path / "full.log", check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    reason = the_one_save_failure(output)
    assert "saving checkpoint 'global_step5'" in reason and "in the background failed" in reason, reason
    assert "No space left on device" in reason and "still names 'global_step3'" in reason, reason
    assert "engine.step()" in output and "wait_for_saves" not in output, output[-3000:]  # raised by a step
    assert (save_dir / "latest").read_text() == "global_step3" and not commit.unfinished_saves(save_dir)
    assert sorted(p.name for p in save_dir.iterdir()) == ["global_step3", "latest", "zero_to_fp32.py",
                                                          "zero_to_torch.py"]
    resumed = tmp_path / "resumed"
    shutil.copytree(save_dir, resumed)
    assert sorted(_resume_at_tp1(resumed, tmp_path)) == [4, 5, 6]
