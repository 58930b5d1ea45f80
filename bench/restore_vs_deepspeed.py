"""Restores at a new degree against DeepSpeed's own ``load_checkpoint`` at that degree, on the 246M benchmark
checkpoint (TP=2 ZeRO-1 bf16, one training step; cached by bench/convert.py's builder).

For each target (TP x DP, ZeRO stage), all in this one run, the input evicted from the page cache each time:

* DeepSpeed alone: a checkpoint saved at the target degree (one training step there, cached) loaded by
  DeepSpeed's own ``load_checkpoint`` (an engine without the ``deepspeed_ext`` section): the floor;
* deepspeed-ext, direct: the TP=2 checkpoint loaded at the target degree (resharded at load time);
* deepspeed-ext, universal: its universal form (``to-universal``, cached) loaded at the target degree.

Each row is the slowest rank's ``load_checkpoint`` time (with deepspeed-ext: its fingerprint check included) and
the bytes each rank read against its share (the fp32 masters and both Adam moments it holds).

    python bench/restore_vs_deepspeed.py                        # TP=1xDP=2 ZeRO-1 and ZeRO-3, 1 round
    python bench/restore_vs_deepspeed.py --targets 1x2x1 1x1x1 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import build_checkpoint, checkpoint_workdir, resume  # noqa: E402
from maxtext_rss import model_arguments  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def target_checkpoint(args: argparse.Namespace, work: Path, tp: int, dp: int, zero: int) -> Path:
    """A checkpoint saved at the target degree (one training step there), built once."""
    save_dir = work / f"native_tp{tp}_dp{dp}_zero{zero}"
    if not (save_dir / "latest").is_file():
        shutil.rmtree(save_dir, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                        str(tp * dp), "-m", "deepspeed_ext.demo.train", "--tp", str(tp), "--zero", str(zero),
                        "--dtype", "bf16", "--steps", "1", "--save-dir", str(save_dir), "--save-at", "1",
                        "--model-config", str(work / "config.json"), "--plain"],
                       check=True, cwd=ROOT, capture_output=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    return save_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(p)
    p.add_argument("--targets", nargs="+", default=["1x2x1", "1x2x3"], help="TPxDPxZeRO of each target")
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    tag_dir = build_checkpoint(args, checkpoint_workdir(args, args.layers))
    work = tag_dir.parent.parent
    universal = work / "restore_universal"
    if not (universal / "latest_universal").is_file():
        shutil.rmtree(universal, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "deepspeed_ext", "to-universal", str(tag_dir), "-o", str(universal),
                        "--quiet"], check=True, cwd=ROOT)
    print("| target (TP x DP, ZeRO) | loaded by | load_checkpoint s (slowest rank) | vs DeepSpeed alone | "
          "max read / share per rank |")
    print("|---|---|---|---|---|")
    for target in args.targets:
        tp, dp, zero = (int(n) for n in target.split("x"))
        native = target_checkpoint(args, work, tp, dp, zero)
        runs = {"DeepSpeed alone, its own degree": (native, ("--plain", "--no-load-universal")),
                "deepspeed-ext, direct from TP=2": (tag_dir.parent, ("--no-load-universal", )),
                "deepspeed-ext, universal": (universal, ())}
        results: dict[str, list[dict]] = {name: [] for name in runs}
        for round_ in range(args.rounds):
            for name in (list(runs) if round_ % 2 == 0 else list(reversed(runs))):
                load_dir, extra = runs[name]
                results[name].append(resume(args, work, tp, dp, zero, load_dir, name.split(",")[0].replace(" ", "_")
                                            + name.split(",")[-1].replace(" ", "_"), extra))
        floor = statistics.median(r["load_s"] for r in results["DeepSpeed alone, its own degree"])
        for name, rows in results.items():
            load = statistics.median(r["load_s"] for r in rows)
            worst = max(read / share for r in rows
                        for read, share in zip(r["read_per_rank"], r["share_per_rank"], strict=True))
            print(f"| {tp} x {dp}, ZeRO-{zero} | {name} | {load:.2f} | {load / floor:.2f} | {worst:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
