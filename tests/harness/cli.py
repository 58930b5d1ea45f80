"""The CLI run in this process, and the small checkpoints the CLI tests share (built from configs in code)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
from pathlib import Path

from deepspeed_ext.cli import main
from deepspeed_ext.demo.models import build_model

REFUSED = "deepspeed-ext never writes into its input"


def universal_in(save_dir: Path) -> Path:
    """The universal checkpoint directory of a save directory that ``-o`` wrote (its ``latest_universal``)."""
    return save_dir / (save_dir / "latest_universal").read_text().strip()


def digest(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes (symlinks by their target)."""
    return {str(p.relative_to(root)): (os.readlink(p).encode() if p.is_symlink() else p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_file() or p.is_symlink()}


def run(capsys, *args: str) -> tuple[int, str, str]:
    """``deepspeed-ext ARGS`` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def cli_result(*args: str) -> subprocess.CompletedProcess:
    """``deepspeed-ext ARGS`` in this process (as a subprocess would see it: exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def placements(source: Path) -> dict[str, Path]:
    return {"equal": source, "inside": source / "sub", "parent": source.parent}


def assert_refused_everywhere(capsys, tmp_path: Path, command: str, source: Path, extra: list[str],
                              named: Path | None = None) -> None:
    """``command named -o X [--overwrite]`` for X at, inside and around ``source``: refused in one line, and
    nothing under ``tmp_path`` (the source and everything around it) changes."""
    named = named or source
    before = digest(tmp_path)
    for where, out in placements(source).items():
        for overwrite in ([], ["--overwrite"]):
            code, _, err = run(capsys, command, str(named), "-o", str(out), *extra, *overwrite, "-q")
            lines = err.strip().splitlines()
            assert code == 2 and len(lines) == 1 and REFUSED in lines[0], (command, where, overwrite, err)
            assert lines[0].startswith(f"deepspeed-ext: error: {out}: the output"), lines
    assert digest(tmp_path) == before, command


def make_formats(root: Path) -> dict[str, Path]:
    """One checkpoint per format under ``root``: HF (sharded safetensors), universal (from-hf's save directory),
    MaxText."""
    build_model("llama", seed=5).save_pretrained(root / "hf", max_shard_size="30KB")
    assert main(["from-hf", str(root / "hf"), "-o", str(root / "universal"), "-q"]) == 0
    assert main(["to-maxtext", str(root / "hf"), "-o", str(root / "maxtext"), "-q"]) == 0
    return {"huggingface": root / "hf", "universal": root / "universal", "maxtext": root / "maxtext"}


def make_sources(root: Path) -> Path:
    """A sharded HF checkpoint of the tiny Llama and its MaxText conversion, under ``root``."""
    build_model("llama", seed=3).save_pretrained(root / "hf", max_shard_size="30KB")
    assert cli_result("to-maxtext", str(root / "hf"), "-o", str(root / "maxtext"), "-q").returncode == 0
    return root
