"""``to-maxtext`` with each storage choice (``--compression zstd``, the default; ``none``; ``none`` with
``--no-ocdbt``, chunk files deepspeed-ext writes itself): the write, against
``cp -r`` per byte written, and MaxText's own load of the result (``maxtext.common.checkpointing.
load_params_from_path``, what ``load_parameters_path`` runs), on the 246M benchmark checkpoint (TP=2 ZeRO-1
bf16, one training step, cached by bench/convert.py's builder).

Each round, in alternating order: ``cp -r`` of the DeepSpeed tag, then per choice ``to-maxtext`` (bf16
parameters), then MaxText's load of what it wrote into one CPU device, with the input warm (read after a
``sync``) or cold (evicted); medians. MaxText's load runs in the MaxText environment (.venv-maxtext).

    python bench/maxtext_load.py                      # 3 rounds, warm and cold
    python bench/maxtext_load.py --rounds 5 --cache warm
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import build_checkpoint, checkpoint_workdir, du, evict, timed, warm  # noqa: E402
from maxtext_rss import model_arguments  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: Each storage choice, by name, and its to-maxtext options.
CODECS = {"zstd": ["--compression", "zstd"], "none": ["--compression", "none"],
          "none, no OCDBT": ["--compression", "none", "--no-ocdbt"]}

#: Run in the MaxText environment: MaxText's own parameter load of ``argv[1]`` (an ``OUT/0/items``), timed.
LOAD = r"""
import json, sys, time
import jax, numpy as np
import orbax.checkpoint as ocp
from maxtext.common import checkpointing
items = sys.argv[1]
meta = ocp.PyTreeCheckpointer().metadata(items).item_metadata.tree["params"]
sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
abstract = {"params": jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), np.dtype(m.dtype), sharding=sharding),
                                   meta["params"])}
start = time.perf_counter()
params = checkpointing.load_params_from_path(items, abstract, checkpoint_storage_concurrent_gb=96)
jax.block_until_ready(params)
print(json.dumps({"load_s": time.perf_counter() - start}))
"""


def maxtext_load(items: Path, cold: bool) -> float:
    if cold:
        evict(items.parent.parent)
    else:
        warm(items.parent.parent)
    proc = subprocess.run([str(ROOT / ".venv-maxtext" / "bin" / "python"), "-c", LOAD, str(items)], check=True,
                          capture_output=True, text=True, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    return float(json.loads(proc.stdout.strip().splitlines()[-1])["load_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(p)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cache", nargs="+", choices=["cold", "warm"], default=["warm", "cold"])
    args = p.parse_args()
    tag_dir = build_checkpoint(args, checkpoint_workdir(args, args.layers))
    work = Path(args.workdir) / "maxtext_load"
    rows: dict[str, list[float]] = {}
    for cache in args.cache:
        for round_ in range(args.rounds):
            order = list(CODECS) if round_ % 2 == 0 else list(reversed(CODECS))
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            if cache == "warm":
                warm(tag_dir)
            copy = timed(["cp", "-r", str(tag_dir), str(work / "cp")], cold=tag_dir if cache == "cold" else None)
            rows.setdefault(f"{cache} cp wall", []).append(copy["wall"])
            rows.setdefault(f"{cache} cp written", []).append(du(work / "cp"))
            for codec in order:
                out = work / codec.replace(", ", "_").replace(" ", "_")
                if cache == "warm":
                    warm(tag_dir)
                run = timed([sys.executable, "-m", "deepspeed_ext", "to-maxtext", str(tag_dir), "-o", str(out),
                             "--quiet", *CODECS[codec]], cold=tag_dir if cache == "cold" else None)
                rows.setdefault(f"{cache} {codec} wall", []).append(run["wall"])
                rows.setdefault(f"{cache} {codec} written", []).append(du(out))
                rows.setdefault(f"{cache} {codec} load", []).append(maxtext_load(out / "0" / "items", cache == "cold"))
                print(f"{cache} round {round_ + 1}: {codec}: write {run['wall']:.1f} s ({du(out) / 2**30:.2f} GiB), "
                      f"MaxText load {rows[f'{cache} {codec} load'][-1]:.1f} s", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    median = {key: statistics.median(values) for key, values in rows.items()}
    print(f"\nto-maxtext by storage choice, {args.layers}-layer Llama (hidden {args.hidden}), {args.rounds} rounds, "
          "medians\n")
    print("| cache | codec | to-maxtext s | written GiB | GB written/s | vs cp per byte written | MaxText load s |")
    print("|---|---|---|---|---|---|---|")
    for cache in args.cache:
        cp_rate = median[f"{cache} cp written"] / median[f"{cache} cp wall"]
        print(f"| {cache} | cp -r | {median[f'{cache} cp wall']:.1f} | {median[f'{cache} cp written'] / 2**30:.2f} | "
              f"{cp_rate / 1e9:.2f} | 1.00 | |")
        for codec in CODECS:
            rate = median[f"{cache} {codec} written"] / median[f"{cache} {codec} wall"]
            print(f"| {cache} | {codec} | {median[f'{cache} {codec} wall']:.1f} | "
                  f"{median[f'{cache} {codec} written'] / 2**30:.2f} | {rate / 1e9:.2f} | {rate / cp_rate:.2f} | "
                  f"{median[f'{cache} {codec} load']:.1f} |")
    print(json.dumps({"median": median, "rounds": rows}))


if __name__ == "__main__":
    main()
