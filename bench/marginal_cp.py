"""Streaming throughput at the margin: what each command adds per extra byte, against ``cp -r``.

A command's wall time on one checkpoint mixes a fixed cost (interpreter start, imports, metadata) with the
time it spends moving bytes. Running it on two checkpoints of the same shapes that differ only in their number
of layers (by default 246M and 608M parameters: hidden 1024, MLP 2816, vocab 32000, 16 and 48 layers, TP=2
ZeRO-1 bf16, trained one step by the real engine; 70 layers, 857M, would need more than 11 GiB per training
rank, which a 24 GiB machine cannot give two ranks) and dividing the bytes difference by the time difference
leaves the marginal rate, which fixed costs cannot hide. Each command runs with its input evicted from the page
cache (cold) and read into it after a ``sync`` (warm), ``--rounds`` times in alternating order; rows are medians;
before each, the interpreter's shared libraries are read into the page cache too (a command that filled a tmpfs had
evicted them, and the next one paid for reading them back). Three marginal rates, each as a fraction of cp's: the
extra checkpoint bytes per extra second (the same bytes for every command, so against cp it is cp's extra time over
the command's), the extra bytes of output per extra second (what the command leaves behind, measured by its size:
"per byte written"), and the extra bytes the command itself read and wrote per extra second as the block layer
counts them (a warm cache and a tmpfs count almost none). Three floors (bench/maxtext_floor.py: every bf16 weight
of the model-states files transposed as MaxText lays it out and written with tensorstore, or written as it lies, or
transposed and written as plain zarr3 files by two threads of ours without tensorstore or OCDBT; nothing checked,
merged or recorded) show what any writer of MaxText's layout pays per byte on this machine, and what leaving
tensorstore would save. A second copy floor, ``cp`` of the model-states files alone, writes as many bytes as
to-maxtext does (``cp -r`` writes seven times as many). Besides the medians, each command's output per extra second
is printed against cp's in the same round (paired), and cp's own extra seconds per round: the spread of the floor.

    python bench/marginal_cp.py                         # builds both checkpoints once (about 2 min), then 3 rounds
    python bench/marginal_cp.py --small 16 --large 70 --rounds 3 --cache cold warm    # where memory allows
    python bench/marginal_cp.py --large 32 --cache warm --out-dir /mnt/ram    # outputs on a tmpfs: no disk writeback
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import (build_checkpoint, checkpoint_workdir, conversion_commands, du, timed, warm,  # noqa: E402
                     warm_program)
from maxtext_rss import model_arguments  # noqa: E402

#: bench/maxtext_floor.py: the least a writer of MaxText's layout does (no checks, no TP merge), with and
#: without MaxText's transposition: what any to-maxtext pays per byte on this machine; and the same arrays written
#: as plain zarr3 files without tensorstore: what a writer of our own would pay.
FLOOR_TRANSPOSED = "floor: transpose + write"
FLOOR_COPY = "floor: write as laid out"
FLOOR_FILES = "floor: transpose + plain files"
#: A second copy floor, as large as to-maxtext's output: ``cp`` of the model-states files alone (the bf16 weights
#: to-maxtext reads). ``cp -r`` of a whole tag writes 7x to-maxtext's bytes into the page cache or a tmpfs, and on
#: a VM the time to find that much fresh memory moved cp's margin 2x from round to round; this floor writes as
#: many bytes as the command it is set beside.
FLOOR_CP_WEIGHTS = "cp model states"
COMMANDS = ("cp -r", "deepspeed-ext to-universal", "to-hf (bf16)", "to-maxtext (bf16 params)",
            "to-maxtext --compression none", "to-maxtext --no-ocdbt --compression none", FLOOR_TRANSPOSED, FLOOR_COPY,
            FLOOR_FILES, FLOOR_CP_WEIGHTS)


def checkpoint(args: argparse.Namespace, layers: int) -> Path:
    return build_checkpoint(argparse.Namespace(**{**vars(args), "layers": layers}), checkpoint_workdir(args, layers))


def marginal_commands(args: argparse.Namespace, tag_dir: Path, out: Path) -> dict[str, list[str]]:
    """bench/convert.py's commands and the three floors."""
    floor = [sys.executable, str(Path(__file__).with_name("maxtext_floor.py")), str(tag_dir), str(out)]
    weights = " ".join(shlex.quote(str(path)) for path in sorted(tag_dir.glob("mp_rank_*_model_states.pt")))
    return {**conversion_commands(args, tag_dir, out), FLOOR_TRANSPOSED: floor, FLOOR_COPY: [*floor, "--no-transpose"],
            FLOOR_FILES: [*floor, "--files"],
            FLOOR_CP_WEIGHTS: ["sh", "-c", f"mkdir -p {shlex.quote(str(out))} && cp {weights} {shlex.quote(str(out))}"]}


def measure(args: argparse.Namespace, tag_dirs: dict[int, Path], cache: str) -> dict[tuple[str, int], dict]:
    """Median wall time and bytes moved of each command on each checkpoint, ``cache`` cold or warm; cp's own
    spread over the rounds is printed (a ratio against a floor is only as sound as the floor)."""
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    for round_ in range(args.rounds):
        for layers, tag_dir in (tag_dirs.items() if round_ % 2 == 0 else reversed(tag_dirs.items())):
            out = (Path(args.out_dir) if args.out_dir else tag_dir.parent.parent) / "out"
            commands = {name: cmd for name, cmd in marginal_commands(args, tag_dir, out).items()
                        if name in args.commands}
            for name in (list(commands) if round_ % 2 == 0 else list(reversed(commands))):
                shutil.rmtree(out, ignore_errors=True)
                warm_program()  # cold or warm, the input alone is what differs
                if cache == "warm":
                    warm(tag_dir)
                result = timed(commands[name], cold=tag_dir if cache == "cold" else None)
                result["output"] = du(out)  # the "per byte written": what the command leaves behind
                runs.setdefault((name, layers), []).append(result)
                print(f"{cache} round {round_ + 1}: {name} on {layers} layers: {result['wall']:.1f} s, "
                      f"read {result['read'] / 2**30:.2f} GiB, written {result['written'] / 2**30:.2f} GiB "
                      f"(block layer), output {result['output'] / 2**30:.2f} GiB", flush=True)
            shutil.rmtree(out, ignore_errors=True)
    cp = {layers: [r["wall"] for r in runs[("cp -r", layers)]] for layers in tag_dirs}
    extra = [large - small for small, large in zip(*cp.values(), strict=True)]
    print(f"{cache}: cp -r wall per round: " + "; ".join(f"{layers} layers {', '.join(f'{w:.2f}' for w in walls)} s"
                                                         for layers, walls in cp.items())
          + f"; its extra s per round {', '.join(f'{e:.2f}' for e in extra)} (spread {min(extra):.2f}-"
          f"{max(extra):.2f})", flush=True)
    small, large = tag_dirs
    for name in [name for name in args.commands if name != "cp -r"]:
        # Paired: each round's output bytes per extra second against cp's in the same round (the same state of
        # the machine's memory and cache), so a floor that drifts between rounds moves both sides of a ratio.
        ratios = [((b["output"] - a["output"]) / max(b["wall"] - a["wall"], 1e-3))
                  / ((d["output"] - c["output"]) / max(d["wall"] - c["wall"], 1e-3))
                  for a, b, c, d in zip(runs[(name, small)], runs[(name, large)], runs[("cp -r", small)],
                                        runs[("cp -r", large)], strict=True)]
        extras = [b["wall"] - a["wall"] for a, b in zip(runs[(name, small)], runs[(name, large)], strict=True)]
        print(f"{cache}: {name}: extra s per round {', '.join(f'{e:.2f}' for e in extras)}; output per extra second "
              f"against cp's in the same round {', '.join(f'{r:.2f}' for r in ratios)}", flush=True)
    return {key: {field: statistics.median(r[field] for r in results) for field in results[0]}
            for key, results in runs.items()}


def report(medians: dict[tuple[str, int], dict], sizes: dict[int, int], small: int, large: int, cache: str) -> None:
    """Per command: the time the larger checkpoint adds, per extra GB of checkpoint, per extra GB of output (the
    output's size: a tmpfs or a warm cache hides writes from the block layer) and per extra GB the command itself
    moved (read + written as the block layer counts them), each against cp's."""
    extra_size = sizes[large] - sizes[small]

    def rates(name: str) -> tuple[float, float, float]:
        a, b = medians[(name, small)], medians[(name, large)]
        seconds = max(b["wall"] - a["wall"], 1e-3)
        return (extra_size / seconds, ((b["read"] + b["written"]) - (a["read"] + a["written"])) / seconds,
                (b["output"] - a["output"]) / seconds)

    cp_size_rate, cp_moved_rate, cp_output_rate = rates("cp -r")
    print(f"\n{cache} cache, medians; marginal = {large} layers ({sizes[large] / 2**30:.2f} GiB) - {small} layers "
          f"({sizes[small] / 2**30:.2f} GiB)\n")
    print(f"| command | wall s, {small} layers | wall s, {large} layers | extra s | checkpoint GB/s at the margin | "
          "vs cp | output GB written/s at the margin | vs cp | GB moved/s at the margin | vs cp |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in [name for name in COMMANDS if (name, small) in medians]:
        a, b = medians[(name, small)], medians[(name, large)]
        size_rate, moved_rate, output_rate = rates(name)
        # Bytes moved come from the block layer's counters: a warm cache and a tmpfs count (almost) none.
        moved = (f"{moved_rate / 1e9:.2f} | {moved_rate / cp_moved_rate:.2f}"
                 if cp_moved_rate * 100 >= cp_size_rate and moved_rate > 0 else "n/a (not counted) | n/a")
        print(f"| {name} | {a['wall']:.1f} | {b['wall']:.1f} | {b['wall'] - a['wall']:.1f} | {size_rate / 1e9:.2f} | "
              f"{size_rate / cp_size_rate:.2f} | {output_rate / 1e9:.2f} | {output_rate / cp_output_rate:.2f} | "
              f"{moved} |")


def main() -> None:
    p = argparse.ArgumentParser()
    model_arguments(p)
    p.add_argument("--small", type=int, default=16, help="layers of the smaller checkpoint")
    p.add_argument("--large", type=int, default=48, help="layers of the larger checkpoint")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cache", nargs="+", choices=["cold", "warm"], default=["cold", "warm"])
    p.add_argument("--save", help="also write the medians to this JSON file")
    p.add_argument("--out-dir", help="write the outputs here (default: beside each checkpoint); a tmpfs takes the "
                                     "disk's writeback out of every command and of the floor")
    p.add_argument("--commands", nargs="+", choices=COMMANDS, default=list(COMMANDS),
                   help="which commands (cp -r always runs: it is the floor)")
    args = p.parse_args()
    args.no_upstream = True
    args.commands = ["cp -r", *(name for name in args.commands if name != "cp -r")]
    tag_dirs = {layers: checkpoint(args, layers) for layers in (args.small, args.large)}
    sizes = {layers: du(tag_dir) for layers, tag_dir in tag_dirs.items()}
    for layers, tag_dir in tag_dirs.items():
        print(f"{layers} layers: {tag_dir} ({sizes[layers] / 2**30:.2f} GiB)")
    results = {cache: measure(args, tag_dirs, cache) for cache in args.cache}
    for cache, medians in results.items():
        report(medians, sizes, args.small, args.large, cache)
    if args.save:
        Path(args.save).write_text(json.dumps({cache: {f"{name}|{layers}": value for (name, layers), value in
                                                       medians.items()} for cache, medians in results.items()}))


if __name__ == "__main__":
    main()
