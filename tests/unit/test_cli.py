"""The command line explains itself (issue: a new user's first hour): --help, --version, global flags anywhere,
labelled progress, a missing extra named with its pip command, verify on added files, to-hf's companions."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import pytest

from harness.cli import cli_result, make_sources


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    return make_sources(tmp_path_factory.mktemp("sources"))


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    from deepspeed_ext.cli import build_parser
    (action, ) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_command_has_a_description_an_example_and_help_for_every_option():
    from deepspeed_ext.checkpoint.families import family_names
    commands = _subparsers()
    assert set(commands) == {"to-universal", "to-maxtext", "from-maxtext", "to-hf", "from-hf", "reshard-orbax",
                             "verify", "inspect", "compare"}
    for name, parser in commands.items():
        text = parser.format_help()
        assert "examples:\n  deepspeed-ext " + name in text, name
        assert len(parser.description.split("\n\n", 1)[1]) > 150, name  # a paragraph beyond the summary line
        for action in parser._actions:
            assert action.help and action.help.strip(), f"{name} {action.option_strings or action.dest}: no help"
        family = [a for a in parser._actions if "--family" in a.option_strings]
        for action in family:  # --family names the families it takes
            assert all(f in action.help for f in family_names()), (name, action.help)


def test_version_names_the_packages_and_the_extras():
    from importlib.metadata import version
    proc = cli_result("--version")
    assert proc.returncode == 0
    assert f"DeepSpeed {version('deepspeed')}, torch {version('torch')}" in proc.stdout
    for extra in ("hf", "maxtext", "trainer"):
        assert f"extra {extra}: installed" in proc.stdout


@pytest.mark.parametrize("argv", [["--quiet", "--debug", "inspect", "X"], ["inspect", "X", "--quiet", "--debug"],
                                  ["-q", "inspect", "--debug", "X"]])
def test_debug_and_quiet_work_before_or_after_the_command(argv):
    from deepspeed_ext.cli import build_parser
    args = build_parser().parse_args(argv)
    assert args.quiet is True and args.debug is True and args.command == "inspect"
    assert build_parser().parse_args(["inspect", "X"]).quiet is False


def test_without_a_command_the_usage_is_shown():
    proc = cli_result()
    assert proc.returncode == 2 and "COMMAND" in proc.stderr and "to-universal" in proc.stderr


def test_a_missing_extra_is_one_line_with_the_pip_command_and_nothing_is_written(sources, tmp_path, monkeypatch):
    from deepspeed_ext import extras
    real = extras._importable
    monkeypatch.setattr(extras, "_importable", lambda module: module not in {"jax", "orbax.checkpoint"} and
                        real(module))
    out = tmp_path / "maxtext"
    proc = cli_result("to-maxtext", str(sources / "hf"), "-o", str(out))
    assert proc.returncode == 2 and not out.exists()
    assert proc.stderr.strip().splitlines() == [
        "deepspeed-ext: error: to-maxtext needs jax, orbax-checkpoint, which are not installed: "
        "pip install 'deepspeed-ext[maxtext]'"]
    # inspect finds the format first, then says what reading it needs
    proc = cli_result("inspect", str(sources / "maxtext"))
    assert proc.returncode == 2 and "pip install 'deepspeed-ext[maxtext]'" in proc.stderr
    assert "extra maxtext: missing jax, orbax-checkpoint" in cli_result("--version").stdout
    # the Python API says the same
    import deepspeed_ext
    from deepspeed_ext.errors import MissingExtraError
    with pytest.raises(MissingExtraError, match=r"pip install 'deepspeed-ext\[maxtext\]'"):
        deepspeed_ext.convert(sources / "hf", tmp_path / "api", to="maxtext")


def test_progress_bars_are_labelled_with_the_command(sources, tmp_path):
    proc = cli_result("from-hf", str(sources / "hf"), "-o", str(tmp_path / "universal"))
    assert proc.returncode == 0, proc.stderr
    assert "from-hf:" in proc.stderr and "to-universal" not in proc.stderr
    proc = cli_result("from-maxtext", str(sources / "maxtext"), "-o", str(tmp_path / "back"))
    assert proc.returncode == 0, proc.stderr
    assert "from-maxtext:" in proc.stderr and "to-universal" not in proc.stderr


def test_inspect_on_hf_says_full_tensors_not_replicated(sources):
    proc = cli_result("inspect", str(sources / "hf"))
    assert proc.returncode == 0
    assert "full tensors (the format has no tensor-parallel layout)" in proc.stdout
    assert "replicated" not in proc.stdout


@pytest.mark.parametrize("mesh, ok", [("data=2,fsdp=2", True), ("fsdp_transpose=2", True), ("", False),
                                      (" , ", False), ("fsdp=2,fsdp=2", False), ("model=2", False)])
def test_mesh_takes_every_maxtext_axis_and_refuses_an_empty_value(sources, tmp_path, mesh, ok):
    out = tmp_path / "maxtext"
    proc = cli_result("to-maxtext", str(sources / "hf"), "-o", str(out), "--mesh", mesh, "-q")
    assert (proc.returncode == 0) == ok, proc.stderr
    if not ok:
        assert len(proc.stderr.strip().splitlines()) == 1 and "--mesh" in proc.stderr and not out.exists()


def test_to_hf_writes_generation_config_and_carries_or_adds_tokenizer_files(sources, tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    from harness.workers.hf_trainer import tiny_tokenizer
    tokenizer_dir = tmp_path / "tokenizer"
    tiny_tokenizer().save_pretrained(tokenizer_dir)

    # an HF folder without tokenizer files, re-sharded: generation config kept, --tokenizer adds the rest
    resharded = tmp_path / "resharded"
    proc = cli_result("to-hf", str(sources / "hf"), "-o", str(resharded), "--tokenizer", str(tokenizer_dir), "-q")
    assert proc.returncode == 0, proc.stderr
    assert (resharded / "generation_config.json").read_bytes() == (sources / "hf" / "generation_config.json").read_bytes()
    assert AutoTokenizer.from_pretrained(resharded)("t5 t7").input_ids == [5, 7]
    # ... and from there on the tokenizer travels with the folder
    again = tmp_path / "again"
    assert cli_result("to-hf", str(resharded), "-o", str(again), "-q").returncode == 0
    assert (again / "tokenizer.json").read_bytes() == (resharded / "tokenizer.json").read_bytes()
    assert cli_result("verify", str(again)).returncode == 0

    # a source folder without a generation config: derived from the model config, as save_pretrained does
    bare = tmp_path / "bare"
    shutil.copytree(sources / "hf", bare)
    (bare / "generation_config.json").unlink()
    out = tmp_path / "from_bare"
    assert cli_result("to-hf", str(bare), "-o", str(out), "-q").returncode == 0
    config = json.loads((bare / "config.json").read_text())
    generation = GenerationConfig.from_pretrained(out)
    assert generation.bos_token_id == config.get("bos_token_id")
    assert generation.eos_token_id == config.get("eos_token_id")

    proc = cli_result("to-hf", str(sources / "hf"), "-o", str(tmp_path / "x"), "--tokenizer", str(tmp_path))
    assert proc.returncode == 2 and "no tokenizer files" in proc.stderr and not (tmp_path / "x").exists()


def test_docs_examples_write_under_their_own_directories():
    """Following one page's example after another's must not fail with "output already exists": each page's
    shell examples keep their files under /tmp/<a directory of that page's own>."""
    import re
    docs = Path(__file__).resolve().parents[2] / "docs"
    roots: dict[str, set[str]] = {}
    for page in sorted(docs.glob("*.md")):
        for block in re.findall(r"```(?:bash|sh)\n(.*?)```", page.read_text(), flags=re.S):
            for root in re.findall(r"/tmp/([A-Za-z0-9_.-]+)", block):
                roots.setdefault(root, set()).add(page.name)
    shared = {root: pages for root, pages in roots.items() if len(pages) > 1}
    assert not shared, shared


def test_docs_examples_set_up_what_they_run():
    """Each page's example starts by building what it runs, and no more (the test setup builds three
    environments): ``setup.sh demo`` for the base install, ``bridges`` where it converts to or from MaxText or runs
    the Trainer, ``maxtext`` where it runs MaxText's own code (.venv-maxtext)."""
    import re
    docs = Path(__file__).resolve().parents[2] / "docs"
    checked = 0
    for page in sorted(docs.glob("*.md")):
        for block in re.findall(r"```(?:bash|sh)\n(.*?)```", page.read_text(), flags=re.S):
            setup = re.search(r"bash scripts/setup\.sh(?: (\w+))?", block)
            if setup is None:
                continue
            checked += 1
            mode = setup.group(1)
            assert mode in ("demo", "bridges", "maxtext"), f"{page.name}: setup.sh {mode or ''} builds the test setup"
            if ".venv-maxtext" in block:
                assert mode == "maxtext", f"{page.name}: runs MaxText's code after setup.sh {mode}"
            elif re.search(r"(to|from)-maxtext|hf_trainer|accelerate", block):
                assert mode == "bridges", f"{page.name}: needs an extra, sets up {mode}"
    assert checked >= 8


_PROCESS_PROBE = """
import gc, os, sys
import deepspeed_ext.checkpoint.formats as formats
from deepspeed_ext import cli
assert "torch" not in sys.modules  # the wait policy must be in place before torch loads libgomp
opened, seen = formats.open_checkpoint, []
def spy(*args, **kwargs):
    seen.append(gc.isenabled())
    return opened(*args, **kwargs)
formats.open_checkpoint = spy
path, as_program = sys.argv[1], sys.argv[2] != "python"
sys.argv = ["deepspeed-ext", "inspect", path]
code = cli.main() if as_program else cli.main(["inspect", path])
print("probe", code, seen, gc.isenabled(), gc.get_freeze_count() > 0, "torch" in sys.modules,
      os.environ.get("OMP_WAIT_POLICY"))
"""


@pytest.mark.parametrize("caller, policy, expected", [
    ("program", None, "probe 0 [False] True True True PASSIVE"),
    ("program", "ACTIVE", "probe 0 [False] True True True ACTIVE"),
    ("python", None, "probe 0 [True] True False True None"),
    ("program, bad input", None, "probe 2 [False] True False False PASSIVE")])
def test_the_program_sets_up_its_process_before_the_libraries_load(sources, tmp_path, caller, policy, expected):
    """The program turns the garbage collector off while torch and DeepSpeed are imported (collections that find
    nothing) and back on, with what was imported frozen, once the source is open (on, unfrozen, when the command
    ends before that). Before torch is loaded it sets OMP_WAIT_POLICY=PASSIVE (its OpenMP workers spinning between
    operations took the cores tensorstore's and the checks' threads needed), unless the user chose a policy. A
    caller in Python keeps its collector and its environment as they were."""
    import subprocess
    import sys
    path = tmp_path / "missing" if caller.endswith("bad input") else sources / "hf"
    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    proc = subprocess.run([sys.executable, "-c", _PROCESS_PROBE, str(path), caller], capture_output=True,
                          text=True, env={**env, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == expected


def test_every_long_option_takes_both_spellings(sources, tmp_path):
    """``--max_shard_size`` as ``--max-shard-size``; upstream's ``--input_folder`` as ``--input-folder``."""
    from deepspeed_ext.cli import build_parser
    from deepspeed_ext.option_spelling import respelled
    parser = build_parser()
    assert respelled(parser, ["to-universal", "--input-folder", "a", "--output-folder=b", "--check_finite"]) == \
        ["to-universal", "--input_folder", "a", "--output_folder=b", "--check-finite"]
    assert respelled(parser, ["to-hf", "x", "--", "--max_shard_size"]) == ["to-hf", "x", "--", "--max_shard_size"]
    result = cli_result("to-hf", str(sources / "hf"), "-o", str(tmp_path / "out"), "--max_shard_size", "20KB", "-q")
    assert result.returncode == 0 and len(list((tmp_path / "out").glob("*.safetensors"))) > 1, result.stderr


def test_an_unknown_option_shows_the_subcommands_usage(sources, tmp_path):
    import contextlib
    import io

    from deepspeed_ext.cli import main
    stderr = io.StringIO()
    with pytest.raises(SystemExit) as stopped, contextlib.redirect_stderr(stderr):
        main(["to-hf", str(sources / "hf"), "-o", str(tmp_path / "out"), "--bogus"])
    err = stderr.getvalue()
    assert stopped.value.code == 2 and "usage: deepspeed-ext to-hf" in err and "unrecognized arguments: --bogus" in err


def test_an_output_the_system_refuses_is_one_line_naming_it_and_debug_keeps_the_exit_status(sources):
    result = cli_result("to-hf", str(sources / "hf"), "-o", "/proc/deepspeed-ext-test", "-q")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "deepspeed-ext: error: /proc/deepspeed-ext-test: No such file or directory"], result.stderr
    debug = cli_result("--debug", "inspect", "/nonexistent/checkpoint")
    assert debug.returncode == 2 and "Traceback" in debug.stderr
    assert debug.stderr.strip().splitlines()[-1] == \
        "deepspeed-ext: error: /nonexistent/checkpoint: no such checkpoint directory"


def test_inspect_json_gives_each_hf_tensor_its_file_dtype(tmp_path):
    import torch

    from deepspeed_ext.demo.models import build_model
    build_model("llama").to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    result = cli_result("inspect", str(tmp_path / "hf"), "--json")
    dtypes = {entry["dtype"] for entry in json.loads(result.stdout)["parameters"].values()}
    assert result.returncode == 0 and dtypes == {"bfloat16"}, result.stderr


def test_every_subcommands_examples_are_indented_alike():
    for name, parser in _subparsers().items():
        lines = parser.format_help().split("examples:\n", 1)[1].strip("\n").splitlines()
        assert lines and all(line.startswith("  ") and not line.startswith("   ") for line in lines), (name, lines)


def test_an_existing_output_is_refused_before_the_libraries_load(sources, tmp_path):
    """The refusal needs only the names: it comes before torch is imported (it came after 4-5 s of imports)."""
    import subprocess
    import sys
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "kept").write_text("")
    probe = ("import sys; from deepspeed_ext.cli import main; code = main(sys.argv[1:]); "
             "print('torch' in sys.modules, code)")
    proc = subprocess.run([sys.executable, "-c", probe, "to-hf", str(sources / "hf"), "-o", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["False", "2"], proc.stdout + proc.stderr
    assert proc.stderr.strip() == f"deepspeed-ext: error: {tmp_path / 'out'}: output already exists; pass --overwrite " \
        "to replace it"
    assert (tmp_path / "out" / "kept").exists()


@pytest.mark.parametrize("command, tag", [(["to-universal"], None), (["inspect"], "global_step7"),
                                          (["to-hf"], "global_step7")])
def test_a_missing_tag_is_refused_before_the_libraries_load(tmp_path, command, tag):
    """A save directory whose tag (``--tag``, or the one ``latest`` names) is not there: the reader's own line,
    before torch is imported (it came after 4-5 s of imports)."""
    import subprocess
    import sys
    save = tmp_path / "save"
    save.mkdir()
    (save / "latest").write_text("global_step9")
    args = [*command, str(save), *(["--tag", tag] if tag else []), *(["-o", str(tmp_path / "out")]
                                                                    if command != ["inspect"] else [])]
    probe = ("import sys; from deepspeed_ext.cli import main; code = main(sys.argv[1:]); "
             "print('torch' in sys.modules, code)")
    proc = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["False", "2"], proc.stdout + proc.stderr
    expected = (f"{save / tag}: no such tag directory" if tag else
                f"{save / 'latest'}: names tag 'global_step9', but {save / 'global_step9'} does not exist")
    assert proc.stderr.strip() == f"deepspeed-ext: error: {expected}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["save"]


def test_an_unexpected_structure_is_one_line_naming_the_input_and_where_it_was_raised(sources, monkeypatch):
    """A structure no reader check anticipated (here a state the tensor lacks, asked for as a reader would) is one
    line naming the input and the package's file and line that raised it: what tells a damaged input from a defect
    of ours; --debug adds the traceback and keeps the exit status."""
    from deepspeed_ext.checkpoint.tensor import LogicalTensor
    from deepspeed_ext.cli import tools
    tensor = LogicalTensor(name="w", shape=(1, ), layout=None, states=("fp32", ), loader=lambda state: 0)
    monkeypatch.setattr(tools, "cmd_inspect", lambda args: tensor.load("exp_avg"))
    result = cli_result("inspect", str(sources / "hf"))
    (line, ) = result.stderr.strip().splitlines()
    assert result.returncode == 2 and line.startswith(f"deepspeed-ext: error: {sources / 'hf'}: unexpected content "
                                                      f"(KeyError: ")
    assert "raised at deepspeed_ext/checkpoint/tensor.py:" in line and "a defect of deepspeed-ext" in line, line
    debug = cli_result("--debug", "inspect", str(sources / "hf"))
    assert debug.returncode == 2 and "Traceback" in debug.stderr and debug.stderr.strip().splitlines()[-1] == line
