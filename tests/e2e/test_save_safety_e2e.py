"""A save killed at any point never passes for a complete one (docs/reliability.md).

Each test trains the tiny Llama at TP=2 (ZeRO-1, bf16), saves global_step3, then kills every rank with SIGKILL
(``DEEPSPEED_EXT_FAULT``: deterministic, at a named point of the save, not a race with timing) while global_step5
is being saved. Then: ``latest`` names a committed tag, training resumes from the save directory at TP=1, and every
command refuses the torn save in one line.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from deepspeed_ext.checkpoint import commit
from harness.cli import cli_result
from harness.runner import read_losses, the_one_save_failure, torchrun_train

TORN = "global_step5"
#: The points that leave the save of global_step5 unfinished; "before-latest" leaves it committed, not pointed at.
TORN_POINTS = ["mid-file", "files-written", "before-marker", "before-publish"]


def _train_and_kill(root: Path, monkeypatch, point: str, tp: int = 2, zero: int = 1) -> Path:
    save_dir = root / "save"
    monkeypatch.setenv("DEEPSPEED_EXT_FAULT", f"{point}@{TORN}")
    proc = torchrun_train(tp, ["--tp", str(tp), "--zero", str(zero), "--steps", "6", "--save-dir", str(save_dir),
                               "--save-at", "3", "--save-at", "5"], root / "killed.log", check=False)
    monkeypatch.delenv("DEEPSPEED_EXT_FAULT")
    assert proc.returncode != 0, "the fault point was never reached"
    output = proc.stdout + proc.stderr
    assert "SIGKILL" in output or "exitcode  : -9" in output, output[-3000:]
    return save_dir


def _resume_at_tp1(save_dir: Path, root: Path, tag: str | None = None, check: bool = True,
                   save_at: int | None = None) -> subprocess.CompletedProcess:
    """Train at TP=1 from ``save_dir`` (its ``latest``, or ``tag``) to step 6; ``save_at``: saving into it too."""
    result = root / "resumed.json"
    args = ["--tp", "1", "--steps", "6", "--load-dir", str(save_dir), "--result", str(result)]
    if save_at is not None:
        args += ["--save-dir", str(save_dir), "--save-at", str(save_at)]
    return torchrun_train(1, args + (["--load-tag", tag] if tag else []), root / "resumed.log", check=check)


def _one_line_refusal(proc: subprocess.CompletedProcess, *expected: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0, (proc.args, proc.stdout, proc.stderr)
    errors = [line for line in lines if line.startswith("deepspeed-ext: error:")]
    assert len(errors) == 1, (proc.args, proc.stderr)
    for text in expected:
        assert text in errors[0], (proc.args, errors[0])
    return errors[0]


def _assert_every_command_refuses(save_dir: Path, tmp_path: Path) -> None:
    """verify, inspect, to-universal, to-hf, to-maxtext and compare, given the torn save by --tag or by the
    path of its files, refuse it in one line that says it did not finish."""
    staged = commit.staging_root(save_dir, TORN) / TORN
    good = save_dir / "global_step3"
    out = tmp_path / "out"
    by_tag = [["inspect", str(save_dir), "--tag", TORN],
              ["to-universal", str(save_dir), "--tag", TORN, "-o", str(out / "u"), "-q"],
              ["to-hf", str(save_dir), "--tag", TORN, "-o", str(out / "h"), "-q"],
              ["to-maxtext", str(save_dir), "--tag", TORN, "-o", str(out / "m"), "-q"]]
    by_path = [["verify", str(staged)], ["inspect", str(staged)], ["compare", str(good), str(staged), "-q"],
               ["to-universal", str(staged), "-o", str(out / "u"), "-q"], ["to-hf", str(staged), "-o",
                                                                            str(out / "h"), "-q"]]
    for args in by_tag:
        _one_line_refusal(cli_result(*args), f"the save of {TORN} did not finish", "global_step3")
    for args in by_path:
        _one_line_refusal(cli_result(*args), "unfinished save")
    assert not out.exists()


@pytest.mark.parametrize("point", TORN_POINTS)
def test_a_save_killed_mid_way_is_never_read_and_training_resumes(tmp_path, monkeypatch, point):
    save_dir = _train_and_kill(tmp_path, monkeypatch, point)
    assert (save_dir / "latest").read_text() == "global_step3"
    assert commit.tag_status(save_dir / "global_step3").state is commit.TagState.COMMITTED
    assert commit.tag_status(save_dir / "global_step3").complete
    assert not (save_dir / TORN).exists()  # the torn save never appears under its name
    assert commit.unfinished_saves(save_dir) == {TORN: commit.staging_root(save_dir, TORN)}
    if point == "mid-file":  # no file of the unfinished save looks whole under a checkpoint file's name
        staged = commit.staging_root(save_dir, TORN) / TORN
        assert not any(staged.glob("*optim_states.pt")), sorted(p.name for p in staged.iterdir())
    _assert_every_command_refuses(save_dir, tmp_path)
    # The save directory still works: verify and convert read global_step3, and training resumes at TP=1.
    verified = cli_result("verify", str(save_dir))
    assert verified.returncode == 0 and "against the commit marker" in verified.stdout, verified.stdout
    # ... and the resumed run's own save of global_step5 clears what the killed one left.
    _resume_at_tp1(save_dir, tmp_path, save_at=5)
    assert sorted(read_losses(tmp_path / "resumed.json")) == [4, 5, 6]
    assert (save_dir / "latest").read_text() == TORN and not commit.unfinished_saves(save_dir)
    assert commit.tag_status(save_dir / TORN).complete


def test_killed_after_the_commit_before_latest_the_tag_is_complete_and_latest_unchanged(tmp_path, monkeypatch):
    save_dir = _train_and_kill(tmp_path, monkeypatch, "before-latest")
    assert (save_dir / "latest").read_text() == "global_step3"
    status = commit.tag_status(save_dir / TORN)
    assert status.state is commit.TagState.COMMITTED and status.complete
    assert cli_result("verify", str(save_dir / TORN)).returncode == 0
    _resume_at_tp1(save_dir, tmp_path)  # latest: global_step3
    assert sorted(read_losses(tmp_path / "resumed.json")) == [4, 5, 6]


def test_an_explicit_tag_of_a_torn_save_is_refused_by_load_checkpoint(tmp_path, monkeypatch):
    save_dir = _train_and_kill(tmp_path, monkeypatch, "before-marker")
    proc = _resume_at_tp1(save_dir, tmp_path, tag=TORN, check=False)
    assert proc.returncode != 0
    assert f"the save of {TORN} did not finish" in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
    # A tag whose files disagree with its marker is refused too (a file cut short after the commit).
    broken = tmp_path / "broken"
    shutil.copytree(save_dir, broken, ignore=shutil.ignore_patterns(commit.STAGING_PREFIX + "*"))
    victim = next((broken / "global_step3").glob("*optim_states.pt"))
    with open(victim, "r+b") as handle:
        handle.truncate(victim.stat().st_size - 100)
    proc = _resume_at_tp1(broken, tmp_path, check=False)
    assert proc.returncode != 0 and f"{victim}: " in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]


def test_a_resave_into_the_same_tag_at_another_degree_replaces_it_whole(tmp_path):
    """TP=2 saves global_step3; a TP=1 run saves global_step3 again into the same directory: only TP=1's files
    remain, the marker lists exactly them, and inspect and verify read the result."""
    save_dir = tmp_path / "save"
    torchrun_train(2, ["--tp", "2", "--steps", "3", "--save-dir", str(save_dir), "--save-at", "3"],
                   tmp_path / "tp2.log")
    assert (save_dir / "global_step3" / "mp_rank_01_model_states.pt").is_file()
    torchrun_train(1, ["--tp", "1", "--steps", "3", "--save-dir", str(save_dir), "--save-at", "3"],
                   tmp_path / "tp1.log")
    names = sorted(p.name for p in (save_dir / "global_step3").iterdir())
    assert not [name for name in names if "mp_rank_01" in name], names
    marker = json.loads((save_dir / "global_step3" / commit.COMMIT_FILE).read_text())
    assert sorted(marker["files"]) == sorted(name for name in names if name != commit.COMMIT_FILE)
    assert marker["tp_degree"] == 1
    inspected = cli_result("inspect", str(save_dir), "--json")
    assert inspected.returncode == 0 and json.loads(inspected.stdout)["tp_degree"] == 1, inspected.stderr
    assert cli_result("verify", str(save_dir)).returncode == 0
    assert not commit.unfinished_saves(save_dir) and sorted(p.name for p in save_dir.iterdir()) == [
        "global_step3", "latest", "zero_to_fp32.py", "zero_to_torch.py"]


def test_a_full_disk_mid_save_fails_every_rank_with_one_reason_and_keeps_the_last_save(small_disk, tmp_path):
    """The disk fills while global_step5 is written: every rank stops within seconds with the same line (none waits
    for a rank that died of it), nothing of global_step5 is left, latest names global_step3, and training resumes
    from it at TP=1."""
    save_dir = small_disk / "save"
    proc = torchrun_train(2, ["--tp", "2", "--steps", "6", "--save-dir", str(save_dir), "--save-at", "3",
                              "--save-at", "5"], tmp_path / "full.log", check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    reason = the_one_save_failure(output)
    assert "saving checkpoint 'global_step5'" in reason and "No space left on device" in reason, reason
    assert f"{save_dir / 'latest'} still names 'global_step3'" in reason, reason
    assert (save_dir / "latest").read_text() == "global_step3" and not commit.unfinished_saves(save_dir)
    assert sorted(p.name for p in save_dir.iterdir()) == ["global_step3", "latest", "zero_to_fp32.py",
                                                          "zero_to_torch.py"]
    assert commit.tag_status(save_dir / "global_step3").complete
    resumed = tmp_path / "resumed"
    shutil.copytree(save_dir, resumed)
    _resume_at_tp1(resumed, tmp_path)
    assert sorted(read_losses(tmp_path / "resumed.json")) == [4, 5, 6]


def _save_failing_at(fault: str, save_dir, tmp_path, monkeypatch) -> tuple[str, str]:
    """Train to step 6 at TP=2 saving global_step3 and global_step5, with ``DEEPSPEED_EXT_FAULT=fault`` (an I/O error
    injected on one rank): the run fails, no rank is killed, and every rank raises the same one line. Returns the
    output and that line."""
    monkeypatch.setenv("DEEPSPEED_EXT_FAULT", fault)
    proc = torchrun_train(2, ["--tp", "2", "--steps", "6", "--save-dir", str(save_dir), "--save-at", "3",
                              "--save-at", "5"], tmp_path / "failed.log", check=False)
    monkeypatch.delenv("DEEPSPEED_EXT_FAULT")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "SIGKILL" not in output, output[-3000:]
    reason = the_one_save_failure(output)
    return output, reason


def test_one_rank_failing_its_write_stops_every_rank_with_its_reason(tmp_path, monkeypatch):
    """Only rank 1's write of global_step5 fails (an I/O error injected inside its file); rank 0's succeed. Both
    ranks raise the same line, naming rank 1 and its file, instead of rank 0 committing half a save or waiting for
    rank 1; nothing of global_step5 is left and latest still names global_step3."""
    save_dir = tmp_path / "save"
    output, reason = _save_failing_at(f"mid-file@{TORN}:1=error", save_dir, tmp_path, monkeypatch)
    assert f"saving checkpoint '{TORN}'" in reason and "failed on rank 1:" in reason, reason
    assert "other rank" not in reason and "mp_rank_01" in reason and "injected I/O error" in reason, reason
    assert (save_dir / "latest").read_text() == "global_step3" and not commit.unfinished_saves(save_dir)
    assert sorted(p.name for p in save_dir.iterdir()) == ["global_step3", "latest", "zero_to_fp32.py",
                                                          "zero_to_torch.py"]


def test_a_failed_copy_of_deepspeeds_recovery_scripts_stops_every_rank_with_its_reason(tmp_path, monkeypatch):
    """DeepSpeed copies ``zero_to_fp32.py`` into a save past its checkpoint engine; that write failing on rank 0
    (a disk that fills there) is the same one line on every rank, not rank 0's traceback and rank 1 left at a
    barrier; latest still names global_step3."""
    save_dir = tmp_path / "save"
    output, reason = _save_failing_at(f"recovery-scripts@{TORN}:0=error", save_dir, tmp_path, monkeypatch)
    assert f"saving checkpoint '{TORN}'" in reason and "failed on rank 0:" in reason, reason
    assert "injected I/O error at recovery-scripts" in reason, reason  # said by every rank (the_one_save_failure)
    assert (save_dir / "latest").read_text() == "global_step3" and not commit.unfinished_saves(save_dir)
