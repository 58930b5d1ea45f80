"""Memory against tensor size: peak RSS of each command, and of the restore, on a checkpoint with a large tensor.

Builds once (cached under --workdir) a real DeepSpeed checkpoint, trained one step at TP=2, ZeRO-1, bf16 by the
engine (torchrun, gloo, CPU), of a Llama whose vocabulary makes one tensor large: by default Llama 3's 128256
tokens at hidden 1024 and 4 layers (307M parameters), so the embedding, which AutoTP keeps whole, is 0.49 GiB in
fp32 and 1.47 GiB with its Adam moments. Then runs, under ``/usr/bin/time -v``:

* ``to-universal``, ``to-hf`` (bf16 and fp32) and ``to-maxtext`` (bf16 and fp32 parameters), each also on the
  built-in tiny model: "extra" is the peak above the same command's peak there, which is the interpreter, the
  imports and the metadata (an import-only process, as near as one can get for each command);
* the restore: ``load_checkpoint`` at TP=1 (direct and from the universal form), where "extra" is the rank's
  peak RSS during the load above its RSS when the load began (the engine it restores into), less the Adam
  buffers the load created (a fresh engine has none before its first step, which would create them).

    python bench/memory.py                                  # 307M, vocab 128256 (build: about 3 minutes)
    python bench/memory.py --vocab 32000 --layers 16        # the 246M benchmark model, for comparison
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import build_checkpoint, build_tiny_checkpoint, checkpoint_workdir, resume, timed  # noqa: E402
from maxtext_rss import model_arguments  # noqa: E402


def commands(tag_dir: Path, out: Path) -> dict[str, list[str]]:
    ext = [sys.executable, "-m", "deepspeed_ext"]
    return {
        "to-universal": [*ext, "to-universal", str(tag_dir), "-o", str(out), "--quiet"],
        "to-hf (bf16)": [*ext, "to-hf", str(tag_dir), "-o", str(out), "--quiet"],
        "to-hf --dtype float32": [*ext, "to-hf", str(tag_dir), "-o", str(out), "--dtype", "float32", "--quiet"],
        "to-maxtext (bf16 params)": [*ext, "to-maxtext", str(tag_dir), "-o", str(out), "--quiet"],
        "to-maxtext --dtype float32": [*ext, "to-maxtext", str(tag_dir), "-o", str(out), "--dtype", "float32",
                                       "--quiet"],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    model_arguments(p)
    p.set_defaults(vocab=128256, layers=4)
    p.add_argument("--no-restore", action="store_true", help="skip the restore rows")
    args = p.parse_args()
    work = checkpoint_workdir(args, args.layers)
    tag_dir = build_checkpoint(args, work)
    tiny = build_tiny_checkpoint(work)
    out = work / "out"
    gib = 2**30
    from deepspeed_ext.checkpoint.deepspeed import DeepSpeedCheckpoint
    layouts = DeepSpeedCheckpoint(tag_dir).layouts
    largest = max(layouts, key=lambda n: layouts[n].numel)
    fp32 = layouts[largest].numel * 4 / gib
    total = sum(layout.numel for layout in layouts.values())
    rows = []
    for name, cmd in commands(tag_dir, out).items():
        shutil.rmtree(out, ignore_errors=True)
        small = timed(commands(tiny, out)[name], cold=None)["rss"]
        shutil.rmtree(out, ignore_errors=True)
        big = timed(cmd, cold=None)
        rows.append((name, big["rss"], small, big["wall"]))
        print(f"{name}: peak {big['rss']:.2f} GiB, tiny model {small:.2f} GiB, {big['wall']:.1f} s", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    restores = []
    if not args.no_restore:
        universal = work / "memory_universal"
        shutil.rmtree(universal, ignore_errors=True)
        timed(commands(tag_dir, universal)["to-universal"], cold=None)
        for label, load_dir in (("restore at TP=1, direct", tag_dir), ("restore at TP=1, universal", universal)):
            result = resume(args, work, 1, 1, 1, load_dir, label.replace(" ", "_").replace(",", ""))
            gain, created = result["rss_gain_per_rank"][0] / gib, result["new_state_per_rank"][0] / gib
            restores.append((label, gain, created, result["load_s"]))
            print(f"{label}: +{gain:.2f} GiB during load_checkpoint, {created:.2f} GiB of it the Adam buffers it "
                  "created", flush=True)
        shutil.rmtree(universal, ignore_errors=True)
    print(f"\ncheckpoint: {tag_dir} ({total / 1e6:.0f}M parameters, vocab {args.vocab}, hidden {args.hidden}, "
          f"{args.layers} layers)")
    print(f"largest tensor: {largest}: {fp32:.2f} GiB fp32, {3 * fp32:.2f} GiB with exp_avg and exp_avg_sq\n")
    print("| command | peak RSS GiB | same command, tiny model GiB | extra GiB | extra / largest fp32 tensor | wall s |")
    print("|---|---|---|---|---|---|")
    for name, big, small, wall in rows:
        print(f"| {name} | {big:.2f} | {small:.2f} | {big - small:.2f} | {(big - small) / fp32:.2f} | {wall:.1f} |")
    for label, gain, created, seconds in restores:
        extra = gain - created
        print(f"| {label}: peak during load_checkpoint above its start ({gain:.2f} GiB) less the Adam buffers it "
              f"created ({created:.2f} GiB) | | | {extra:.2f} | {extra / fp32:.2f} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
