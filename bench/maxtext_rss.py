"""Peak RSS of ``deepspeed-ext to-maxtext`` against the size of the largest tensor.

Builds (once, cached under --workdir) a universal checkpoint of a random Llama-style model, then runs
``to-maxtext`` in a subprocess under ``/usr/bin/time -v`` for the requested variants and prints a
table. It also measures the RSS of a process that only imports what the command imports, so the
difference shows what conversion itself holds.

    python bench/maxtext_rss.py                       # 246M Llama (hidden 1024, 16 layers, vocab 32000)
    python bench/maxtext_rss.py --hidden 2048 --layers 16 --intermediate 5632   # ~1.1B
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build_universal(args: argparse.Namespace, out: Path) -> dict:
    """A universal checkpoint of a random model (fp32 master + zero moments), written tensor by tensor."""
    import transformers

    from deepspeed_ext.checkpoint import serialization
    from deepspeed_ext.checkpoint.metadata import UCInfo, write_uc_info
    from deepspeed_ext.module_inject.layout import TPLayout

    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                      intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                      tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    layouts = {}
    generator = torch.Generator().manual_seed(0)
    for name, param in model.named_parameters():
        tensor = torch.randn(param.shape, generator=generator) * 0.02
        directory = partial / "zero" / name
        directory.mkdir(parents=True)
        serialization.save({"param": tensor}, directory / "fp32.pt")
        for moment in ("exp_avg", "exp_avg_sq"):
            serialization.save({"param": torch.zeros_like(tensor)}, directory / f"{moment}.pt")
        serialization.save(0, directory / "step.pt")
        layouts[name] = TPLayout.replicated(tuple(param.shape), 1)
    serialization.save({"param_groups": []}, partial / "zero" / "optimizer_state.pt")
    serialization.save({"global_steps": 0, "mp_world_size": 1, "dp_world_size": 1},
                       partial / "mp_rank_00_model_states.pt")
    write_uc_info(partial, UCInfo(tp_size=1, layouts=layouts, model_config=json.loads(config.to_json_string()),
                                  kind="universal"))
    os.replace(partial, out)
    return {name: tuple(layout.shape) for name, layout in layouts.items()}


def peak_rss(cmd: list[str]) -> tuple[float, float]:
    """(peak RSS in GiB, wall seconds) of ``cmd`` under /usr/bin/time -v."""
    start = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "JAX_PLATFORMS": "cpu"})
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    return kib / 2**20, wall


def model_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark model's shape (default: the 246M Llama) and the cache directory."""
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--workdir", default="/tmp/deepspeed_ext_bench")


def cached_universal(args: argparse.Namespace) -> tuple[Path, Path]:
    """(this model's work directory, its universal checkpoint), built on first use."""
    work = Path(args.workdir) / f"llama_h{args.hidden}_l{args.layers}_i{args.intermediate}_v{args.vocab}"
    universal = work / "universal"
    if not universal.is_dir():
        print(f"building {universal} ...", flush=True)
        work.mkdir(parents=True, exist_ok=True)
        build_universal(args, universal)
    return work, universal


def main() -> None:
    p = argparse.ArgumentParser()
    model_arguments(p)
    args = p.parse_args()
    work, universal = cached_universal(args)
    from deepspeed_ext.checkpoint.universal import UniversalCheckpoint
    shapes = {t.name: t.shape for t in UniversalCheckpoint(universal).tensors()}
    numel = {name: int(torch.Size(shape).numel()) for name, shape in shapes.items()}
    largest = max(numel, key=numel.get)
    # The largest output array: a scanned stack holds one per-layer tensor per layer.
    per_layer = {}
    for name, n in numel.items():
        key = re.sub(r"\.\d+\.", ".*.", name)
        per_layer[key] = per_layer.get(key, 0) + n
    largest_stack = max(per_layer, key=per_layer.get)
    python = sys.executable
    baseline, _ = peak_rss([python, "-c", "import deepspeed_ext.cli, deepspeed_ext.checkpoint.maxtext, "
                            "orbax.checkpoint, jax, torch, tensorstore"])
    rows = []
    for dtype in ("bfloat16", "float32"):
        for scan in (True, False):
            out = work / f"maxtext_{dtype}_{'scan' if scan else 'noscan'}"
            cmd = [python, "-m", "deepspeed_ext", "to-maxtext", str(universal), "-o", str(out), "--dtype", dtype,
                   "--overwrite", "--quiet", "--scan-layers" if scan else "--no-scan-layers"]
            rss, wall = peak_rss(cmd)
            rows.append((dtype, scan, rss, wall))
            shutil.rmtree(out, ignore_errors=True)
    gib = 2**30
    total = sum(numel.values())
    print(f"\nmodel: {total / 1e6:.0f}M parameters ({total * 4 / gib:.2f} GiB fp32, {total * 2 / gib:.2f} GiB bf16)")
    print(f"largest tensor: {largest} {shapes[largest]} = {numel[largest] * 4 / gib:.3f} GiB fp32")
    print(f"largest scanned stack: {largest_stack} = {per_layer[largest_stack] * 4 / gib:.3f} GiB fp32, "
          f"{per_layer[largest_stack] * 2 / gib:.3f} GiB bf16")
    print(f"import-only baseline RSS: {baseline:.2f} GiB\n")
    print("| dtype | scan_layers | peak RSS GiB | peak - baseline GiB | (peak - baseline) / largest fp32 tensor | "
          "(peak - baseline) / largest output array | model bf16 GiB | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype, scan, rss, wall in rows:
        out_bytes = (per_layer[largest_stack] if scan else numel[largest]) * (2 if dtype == "bfloat16" else 4)
        extra = rss - baseline
        print(f"| {dtype} | {scan} | {rss:.2f} | {extra:.2f} | {extra * gib / (numel[largest] * 4):.2f} | "
              f"{extra * gib / out_bytes:.2f} | {total * 2 / gib:.2f} | {wall:.1f} |")


if __name__ == "__main__":
    main()
