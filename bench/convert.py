"""Conversion and resume speed and memory on a real DeepSpeed AutoTP checkpoint, against `cp -r` and upstream.

Builds once (cached under --workdir) a DeepSpeed checkpoint of a 246M-parameter Llama-style model (hidden
1024, 16 layers, 16 query / 4 KV heads, intermediate 2816, vocab 32000) trained one step at TP=2, ZeRO-1,
bf16 with the real engine (torchrun, gloo, CPU). Then, in one run:

1. ``--rounds`` rounds, the command order alternating each round, of
   ``cp -r`` of the tag directory (the I/O floor), ``deepspeed-ext to-universal``, the same under
   ``torchrun --nproc_per_node 2 ... --distributed``, upstream ``python -m deepspeed.checkpoint.ds_to_universal``
   (skipped with --no-upstream), ``to-maxtext`` and ``to-hf``. Each starts with its input evicted from the
   page cache (sync + posix_fadvise DONTNEED) and its time includes the final ``sync``, so every command
   pays for its own reads and writes. Wall time, peak RSS and bytes read + written (``/usr/bin/time -v``) are
   reported as medians, with throughput against cp's.
2. Resume at TP=1 and TP=4 (DP=1, ZeRO-1) and into ZeRO-3 at TP=1 x DP=2 and TP=2 x DP=2 of (a)
   ``to-universal`` + ``load_checkpoint(universal)`` and (b) the direct ``load_checkpoint(tag_dir)`` (load-time
   resharding): time to the end of the first step, and each rank's bytes read from storage during
   ``load_checkpoint`` (``/proc/self/io``, cold cache) against its share (fp32 + exp_avg + exp_avg_sq of its TP
   slice, or under ZeRO-3 of its DP partition of that slice).

    python bench/convert.py                      # 246M, 3 rounds
    python bench/convert.py --layers 32 --rounds 1 --no-upstream --no-resume   # scaling: peak RSS vs layers
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from maxtext_rss import model_arguments  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def llama_config(args: argparse.Namespace) -> dict:
    import transformers
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                      intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    return json.loads(config.to_json_string(use_diff=False))


def run_rank_workers(args: argparse.Namespace, script: str, name: str) -> dict:
    """Run ``script --worker`` on 2 ranks (torchrun, gloo, CPU) for the benchmark model in a fresh
    ``--workdir/name``; what rank 0 left in its ``result.json``."""
    work = Path(args.workdir) / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "config.json").write_text(json.dumps(llama_config(args)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script,
           "--worker", "--config", str(work / "config.json"), "--out", str(work), "--rounds", str(args.rounds)]
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    return json.loads((work / "result.json").read_text())


def checkpoint_workdir(args: argparse.Namespace, layers: int) -> Path:
    """Where the benchmark checkpoint of this model's shapes with ``layers`` layers is cached."""
    vocab = "" if args.vocab == 32000 else f"_v{args.vocab}"
    return Path(args.workdir) / f"deepspeed_tp2_zero1_bf16_h{args.hidden}_l{layers}_i{args.intermediate}{vocab}"


def build_checkpoint(args: argparse.Namespace, work: Path) -> Path:
    """A real DeepSpeed TP=2 ZeRO-1 bf16 checkpoint of the model, saved after one training step."""
    save_dir = work / "deepspeed"
    tag_dir = save_dir / "global_step1"
    if (save_dir / "latest").is_file():
        return tag_dir
    shutil.rmtree(save_dir, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    (work / "config.json").write_text(json.dumps(llama_config(args)))
    print(f"building {tag_dir} (one training step at TP=2, ZeRO-1, bf16) ...", flush=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "deepspeed_ext.demo.train", "--tp", "2",
           "--zero", "1", "--dtype", "bf16", "--steps", "1", "--save-dir", str(save_dir), "--save-at", "1",
           "--model-config", str(work / "config.json")]
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    return tag_dir


def build_tiny_checkpoint(work: Path) -> Path:
    """The built-in tiny Llama (95K parameters) at TP=2: running a command on it measures its fixed cost
    (interpreter start, imports, metadata), which is independent of the checkpoint's size."""
    save_dir = work.parent / "tiny_tp2_zero1_bf16"
    if not (save_dir / "latest").is_file():
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
                        "deepspeed_ext.demo.train", "--tp", "2", "--zero", "1", "--dtype", "bf16", "--steps", "1",
                        "--save-dir", str(save_dir), "--save-at", "1"], check=True, cwd=ROOT, capture_output=True,
                       env={**os.environ, "DS_ACCELERATOR": "cpu"})
    return save_dir / "global_step1"


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def evict(*paths: Path) -> None:
    """Write back and drop these files from the page cache (posix_fadvise DONTNEED on clean pages), so the next
    command reads them from storage; the Python environment stays cached, as on a machine in use."""
    subprocess.run(["sync"], check=True)
    for root in paths:
        for path in [root] if root.is_file() else root.rglob("*"):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def warm(*paths: Path) -> None:
    """Write back whatever is dirty, then read these files into the page cache, so the next command finds its
    input in memory (as right after a save, once its writes are on disk)."""
    subprocess.run(["sync"], check=True)
    for root in paths:
        for path in [root] if root.is_file() else root.rglob("*"):
            if path.is_file():
                with open(path, "rb") as handle:
                    while handle.read(1 << 24):
                        pass


def warm_program() -> None:
    """Read the interpreter's libraries (the environment's packages, torch, JAX, tensorstore..., about 1.9 GB, and the
    standard library) into the page cache: a command that writes gigabytes into a tmpfs beside cached checkpoints
    makes the kernel evict them, and the next command then re-reads them from the disk as it imports (68 major
    faults and +1.1 s for a 48-layer to-maxtext run right after a ``cp -r`` of its input, against the same run after
    another to-maxtext). Run before each timed command, so that a size's margin does not depend on which command
    ran before it."""
    import sysconfig
    paths = sysconfig.get_paths()
    # find and cat: 1.5 s for 40k files from a warm cache, where Python's own walk took 6 s. The base interpreter's
    # own packages are not this environment's (a venv's are under purelib).
    roots = " ".join(shlex.quote(root) for root in sorted({paths["purelib"], paths["platlib"], paths["stdlib"]}))
    subprocess.run(["sh", "-c", f"find {roots} -path {shlex.quote(os.path.join(paths['stdlib'], 'site-packages'))} "
                    "-prune -o -type f -print0 2>/dev/null | xargs -0 cat > /dev/null 2>&1"], check=False)


def timed(cmd: list[str], cold: Path | None) -> dict[str, float]:
    """Wall time (including the final sync), peak RSS and bytes read/written of ``cmd``; ``cold``: evict this
    input from the page cache first."""
    if cold is not None:
        evict(cold)
    shell = " ".join(shlex.quote(c) for c in cmd) + " && sync"
    start = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", "sh", "-c", shell], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "JAX_PLATFORMS": "cpu"})
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"failed: {shell}\n{proc.stderr[-3000:]}")

    def field(label: str) -> int:
        return int(re.search(rf"{label}: (\d+)", proc.stderr).group(1))

    return {"wall": wall, "rss": field(r"Maximum resident set size \(kbytes\)") / 2**20,
            "read": field("File system inputs") * 512, "written": field("File system outputs") * 512}


def conversion_commands(args: argparse.Namespace, tag_dir: Path, out: Path) -> dict[str, list[str]]:
    python = sys.executable
    ext = [python, "-m", "deepspeed_ext"]
    commands = {
        "cp -r": ["cp", "-r", str(tag_dir), str(out)],
        "deepspeed-ext to-universal": [*ext, "to-universal", str(tag_dir), "-o", str(out), "--quiet"],
        "to-universal --distributed (2 ranks)": [python, "-m", "torch.distributed.run", "--standalone",
                                                 "--nproc_per_node=2", "-m", "deepspeed_ext", "to-universal",
                                                 str(tag_dir), "-o", str(out), "--quiet", "--distributed"],
    }
    if not args.no_upstream:
        commands["upstream ds_to_universal"] = [python, "-m", "deepspeed.checkpoint.ds_to_universal",
                                                "--input_folder", str(tag_dir), "--output_folder", str(out),
                                                "--num_extract_workers", "2", "--num_merge_workers", "2"]
    commands["to-maxtext (bf16 params)"] = [*ext, "to-maxtext", str(tag_dir), "-o", str(out), "--quiet"]
    commands["to-maxtext --compression none"] = [*ext, "to-maxtext", str(tag_dir), "-o", str(out), "--quiet",
                                                 "--compression", "none"]
    commands["to-maxtext --no-ocdbt --compression none"] = [*ext, "to-maxtext", str(tag_dir), "-o", str(out),
                                                           "--quiet", "--no-ocdbt", "--compression", "none"]
    commands["to-hf (bf16)"] = [*ext, "to-hf", str(tag_dir), "-o", str(out), "--quiet"]
    return commands


def conversions(args: argparse.Namespace, tag_dir: Path, work: Path) -> dict[str, dict[str, float]]:
    out = work / "out"
    commands = conversion_commands(args, tag_dir, out)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in commands}
    for round_ in range(args.rounds):
        order = list(commands) if round_ % 2 == 0 else list(reversed(commands))
        for name in order:
            shutil.rmtree(out, ignore_errors=True)
            if args.cache == "warm":
                warm(tag_dir)
            result = timed(commands[name], cold=tag_dir if args.cache == "cold" else None)
            result["output"] = du(out)
            runs[name].append(result)
            print(f"round {round_ + 1}: {name}: {result['wall']:.1f} s, peak RSS {result['rss']:.2f} GiB, "
                  f"read {result['read'] / 2**30:.2f} GiB, written {result['written'] / 2**30:.2f} GiB", flush=True)
    # Fixed cost: the same commands on the tiny checkpoint (warm cache), median of --rounds.
    tiny = build_tiny_checkpoint(work)
    fixed: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.rounds):
        for name, cmd in conversion_commands(args, tiny, out).items():
            shutil.rmtree(out, ignore_errors=True)
            fixed[name].append(timed(cmd, cold=None)["wall"])
    shutil.rmtree(out, ignore_errors=True)
    medians = {name: {key: statistics.median(r[key] for r in results) for key in results[0]}
               for name, results in runs.items()}
    for name, walls in fixed.items():
        medians[name]["fixed"] = statistics.median(walls) if name != "cp -r" else 0.0
    return medians


def resume(args: argparse.Namespace, work: Path, tp: int, dp: int, zero: int, load_dir: Path,
           label: str, extra: tuple[str, ...] = ()) -> dict[str, float]:
    """One resume at TP=tp x DP=dp under ZeRO ``zero``: load ``load_dir``, train one step; per-rank timing from
    train.py --timing (``extra``: more of its arguments)."""
    timing = work / "timing" / f"{label}_tp{tp}_dp{dp}_zero{zero}"
    timing.parent.mkdir(exist_ok=True)
    for old in timing.parent.glob(f"{timing.name}.rank*.json"):
        old.unlink()
    evict(load_dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(tp * dp), "-m",
           "deepspeed_ext.demo.train", "--tp", str(tp),
           "--zero", str(zero), "--dtype", "bf16", "--steps", "2", "--load-dir", str(load_dir), "--timing",
           str(timing), "--model-config", str(work / "config.json"), *extra]
    # torchrun gives each of several ranks one OpenMP thread; a single rank keeps the machine's cores.
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    ranks = [json.loads(p.read_text()) for p in sorted(timing.parent.glob(f"{timing.name}.rank*.json"))]
    return {"first_step_s": max(r["first_step_s"] for r in ranks), "load_s": max(r["load_s"] for r in ranks),
            "read_per_rank": [r["load_read_bytes"] for r in ranks],
            "share_per_rank": [r["share_bytes"] for r in ranks],
            "rss_gain_per_rank": [r["load_peak_rss_gain_bytes"] for r in ranks],
            "new_state_per_rank": [r["load_new_optimizer_state_bytes"] for r in ranks]}


def resume_targets(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    """(TP, DP, ZeRO stage) of each resume row: --resume-tp at DP=1 under ZeRO-1, --resume-zero3 TPxDP."""
    zero3 = [tuple(int(n) for n in spec.split("x")) for spec in args.resume_zero3]
    return [(tp, 1, 1) for tp in args.resume_tp] + [(tp, dp, 3) for tp, dp in zero3]


def resumes(args: argparse.Namespace, tag_dir: Path, work: Path) -> list[str]:
    python = sys.executable
    universal = work / "resume_universal"
    lines = ["| resume | TP | DP | ZeRO | convert s | load_checkpoint s | load + first step s | time to first step s | "
             "(b)/(a) | (b)/(a) without the step | max read / share per rank | all ranks read / all shares |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for tp, dp, zero in resume_targets(args):
        shutil.rmtree(universal, ignore_errors=True)
        convert = timed([python, "-m", "deepspeed_ext", "to-universal", str(tag_dir), "-o", str(universal),
                         "--quiet"], cold=tag_dir)["wall"]
        via_universal = resume(args, work, tp, dp, zero, universal, "universal")
        direct = resume(args, work, tp, dp, zero, tag_dir, "direct")
        total_a = convert + via_universal["first_step_s"]
        load_a = convert + via_universal["load_s"]
        for name, result, conv, total in (("(a) to-universal + load", via_universal, convert, total_a),
                                          ("(b) direct load", direct, 0.0, direct["first_step_s"])):
            reads, shares = result["read_per_rank"], result["share_per_rank"]
            worst = max(r / s for r, s in zip(reads, shares, strict=True))
            lines.append(f"| {name} | {tp} | {dp} | {zero} | {conv:.1f} | {result['load_s']:.1f} | "
                         f"{result['first_step_s']:.1f} | {total:.1f} | {total / total_a:.2f} | "
                         f"{(conv + result['load_s']) / load_a:.2f} | {worst:.2f} | {sum(reads) / sum(shares):.2f} |")
            print(lines[-1], flush=True)
    shutil.rmtree(universal, ignore_errors=True)
    return lines


def main() -> None:
    p = argparse.ArgumentParser()
    model_arguments(p)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-upstream", action="store_true", help="skip upstream ds_to_universal (slow)")
    p.add_argument("--no-resume", action="store_true", help="skip the resume measurements")
    p.add_argument("--resume-tp", type=int, nargs="*", default=[1, 4], help="ZeRO-1 resumes at these TP degrees")
    p.add_argument("--resume-zero3", nargs="*", default=["1x2", "2x2"], metavar="TPxDP",
                   help="ZeRO-3 resumes at these TP x DP degrees")
    p.add_argument("--no-convert", action="store_true", help="skip the conversion table (resumes only)")
    p.add_argument("--cache", choices=["cold", "warm"], default="cold",
                   help="the input evicted from the page cache before each command (cold), or read into it (warm)")
    args = p.parse_args()
    work = checkpoint_workdir(args, args.layers)
    tag_dir = build_checkpoint(args, work)
    medians = {} if args.no_convert else conversions(args, tag_dir, work)
    resume_lines = [] if args.no_resume else resumes(args, tag_dir, work)
    if medians:
        report_conversions(args, tag_dir, medians)
    if resume_lines:
        print()
        print("\n".join(resume_lines))


def report_conversions(args: argparse.Namespace, tag_dir: Path, medians: dict[str, dict[str, float]]) -> None:
    """The conversion table, against cp -r, with the memory target's unit."""
    from deepspeed_ext.checkpoint.deepspeed import DeepSpeedCheckpoint
    layouts = DeepSpeedCheckpoint(tag_dir).layouts
    largest = max(layouts, key=lambda n: layouts[n].numel)
    unit = layouts[largest].numel * 4 * 3 / 2**30  # fp32 master + exp_avg + exp_avg_sq
    size = du(tag_dir)
    cp = medians["cp -r"]
    cp_rate = (cp["read"] + cp["written"]) / cp["wall"]
    print(f"\ncheckpoint: {tag_dir} ({size / 2**30:.2f} GiB, {sum(t.numel for t in layouts.values()) / 1e6:.0f}M "
          f"params, {args.layers} layers)")
    print(f"largest parameter: {largest}: fp32 + exp_avg + exp_avg_sq = {unit:.3f} GiB; "
          f"memory target 1.5 x that + 0.5 GiB = {1.5 * unit + 0.5:.2f} GiB")
    where = "evicted from" if args.cache == "cold" else "read into"
    print(f"medians of {args.rounds} rounds; the input {where} the page cache before each command\n")
    print("| command | wall s | x cp -r | peak RSS GiB | read GiB | written GiB | throughput vs cp | fixed cost s | "
          "throughput after the fixed cost vs cp |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, m in medians.items():
        moved = m["read"] + m["written"]  # throughput: bytes read + written per second, as for cp
        streaming = moved / max(m["wall"] - m["fixed"], 1e-3)
        print(f"| {name} | {m['wall']:.1f} | {m['wall'] / cp['wall']:.2f} | {m['rss']:.2f} | "
              f"{m['read'] / 2**30:.2f} | {m['written'] / 2**30:.2f} | {moved / m['wall'] / cp_rate:.2f} | "
              f"{m['fixed']:.1f} | {streaming / cp_rate:.2f} |")
    if "upstream ds_to_universal" in medians:
        for name in ("deepspeed-ext to-universal", "to-universal --distributed (2 ranks)"):
            print(f"\n{name} / upstream wall time: "
                  f"{medians[name]['wall'] / medians['upstream ds_to_universal']['wall']:.3f}", end="")
        print()
    single, dist = medians["deepspeed-ext to-universal"], medians["to-universal --distributed (2 ranks)"]
    print(f"--distributed speed-up on 2 ranks: {single['wall'] / dist['wall']:.2f}x")


if __name__ == "__main__":
    main()
