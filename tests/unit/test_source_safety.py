"""Never touch the source, answer every input in one line, and work on every format each command accepts.

* Every writing command is run with ``-o`` equal to, inside, and a parent of its source, with and without
  ``--overwrite``: refused in one line (exit 2), the whole tree around the source byte-identical.
* With ``-o`` nothing is written outside the output; ``-o`` of the universal writers is a save directory.
* Each command on each format's output: it works, or says in one line which command reads that format.
* Misleading inputs get the line that names what is wrong.

Ctrl-C, a closed stdout (the CLI in a subprocess) and the DeepSpeed-checkpoint cases (a real engine's
checkpoint) are in tests/e2e/test_source_safety_e2e.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deepspeed_ext.demo.models import build_model
from harness.cli import REFUSED, assert_refused_everywhere, digest, make_formats, run, universal_in
from harness.runner import child_env


@pytest.fixture(scope="module")
def formats(tmp_path_factory) -> dict[str, Path]:
    """One checkpoint per format: HF (sharded safetensors), universal (from-hf's save directory), MaxText."""
    return make_formats(tmp_path_factory.mktemp("formats"))


# --------------------------------------------------------------------------- -o at, inside or around the source
#: (command, source format, extra arguments) of every writing command on every format it reads.
WRITERS = [("to-hf", "huggingface", []), ("to-hf", "universal", []), ("to-hf", "maxtext", []),
           ("to-maxtext", "huggingface", []), ("to-maxtext", "universal", []),
           ("from-hf", "huggingface", []), ("from-maxtext", "maxtext", []),
           ("reshard-orbax", "maxtext", ["--mesh", "fsdp=2"])]


@pytest.mark.parametrize("command, kind, extra", WRITERS, ids=[f"{c}-{k}" for c, k, _ in WRITERS])
def test_an_output_at_inside_or_around_the_source_is_refused(formats, tmp_path, capsys, command, kind, extra):
    source = tmp_path / "work" / kind
    shutil.copytree(formats[kind], source, symlinks=True)
    assert_refused_everywhere(capsys, tmp_path / "work", command, source, extra)
    if kind == "maxtext":  # named by its item directory, the checkpoint is still the whole root
        assert_refused_everywhere(capsys, tmp_path / "work", command, source, extra, named=source / "0" / "items")
    if kind == "universal":  # named by the universal directory inside the save directory
        assert_refused_everywhere(capsys, tmp_path / "work", command, universal_in(source), extra)


def test_a_symlink_to_the_source_or_through_it_is_refused(formats, tmp_path, capsys):
    """Symlinks and ``..`` are resolved: an output reached through a link into the source is the source."""
    source = tmp_path / "hf"
    shutil.copytree(formats["huggingface"], source)
    (tmp_path / "link").symlink_to(source)
    before = digest(tmp_path)
    for out in (tmp_path / "link", tmp_path / "link" / "x", source / ".." / "hf"):
        code, _, err = run(capsys, "to-hf", str(source), "-o", str(out), "--overwrite", "-q")
        assert code == 2 and REFUSED in err, (out, err)
    assert digest(tmp_path) == before


def test_hf_cache_blobs_behind_symlinks_are_protected(formats, tmp_path, capsys):
    """A Hugging Face cache snapshot holds symlinks into blobs/: the blobs are the source too."""
    blobs, snapshot = tmp_path / "cache" / "blobs", tmp_path / "cache" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in formats["huggingface"].iterdir():
        shutil.copy(file, blobs / f"blob-{file.name}")
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", f"blob-{file.name}"))
    before = digest(tmp_path)
    code, _, err = run(capsys, "from-hf", str(snapshot), "-o", str(blobs), "--overwrite", "-q")
    assert code == 2 and "the output contains the source checkpoint" in err and str(blobs) in err, err
    assert digest(tmp_path) == before
    assert run(capsys, "from-hf", str(snapshot), "-o", str(tmp_path / "universal"), "-q")[0] == 0


@pytest.mark.parametrize("command, kind, extra", WRITERS, ids=[f"{c}-{k}" for c, k, _ in WRITERS])
def test_with_o_nothing_is_written_outside_the_output(formats, tmp_path, capsys, command, kind, extra):
    """Beside the source and the output nothing appears; an existing output needs --overwrite, which replaces it."""
    source = tmp_path / kind
    shutil.copytree(formats[kind], source)
    out = tmp_path / "out"
    before = digest(source)
    assert run(capsys, command, str(source), "-o", str(out), *extra, "-q")[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([kind, "out"]) and digest(source) == before
    code, _, err = run(capsys, command, str(source), "-o", str(out), *extra, "-q")
    assert code == 2 and "output already exists; pass --overwrite to replace it" in err
    assert run(capsys, command, str(source), "-o", str(out), *extra, "--overwrite", "-q")[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([kind, "out"]) and digest(source) == before
    if command.startswith("from-"):  # a save directory: the pointer and the universal directory, nothing else
        assert sorted(p.name for p in out.iterdir()) == sorted(["latest_universal", universal_in(out).name])
    assert run(capsys, "verify", str(out))[0] == 0


def test_an_output_that_is_a_file_is_refused(formats, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("keep me")
    code, _, err = run(capsys, "to-hf", str(formats["huggingface"]), "-o", str(tmp_path / "notes.txt"), "--overwrite",
                       "-q")
    assert code == 2 and "exists and is not a directory" in err and (tmp_path / "notes.txt").read_text() == "keep me"


# --------------------------------------------------------------------------- every command on every format
#: What a command says about a format it does not read (None: it reads it).
ANSWERS = {
    "to-universal": {"huggingface": "convert it with from-hf", "universal": "already a universal checkpoint",
                     "maxtext": "convert it with from-maxtext"},
    "from-hf": {"huggingface": None, "universal": "already a universal checkpoint", "maxtext": "from-maxtext"},
    "from-maxtext": {"huggingface": "convert it with from-hf or to-maxtext", "universal": "already a universal",
                     "maxtext": None},
    "to-hf": {"huggingface": None, "universal": None, "maxtext": None},
    "to-maxtext": {"huggingface": None, "universal": None, "maxtext": None},
}


@pytest.mark.parametrize("kind", ["huggingface", "universal", "maxtext"])
def test_every_command_on_every_format(formats, tmp_path, capsys, kind):
    source = formats[kind]
    for argument in (source, *([source / "0" / "items"] if kind == "maxtext" else []),
                     *([universal_in(source)] if kind == "universal" else [])):
        code, out, err = run(capsys, "inspect", str(argument))
        assert code == 0 and "parameters:" in out and "model.norm.weight" in out, (argument, err)
        code, out, _ = run(capsys, "inspect", str(argument), "--json")
        assert code == 0 and json.loads(out)["num_parameters"] == sum(p.numel() for p in build_model().parameters())
        code, out, _ = run(capsys, "verify", str(argument))
        assert code == 0 and ": OK: " in out and "0 problem(s)" in out, out
        for command, answers in ANSWERS.items():
            out_dir = tmp_path / f"{command}-{argument.name}"
            code, _, err = run(capsys, command, str(argument), *(["-o", str(out_dir)]), "-q")
            if answers[kind] is None:
                assert code == 0, (command, argument, err)
                assert run(capsys, "verify", str(out_dir))[0] == 0, (command, argument)
            else:
                lines = err.strip().splitlines()
                assert code == 2 and len(lines) == 1 and answers[kind] in lines[0], (command, argument, err)
                assert not out_dir.exists()


# --------------------------------------------------------------------------- misleading inputs
def test_inputs_that_are_not_checkpoints_get_the_line_that_names_the_problem(formats, tmp_path, capsys):
    cases = {
        (str(tmp_path / "nope"), "from-maxtext"): f"{tmp_path / 'nope'}: no such checkpoint directory",
        (str(tmp_path / "nope"), "inspect"): f"{tmp_path / 'nope'}: no such checkpoint directory",
        (str(formats["huggingface"] / "config.json"), "to-hf"): "is a file, not a checkpoint directory",
        (str(next(formats["huggingface"].glob("*.safetensors"))), "from-hf"):
            "the model directory that holds it and config.json",
    }
    (tmp_path / "empty").mkdir()
    cases[(str(tmp_path / "empty"), "to-universal")] = "not a checkpoint: neither a tag directory"
    for (argument, command), expected in cases.items():
        out = [] if command == "inspect" else ["-o", str(tmp_path / "out")]
        code, _, err = run(capsys, command, argument, *out)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and expected in lines[0], (command, argument, err)
        assert lines[0].startswith(f"deepspeed-ext: error: {argument}"), lines
    assert not (tmp_path / "out").exists()


def test_hf_weights_without_config_json_and_with_config(formats, tmp_path, capsys):
    """The line says config.json is missing and how to supply it; --config then works for every command."""
    source = tmp_path / "weights"
    shutil.copytree(formats["huggingface"], source)
    (source / "config.json").rename(tmp_path / "config.json")
    for command in ("inspect", "verify", "from-hf", "to-hf", "to-maxtext"):
        out = [] if command in ("inspect", "verify") else ["-o", str(tmp_path / f"{command}-out")]
        code, _, err = run(capsys, command, str(source), *out)
        assert code == 2 and f"{source / 'config.json'}: missing" in err and "--config" in err, (command, err)
        code, _, err = run(capsys, command, str(source), *out, "--config", str(tmp_path / "config.json"))
        assert code == 0, (command, err)


def test_from_maxtext_accepts_the_root_the_step_and_the_items(formats, tmp_path, capsys):
    root = formats["maxtext"]
    outputs = []
    for index, argument in enumerate((root, root / "0", root / "0" / "items")):
        outputs.append(tmp_path / f"u{index}")
        assert run(capsys, "from-maxtext", str(argument), "-o", str(outputs[-1]), "-q")[0] == 0
    files = [digest(universal_in(out)) for out in outputs]
    assert files[0] == files[1] == files[2]


def test_a_directory_with_two_formats_is_read_as_each_command_expects(formats, tmp_path, capsys):
    """A Hugging Face Trainer checkpoint holds HF weights and, beside them, a DeepSpeed save (`latest`): from-hf
    reads the weights, the DeepSpeed-reading commands the DeepSpeed save (here a universal one, standing in)."""
    both = tmp_path / "checkpoint-3"
    shutil.copytree(formats["huggingface"], both)
    shutil.copytree(formats["universal"], both, dirs_exist_ok=True)  # latest_universal + its directory
    assert run(capsys, "from-hf", str(both), "-o", str(tmp_path / "from_hf"), "-q")[0] == 0
    code, out, _ = run(capsys, "inspect", str(both), "--json")
    assert code == 0 and json.loads(out)["kind"] == "universal"
    code, _, err = run(capsys, "to-universal", str(both))
    assert code == 2 and "already a universal checkpoint" in err


def test_the_staging_directory_is_the_outputs_lock(tmp_path):
    """While one writer builds ``out`` a second one refuses and leaves its work alone; a stale staging
    directory (nobody holds its lock) is cleared."""
    from deepspeed_ext.checkpoint import output
    from deepspeed_ext.errors import CheckpointError
    out = tmp_path / "out"
    with output.staged(out) as partial:
        (partial / "work").write_text("first")
        with pytest.raises(CheckpointError, match="another deepspeed-ext run is writing this output"):
            with output.staged(out):
                pass
        assert (partial / "work").read_text() == "first"
    assert (out / "work").read_text() == "first"
    stale = tmp_path / "other.partial"
    stale.mkdir()
    (stale / "leftover").write_text("killed run")
    with output.staged(tmp_path / "other") as partial:
        assert not (partial / "leftover").exists()
    assert (tmp_path / "other").is_dir() and not stale.exists()


@pytest.mark.parametrize("where", ["main", "thread"])
def test_ctrl_c_ends_the_run_and_what_writer_threads_recreate_is_swept(tmp_path, where):
    """A SIGINT handled on whichever thread it lands, while the main thread waits in a lock for good ("thread":
    Python's own handler would never run), and a writer thread that re-creates the staging directory by path
    after it was removed: exit 130, one line, and once the process and its sweeper are gone (the caller read
    stderr to its end), nothing left. Five runs each: the re-creation is a race the sweep must win every time."""
    worker = Path(__file__).resolve().parents[1] / "harness" / "workers" / "interrupted_staging.py"
    for attempt in range(5):
        work = tmp_path / str(attempt)
        work.mkdir()
        proc = subprocess.run([sys.executable, str(worker), str(work / "out"), where], capture_output=True,
                              text=True, timeout=60, env=child_env())
        assert proc.returncode == 130 and proc.stderr == "deepspeed-ext: interrupted; nothing was written\n", \
            (attempt, proc.returncode, proc.stderr[-2000:])
        assert sorted(p.name for p in work.iterdir()) == [], attempt


def test_optimizer_state_lists_are_read_as_dicts_and_other_shapes_refused(tmp_path):
    from deepspeed_ext.checkpoint.deepspeed.files import indexed_state
    from deepspeed_ext.errors import CheckpointError
    path = tmp_path / "optim.pt"
    entry = {"step": 3, "exp_avg": 1}
    assert indexed_state({"state": [entry], "param_groups": []}, path)["state"] == {0: entry}
    base = {"state": {0: entry}}
    assert indexed_state(base, path) is base
    for bad, says in (([], "state dict is a list"), ({"state": 3}, "'state' is a int"),
                      ({"state": {0: 3}}, "entry 0 is a int")):
        with pytest.raises(CheckpointError, match=says) as info:
            indexed_state(bad, path)
        assert str(path) in str(info.value)


def test_the_interrupt_line_starts_a_line_of_its_own_after_a_progress_bar():
    """tqdm ends its updates with a carriage return: the interrupt's line gets a line break first while a bar is
    shown (it was appended to the bar's line), and none without one."""
    import io

    from tqdm import tqdm

    from deepspeed_ext.checkpoint.output import _line_break_after_a_bar
    assert _line_break_after_a_bar() == ""
    bar = tqdm(total=3, file=io.StringIO())
    try:
        assert _line_break_after_a_bar() == "\n"
    finally:
        bar.close()
    with tqdm(total=3, disable=True):
        assert _line_break_after_a_bar() == ""
