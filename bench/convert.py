"""Conversion speed and memory on a real DeepSpeed AutoTP checkpoint, against `cp -r` and upstream.

Builds once (cached under --workdir) a DeepSpeed checkpoint of a 246M-parameter Llama-style model (hidden
1024, 16 layers, 16 query / 4 KV heads, intermediate 2816, vocab 32000) trained one step at TP=2, ZeRO-1,
bf16 with the real engine (torchrun, gloo, CPU). Then, alternating the commands in each round so that
page-cache warmth is shared fairly, it runs ``--rounds`` times:

* ``cp -r`` of the tag directory (the I/O floor of this machine);
* ``deepspeed-ext to-universal``;
* upstream ``python -m deepspeed.checkpoint.ds_to_universal`` (skipped with --no-upstream);

each under ``/usr/bin/time -v``, and prints the median wall time and peak RSS of each, their ratios, and
the size of the largest parameter's fp32 + exp_avg + exp_avg_sq (the memory target's unit).

    python bench/convert.py                      # 246M, 3 rounds
    python bench/convert.py --layers 32          # scaling: peak RSS must not grow with layer count
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from maxtext_rss import model_arguments, peak_rss  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def llama_config(args: argparse.Namespace) -> dict:
    import transformers
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                      intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    return json.loads(config.to_json_string(use_diff=False))


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
    cmd = ["torchrun", "--standalone", "--nproc_per_node", "2", "-m", "deepspeed_ext.demo.train", "--tp", "2",
           "--zero", "1", "--dtype", "bf16", "--steps", "1", "--save-dir", str(save_dir), "--save-at", "1",
           "--model-config", str(work / "config.json")]
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    return tag_dir


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    p = argparse.ArgumentParser()
    model_arguments(p)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-upstream", action="store_true", help="skip upstream ds_to_universal (slow)")
    args = p.parse_args()
    work = Path(args.workdir) / f"deepspeed_tp2_zero1_bf16_h{args.hidden}_l{args.layers}_i{args.intermediate}"
    tag_dir = build_checkpoint(args, work)
    python = sys.executable
    out = work / "out"
    commands = {
        "cp -r": ["cp", "-r", str(tag_dir), str(out)],
        "deepspeed-ext to-universal": [python, "-m", "deepspeed_ext", "to-universal", str(tag_dir), "-o", str(out),
                                       "--quiet"],
    }
    if not args.no_upstream:
        commands["upstream ds_to_universal"] = [python, "-m", "deepspeed.checkpoint.ds_to_universal",
                                                "--input_folder", str(tag_dir), "--output_folder", str(out),
                                                "--num_extract_workers", "2", "--num_merge_workers", "2"]
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    for round_ in range(args.rounds):
        order = list(commands) if round_ % 2 == 0 else list(reversed(commands))
        for name in order:
            shutil.rmtree(out, ignore_errors=True)
            rss, wall = peak_rss(commands[name])
            results[name].append((rss, wall))
            print(f"round {round_ + 1}: {name}: {wall:.1f} s, peak RSS {rss:.2f} GiB", flush=True)
    shutil.rmtree(out, ignore_errors=True)

    from deepspeed_ext.checkpoint.deepspeed import DeepSpeedCheckpoint
    layouts = DeepSpeedCheckpoint(tag_dir).layouts
    largest = max(layouts, key=lambda n: layouts[n].numel)
    unit = layouts[largest].numel * 4 * 3 / 2**30  # fp32 master + exp_avg + exp_avg_sq
    size = du(tag_dir) / 2**30
    median = {name: (statistics.median(r for r, _ in runs), statistics.median(w for _, w in runs))
              for name, runs in results.items()}
    floor = median["cp -r"][1]
    print(f"\ncheckpoint: {tag_dir} ({size:.2f} GiB, {sum(t.numel for t in layouts.values()) / 1e6:.0f}M params)")
    print(f"largest parameter: {largest}: fp32 + exp_avg + exp_avg_sq = {unit:.3f} GiB; "
          f"memory target 1.5 x that + 0.5 GiB = {1.5 * unit + 0.5:.2f} GiB")
    print(f"medians of {args.rounds} rounds\n")
    print("| command | wall s | x cp -r | peak RSS GiB |")
    print("|---|---|---|---|")
    for name, (rss, wall) in median.items():
        print(f"| {name} | {wall:.1f} | {wall / floor:.2f} | {rss:.2f} |")
    if "upstream ds_to_universal" in median:
        ratio = median["deepspeed-ext to-universal"][1] / median["upstream ds_to_universal"][1]
        print(f"\nto-universal / upstream wall time: {ratio:.3f}")


if __name__ == "__main__":
    main()
