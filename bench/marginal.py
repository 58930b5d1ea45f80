"""Each conversion's speed at the margin against a floor of exactly what it writes (round four).

A command's wall time on one checkpoint mixes a fixed cost (interpreter, imports, metadata) with the time it
spends moving bytes. Each workload runs on two sources of the same shapes that differ only in their number of
layers; the difference of the two times is what the extra layers cost, which no fixed cost can hide. The floor is
``bench/floor_write.py``: it reads the same input and writes **the same files with the same sizes** the command
wrote on that source (the layout recorded from a first, untimed run), from memory, on one thread, with nothing
computed (``--floor-writes-only``: the writes alone); both are timed as ``CMD && sync`` (the user waits for the
data to be on the disk), the output on the real disk unless ``--out-dir`` says otherwise. Per round, the command
and its floor run back to back on both sizes,
in an order that alternates from round to round; the round's ratio is the floor's extra seconds over the command's
(the same extra bytes written by both: the command's rate per byte written at the margin against the floor's).
Rows give the median ratio with its spread over the rounds (min-max, and a 95% confidence interval of the median
from the order statistics), the floor's own extra seconds with theirs, and the peak RSS on both sizes (memory flat
in the model size: the same on both).

Workloads (sources generated or trained once, cached under --workdir):
  to-universal, to-hf, to-hf --quantize fp8, to-maxtext (zstd, the default)
      a DeepSpeed checkpoint trained one step by the real engine (Llama 246M shapes: hidden 1024, MLP 2816, vocab
      32000, TP=2 ZeRO-1 bf16), --ds-layers SMALL LARGE layers
  from-hf fp8     a block-FP8 release at Llama-3-8B's shapes (bench/fp8_from_hf.py), --fp8-layers SMALL LARGE
  from-hf mxfp4   a gpt-oss release at gpt-oss-20b's shapes, experts MXFP4 (bench/mxfp4_source.py),
                  --mxfp4-layers SMALL LARGE

    python bench/marginal.py --workloads "from-hf fp8" --rounds 9 --cache warm
    python bench/marginal.py --workloads "from-hf fp8" --cores 1     # the same under `taskset -c 0`
    python bench/marginal.py --out-dir /dev/shm/m                     # outputs on a tmpfs (no disk writeback)
    python bench/marginal.py --workloads to-maxtext --floor-reads '*model_states.pt'   # reads what it reads
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import build_checkpoint, checkpoint_workdir, timed, warm, warm_program  # noqa: E402
from fp8_from_hf import cached_source  # noqa: E402
from maxtext_rss import model_arguments  # noqa: E402
from mxfp4_source import cached_mxfp4_source  # noqa: E402

FLOOR = str(Path(__file__).with_name("floor_write.py"))
#: workload: (source kind, the command's arguments after ``deepspeed-ext``, with SRC and OUT)
WORKLOADS = {
    "to-universal": ("deepspeed", ["to-universal", "SRC", "-o", "OUT", "-q"]),
    "to-hf": ("deepspeed", ["to-hf", "SRC", "-o", "OUT", "-q"]),
    "to-hf --quantize fp8": ("deepspeed", ["to-hf", "SRC", "-o", "OUT", "-q", "--quantize", "fp8"]),
    "to-maxtext": ("deepspeed", ["to-maxtext", "SRC", "-o", "OUT", "-q"]),
    "from-hf fp8": ("fp8", ["from-hf", "SRC", "-o", "OUT", "-q"]),
    "from-hf mxfp4": ("mxfp4", ["from-hf", "SRC", "-o", "OUT", "-q"]),
}


def source(args: argparse.Namespace, kind: str, layers: int) -> Path:
    if kind == "deepspeed":
        settings = argparse.Namespace(**{**vars(args), "layers": layers})
        return build_checkpoint(settings, checkpoint_workdir(settings, layers))
    if kind == "fp8":
        return cached_source(argparse.Namespace(workdir=args.workdir, shapes="llama3-8b", layers=layers,
                                                max_shard_size=5.0))
    return cached_mxfp4_source(args.workdir, layers)


def layout_of(out: Path) -> list[tuple[str, int]]:
    """(relative path, size) of every file under ``out``, in path order."""
    return [(str(p.relative_to(out)), p.stat().st_size) for p in sorted(out.rglob("*")) if p.is_file()]


def on_tmpfs(path: Path) -> bool:
    probe = path if path.exists() else path.parent
    return subprocess.run(["stat", "-f", "-c", "%T", str(probe)], capture_output=True, text=True).stdout.strip() \
        in ("tmpfs", "ramfs")


def settle(args: argparse.Namespace) -> None:
    """Every run starts from the same memory: the last run's writes on the disk, and (``--drop-caches``, as root)
    the page cache emptied, so that no run pays to evict what the one before it left (the floor's extra seconds
    moved 2.2-10.5 s over seven rounds without it)."""
    subprocess.run(["sync"], check=True)
    if args.drop_caches:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")


def median_interval(values: list[float]) -> tuple[float, float]:
    """A distribution-free 95% confidence interval of the median: order statistics ``k`` and ``n + 1 - k`` with
    the binomial(n, 1/2) tail below ``k`` at most 2.5% (for n < 6, the whole range)."""
    ordered, n = sorted(values), len(values)
    k, tail = 0, 0.0
    while k < n // 2 and tail + math.comb(n, k) / 2**n <= 0.025:
        tail += math.comb(n, k) / 2**n
        k += 1
    k = max(k, 1)
    return ordered[k - 1], ordered[n - k]


def measure(args: argparse.Namespace, name: str, cache: str) -> dict:
    kind, template = WORKLOADS[name]
    small, large = getattr(args, f"{kind}_layers")
    sources = {layers: source(args, kind, layers) for layers in (small, large)}
    out = Path(args.out_dir) / "out"
    out.parent.mkdir(parents=True, exist_ok=True)
    pin = ["taskset", "-c", f"0-{args.cores - 1}"] if args.cores else []

    def command(src: Path) -> list[str]:
        return [*pin, sys.executable, "-m", "deepspeed_ext",
                *(str(src) if a == "SRC" else str(out) if a == "OUT" else a for a in template)]

    layouts: dict[int, Path] = {}
    for layers, src in sources.items():  # a first, untimed run: the layout the floor writes (and warm libraries)
        shutil.rmtree(out, ignore_errors=True)
        timed(command(src), cold=None)
        layouts[layers] = Path(args.out_dir) / f"layout_{layers}.json"
        layouts[layers].write_text(json.dumps(layout_of(out)))
    shutil.rmtree(out, ignore_errors=True)
    runs: dict[tuple[str, int], list[dict]] = {}
    for round_ in range(args.rounds):
        sizes = list(sources) if round_ % 2 == 0 else list(reversed(sources))
        for layers in sizes:
            src = sources[layers]
            pair = {"command": command(src), "floor": [*pin, sys.executable, FLOOR, "-" if args.floor_writes_only
                                                       else str(src), str(layouts[layers]), str(out),
                                                       *([args.floor_reads] if args.floor_reads else [])]}
            for which in (list(pair) if (round_ // 2) % 2 == 0 else list(reversed(pair))):
                shutil.rmtree(out, ignore_errors=True)
                settle(args)
                warm_program()
                if cache == "warm":
                    warm(src)
                result = timed(pair[which], cold=src if cache == "cold" else None)
                files = layout_of(out)
                result["output"], result["files"] = sum(size for _, size in files), len(files)
                runs.setdefault((which, layers), []).append(result)
                print(f"{name}, {cache}, round {round_ + 1}: {which} on {layers} layers: {result['wall']:.2f} s, "
                      f"{result['output'] / 1e9:.3f} GB in {result['files']} files, peak RSS {result['rss']:.2f} GiB",
                      flush=True)
    shutil.rmtree(out, ignore_errors=True)
    extra = {which: [b["wall"] - a["wall"] for a, b in zip(runs[(which, small)], runs[(which, large)], strict=True)]
             for which in ("command", "floor")}
    ratios = [f / c if c > 0 else math.inf for c, f in zip(extra["command"], extra["floor"], strict=True)]
    written = statistics.median(r["output"] for r in runs[("command", large)]) - \
        statistics.median(r["output"] for r in runs[("command", small)])
    mismatch = [f"{layers} layers" for layers in sources
                if {r["output"] for r in runs[("command", layers)]} != {r["output"] for r in runs[("floor", layers)]}]
    return {"workload": name, "cache": cache, "layers": [small, large], "rounds": args.rounds, "cores": args.cores,
            "floor_reads_input": not args.floor_writes_only, "floor_reads": args.floor_reads or "*",
            "extra_bytes_written": written, "files": [runs[("command", n)][0]["files"] for n in (small, large)],
            "extra_s": extra, "ratios": ratios, "ratio_median": statistics.median(ratios),
            "ratio_interval": median_interval(ratios),
            "wall": {f"{w} {n}": [r["wall"] for r in runs[(w, n)]] for w, n in runs},
            "rss": {n: statistics.median(r["rss"] for r in runs[("command", n)]) for n in (small, large)},
            "output_mismatch": mismatch}


def report(rows: list[dict], args: argparse.Namespace) -> None:
    floor = "writing the command's files alone" if args.floor_writes_only else \
        f"reading the input's {args.floor_reads} files, then writing the command's files" if args.floor_reads else \
        "reading the input, then writing the command's files"
    print(f"\n{args.rounds} paired rounds{', page cache emptied before each run' if args.drop_caches else ''}, "
          f"the floor {floor}, outputs in {args.out_dir}"
          f"{' (a tmpfs: no disk writeback)' if on_tmpfs(Path(args.out_dir)) else ' (the disk)'}"
          f"{f', pinned to {args.cores} core(s)' if args.cores else ''}\n")
    print("| workload | cache | layers | extra GB written (files) | command: extra s, median (min-max) | floor: "
          "extra s, median (min-max) | per byte written vs floor: median (min-max; 95% CI) | "
          "peak RSS GiB, small / large |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        c, f = row["extra_s"]["command"], row["extra_s"]["floor"]
        low, high = row["ratio_interval"]
        print(f"| {row['workload']} | {row['cache']} | {row['layers'][0]} / {row['layers'][1]} | "
              f"{row['extra_bytes_written'] / 1e9:.2f} ({row['files'][0]} / {row['files'][1]}) | "
              f"{statistics.median(c):.2f} ({min(c):.2f}-{max(c):.2f}) | {statistics.median(f):.2f} "
              f"({min(f):.2f}-{max(f):.2f}) | **{row['ratio_median']:.2f}x** ({min(row['ratios']):.2f}-"
              f"{max(row['ratios']):.2f}; {low:.2f}-{high:.2f}) | {row['rss'][row['layers'][0]]:.2f} / "
              f"{row['rss'][row['layers'][1]]:.2f} |")
        if row["output_mismatch"]:
            print(f"  (the floor's output differed in size from the command's on {', '.join(row['output_mismatch'])})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(p)
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--cache", nargs="+", choices=["cold", "warm"], default=["warm", "cold"])
    p.add_argument("--ds-layers", dest="deepspeed_layers", type=int, nargs=2, default=[8, 24], metavar=("SMALL",
                                                                                                         "LARGE"))
    p.add_argument("--fp8-layers", dest="fp8_layers", type=int, nargs=2, default=[2, 6], metavar=("SMALL", "LARGE"))
    p.add_argument("--mxfp4-layers", dest="mxfp4_layers", type=int, nargs=2, default=[1, 3],
                   metavar=("SMALL", "LARGE"))
    p.add_argument("--floor-writes-only", action="store_true",
                   help="the floor writes the command's files and reads nothing (default: it reads every file of the "
                   "input first, as a converter that needs all of it would)")
    p.add_argument("--floor-reads", metavar="GLOB",
                   help="the floor reads only the input's files whose names match GLOB (what the command reads, e.g. "
                   "'*model_states.pt' for to-maxtext, whose bf16 weights are there), then writes")
    p.add_argument("--cores", type=int, help="run the command and its floor on the first N cores (taskset)")
    p.add_argument("--out-dir", help="where the outputs go (default: --workdir/marginal, on its disk)")
    p.add_argument("--save", help="also write the rows to this JSON file")
    p.add_argument("--no-drop-caches", dest="drop_caches", action="store_false",
                   help="leave the page cache as the last run left it (default: emptied before each run, as root)")
    args = p.parse_args()
    args.no_upstream = True
    args.out_dir = args.out_dir or str(Path(args.workdir) / "marginal")
    args.drop_caches = args.drop_caches and os.access("/proc/sys/vm/drop_caches", os.W_OK)
    if args.cores:
        os.environ.setdefault("OMP_NUM_THREADS", str(args.cores))
    rows = [measure(args, name, cache) for name in args.workloads for cache in args.cache]
    report(rows, args)
    if args.save:
        Path(args.save).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
