"""Memory against tensor size: peak RSS of each command, and of the restore, on a checkpoint with a large tensor.

Builds once (cached under --workdir) a real DeepSpeed checkpoint, trained one step at TP=2, ZeRO-1, bf16 by the
engine (torchrun, gloo, CPU), of a Llama whose vocabulary makes one tensor large: by default Llama 3's 128256
tokens at hidden 1024 and 4 layers (307M parameters), so the embedding, which AutoTP keeps whole, is 0.49 GiB in
fp32 and 1.47 GiB with its Adam moments. Then runs, under ``/usr/bin/time -v``:

* ``to-universal``, ``to-hf`` (bf16 and fp32) and ``to-maxtext`` (bf16 and fp32 parameters), each also on the
  built-in tiny model: "extra" is the peak above the same command's peak there, which is the interpreter, the
  imports and the metadata (an import-only process, as near as one can get for each command);
* the restore: ``load_checkpoint`` at TP=1 into ZeRO-1 and into ZeRO-3 (direct and from the universal form;
  a single rank, so ZeRO-3's partition is each whole tensor), where "extra" is the rank's
  peak RSS during the load above its RSS when the load began (the engine it restores into), less the Adam
  buffers the load created (a fresh engine has none before its first step, which would create them).

    python bench/memory.py                                  # 307M, vocab 128256 (build: about 3 minutes)
    python bench/memory.py --vocab 32000 --layers 16        # the 246M benchmark model, for comparison
    python bench/memory.py --only restore                   # just the restore rows (ZeRO-1 and ZeRO-3)

At real shapes (``--shapes llama3-8b``): Llama-3-8B's tensors with 2 layers (1.49B parameters, 28 GB at TP=2
ZeRO-1 bf16), which the engine cannot train on a 24 GiB machine, so the checkpoint is written by
``bench/synth_checkpoint.py`` in the engine's exact layout (checked against a real run by
``tests/e2e/test_synth_checkpoint.py``), once, cached under --workdir. The rows add ``cp -r`` and upstream's
``ds_to_universal`` (time and peak RSS); every command runs under a guard that kills it (its own process
group) when the machine's available memory falls below --min-available GiB, and the row says so. The restore
rows are not run there (see ``RESTORE_NOTE``).

    python bench/memory.py --shapes llama3-8b                           # every row (about 20 minutes)
    python bench/memory.py --shapes llama3-8b --only to-maxtext         # just the to-maxtext rows
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import ROOT, build_checkpoint, build_tiny_checkpoint, checkpoint_workdir, du, resume, timed  # noqa: E402
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


GIB = 2**30

#: Why the real-shape run has no restore row: the engine a restore loads into does not fit.
RESTORE_NOTE = ("restore: not run. Loading means building the engine first: at TP=1 it holds {params:.2f}B bf16 "
                "weights (2 B each), their fp32 masters (4), gradients (2) and, once loaded, both Adam moments "
                "(8): 16 bytes per parameter, {need:.1f} GiB, against {ram:.1f} GiB of RAM; at TP=2 each rank "
                "holds {rank:.2f}B of them (the embedding is whole on both), {need2:.1f} GiB for the two ranks.")


def guarded(cmd: list[str], min_available: float) -> dict[str, float | str]:
    """``cmd`` under ``/usr/bin/time -v`` (then ``sync``): wall time and peak RSS; killed (its own process group)
    if the machine's available memory falls below ``min_available`` GiB, so that an over-large command ends
    itself rather than the machine's other processes. ``status``: ok, failed (rc), or killed."""
    shell = " ".join(shlex.quote(c) for c in cmd) + " && sync"
    start = time.perf_counter()
    proc = subprocess.Popen(["/usr/bin/time", "-v", "sh", "-c", shell], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True,
                            env={**os.environ, "DS_ACCELERATOR": "cpu", "JAX_PLATFORMS": "cpu",
                                 "OMP_NUM_THREADS": "1"})
    killed, lowest = False, float("inf")
    stderr_chunks: list[str] = []
    reader = threading.Thread(target=lambda: stderr_chunks.append(proc.stderr.read() if proc.stderr else ""))
    reader.start()
    while proc.poll() is None:
        available = _available_gib()
        lowest = min(lowest, available)
        if available < min_available and not killed:
            os.killpg(proc.pid, signal.SIGKILL)  # the process group this call started, nothing else
            killed = True
        time.sleep(0.2)
    reader.join()
    wall = time.perf_counter() - start
    stderr = "".join(stderr_chunks)
    match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr)
    rss = int(match.group(1)) / 2**20 if match else float("nan")
    status = "killed" if killed else "ok" if proc.returncode == 0 else f"failed ({proc.returncode})"
    if status.startswith("failed"):
        print(stderr[-2000:], file=sys.stderr)
    return {"wall": wall, "rss": rss, "status": status, "lowest_available": lowest}


def _available_gib() -> float:
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:")) / 2**20


def synthetic_commands(tag_dir: Path, out: Path, upstream_workers: list[int]) -> dict[str, list[str]]:
    """The real-shape rows, in order: cp first (the floor), ours, upstream last (the slowest)."""
    rows = {"cp -r": ["cp", "-r", str(tag_dir), str(out)], **commands(tag_dir, out)}
    for workers in upstream_workers:
        rows[f"upstream ds_to_universal ({workers} extract + {workers} merge workers)"] = [
            sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag_dir),
            "--output_folder", str(out), "--num_extract_workers", str(workers), "--num_merge_workers", str(workers)]
    return rows


def synthetic(args: argparse.Namespace) -> None:
    """The rows at real shapes, on the generated checkpoint (see the module docstring)."""
    import synth_checkpoint as synth
    work = Path(args.workdir) / f"synth_{args.shapes}"
    save_dir = work / "deepspeed"
    plan = synth.make_plan(synth.llama_config_dict(synth.SHAPES[args.shapes]))
    if not (save_dir / "latest").is_file():
        shutil.rmtree(save_dir, ignore_errors=True)
        print(f"generating {save_dir} ...", flush=True)
        synth.write_checkpoint(plan, save_dir)
    tag_dir = save_dir / (save_dir / "latest").read_text().strip()
    tiny = build_tiny_checkpoint(work)
    size = du(tag_dir)
    out = work / "out"
    params = sum(p.layout.numel for p in plan.params) / 1e9
    largest = max(plan.params, key=lambda p: p.layout.numel)
    fp32 = largest.layout.numel * 4 / GIB
    rows: list[tuple[str, dict[str, float | str], float | None]] = []
    for name, cmd in synthetic_commands(tag_dir, out, args.upstream_workers).items():
        if args.only and not any(word in name for word in args.only):
            continue
        shutil.rmtree(out, ignore_errors=True)
        # Ours write at most the checkpoint's size; upstream first extracts every rank's fragments of the three
        # fp32 states to files (the optimizer files' bytes), then merges them into the same again per parameter.
        optim = sum(p.stat().st_size for p in tag_dir.glob("*optim_states.pt"))
        need = optim + int(params * 1e9 * 12) if name.startswith("upstream") else size
        free = shutil.disk_usage(work).free
        if free < need + args.disk_margin * GIB:  # the disk is shared: never fill it
            print(f"{name}: skipped, {free / GIB:.1f} GiB free, needs up to {need / GIB:.1f}", flush=True)
            rows.append((name, {"wall": float("nan"), "rss": float("nan"), "status": "skipped (disk)"}, None))
            continue
        small = None
        if name in commands(tiny, out):
            baseline = guarded(commands(tiny, out)[name], args.min_available)
            shutil.rmtree(out, ignore_errors=True)
            if baseline["status"] != "ok":  # a failed baseline is no baseline: say so, leave "extra" empty
                print(f"{name}: the tiny model's run {baseline['status']}", flush=True)
            else:
                small = float(baseline["rss"])
        result = guarded(cmd, args.min_available)
        result["written"] = du(out) if out.exists() else 0
        shutil.rmtree(out, ignore_errors=True)
        rows.append((name, result, small))
        print(f"{name}: {result['status']}, peak {result['rss']:.2f} GiB, {result['wall']:.1f} s, lowest available "
              f"{result['lowest_available']:.1f} GiB" + (f", tiny model {small:.2f} GiB" if small is not None else ""),
              flush=True)
    print(f"\ncheckpoint: {tag_dir} ({size / 1e9:.1f} GB, {params:.2f}B parameters, shapes {args.shapes}, generated)")
    print(f"largest tensor: {largest.name}: {fp32:.2f} GiB fp32, {3 * fp32:.2f} GiB with exp_avg and exp_avg_sq")
    cp = next((r for n, r, _ in rows if n == "cp -r" and r["status"] == "ok"), None)
    print("\n| command | peak RSS GiB | same command, tiny model GiB | extra GiB | wall s | x cp -r | status |")
    print("|---|---|---|---|---|---|---|")
    for name, result, small in rows:
        extra = f"{float(result['rss']) - small:.2f}" if small is not None else ""
        ratio = f"{float(result['wall']) / float(cp['wall']):.2f}" if cp and result["status"] == "ok" else ""
        print(f"| {name} | {float(result['rss']):.2f} | {'' if small is None else f'{small:.2f}'} | {extra} | "
              f"{float(result['wall']):.1f} | {ratio} | {result['status']} |")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    rank = max(plan.rank_numel(r) for r in range(plan.tp)) / 1e9
    print("\n" + RESTORE_NOTE.format(params=params, need=params * 1e9 * 16 / GIB, ram=ram, rank=rank,
                                     need2=2 * rank * 1e9 * 16 / GIB))


def main() -> None:
    p = argparse.ArgumentParser()
    model_arguments(p)
    p.set_defaults(vocab=128256, layers=4)
    p.add_argument("--no-restore", action="store_true", help="skip the restore rows")
    p.add_argument("--shapes", help="real shapes (llama3-8b): a checkpoint generated in the engine's layout, "
                   "rows with cp -r and upstream, no restore")
    p.add_argument("--only", nargs="*", help="only the rows whose name contains one of these")
    p.add_argument("--upstream-workers", type=int, nargs="*", default=[2, 1],
                   help="with --shapes: upstream ds_to_universal rows, one per worker count")
    p.add_argument("--min-available", type=float, default=1.5,
                   help="with --shapes: kill a command when the machine's available memory falls below this (GiB)")
    p.add_argument("--disk-margin", type=float, default=5.0,
                   help="with --shapes: skip a command unless this many GiB stay free beside its output")
    args = p.parse_args()
    if args.shapes:
        synthetic(args)
        return
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
        if args.only and not any(word in name for word in args.only):
            continue
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
        for label, load_dir, zero in (("restore at TP=1, direct", tag_dir, 1),
                                      ("restore at TP=1, universal", universal, 1),
                                      ("restore at TP=1 into ZeRO-3 (DP=1), direct", tag_dir, 3),
                                      ("restore at TP=1 into ZeRO-3, universal", universal, 3)):
            if args.only and not any(word in label for word in args.only):
                continue
            result = resume(args, work, 1, 1, zero, load_dir, f"memory_{len(restores)}_zero{zero}")
            gain, created = result["rss_gain_per_rank"][0] / gib, result["new_state_per_rank"][0] / gib
            restores.append((label, gain, created, result["load_s"]))
            print(f"{label}: +{gain:.2f} GiB during load_checkpoint, {created:.2f} GiB of it the Adam buffers it "
                  "created", flush=True)
        shutil.rmtree(universal, ignore_errors=True)
    print(f"\ncheckpoint: {tag_dir} ({total / 1e6:.0f}M parameters, vocab {args.vocab}, hidden {args.hidden}, "
          f"{args.layers} layers)")
    print(f"largest tensor: {largest}: {fp32:.2f} GiB fp32, {3 * fp32:.2f} GiB with exp_avg and exp_avg_sq\n")
    print("| command | peak RSS GiB | same command, tiny model GiB | extra GiB | extra / largest fp32 tensor "
          "| wall s |")
    print("|---|---|---|---|---|---|")
    for name, big, small, wall in rows:
        print(f"| {name} | {big:.2f} | {small:.2f} | {big - small:.2f} | {(big - small) / fp32:.2f} | {wall:.1f} |")
    for label, gain, created, seconds in restores:
        extra = gain - created
        print(f"| {label}: peak during load_checkpoint above its start ({gain:.2f} GiB) less the Adam buffers it "
              f"created ({created:.2f} GiB) | | | {extra:.2f} | {extra / fp32:.2f} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
