"""Peak RSS of ``to-hf`` and ``from-hf`` against the size of the largest tensor.

Uses the random Llama universal checkpoint of ``bench/maxtext_rss.py`` (built once, cached under
--workdir) and runs each command in a subprocess under ``/usr/bin/time -v``:

* universal (fp32) -> ``to-hf --dtype bfloat16`` and ``--dtype float32``;
* the bf16 HF output -> ``from-hf`` (bf16 kept) and -> ``to-hf`` again (an HF re-shard).

"Extra" is the peak above a process that only imports what the commands import.

    python bench/hf_rss.py                    # 246M Llama (hidden 1024, 16 layers, vocab 32000)
    python bench/hf_rss.py --layers 32        # same tensors, twice the layers: the peak must not grow
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from maxtext_rss import cached_universal, model_arguments, peak_rss  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    model_arguments(p)
    p.add_argument("--max-shard-size", default="1GB")
    args = p.parse_args()
    work, universal = cached_universal(args)
    from deepspeed_ext.checkpoint.universal import UniversalCheckpoint
    numel = {t.name: int(torch.Size(t.shape).numel()) for t in UniversalCheckpoint(universal).tensors()}
    largest = max(numel, key=numel.get)
    python = sys.executable
    baseline, _ = peak_rss([python, "-c", "import deepspeed_ext.cli, deepspeed_ext.checkpoint.hf, "
                            "deepspeed_ext.checkpoint.universal, transformers, safetensors, torch"])
    cli = [python, "-m", "deepspeed_ext"]
    hf_bf16, hf_fp32 = work / "hf_bf16", work / "hf_fp32"
    runs = [("universal -> to-hf bf16", cli + ["to-hf", str(universal), "-o", str(hf_bf16), "--dtype", "bfloat16"]),
            ("universal -> to-hf fp32", cli + ["to-hf", str(universal), "-o", str(hf_fp32), "--dtype", "float32"]),
            ("HF bf16 -> from-hf", cli + ["from-hf", str(hf_bf16), "-o", str(work / "from_hf")]),
            ("HF bf16 -> to-hf (re-shard)", cli + ["to-hf", str(hf_bf16), "-o", str(work / "hf_again")])]
    rows = []
    for label, cmd in runs:
        rss, wall = peak_rss(cmd + ["--max-shard-size", args.max_shard_size] * ("to-hf" in cmd) +
                             ["--overwrite", "--quiet"])
        rows.append((label, rss, wall))
    for path in (hf_fp32, work / "from_hf", work / "hf_again", hf_bf16):
        shutil.rmtree(path, ignore_errors=True)
    gib = 2**30
    total = sum(numel.values())
    print(f"\nmodel: {total / 1e6:.0f}M parameters ({total * 4 / gib:.2f} GiB fp32, {total * 2 / gib:.2f} GiB bf16)")
    print(f"largest tensor: {largest} = {numel[largest] * 4 / gib:.3f} GiB fp32")
    print(f"import-only baseline RSS: {baseline:.2f} GiB\n")
    print("| run | peak RSS GiB | peak - baseline GiB | (peak - baseline) / largest fp32 tensor | wall s |")
    print("|---|---|---|---|---|")
    for label, rss, wall in rows:
        extra = rss - baseline
        print(f"| {label} | {rss:.2f} | {extra:.2f} | {extra * gib / (numel[largest] * 4):.2f} | {wall:.1f} |")


if __name__ == "__main__":
    main()
