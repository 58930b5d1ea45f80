"""Startup: each command, whole, on the built-in tiny model, against ``python -c "import torch"``.

The tiny checkpoint (95K parameters, TP=2, ZeRO-1, bf16, saved by the real engine) holds a few hundred
kilobytes, so a command's wall time on it is its fixed cost: interpreter start, imports, metadata, writing
the output's small files. The targets (1.5 s for ``to-universal``, ``inspect``, ``verify``; 3 s for
``to-hf``, ``from-hf``, ``to-maxtext``, ``from-maxtext``) name the time from process start to the first
tensor processed: measured as the moment the first tensor state is read (the reader writes it to
``DEEPSPEED_EXT_FIRST_READ_FILE``), and for a command that reads no tensor, as its whole run. The page
cache is warm (every command runs once before the rounds), as on a machine in use; commands alternate
their order each round and each row is the median of ``--rounds``.

The whole command above ``import torch`` has targets of its own (``to-hf`` +1.5 s, ``to-maxtext`` +2.5 s): what
the user waits for. The package is byte-compiled first, as ``pip install`` leaves it (an editable checkout where
``PYTHONDONTWRITEBYTECODE`` is set compiles it again in every process). What transformers says about the model
config is kept in a cache of the bench's own (``DEEPSPEED_EXT_CACHE_DIR``), emptied first: the warm-up run fills it,
as a user's first command does; ``--no-config-cache`` measures every command as a first one.

    python bench/startup.py                  # 5 rounds (about 3 minutes)
    python bench/startup.py --no-config-cache --rounds 3
    python bench/startup.py --importtime     # also where each command's imports go (-X importtime, top 8)
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import build_tiny_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: Issue 34: the whole command, above ``import torch``.
WHOLE_TARGETS = {"to-hf": 1.5, "to-maxtext": 2.5}
TARGETS = {"to-universal": 1.5, "inspect": 1.5, "verify": 1.5, "to-hf": 3.0, "from-hf": 3.0, "to-maxtext": 3.0,
           "from-maxtext": 3.0}
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "JAX_PLATFORMS": "cpu"}


def commands(tag_dir: Path, work: Path) -> dict[str, tuple[list[str], Path | None]]:
    """Each command and the output it writes (removed before each run). The inputs of verify, from-hf and
    from-maxtext are written once, before the rounds."""
    ext = [sys.executable, "-m", "deepspeed_ext"]
    return {
        'python -c "import torch"': ([sys.executable, "-c", "import torch"], None),
        "to-universal": ([*ext, "to-universal", str(tag_dir), "-o", str(work / "universal"), "-q"],
                         work / "universal"),
        "inspect": ([*ext, "inspect", str(tag_dir)], None),
        "verify": ([*ext, "verify", str(work / "input_universal")], None),
        "to-hf": ([*ext, "to-hf", str(tag_dir), "-o", str(work / "hf"), "-q"], work / "hf"),
        "from-hf": ([*ext, "from-hf", str(work / "input_hf"), "-o", str(work / "from_hf"), "-q"], work / "from_hf"),
        "to-maxtext": ([*ext, "to-maxtext", str(tag_dir), "-o", str(work / "maxtext"), "-q"], work / "maxtext"),
        "from-maxtext": ([*ext, "from-maxtext", str(work / "input_maxtext"), "-o", str(work / "from_maxtext"), "-q"],
                         work / "from_maxtext"),
    }


def run(cmd: list[str], out: Path | None) -> tuple[float, float | None]:
    """(whole command s, s from its start to the first tensor state read, where it reads one)."""
    if out is not None:
        shutil.rmtree(out, ignore_errors=True)
    probe = Path(tempfile.mkdtemp()) / "first_read"
    start_wall, start = time.time(), time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env={**ENV, "DEEPSPEED_EXT_FIRST_READ_FILE": str(probe)})
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    first = float(probe.read_text()) - start_wall if probe.is_file() else None
    shutil.rmtree(probe.parent)
    return took, first


def import_profile(cmd: list[str], out: Path | None, top: int) -> list[tuple[float, str]]:
    """The slowest top-level imports of ``cmd`` (-X importtime), in seconds."""
    if out is not None:
        shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run([cmd[0], "-X", "importtime", *cmd[1:]], capture_output=True, text=True, cwd=ROOT, env=ENV)
    rows = []
    for line in proc.stderr.splitlines():
        match = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\S.*)$", line)  # depth 0: no indent after "| "
        if match:
            rows.append((int(match.group(1)) / 1e6, match.group(2)))
    return sorted(rows, reverse=True)[:top]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="/tmp/deepspeed_ext_bench")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--importtime", action="store_true", help="also profile each command's imports")
    p.add_argument("--no-config-cache", action="store_true",
                   help="keep no model-config cache: every command finds the config's facts from transformers")
    args = p.parse_args()
    import compileall
    compileall.compile_dir(ROOT / "deepspeed_ext", quiet=1)
    cache = Path(args.workdir) / "config_cache"
    shutil.rmtree(cache, ignore_errors=True)
    ENV["DEEPSPEED_EXT_CACHE_DIR"] = "off" if args.no_config_cache else str(cache)
    tag_dir = build_tiny_checkpoint(Path(args.workdir) / "startup")
    work = Path(args.workdir) / "startup_outputs"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ext = [sys.executable, "-m", "deepspeed_ext"]
    for prepare in (["to-universal", str(tag_dir), "-o", str(work / "input_universal"), "-q"],
                    ["to-hf", str(tag_dir), "-o", str(work / "input_hf"), "-q"],
                    ["to-maxtext", str(tag_dir), "-o", str(work / "input_maxtext"), "-q"]):
        run([*ext, *prepare], None)
    table = commands(tag_dir, work)
    times: dict[str, list[float]] = {name: [] for name in table}
    firsts: dict[str, list[float]] = {name: [] for name in table}
    for name, (cmd, out) in table.items():  # warm the page cache
        run(cmd, out)
    for round_ in range(args.rounds):
        order = list(table) if round_ % 2 == 0 else list(reversed(table))
        for name in order:
            whole, first = run(*table[name])
            times[name].append(whole)
            if first is not None:
                firsts[name].append(first)
    torch_s = statistics.median(times['python -c "import torch"'])
    print(f"\nstartup on the tiny model ({tag_dir}), warm cache, median of {args.rounds} rounds, model-config cache "
          f"{'off' if args.no_config_cache else 'filled by the warm-up run'}")
    print("(to the first tensor: from process start to the first tensor state read; a command that reads none")
    print("is measured whole)\n")
    print("| command | whole command s | range | whole above import torch s | target s | met | to the first tensor s "
          "| target s | met |")
    print("|---|---|---|---|---|---|---|---|---|")

    def verdict(value: float, target: float | None) -> str:
        return "" if target is None else "yes" if value <= target else "no"

    for name, values in times.items():
        whole = statistics.median(values)
        first = statistics.median(firsts[name]) if firsts[name] else whole
        target, whole_target = TARGETS.get(name), WHOLE_TARGETS.get(name)
        print(f"| {name} | {whole:.2f} | {min(values):.2f}–{max(values):.2f} | {whole - torch_s:+.2f} | "
              f"{whole_target or ''} | {verdict(whole - torch_s, whole_target)} | "
              f"{first:.2f}{'' if firsts[name] else ' (whole)'} | {target or ''} | {verdict(first, target)} |")
    if args.importtime:
        for name, (cmd, out) in table.items():
            print(f"\n{name}: slowest top-level imports (s)")
            for seconds, module in import_profile(cmd, out, 8):
                print(f"  {seconds:6.2f}  {module}")


if __name__ == "__main__":
    main()
