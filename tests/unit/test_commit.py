"""Commit markers: what makes a DeepSpeed tag complete, and how every reader finds out (no torchrun here: the tags
are built with torch.save; tests/e2e/test_save_safety_e2e.py kills real saves)."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import pytest
import torch

from deepspeed_ext.checkpoint import commit, durable, faults, serialization
from deepspeed_ext.checkpoint.formats import detect_all, trainer_checkpoints
from deepspeed_ext.errors import CheckpointError
from deepspeed_ext.runtime import refuse_incomplete
from harness.environments import require


def _tag(directory: Path, tp: int = 2) -> Path:
    directory.mkdir(parents=True)
    for rank in range(tp):
        torch.save({"module": {"w": torch.randn(300_000)}, "mp_world_size": tp},
                   directory / f"mp_rank_{rank:02d}_model_states.pt")
    (directory / commit.UC_INFO_FILE).write_text(json.dumps({"format": "deepspeed_ext.uc_info",
                                                            commit.UC_INFO_KEY: commit.COMMIT_FILE}))
    return directory


def _save(save_dir: Path, tag: str, tp: int = 2, latest: bool = True) -> Path:
    """A save as the engine hook makes it: built in the staging directory, then committed."""
    commit.prepare_staging(save_dir, tag)
    _tag(commit.staging_root(save_dir, tag) / tag, tp)
    return commit.commit(save_dir, tag, {"tp_degree": tp}, save_latest=latest)


def test_a_committed_tag_lists_every_file_with_its_size_and_crc32(tmp_path):
    tag_dir = _save(tmp_path / "save", "global_step3")
    marker = json.loads((tag_dir / commit.COMMIT_FILE).read_text())
    assert sorted(marker["files"]) == sorted(p.name for p in tag_dir.iterdir() if p.name != commit.COMMIT_FILE)
    for name, entry in marker["files"].items():
        data = (tag_dir / name).read_bytes()
        assert entry == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}, name
    assert (tmp_path / "save" / "latest").read_text() == "global_step3"
    assert not commit.unfinished_saves(tmp_path / "save")
    status = commit.require_complete(tag_dir)
    assert status.state is commit.TagState.COMMITTED and status.complete
    checked, problems = commit.check_contents(tag_dir)
    assert not problems and "against the commit marker" in checked


def test_every_damage_to_a_committed_tag_is_named(tmp_path):
    tag_dir = _save(tmp_path / "save", "global_step3")
    rank1 = tag_dir / "mp_rank_01_model_states.pt"
    # bytes changed in place (same size): only the checksums see it
    with open(rank1, "r+b") as handle:
        handle.seek(rank1.stat().st_size // 2)
        handle.write(b"\0" * 4096)
    _, problems = commit.check_contents(tag_dir)
    assert problems and all(str(rank1) in problem for problem in problems), problems
    commit.require_complete(tag_dir)  # names and sizes agree: a cheap open does not read the bytes
    # a file cut short, a file missing, a file of another save beside them
    with open(rank1, "r+b") as handle:
        handle.truncate(100)
    with pytest.raises(CheckpointError, match="mp_rank_01_model_states.pt: 100 bytes, deepspeed_ext.commit.json says"):
        commit.require_complete(tag_dir)
    rank1.unlink()
    with pytest.raises(CheckpointError, match="mp_rank_01_model_states.pt: missing"):
        commit.require_complete(tag_dir)
    torch.save({}, rank1)
    (tag_dir / "mp_rank_02_model_states.pt").write_bytes(b"x")
    problems = commit.tag_status(tag_dir).problems
    assert any("mp_rank_02_model_states.pt: not part of the committed save" in p for p in problems), problems


def test_an_unfinished_save_is_refused_naming_the_newest_complete_tag(tmp_path):
    save_dir = tmp_path / "save"
    _save(save_dir, "global_step3")
    commit.prepare_staging(save_dir, "global_step5")
    staged = _tag(commit.staging_root(save_dir, "global_step5") / "global_step5")
    hint = "the newest complete tag is global_step3"
    for tag_dir in (staged, staged.parent):
        with pytest.raises(CheckpointError, match=f"unfinished save.*{hint}"):
            commit.require_complete(tag_dir)
        with pytest.raises(CheckpointError, match="unfinished save"):
            detect_all(tag_dir)
    with pytest.raises(CheckpointError, match=f"the save of global_step5 did not finish.*{hint}"):
        refuse_incomplete(save_dir, "global_step5")
    refuse_incomplete(save_dir)  # latest: global_step3
    refuse_incomplete(save_dir, "global_step3")
    assert detect_all(save_dir) == ["deepspeed"]
    # the tag moved out of its staging directory by hand, without its marker: deepspeed_ext.json says one is due
    os.replace(staged, save_dir / "global_step5")
    with pytest.raises(CheckpointError, match="the save of this tag did not finish"):
        refuse_incomplete(save_dir, "global_step5")


def test_a_save_directory_whose_only_save_never_finished(tmp_path):
    save_dir = tmp_path / "save"
    commit.prepare_staging(save_dir, "global_step3")
    _tag(commit.staging_root(save_dir, "global_step3") / "global_step3")
    for call in (lambda: detect_all(save_dir), lambda: refuse_incomplete(save_dir)):
        with pytest.raises(CheckpointError, match="the save of global_step3 did not finish"):
            call()


def test_a_resave_of_a_tag_replaces_it_whole_and_clears_a_killed_save(tmp_path):
    save_dir = tmp_path / "save"
    _save(save_dir, "global_step3", tp=2)
    commit.prepare_staging(save_dir, "global_step3")  # a killed save of the same tag: the old one stays
    (commit.staging_root(save_dir, "global_step3") / "junk").write_text("x")
    assert commit.require_complete(save_dir / "global_step3").complete
    tag_dir = _save(save_dir, "global_step3", tp=1)
    assert sorted(p.name for p in tag_dir.iterdir()) == [commit.COMMIT_FILE, commit.UC_INFO_FILE,
                                                          "mp_rank_00_model_states.pt"]
    assert sorted(p.name for p in save_dir.iterdir()) == ["global_step3", "latest"]


def test_exchange_swaps_two_directories(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "from_a").write_text("")
    if not durable.exchange(tmp_path / "a", tmp_path / "b"):
        pytest.skip("no renameat2(RENAME_EXCHANGE) here")  # a failure under CI=true (tests/conftest.py): Linux has it
    assert (tmp_path / "b" / "from_a").exists() and not (tmp_path / "a" / "from_a").exists()


class _Killed(BaseException):
    pass


@pytest.mark.parametrize("point", ["before-marker", "before-publish", "before-latest", "before-cleanup"])
def test_the_commit_stopped_at_each_point_leaves_a_committed_tag_under_latest(tmp_path, monkeypatch, point):
    """The commit stopped dead at ``point`` (as SIGKILL would stop it: tests/e2e/test_save_safety_e2e.py kills real
    saves) while re-saving an existing tag, the hardest case: ``latest`` names a committed tag, and the tag under
    its name is complete, the old one or the new one."""
    save_dir = tmp_path / "save"
    _save(save_dir, "global_step3", tp=2)

    def reached(name: str) -> None:
        if name == point:
            raise _Killed

    monkeypatch.setattr(faults, "reached", reached)
    with pytest.raises(_Killed):
        _save(save_dir, "global_step3", tp=1)
    assert (save_dir / "latest").read_text() == "global_step3"
    status = commit.require_complete(save_dir / "global_step3")
    tp1 = not (save_dir / "global_step3" / "mp_rank_01_model_states.pt").exists()
    assert status.complete and tp1 == (point in ("before-latest", "before-cleanup")), point
    assert not commit.check_contents(save_dir / "global_step3")[1]


def _trainer_checkpoint(output_dir: Path, step: int, complete: bool) -> Path:
    folder = output_dir / f"checkpoint-{step}"
    tag = f"global_step{step}"
    if complete:
        _save(folder, tag)
        (folder / "trainer_state.json").write_text("{}")
    else:
        commit.prepare_staging(folder, tag)
        _tag(commit.staging_root(folder, tag) / tag)
    (folder / "config.json").write_text("{}")
    return folder


def test_the_newest_complete_trainer_checkpoint_is_chosen_and_the_torn_one_named(tmp_path):
    out = tmp_path / "out"
    three = _trainer_checkpoint(out, 3, complete=True)
    five = _trainer_checkpoint(out, 5, complete=False)
    chosen, skipped = trainer_checkpoints(out)
    assert chosen == three and [folder for folder, _ in skipped] == [five]
    assert "did not finish" in skipped[0][1]
    with pytest.raises(CheckpointError, match=f"did not finish.*newest complete checkpoint is {three}"):
        detect_all(five)
    # the Trainer died after the DeepSpeed save, before trainer_state.json, which it writes last
    one = _trainer_checkpoint(out, 1, complete=True)
    (three / "trainer_state.json").unlink()
    chosen, skipped = trainer_checkpoints(out)
    assert chosen == one and [folder for folder, _ in skipped] == [five, three]
    assert "no trainer_state.json" in skipped[1][1]


def test_the_trainers_resume_choice_skips_a_torn_checkpoint_under_enable(tmp_path):
    trainer_utils = require("transformers.trainer_utils", "the [hf] extra")

    from deepspeed_ext.runtime import integrations
    out = tmp_path / "out"
    three = _trainer_checkpoint(out, 3, complete=True)
    _trainer_checkpoint(out, 5, complete=False)
    own = trainer_utils.get_last_checkpoint
    assert own(str(out)).endswith("checkpoint-5")  # transformers alone: the highest N, torn or not
    integrations.trainer_resume_choice(install=True)
    try:
        assert trainer_utils.get_last_checkpoint(str(out)) == str(three)
    finally:
        integrations.trainer_resume_choice(install=False)
    assert trainer_utils.get_last_checkpoint is own


def _optimizer_tag(directory: Path) -> Path:
    """A tag with one optimizer file whose master and moments are large records (each past the few KiB a check
    always reads); the file."""
    _tag(directory, tp=1)
    states = {"fp32": torch.randn(100_000), "exp_avg": torch.randn(100_000), "exp_avg_sq": torch.rand(100_000)}
    optim = directory / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save(states, optim)
    return optim


def _zero_inside(path: Path, tensor: torch.Tensor) -> None:
    """64 bytes of ``tensor``'s data in ``path`` zeroed in place (a hole a killed writer left)."""
    location = serialization.mapped_location(tensor)
    assert location is not None and location[0] == path.resolve()
    with open(path, "r+b") as handle:
        handle.seek(location[1] + 1024)
        handle.write(b"\0" * 64)


@pytest.mark.parametrize("mapped", [False, True], ids=["read", "mapped"])
@pytest.mark.parametrize("marked", [True, False], ids=["committed", "no-marker"])
def test_a_lazy_content_check_reads_only_the_records_read_and_finds_damage_there(tmp_path, marked, mapped):
    """The conversions' check (``ContentCheck`` with the optimizer files lazy): a hole in a moment no one reads
    passes, the same hole in the master that was read is named, and the whole check (``verify``'s) names both.
    Everything of the file but its unread records' data is checked all the same (a cut-short file is named).
    ``mapped`` (a conversion's: the records summed through a mapping) finds the same."""
    if marked:
        commit.prepare_staging(tmp_path / "save", "t")
        directory = commit.staging_root(tmp_path / "save", "t") / "t"
    else:
        directory = tmp_path / "save" / "t"
    name = _optimizer_tag(directory).name
    tag_dir = commit.commit(tmp_path / "save", "t", {}, save_latest=True) if marked else directory
    if not marked:
        (tag_dir / commit.UC_INFO_FILE).unlink()  # a plain DeepSpeed tag: no marker is due
    optim = tag_dir / name
    states = serialization.load(optim)
    _zero_inside(optim, states["exp_avg"])

    def lazy_check(*read: str) -> tuple[str, list[str]]:
        check = commit.ContentCheck(tag_dir, lazy=[optim], mapped=mapped)
        for state in read:
            location = serialization.mapped_location(states[state])
            assert location is not None
            check.note_read(optim, location[1])
        return check.result()

    checked, problems = lazy_check("fp32")
    assert not problems, problems
    assert "checked only where read (1 records, 400000 bytes)" in checked, checked
    _, problems = lazy_check("fp32", "exp_avg", "exp_avg")  # the second read of a record is not checked again
    assert len(problems) == 1 and str(optim) in problems[0], problems
    _, problems = commit.check_contents(tag_dir, mapped=mapped)  # every byte (verify's, not mapped)
    assert problems and all(str(optim) in problem for problem in problems), problems

    check = commit.ContentCheck(tag_dir, lazy=[optim], mapped=mapped)
    check.result()
    check.note_read(optim, None)  # read after the verdict, somewhere unknown: the whole file, at once
    with pytest.raises(CheckpointError, match=f"{optim}.*nothing was written"):
        check.raise_if_damaged()

    with open(optim, "r+b") as handle:
        handle.truncate(optim.stat().st_size - 100)
    _, problems = lazy_check()
    assert problems and str(optim) in problems[0], problems


def test_a_conversion_sums_its_records_through_a_mapping_and_a_full_check_reads_them(tmp_path):
    """A conversion's check (``tensors()``) sums the records where they lie, as the conversion maps them itself;
    the check of every byte (``verify``'s) reads them (a read error is then a line naming the file, not a
    SIGBUS). Both find a hole in a model-states record the conversion reads."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import synth_checkpoint

    from deepspeed_ext.checkpoint.deepspeed import DeepSpeedCheckpoint
    config = {"vocab_size": 101, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    plan = synth_checkpoint.make_plan(synth_checkpoint.llama_config_dict(config), tp=2)
    tag = synth_checkpoint.write_checkpoint(plan, tmp_path / "ckpt", log=False)
    source = DeepSpeedCheckpoint(tmp_path / "ckpt")
    list(source.tensors())
    assert source._content_check is not None and source._content_check.mapped
    source.raise_if_damaged()
    assert source.contents_checked()[1] == []
    assert not source._content_check.mapped

    states = serialization.load(tag / "mp_rank_01_model_states.pt")
    name, weights = max(states["module"].items(), key=lambda item: item[1].numel())
    _zero_inside(tag / "mp_rank_01_model_states.pt", weights)
    for full in (False, True):
        damaged = DeepSpeedCheckpoint(tmp_path / "ckpt")
        list(damaged.tensors())
        problems = damaged.contents_checked()[1] if full else damaged._content_check.result()[1]
        assert any("mp_rank_01_model_states.pt" in problem for problem in problems), problems
