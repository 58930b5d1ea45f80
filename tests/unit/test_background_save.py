"""The background writer of an asynchronous save (:mod:`deepspeed_ext.checkpoint.background`): the fork is a snapshot,
ranks agree through files, a dead writer is reported, and the fingerprints' sums add up as a gather's would."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from deepspeed_ext.checkpoint import background, faults
from deepspeed_ext.checkpoint.engine_fingerprints import LocalSums, combine_local_sums
from deepspeed_ext.config import ExtConfig


def test_the_writer_sees_the_state_as_it_was_when_the_save_returned(tmp_path):
    """The parent changes the tensor in place right after start() returns; the writer, which reads it later, writes
    the values of the instant it was forked."""
    tensor = torch.arange(1 << 20, dtype=torch.float32)
    path = tmp_path / "state.pt"

    def write() -> None:
        time.sleep(0.3)
        torch.save({"t": tensor}, path)

    pending = background.start(write, tag="t", save_dir=str(tmp_path), staging=tmp_path / "staging", rank=0,
                               coordinator=True)
    tensor.mul_(-1)  # what the next optimizer step does to the live state
    assert pending.wait() == background.Outcome(True)
    assert torch.equal(torch.load(path, weights_only=True)["t"], torch.arange(1 << 20, dtype=torch.float32))


def test_a_failure_is_one_line_and_a_killed_writer_is_named_and_leaves_its_word(tmp_path):
    staging = tmp_path / "staging"
    staging.mkdir()

    def fail() -> None:
        raise background.BackgroundFailure("disk.pt: No space left on device")

    failed = background.start(fail, tag="t", save_dir=str(tmp_path), staging=staging, rank=0, coordinator=False)
    assert failed.wait() == background.Outcome(False, "disk.pt: No space left on device")

    killed = background.start(lambda: time.sleep(30), tag="t", save_dir=str(tmp_path), staging=staging, rank=3,
                              coordinator=False)
    assert killed.poll() is None  # still writing
    os.kill(killed.pid, signal.SIGKILL)
    outcome = killed.wait()
    assert not outcome.ok and "killed (SIGKILL)" in outcome.message
    assert (background.ranks_dir(staging) / "3.failed").exists()  # the coordinator stops waiting for it


def test_the_coordinator_commits_only_when_every_rank_said_ok_and_relays_a_failure(tmp_path):
    staging = tmp_path / "staging"
    staging.mkdir()
    background.report_rank(staging, 1, None, {"sums": [1.5]})
    background.report_rank(staging, 0, None, {"sums": [2.5]})
    assert background.wait_for_ranks(staging, 2) == {0: {"sums": [2.5]}, 1: {"sums": [1.5]}}

    other = tmp_path / "other"
    other.mkdir()
    background.report_rank(other, 0, None, {})
    background.report_rank(other, 1, "full disk")
    with pytest.raises(background.OtherRankFailed, match="rank 1's part of the save failed"):
        background.wait_for_ranks(other, 2)

    relayed = background.start(lambda: background.wait_for_ranks(other, 2), tag="t", save_dir=str(tmp_path),
                               staging=other, rank=0, coordinator=True).wait()
    assert not relayed.ok and relayed.relayed


def test_a_writer_that_died_without_a_word_on_this_host_stops_the_coordinator(tmp_path):
    staging = tmp_path / "staging"
    staging.mkdir()
    pending = background.start(lambda: background.note_writer(staging, 1), tag="t", save_dir=str(tmp_path),
                               staging=staging, rank=1, coordinator=False)
    os.waitpid(pending.pid, 0)  # reaped, and its parent has not yet noticed (no .failed, no .ok)
    with pytest.raises(background.OtherRankFailed, match="rank 1's background writer died"):
        background.wait_for_ranks(staging, 2)


def test_a_removed_staging_directory_stops_the_coordinator(tmp_path):
    with pytest.raises(background.OtherRankFailed, match="staging directory was removed"):
        background.wait_for_ranks(tmp_path / "gone", 2)


def _local(params: list[str], sums: list[float], stage: int = 0, stages: int = 1, step: int = 3) -> LocalSums:
    return LocalSums(params, ("fp32", "exp_avg"), torch.tensor(sums, dtype=torch.float64).reshape(len(params), 2, 3),
                     [("bias", torch.bfloat16)], torch.tensor([[2.0, 1.0, 0.5]], dtype=torch.float64),
                     torch.tensor([step, -step, step, -step, step, -step], dtype=torch.float64), True, stage, stages)


def test_the_sums_travel_exactly_and_add_up_in_rank_order():
    first = _local(["a", "b"], [0.1 * i for i in range(12)])
    second = _local(["a", "b"], [1 / 3 + i for i in range(12)])
    for local in (first, second):
        back = LocalSums.from_json(local.to_json())
        assert torch.equal(back.sums, local.sums) and back.buffers == local.buffers and back.states == local.states
    found, problems = combine_local_sums([first, second])
    assert not problems and found.step == 3
    expected = first.sums[0, 0] + second.sums[0, 0]
    assert found.tensors["a"]["fp32"].total == expected[1].item()
    assert found.roundings["bias"] == torch.finfo(torch.bfloat16).eps


def test_a_name_several_pipeline_stages_hold_counts_once_and_steps_that_differ_are_a_problem():
    head = _local(["embed", "layer0"], [1.0] * 12, stage=0, stages=2)
    tail = _local(["layer1", "embed"], [1.0] * 12, stage=1, stages=2, step=4)
    found, problems = combine_local_sums([head, tail])
    assert found.tensors["embed"]["fp32"].numel == 1  # from stage 0 only
    assert sorted(found.tensors) == ["bias", "embed", "layer0", "layer1"]
    assert any("step differs" in problem for problem in problems)


def test_faults_act_per_tag_and_rank(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(faults, "current_tag", "global_step5")
    monkeypatch.setenv(faults.ENV, "mid-file@global_step4=error,files-written@global_step5:1=error")
    faults.reached("mid-file")  # another tag's fault
    with pytest.raises(OSError, match="injected I/O error at files-written"):
        faults.reached("files-written")
    monkeypatch.setenv(faults.ENV, "files-written:0=error,before-marker=sleep0.2")
    faults.reached("files-written")  # rank 0's
    started = time.monotonic()
    faults.reached("before-marker")
    assert time.monotonic() - started >= 0.2


def test_async_save_is_a_boolean_or_names_its_snapshot_and_hooks_the_engine_on_its_own():
    plain = ExtConfig.from_ds_config({"deepspeed_ext": {"async_save": True}})
    assert plain.hooks_engine and plain.async_snapshot is None  # the engine's device decides
    assert not ExtConfig.from_ds_config({"deepspeed_ext": {}}).hooks_engine
    copying = ExtConfig.from_ds_config({"deepspeed_ext": {"async_save": {"snapshot": "copy"}}})
    assert copying.async_save and copying.async_snapshot == "copy"
    off = ExtConfig.from_ds_config({"deepspeed_ext": {"async_save": {"enabled": False, "snapshot": "fork"}}})
    assert not off.async_save and not off.hooks_engine
    with pytest.raises(ValueError, match="async_save' must be true, false or an object"):
        ExtConfig.from_ds_config({"deepspeed_ext": {"async_save": "yes"}})
    with pytest.raises(ValueError, match="async_save.snapshot' must be one of"):
        ExtConfig.from_ds_config({"deepspeed_ext": {"async_save": {"snapshot": "pinned"}}})
    with pytest.raises(ValueError, match="unknown key"):
        ExtConfig.from_ds_config({"deepspeed_ext": {"async_save": {"snapshots": "copy"}}})


def test_a_writer_thread_reports_like_a_fork_and_stops_when_killed(tmp_path):
    """The copy snapshot's writer (a thread): the same outcomes as a forked writer's, a failure leaves the rank's
    word for the coordinator, and kill() makes a writer that checks ``stopped`` give up."""
    staging = tmp_path / "staging"
    staging.mkdir()
    done = background.WriterThread(lambda stopped: None, tag="t", save_dir=str(tmp_path), staging=staging, rank=0,
                                   coordinator=True)
    assert done.wait() == background.Outcome(True)

    def fail(stopped) -> None:
        raise background.BackgroundFailure("disk.pt: No space left on device")

    failed = background.WriterThread(fail, tag="t", save_dir=str(tmp_path), staging=staging, rank=2,
                                     coordinator=False)
    assert failed.wait() == background.Outcome(False, "disk.pt: No space left on device")
    assert (background.ranks_dir(staging) / "2.failed").exists()

    def waits(stopped) -> None:
        while not stopped():
            time.sleep(0.01)
        raise background.BackgroundFailure("stopped")

    waiting = background.WriterThread(waits, tag="t", save_dir=str(tmp_path), staging=staging, rank=3,
                                      coordinator=False)
    assert waiting.poll() is None
    waiting.kill()
    assert waiting.outcome == background.Outcome(False, "stopped")


def test_nothing_here_imports_torch_or_deepspeed():
    source = Path(background.__file__).read_text()
    assert "import torch" not in source and "deepspeed." not in source.replace("deepspeed_ext", "")


def test_a_writer_gives_back_what_it_wrote_but_keeps_what_it_still_reads(tmp_path):
    """In the writer, a released block reads as zeros afterwards (so nothing it still reads may be released: a
    kept range is not), and the training process's memory is untouched either way."""
    page = 4096
    state = torch.ones(64 * page // 4)
    address = state.data_ptr()
    kept = (address + 32 * page, address + 40 * page)
    seen = tmp_path / "seen.pt"

    def write() -> None:
        torch.set_num_threads(1)  # the parent's OpenMP threads are not in a forked child (as the runtime does)
        release = background.ReleasedPages(lambda: [kept])
        release(address, 64 * page)  # overlaps the kept range: nothing is given back
        release(address, 16 * page)
        torch.save(state.clone(), seen)

    assert background.start(write, tag="t", save_dir=str(tmp_path), staging=tmp_path, rank=0,
                            coordinator=True).wait().ok
    after = torch.load(seen, weights_only=True)
    per_page = page // 4
    assert int((after[:16 * per_page] == 0).sum()) >= 15 * per_page  # the whole pages of the first 16 pages
    assert float(after[16 * per_page:].min()) == 1.0  # never released (the kept range overlapped the whole)
    assert float(state.min()) == 1.0  # the training process's own pages
