"""The user story on the real engine: train with AutoTP + ZeRO, save, convert, resume at another TP/DP.

Every scenario is real: torchrun, gloo, DeepSpeed's engine and optimizer, a transformers Llama with
GQA (16 query / 4 KV heads) and a vocabulary of 101 (uneven over 2, 3 and 4 ranks).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepspeed_ext.checkpoint import serialization
from harness.cli import universal_in
from harness.runner import cli, cli_stopped, run_logged
from harness.scenario import (Load, assert_losses_continue, assert_universal_matches_live, differences_from_upstream,
                              upstream_ds_to_universal, without_commit_marker)


@pytest.fixture(scope="module")
def tp2(scenarios):
    return scenarios("tp2_zero1_bf16", tp=2)


# --------------------------------------------------------------- TP=2, ZeRO-1, bf16 → TP=1/3/4
@pytest.mark.parametrize("target_tp", [1, 3, 4])
def test_tp2_zero1_bf16_resumes_at_other_tp(tp2, target_tp):
    assert_losses_continue(tp2, tp2.resume(target_tp))


def test_tp2_zero1_bf16_merged_state_equals_live_engine(tp2):
    assert assert_universal_matches_live(tp2) == 21 * 3 * 2


@pytest.mark.parametrize("target", [(1, 1, True), (4, 1, True), (1, 2, False), (3, 1, False)])
def test_direct_load_of_the_deepspeed_checkpoint_equals_loading_its_universal_form(tp2, target):
    """engine.load_checkpoint(tag_dir) at another TP/DP degree reshards the ORIGINAL TP=2 checkpoint at load
    time; every rank's weights and Adam state then equal, bit for bit, what loading the converted universal
    checkpoint gives, and so does the next step's loss. ``load_universal`` False: routed by the degree
    mismatch alone."""
    tp, dp, load_universal = target
    (direct, direct_losses), (converted, converted_losses) = tp2.loaded_many(
        [Load(tp, dp, tp2.tag_dir, load_universal=load_universal), Load(tp, dp, tp2.universal_dir)])
    for rank in range(tp):
        assert sorted(direct[rank]) == sorted(converted[rank]) and len(direct[rank]) == 21
        for name, states in converted[rank].items():
            for state, expected in states.items():
                assert torch.equal(direct[rank][name][state], expected), f"TP rank {rank}: {name}/{state}"
    assert direct_losses == converted_losses and list(direct_losses) == [tp2.save_at + 1]
    step = tp2.save_at + 1
    assert abs(direct_losses[step] - tp2.baseline[step]) <= 1e-2 * abs(tp2.baseline[step])


def test_a_universal_save_directory_loads_with_or_without_load_universal(tp2, tmp_path):
    """``to-universal -o OUT`` writes a save directory; engine.load_checkpoint(OUT) restores it at TP=3 even with
    load_universal off (DeepSpeed would find no 'latest' and load nothing), exactly as the default output does."""
    out = tmp_path / "uni"
    cli(["to-universal", str(tp2.save_dir), "-o", str(out), "--quiet"], tmp_path / "convert.log")
    _, losses = tp2.loaded(3, 1, out, load_universal=False)
    step = tp2.save_at + 1
    assert losses[step] == tp2.resume(3)[step]


def test_distributed_to_universal_writes_the_same_bytes(tp2, tmp_path):
    """torchrun -m deepspeed_ext to-universal --distributed: two ranks split the parameters; the output is
    byte-identical to the single-process conversion, and only complete output is published."""
    out = tmp_path / "distributed_universal"
    run_logged([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                "deepspeed_ext", "to-universal", str(tp2.tag_dir), "-o", str(out), "--distributed", "--quiet"],
               tmp_path / "distributed.log")
    single = tp2.universal_dir

    def files(root):
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())

    universal = universal_in(out)
    assert universal.name == single.name and sorted(p.name for p in out.iterdir()) == [single.name, "latest_universal"]
    assert files(universal) == files(single) and len(files(universal)) == 21 * 4 + 5  # + the manifest
    for relative in files(single):
        assert (universal / relative).read_bytes() == (single / relative).read_bytes(), relative
    assert sorted(p.name for p in tmp_path.iterdir()) == ["distributed.log", out.name]  # nothing outside -o


def test_tp2_universal_equals_upstream_ds_to_universal(tp2, tmp_path):
    """Independent oracle: upstream's converter on the same checkpoint gives the same bits."""
    upstream = upstream_ds_to_universal(tp2.tag_dir, tmp_path / "upstream")
    assert differences_from_upstream(tp2.universal_dir, upstream) == []


def test_universal_layout_and_latest_pointer(tp2):
    universal = tp2.universal_dir
    assert (tp2.save_dir / "latest_universal").read_text() == universal.name
    assert (universal / "zero" / "optimizer_state.pt").is_file()
    assert sorted(p.name for p in universal.glob("mp_rank_*_model_states.pt")) == [
        "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"
    ]
    entry = serialization.load(universal / "zero" / "lm_head.weight" / "fp32.pt")
    assert entry["param"].shape == (101, 64) and entry["cat_dim"] == 0
    assert serialization.load(universal / "zero" / "model.layers.0.self_attn.o_proj.weight" / "fp32.pt")["cat_dim"] == 1
    assert not list(tp2.save_dir.glob("*.partial"))


def test_saved_checkpoint_still_loads_in_plain_deepspeed_format(tp2):
    """Our UC info is a JSON file beside DeepSpeed's files; the model states are untouched."""
    info = json.loads((tp2.tag_dir / "deepspeed_ext.json").read_text())
    assert info["tp_size"] == 2 and info["model_config"]["num_key_value_heads"] == 4
    states = serialization.load(tp2.tag_dir / "mp_rank_00_model_states.pt")
    assert "deepspeed_ext" not in states and states["mp_world_size"] == 2


def test_inspect_deepspeed_and_universal(tp2, tmp_path):
    # As a user runs it: no DS_ACCELERATOR in the environment, and stdout must still be pure JSON.
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    proc = subprocess.run([sys.executable, "-m", "deepspeed_ext", "inspect", str(tp2.save_dir), "--json"],
                          env=env, capture_output=True, text=True, check=True)
    summary = json.loads(proc.stdout)
    assert (summary["tp_degree"], summary["dp_degree"], summary["zero_stage"]) == (2, 1, 1)
    assert summary["model_dtypes"] == ["bfloat16"] and summary["metadata"] == "deepspeed_ext"
    from deepspeed_ext.demo.models import build_model
    assert summary["num_parameters"] == sum(p.numel() for p in build_model().parameters())
    qkv = summary["parameters"]["model.layers.0.self_attn.q_proj.weight"]
    assert qkv["partition_type"] == "column" and qkv["shard_widths"] == [[32, 32]]
    proc = cli(["inspect", str(tp2.universal_dir), "--json"], tmp_path / "inspect_u.log")
    usummary = json.loads(proc.stdout)
    assert usummary["kind"] == "universal" and usummary["optimizer_step"] == 3
    assert usummary["num_parameters"] == summary["num_parameters"]
    text = cli(["inspect", str(tp2.save_dir)], tmp_path / "inspect_text.log").stdout
    assert "lm_head.weight" in text and "shards [51, 50] (vocab)" in text


# --------------------------------------------------------------- TP=1 → TP=2
def test_tp1_to_tp2(scenarios):
    tp1 = scenarios("tp1_zero1_bf16", tp=1)
    assert_universal_matches_live(tp1)
    assert_losses_continue(tp1, tp1.resume(2))


def test_tp1_dp1_to_tp2_dp2(scenarios):
    """Scaling back up: both degrees grow at once (4 processes)."""
    tp1 = scenarios("tp1_zero1_bf16", tp=1)
    assert_losses_continue(tp1, tp1.resume(2, dp=2))


# --------------------------------------------------------------- ZeRO-2
@pytest.mark.parametrize("target_tp", [1, 3])  # TP=4, where some ranks hold no KV head: ZeRO-1's and test_kv_heads
def test_tp2_zero2_bf16_resumes_at_other_tp(scenarios, target_tp):
    zero2 = scenarios("tp2_zero2_bf16", tp=2, zero=2)
    if target_tp == 1:
        assert_universal_matches_live(zero2)
    assert_losses_continue(zero2, zero2.resume(target_tp))


# --------------------------------------------------------------- fp32 training
def test_tp2_zero1_fp32_resumes_at_tp3(scenarios):
    fp32 = scenarios("tp2_zero1_fp32", tp=2, dtype="fp32")
    assert_universal_matches_live(fp32)
    assert_losses_continue(fp32, fp32.resume(3))


# --------------------------------------------------------------- ZeRO partitions over DP=2
@pytest.mark.parametrize("target", [(1, 1), (4, 1), (1, 2)])
def test_tp2_dp2_merges_zero_partitions_and_resumes(scenarios, target):
    dp2 = scenarios("tp2_dp2_zero1_bf16", tp=2, dp=2)
    if target == (1, 1):
        assert_universal_matches_live(dp2)
    assert_losses_continue(dp2, dp2.resume(*target))


# --------------------------------------------------------------- checkpoints saved without our section
def test_upstream_tagged_checkpoint_converts_and_resumes(scenarios):
    plain = scenarios("tp2_plain_deepspeed", tp=2, plain=True)
    assert not (plain.tag_dir / "deepspeed_ext.json").exists()
    assert "metadata: deepspeed" in cli(["to-universal", str(plain.save_dir), "-o", str(plain.root / "again")],
                                        plain.root / "again.log").stdout
    assert_universal_matches_live(plain)
    assert_losses_continue(plain, plain.resume(1))


def test_untagged_checkpoint_fails_naming_the_missing_metadata(scenarios, tmp_path):
    """A TP=2 checkpoint with no tags at all (as DeepSpeed < 0.18.9 wrote) is refused, clearly."""
    plain = scenarios("tp2_plain_deepspeed", tp=2, plain=True)
    save_dir = tmp_path / "untagged"
    shutil.copytree(plain.save_dir, save_dir, ignore=shutil.ignore_patterns("*_universal", "latest_universal"))
    for path in (save_dir / plain.tag_dir.name).glob("mp_rank_*_model_states.pt"):
        states = torch.load(path, weights_only=True)
        del states["universal_checkpoint_info"]
        torch.save(states, path)
    before = sorted(p.name for p in save_dir.rglob("*"))
    proc = cli(["to-universal", str(save_dir)], tmp_path / "fail.log", check=False)
    assert proc.returncode != 0
    message = proc.stderr.strip()
    assert len(message.splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "mp_rank_00_model_states.pt" in message and "no tensor-parallel metadata" in message
    assert "deepspeed_ext.json" in message and "universal_checkpoint_info" in message
    assert sorted(p.name for p in save_dir.rglob("*")) == before  # nothing written, source untouched


def test_existing_output_is_refused_unless_overwrite(tp2, tmp_path):
    before = (tp2.universal_dir / "zero" / "lm_head.weight" / "fp32.pt").stat().st_mtime_ns
    proc = cli(["to-universal", str(tp2.save_dir)], tmp_path / "again.log", check=False)
    assert proc.returncode == 2 and "already exists; pass --overwrite" in proc.stderr
    assert (tp2.universal_dir / "zero" / "lm_head.weight" / "fp32.pt").stat().st_mtime_ns == before
    cli(["to-universal", str(tp2.save_dir), "--overwrite", "--quiet"], tmp_path / "overwrite.log")
    assert_universal_matches_live(tp2)


def _copy_checkpoint(tp2, save_dir) -> None:
    """The TP=2 save directory without its universal conversion or its commit marker: a source a test may damage,
    where the reader's own checks of the files must find what is wrong (with the marker, any edited file differs
    from it: tests/unit/test_commit.py)."""
    shutil.copytree(tp2.save_dir, save_dir, ignore=shutil.ignore_patterns("*_universal", "latest_universal"))
    without_commit_marker(save_dir / tp2.tag_dir.name)


def _copy_with_edited_moment(tp2, save_dir, param: str, moment: str, edit):
    """A copy of the TP=2 checkpoint where ``edit(flat_moment, start)`` changed TP rank 1's piece of ``param``."""
    _copy_checkpoint(tp2, save_dir)
    path = next((save_dir / tp2.tag_dir.name).glob("*zero_pp_rank_0_mp_rank_01_optim_states.pt"))

    def edit_moment(optim) -> None:
        state = optim["optimizer_state_dict"]
        edit(state["base_optimizer_state"]["state"][0][moment], state["param_slice_mappings"][0][param].start)

    _edit_torch_file(path, edit_moment)
    return save_dir


def test_replicas_that_drifted_apart_are_refused(tp2, tmp_path):
    """A replicated parameter (a norm) that differs between TP ranks has no single value: stop and name it."""
    save_dir = _copy_with_edited_moment(tp2, tmp_path / "drifted", "model.norm.weight", "exp_avg",
                                        lambda moment, start: moment.__setitem__(start, moment[start] + 1.0))
    proc = cli(["to-universal", str(save_dir)], tmp_path / "drifted.log", check=False)
    assert proc.returncode == 2
    assert "'model.norm.weight'" in proc.stderr and "differs between TP rank 0 and TP rank 1" in proc.stderr
    assert not list(save_dir.glob("*_universal*")) and not (save_dir / "latest_universal").exists()


def test_check_finite_names_a_diverged_moment(tp2, tmp_path):
    """An Inf in one Adam moment of one ZeRO partition: to-universal --check-finite names the parameter and the
    state in one line and publishes nothing. Without the check, a moment that turned Inf after the save is still
    refused, by the fingerprints the save recorded (finite); one that was Inf when saved (a run that diverged: no
    record of other values) converts."""
    save_dir = _copy_with_edited_moment(tp2, tmp_path / "diverged", "model.layers.1.self_attn.q_proj.weight",
                                        "exp_avg_sq", lambda moment, start: moment.__setitem__(start + 5, float("inf")))
    proc = cli(["to-universal", str(save_dir), "--check-finite", "--quiet"], tmp_path / "diverged.log", check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert ("NaN/Inf in 1 parameter(s): model.layers.1.self_attn.q_proj.weight (exp_avg_sq); nothing was written"
            in proc.stderr)
    assert not list(save_dir.glob("*_universal*")) and not (save_dir / "latest_universal").exists()
    proc = cli(["to-universal", str(save_dir), "--quiet"], tmp_path / "unchecked.log", check=False)
    assert proc.returncode == 2 and "recorded fingerprints disagree" in proc.stderr, proc.stderr
    assert "'model.layers.1.self_attn.q_proj.weight' exp_avg_sq" in proc.stderr and "sum=inf" in proc.stderr
    info = save_dir / tp2.tag_dir.name / "deepspeed_ext.json"  # as a diverged run saved it: no finite record
    info.write_text(json.dumps({key: value for key, value in json.loads(info.read_text()).items()
                                if key != "fingerprints"}))
    cli(["to-universal", str(save_dir), "--quiet"], tmp_path / "diverged_saved.log")


def _zero_inside_record(path, state: str, length: int = 64 * 1024) -> str:
    """Zero ``length`` bytes in the middle of the zip record of ``path`` (a ZeRO-1/2 optimizer file) that holds
    flat group 0's ``state`` (``fp32``: the master partition; else a moment), as a write that never arrived leaves
    a preallocated file: a hole; the record's name."""
    import zipfile

    from deepspeed_ext.checkpoint import serialization
    from deepspeed_ext.checkpoint.zipcheck import record_data_offset, records_holding
    optimizer = serialization.load(path)["optimizer_state_dict"]
    flat = optimizer["single_partition_of_fp32_groups"][0] if state == "fp32" else \
        optimizer["base_optimizer_state"]["state"][0][state]
    location = serialization.mapped_location(flat)
    assert location is not None
    (name, ) = records_holding(path, [location[1]])
    del optimizer, flat
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo(name)
    with open(path, "r+b") as handle:
        data_offset = record_data_offset(handle, info.header_offset)
        assert data_offset is not None, info.filename
        handle.seek(data_offset + (info.file_size - length) // 2)
        handle.write(bytes(length))
    return info.filename


@pytest.mark.parametrize("state", ["fp32", "exp_avg"], ids=["master", "moment"])
@pytest.mark.parametrize("marked", [False, True], ids=["no-marker", "committed"])
def test_a_zeroed_range_in_an_optimizer_partition_is_refused_by_verify_and_the_converters_that_read_it(
        tp2, tmp_path, marked, state):
    """Issue 28's reproduction: a complete tag copied, 64 KiB zeroed inside TP rank 0's fp32 partition (a range a
    killed writer never wrote). Without a marker (plain DeepSpeed, or a torn save whose metadata is gone) the zip
    record's CRC-32 names the file and the record; with the marker, the file differs from it. verify fails and
    to-universal / to-hf exit 2 in one line, publishing nothing. The same hole in a moment: verify and
    to-universal (which reads the moments) refuse it; to-hf reads the masters alone, every byte of them checked,
    and converts."""
    save_dir = tmp_path / "holed"
    shutil.copytree(tp2.save_dir, save_dir, ignore=shutil.ignore_patterns("*_universal", "latest_universal"))
    tag = save_dir / tp2.tag_dir.name
    config = tmp_path / "config.json"  # to-hf's model config, which a tag without deepspeed_ext.json lacks
    config.write_text(json.dumps(json.loads((tag / "deepspeed_ext.json").read_text())["model_config"]))
    if not marked:
        without_commit_marker(tag)
        (tag / "deepspeed_ext.json").unlink()  # as in the report: upstream's universal_checkpoint_info remains
    victim = tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    record = _zero_inside_record(victim, state)
    before = {p: p.read_bytes() for p in save_dir.rglob("*") if p.is_file()}

    verified = cli(["verify", str(save_dir)], tmp_path / "verify.log", check=False)
    assert verified.returncode == 1 and "FAILED" in verified.stdout, verified.stdout + verified.stderr
    assert verified.stdout.count(f"{victim}") == 1, verified.stdout  # named once, with or without the marker
    if not marked:
        assert record in verified.stdout, verified.stdout
    for command, out, extra in (("to-universal", tmp_path / "uni", []),
                                ("to-hf", tmp_path / "hf", ["--config", str(config)])):
        proc = cli([command, str(save_dir), "-o", str(out), "-q", *extra], tmp_path / f"{command}.log", check=False)
        if command == "to-hf" and state != "fp32":
            assert proc.returncode == 0 and (out / "model.safetensors").is_file(), proc.stderr
            continue
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and victim.name in lines[0], (command, proc.stderr)
        assert not out.exists() and not Path(f"{out}.partial").exists(), command
    assert {p: p.read_bytes() for p in save_dir.rglob("*") if p.is_file()} == before


def _edit_torch_file(path, edit) -> None:
    data = torch.load(path, weights_only=False)  # our own test file
    edit(data)
    torch.save(data, path)


def _set_step(optim) -> None:
    optim["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["step"] = 7


_FAULTS = {
    "truncated optimizer file": ("bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt",
                                 lambda path: path.write_bytes(path.read_bytes()[:4000]), "cannot read torch file"),
    "missing optimizer file": ("bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt", lambda path: path.unlink(),
                               "missing optimizer file for dp_rank 0, mp_rank 01"),
    "missing mp_rank file": ("mp_rank_01_model_states.pt", lambda path: path.unlink(),
                             "mp_rank files for TP ranks [1] are missing"),
    "model states of another step": ("mp_rank_01_model_states.pt",
                                     lambda path: _edit_torch_file(path, lambda s: s.update(global_steps=2)),
                                     "saved at global step 2, but mp_rank_00_model_states.pt at step 3: files of "
                                     "two checkpoints are mixed"),
    "optimizer file of another step": ("bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt",
                                       lambda path: _edit_torch_file(path, _set_step),
                                       "optimizer step 7, but bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt has "
                                       "step 3: files of two checkpoints are mixed"),
    "DP degrees disagree": ("mp_rank_01_model_states.pt",
                            lambda path: _edit_torch_file(path, lambda s: s.update(dp_world_size=2)),
                            "says DP=2, but mp_rank_00_model_states.pt says DP=1"),
    "TP degrees disagree": ("mp_rank_01_model_states.pt",
                            lambda path: _edit_torch_file(path, lambda s: s.update(mp_world_size=4)),
                            "says TP=4, but mp_rank_00_model_states.pt says TP=2"),
    "partitioned for another DP degree": ("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                          lambda path: _edit_torch_file(
                                              path, lambda o: o["optimizer_state_dict"].update(partition_count=[2])),
                                          "param group 0 is partitioned over 2 ranks, but the model states and "
                                          "files say DP=1"),
}


def _tree_digest(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("fault", sorted(_FAULTS))
def test_bad_checkpoint_files_get_one_line_naming_the_file(tp2, tmp_path, fault):
    """Each fault: exit 2, one line naming the file and the problem, no traceback, the source untouched and
    nothing published."""
    file_name, damage, message = _FAULTS[fault]
    save_dir = tmp_path / "ckpt"
    _copy_checkpoint(tp2, save_dir)
    damage(save_dir / tp2.tag_dir.name / file_name)
    before = _tree_digest(save_dir)
    proc = cli(["to-universal", str(save_dir), "--quiet"], tmp_path / "fault.log", check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"deepspeed-ext: error: {save_dir / tp2.tag_dir.name}") and message in lines[0], lines
    assert _tree_digest(save_dir) == before
    assert not list(save_dir.glob("*_universal*")) and not (save_dir / "latest_universal").exists()


def test_a_full_disk_fails_cleanly_and_a_rerun_finishes(tp2, tmp_path):
    """RLIMIT_FSIZE (a full disk) during to-universal: one line naming the file, exit 2, no output; the same
    command without the limit then converts."""
    save_dir = tmp_path / "ckpt"
    _copy_checkpoint(tp2, save_dir)
    limit = "import resource; resource.setrlimit(resource.RLIMIT_FSIZE, (100 * 1024, 100 * 1024)); "
    proc = subprocess.run([sys.executable, "-c", limit + "from deepspeed_ext.cli import main; import sys; "
                           f"sys.exit(main(['to-universal', {str(save_dir)!r}, '--quiet']))"],
                          capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "File too large" in lines[0], proc.stderr
    assert str(save_dir) in lines[0]
    assert not list(save_dir.glob("*_universal*")) and not (save_dir / "latest_universal").exists()
    cli(["to-universal", str(save_dir), "--quiet"], tmp_path / "rerun.log")
    assert (save_dir / "latest_universal").read_text() == f"{tp2.tag_dir.name}_universal"


@pytest.mark.parametrize("written", [1, 8, 15])
def test_kill_9_mid_conversion_leaves_nothing_that_looks_complete(tp2, tmp_path, written):
    """kill -9 inside the file of the first state after ``written`` parameters' (3 states each): its bytes are in
    its ``.tmp``, not renamed. Nothing under the output's name and no latest_universal beside it; the staging
    directory has no manifest (written last); the source is untouched; the rerun clears the staging directory,
    finishes and verifies."""
    save_dir = tmp_path / "ckpt"
    _copy_checkpoint(tp2, save_dir)
    before = _tree_digest(save_dir)
    out = tmp_path / "universal"
    partial = tmp_path / "universal.partial"
    killed = cli_stopped(["to-universal", str(save_dir), "-o", str(out), "-q"], tmp_path / "killed.log",
                         point="range-read", count=3 * written + 1)
    assert killed.returncode == -signal.SIGKILL, killed.returncode
    # The state file the kill hit holds its bytes under the temporary name (the other writer thread may have left
    # one more, possibly empty, beside it); the other thread may be a state ahead or behind.
    torn = [p for p in partial.rglob("*.pt.tmp") if p.name != "step.pt.tmp" and p.stat().st_size]
    complete = [p for p in partial.rglob("*.pt") if p.parent.parent.name == "zero" and p.name != "step.pt"]
    assert torn and len(complete) >= 3 * written - 1, (torn, complete)
    assert not out.exists() and not (tmp_path / "latest_universal").exists()
    assert not list(partial.rglob("deepspeed_ext.manifest.json"))
    assert _tree_digest(save_dir) == before
    cli(["to-universal", str(save_dir), "-o", str(out), "--quiet"], tmp_path / "rerun.log")
    assert not partial.exists()
    assert "0 problem(s)" in cli(["verify", str(out)], tmp_path / "verify.log").stdout
    assert _tree_digest(save_dir) == before


def test_kill_9_mid_to_maxtext_then_rerun(tp2, tmp_path):
    """kill -9 while Orbax writes (inside its write of the 12th array block, its temporary step in the staging
    directory): nothing under the output's name, the source untouched; the rerun clears the leftover, finishes
    and verifies."""
    out = tmp_path / "maxtext"
    staging = tmp_path / "maxtext.partial"
    before = _tree_digest(tp2.tag_dir)
    killed = cli_stopped(["to-maxtext", str(tp2.tag_dir), "-o", str(out), "-q"], tmp_path / "killed.log",
                         point="range-read", count=12)
    assert killed.returncode == -signal.SIGKILL, killed.returncode
    assert any(".orbax-checkpoint-tmp" in entry.name for entry in staging.iterdir()), list(staging.iterdir())
    assert not out.exists()
    cli(["to-maxtext", str(tp2.tag_dir), "-o", str(out), "--quiet"], tmp_path / "rerun.log")
    assert not staging.exists()
    assert "0 problem(s)" in cli(["verify", str(out)], tmp_path / "verify.log").stdout
    assert _tree_digest(tp2.tag_dir) == before


class _FileCreatingPayload:
    """Creates a file when unpickled by a loader that runs code (``torch.load(weights_only=False)``)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_planted_pickle_payload_is_refused_and_never_runs(tp2, tmp_path):
    """A checkpoint whose model states carry a code-running pickle: every command that opens it refuses it in
    one line, exit 2, and the payload never runs; plain torch.load(weights_only=False) would run it."""
    save_dir = tmp_path / "planted"
    _copy_checkpoint(tp2, save_dir)
    path = save_dir / tp2.tag_dir.name / "mp_rank_00_model_states.pt"
    marker = tmp_path / "payload_ran"
    states = torch.load(path, weights_only=False)  # our own test file
    states["client_state"] = _FileCreatingPayload(str(marker))
    torch.save(states, path)
    for args in (["to-universal", str(save_dir)], ["inspect", str(save_dir)],
                 ["to-hf", str(save_dir), "-o", str(tmp_path / "hf")],
                 ["to-maxtext", str(save_dir), "-o", str(tmp_path / "maxtext")]):
        proc = cli([*args, "--quiet"] if args[0] != "inspect" else args, tmp_path / f"{args[0]}.log", check=False)
        assert proc.returncode == 2, args
        assert proc.stderr.strip().splitlines() == [line for line in proc.stderr.strip().splitlines()
                                                    if "refused to unpickle" in line and str(path) in line], args
        assert not marker.exists(), args
    assert not list(tmp_path.glob("hf*")) and not list(tmp_path.glob("maxtext*")) and not list(
        save_dir.glob("*_universal*"))
    torch.load(path, weights_only=False)  # the payload is live: an unsafe loader runs it
    assert marker.exists()


# --------------------------------------------------------------- ZeRO-3 (parameters partitioned too)
@pytest.mark.parametrize("target", [(1, 2, 3), (4, 1, 1)])
def test_tp2_dp2_zero3_converts_and_resumes(scenarios, target):
    """ZeRO-3 TP=2×DP=2 → TP=1×DP=2 under ZeRO-3 (DeepSpeed's ZeRO-3 loader reads our files) and → TP=4
    under ZeRO-1 (the universal form does not care which stage wrote it)."""
    zero3 = scenarios("tp2_dp2_zero3_bf16", tp=2, dp=2, zero=3)
    if target == (1, 2, 3):
        assert_universal_matches_live(zero3)
        summary = json.loads(cli(["inspect", str(zero3.save_dir), "--json"], zero3.root / "inspect.log").stdout)
        assert (summary["zero_stage"], summary["tp_degree"], summary["dp_degree"]) == (3, 2, 2)
        assert summary["optimizer_dtype"] == "float32" and summary["num_parameters"] == 95168
        assert sorted(p.name for p in zero3.universal_dir.glob("*model_states.pt")) == [
            f"zero_pp_rank_{dp}_mp_rank_{tp:02d}_model_states.pt" for dp in range(2) for tp in range(2)
        ]
    tp, dp, zero = target
    assert_losses_continue(zero3, zero3.resume(tp, dp=dp, zero=zero))


#: A Llama of 7 heads (split 4 + 3 at TP=2) whose hidden size, 42, leaves the embedding, the head (101 x 42) and
#: the norms (42) indivisible by 4: ZeRO-3 pads their last partitions at DP=4.
PADDED_LLAMA = dict(model_type="llama", vocab_size=101, hidden_size=42, intermediate_size=160, num_hidden_layers=2,
                    num_attention_heads=7, num_key_value_heads=7, max_position_embeddings=64,
                    tie_word_embeddings=False)


def test_zero3_targets_restore_by_partition_bit_identical_to_deepspeeds_loader(scenarios):
    """Into ZeRO-3 at TP=1 x DP=4 from TP=2 x DP=2 ZeRO-3, with padded partitions: each rank reads only its
    partition of its TP slice, and what it restores equals DeepSpeed's own ZeRO-3 universal loader bit for bit,
    from the universal form and straight from the DeepSpeed checkpoint; training then goes on identically."""
    saved = scenarios("tp2_dp2_zero3_7_heads", tp=2, dp=2, zero=3, model_config=PADDED_LLAMA)
    assert_universal_matches_live(saved)
    (ours, ours_losses), (upstream, upstream_losses), (direct, direct_losses) = saved.loaded_many(
        [Load(1, 4, saved.save_dir), Load(1, 4, saved.save_dir, extra=("--restore", "deepspeed")),
         Load(1, 4, saved.save_dir, load_universal=False)])
    assert ours[0]["model.embed_tokens.weight"]["fp32"].numel() % 4 == 2  # a padded partition
    assert ours[0].keys() == upstream[0].keys() == direct[0].keys()
    for name, states in upstream[0].items():
        for state, value in states.items():
            assert torch.equal(ours[0][name][state], value), (name, state)
            assert torch.equal(direct[0][name][state], value), (name, state)
    assert ours_losses == upstream_losses == direct_losses
    step = saved.save_at + 1
    assert ours_losses[step] == pytest.approx(saved.baseline[step], rel=1e-2)
