"""TP and DP degrees come from the files present, checked against ``mp_world_size`` / ``dp_world_size``.

A file set whose model states record no ``mp_world_size`` (hand-built fixtures, other writers) was once read as
TP=1: the conversion kept TP rank 0's shard alone and said nothing. Here: fake tag directories, ``torch.save`` of
the few keys the reader needs (file-set logic with empty files, where names are all that matters). The same on a
real engine's ZeRO-3 checkpoint, and against upstream's converter, is tests/e2e/test_degrees_e2e.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepspeed_ext.checkpoint import serialization
from deepspeed_ext.checkpoint.deepspeed import DeepSpeedCheckpoint
from deepspeed_ext.checkpoint.deepspeed.files import TagFiles
from deepspeed_ext.errors import CheckpointError
from harness.cli import run

#: One column-split weight, uneven over TP=2 (3 + 2 rows), as the fixture that found the bug had it.
FULL = torch.arange(20, dtype=torch.float32).reshape(5, 4)
SHARDS = [FULL[:3], FULL[3:]]


def fake_zero3(tag: Path, tp: int = 2, dp: int = 2, drop: tuple[str, ...] = ()) -> Path:
    """A ZeRO-3 tag directory with upstream's ``universal_checkpoint_info`` (a dim-0 split of ``fc.weight``),
    every (DP, TP) rank's model states and optimizer file, without the keys in ``drop``."""
    tag.mkdir(parents=True)
    for t in range(tp):
        shard = SHARDS[t].reshape(-1)
        part = -(-shard.numel() // dp)
        padded = torch.cat([shard, shard.new_zeros(part * dp - shard.numel())])
        for d in range(dp):
            states = {"module": {}, "param_shapes": [{"fc.weight": SHARDS[t].shape}], "global_steps": 3,
                      "mp_world_size": tp, "dp_world_size": dp, "ds_version": "0.18.0",
                      "universal_checkpoint_info": {"universal_checkpoint_version": 0.2}}
            torch.save({k: v for k, v in states.items() if k not in drop},
                       tag / f"zero_pp_rank_{d}_mp_rank_{t:02d}_model_states.pt")
            piece = padded[d * part:(d + 1) * part].clone()
            base = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": piece * 2, "exp_avg_sq": piece * 3}},
                    "param_groups": [{"lr": 1e-3, "params": [0]}]}
            torch.save({"optimizer_state_dict": {"zero_stage": 3, "partition_count": [dp], "loss_scaler": None,
                                                 "fp32_flat_groups": [piece], "optimizer_state_dict": base}},
                       tag / f"bf16_zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt")
    return tag


def fake_zero0(tag: Path, tp: int = 2, **records: int) -> Path:
    """A ZeRO-0 tag directory (no optimizer files: the optimizer is in the model states) recording ``records``."""
    tag.mkdir(parents=True)
    for t in range(tp):
        torch.save({"module": {}, "optimizer": {}, "global_steps": 3, **records},
                   tag / f"mp_rank_{t:02d}_model_states.pt")
    return tag


def touch(tag: Path, *names: str) -> Path:
    tag.mkdir(parents=True, exist_ok=True)
    for name in names:
        (tag / name).touch()
    return tag


def zero3_names(tp: int, dp: int, prefix: str = "bf16_") -> list[str]:
    return [name for t in range(tp) for d in range(dp)
            for name in (f"zero_pp_rank_{d}_mp_rank_{t:02d}_model_states.pt",
                         f"{prefix}zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt")]


def zero1_names(tp: int, dp: int) -> list[str]:
    return [f"mp_rank_{t:02d}_model_states.pt" for t in range(tp)] + [
        f"bf16_zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt" for t in range(tp) for d in range(dp)]


def refusal(tag: Path, *records: int | None) -> str:
    """The one-line refusal of ``tag``'s file set, given rank 0's recorded (TP, DP)."""
    files = TagFiles.scan(tag)
    with pytest.raises(CheckpointError) as caught:
        files.degrees(*records, files.model_files.get(0))
    message = str(caught.value)
    assert len(message.splitlines()) == 1 and message.startswith(f"{tag}: "), message
    return message[len(f"{tag}: "):]


# --------------------------------------------------------------------------- the bug: no mp_world_size
@pytest.mark.parametrize("drop", [(), ("mp_world_size", ), ("dp_world_size", ), ("mp_world_size", "dp_world_size")],
                         ids=["recorded", "no-mp_world_size", "no-dp_world_size", "neither"])
def test_degrees_come_from_the_files_and_the_tensors_are_whole(tmp_path, capsys, drop):
    tag = fake_zero3(tmp_path / "ckpt" / "global_step3", drop=drop)
    checkpoint = DeepSpeedCheckpoint(tag)
    assert (checkpoint.tp_degree, checkpoint.dp_degree) == (2, 2)
    assert (checkpoint.info.tp_degree, checkpoint.info.dp_degree) == (2, 2)
    assert torch.equal(checkpoint.full_tensor("fc.weight"), FULL)
    assert torch.equal(checkpoint.full_tensor("fc.weight", "exp_avg"), FULL * 2)
    assert [list(shapes) for shapes in checkpoint._saved_shapes.values()] == [[(3, 4), (2, 4)]]

    code, out, err = run(capsys, "inspect", str(tag), "--json")
    summary = json.loads(out)
    assert code == 0 and (summary["tp_degree"], summary["dp_degree"], summary["zero_stage"]) == (2, 2, 3), err
    assert summary["parameters"]["fc.weight"]["shape"] == [5, 4]

    out_dir = tmp_path / "uni"
    code, _, err = run(capsys, "to-universal", str(tag), "-o", str(out_dir), "-q")
    assert code == 0, err
    zero = out_dir / "global_step3_universal" / "zero" / "fc.weight"
    for state, factor in (("fp32", 1), ("exp_avg", 2), ("exp_avg_sq", 3)):
        assert torch.equal(serialization.load(zero / f"{state}.pt")["param"], FULL * factor), state
    assert run(capsys, "verify", str(out_dir))[0] == 0


def test_zero0_takes_tp_from_the_files_and_dp_from_the_record(tmp_path):
    """Without per-DP files nothing but ``dp_world_size`` says the DP degree (1 where it says nothing)."""
    assert (DeepSpeedCheckpoint(fake_zero0(tmp_path / "a", dp_world_size=4)).tp_degree,
            DeepSpeedCheckpoint(tmp_path / "a").dp_degree) == (2, 4)
    unrecorded = DeepSpeedCheckpoint(fake_zero0(tmp_path / "b"))
    assert (unrecorded.tp_degree, unrecorded.dp_degree) == (2, 1)
    with pytest.raises(CheckpointError, match=r"mp_rank_00_model_states.pt says TP=3, but there are files for 2 "
                                              r"TP ranks \(0\.\.1\)"):
        DeepSpeedCheckpoint(fake_zero0(tmp_path / "c", mp_world_size=3))


def test_the_file_set_alone_gives_the_degrees(tmp_path):
    assert TagFiles.scan(touch(tmp_path / "z3", *zero3_names(2, 4))).degrees() == (2, 4)
    assert TagFiles.scan(touch(tmp_path / "z1", *zero1_names(4, 2))).degrees() == (4, 2)
    assert TagFiles.scan(touch(tmp_path / "z0", "mp_rank_00_model_states.pt")).degrees() == (1, None)
    files = TagFiles.scan(touch(tmp_path / "z1b", *zero1_names(2, 2)))
    assert files.degrees(2, 2, files.model_files[0]) == (2, 2)


# --------------------------------------------------------------------------- a file missing
@pytest.mark.parametrize("removed, expected", [
    ("bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt",
     "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt is missing (TP=2 x DP=2 from the files present; the missing "
     "optimizer file for dp_rank 1, mp_rank 01)"),
    ("zero_pp_rank_1_mp_rank_01_model_states.pt",
     "zero_pp_rank_1_mp_rank_01_model_states.pt is missing (TP=2 x DP=2 from the files present)"),
    ("zero_pp_rank_0_mp_rank_00_model_states.pt",
     "zero_pp_rank_0_mp_rank_00_model_states.pt is missing (TP=2 x DP=2 from the files present)"),
])
def test_a_missing_zero3_file_is_named(tmp_path, removed, expected):
    tag = touch(tmp_path / "t", *[n for n in zero3_names(2, 2) if n != removed])
    assert refusal(tag) == expected


def test_a_missing_file_is_named_by_the_reader_too(tmp_path):
    """The whole reader, on a fake without any records: the same line, before anything is read from it."""
    tag = fake_zero3(tmp_path / "ckpt" / "global_step3", drop=("mp_world_size", "dp_world_size"))
    (tag / "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt").unlink()
    with pytest.raises(CheckpointError) as caught:
        DeepSpeedCheckpoint(tag)
    assert str(caught.value) == (f"{tag}: bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt is missing (TP=2 x DP=2 from "
                                 "the files present; the missing optimizer file for dp_rank 1, mp_rank 01)")
    (tag / "zero_pp_rank_0_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match="zero_pp_rank_0_mp_rank_00_model_states.pt is missing"):
        DeepSpeedCheckpoint(tag)


def test_missing_files_of_other_stages_and_gaps(tmp_path):
    names = zero1_names(3, 2)
    # A TP rank's model states (ZeRO-1): the rank shows in its optimizer files.
    assert refusal(touch(tmp_path / "a", *[n for n in names if n != "mp_rank_01_model_states.pt"])) == (
        "mp_rank_01_model_states.pt is missing (TP=3 x DP=2 from the files present; mp_rank files for TP ranks [1] "
        "are missing)")
    # A whole TP rank in the middle: the ranks must be 0..n-1.
    assert refusal(touch(tmp_path / "b", *[n for n in names if "mp_rank_01" not in n])) == (
        "mp_rank_01_model_states.pt is missing (TP=3 x DP=2 from the files present; mp_rank files for TP ranks [1] "
        "are missing; 3 files missing in all)")  # with its 2 optimizer files
    # A DP rank of one TP rank only: every TP rank must have the same DP ranks.
    assert refusal(touch(tmp_path / "c", *[n for n in names if n != "bf16_zero_pp_rank_1_mp_rank_02_optim_states.pt"])
                   ) == ("bf16_zero_pp_rank_1_mp_rank_02_optim_states.pt is missing (TP=3 x DP=2 from the files "
                         "present; the missing optimizer file for dp_rank 1, mp_rank 02)")
    # Files named without bf16_ are named so when missing.
    removed = "zero_pp_rank_0_mp_rank_01_optim_states.pt"
    tag = touch(tmp_path / "d", *[n for n in zero3_names(2, 2, prefix="") if n != removed])
    assert refusal(tag).startswith(f"{removed} is missing")


def test_fewer_files_than_recorded_name_the_missing_file_and_the_record(tmp_path):
    tag = touch(tmp_path / "t", *zero3_names(2, 2))
    assert refusal(tag, 3, 2) == (
        "zero_pp_rank_0_mp_rank_02_model_states.pt is missing (zero_pp_rank_0_mp_rank_00_model_states.pt says TP=3, "
        "but there are files for 2 TP ranks (0..1); 4 files missing in all)")
    assert refusal(tag, 2, 4) == (
        "zero_pp_rank_2_mp_rank_00_model_states.pt is missing (zero_pp_rank_0_mp_rank_00_model_states.pt says DP=4, "
        "but there are optimizer files for 2 DP ranks (0..1); 8 files missing in all)")


# --------------------------------------------------------------------------- a file too many
def test_a_file_beyond_the_recorded_degree_is_named(tmp_path):
    """Files left from a save at another degree: a rank beyond what the model states record."""
    tag = touch(tmp_path / "tp", *zero3_names(2, 2), "zero_pp_rank_0_mp_rank_02_model_states.pt")
    assert refusal(tag, 2, 2) == (
        "zero_pp_rank_0_mp_rank_02_model_states.pt is beyond the TP degree: zero_pp_rank_0_mp_rank_00_model_states.pt "
        "says TP=2, but there are files for 3 TP ranks (0..2): files of two checkpoints are mixed, or the model "
        "states are wrong")
    tag = touch(tmp_path / "dp", *zero1_names(2, 2), "bf16_zero_pp_rank_2_mp_rank_01_optim_states.pt")
    assert refusal(tag, 2, 2) == (
        "bf16_zero_pp_rank_2_mp_rank_01_optim_states.pt is beyond the DP degree: mp_rank_00_model_states.pt says "
        "DP=2, but there are optimizer files for 3 DP ranks (0..2): files of two checkpoints are mixed, or the "
        "model states are wrong")
    # Without a record the files decide, and the extra rank's missing files are named instead.
    assert refusal(tmp_path / "tp").startswith("zero_pp_rank_1_mp_rank_02_model_states.pt is missing (TP=3 x DP=2")


def test_two_files_for_one_rank_or_of_two_kinds_are_refused(tmp_path):
    for directory, names, expected in [
        ("dup", [*zero3_names(1, 1), "zero_pp_rank_0_mp_rank_00_optim_states.pt"],
         "two files for dp_rank 0, mp_rank 00: bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt and "
         "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
        ("kinds", [*zero3_names(1, 2), "zero_pp_rank_1_mp_rank_01_optim_states.pt"],
         "optimizer files named two ways (bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt and "
         "zero_pp_rank_1_mp_rank_01_optim_states.pt)"),
        ("stages", [*zero3_names(1, 1), "mp_rank_00_model_states.pt"],
         "both mp_rank_00_model_states.pt (ZeRO-0/1/2) and zero_pp_rank_0_mp_rank_00_model_states.pt (ZeRO-3)"),
    ]:
        tag = touch(tmp_path / directory, *names)
        with pytest.raises(CheckpointError) as caught:
            TagFiles.scan(tag)
        assert str(caught.value).startswith(f"{tag}: {expected}") and "mixed" in str(caught.value), caught.value


def test_expert_optimizer_files_are_refused_not_dropped(tmp_path):
    """DeepSpeed's older MoE layer without ZeRO keeps expert moments in files of their own, which are not read: a
    tag read without them would lose the experts' state. (AutoEP's per-expert model states are read:
    tests/unit/test_experts.py.)"""
    expert = "expp_rank_1_mp_rank_01_optim_states.pt"
    tag = touch(tmp_path / "moe", *zero1_names(2, 1), expert)
    with pytest.raises(CheckpointError) as caught:
        TagFiles.scan(tag)
    assert str(caught.value).startswith(f"{tag / expert}: an expert-parallel optimizer file"), caught.value


# --------------------------------------------------------------------------- records that disagree
def test_records_that_disagree_are_named_with_both_sides(tmp_path):
    tag = fake_zero3(tmp_path / "a" / "global_step3")
    path = tag / "zero_pp_rank_0_mp_rank_01_model_states.pt"
    torch.save({**torch.load(path, weights_only=False), "mp_world_size": 4}, path)
    with pytest.raises(CheckpointError) as caught:
        DeepSpeedCheckpoint(tag)
    assert str(caught.value) == f"{path}: says TP=4, but zero_pp_rank_0_mp_rank_00_model_states.pt says TP=2"

    # TP rank 0 records nothing: rank 1's record is checked against the files.
    tag = fake_zero3(tmp_path / "b" / "global_step3", drop=("dp_world_size", ))
    path = tag / "zero_pp_rank_0_mp_rank_01_model_states.pt"
    torch.save({**torch.load(path, weights_only=False), "dp_world_size": 1}, path)
    with pytest.raises(CheckpointError) as caught:
        DeepSpeedCheckpoint(tag)
    assert str(caught.value) == (f"{path}: says DP=1, but the files present say DP=2 (and "
                                 "zero_pp_rank_0_mp_rank_00_model_states.pt records none)")

    tag = fake_zero3(tmp_path / "c" / "global_step3")
    path = tag / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    torch.save({**torch.load(path, weights_only=False), "mp_world_size": "two"}, path)
    with pytest.raises(CheckpointError, match=r"mp_world_size is 'two', not a number$"):
        DeepSpeedCheckpoint(tag)
