"""What each family's AutoTP preset splits and what it leaves whole on every TP rank, in bf16 bytes, for the
released model sizes (transformers' default config of the family's model_type, which is a released model's), built
on the meta device (no memory, no download).

    python bench/tp_memory.py [--tp 8] [FAMILY ...]

Whole: the parameters every rank holds in full (embedding, routers, fused experts, attention a preset cannot split,
norms). Split: the parameters cut over the ranks; a rank holds 1/TP of them. Docs: docs/model-families.md.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def split_patterns(family: str) -> list[tuple[re.Pattern[str], bool]]:
    """(pattern, split?) of the family's preset, in order (the first that matches a weight decides)."""
    from deepspeed_ext import tensor_parallel_preset
    from deepspeed_ext.checkpoint.families import get_family
    from deepspeed_ext.presets import _transformers_tp_plan, partition_config_from_tp_plan
    preset = tensor_parallel_preset(family) or partition_config_from_tp_plan(  # AutoTP's default: the model's plan
        _transformers_tp_plan(get_family(family).model_type) or {})
    specs = preset["partition_config"]["layer_specs"]
    return [(re.compile(pattern), spec["partition_type"] in ("column", "row"))
            for spec in specs for pattern in spec["patterns"]]


def sizes(family: str) -> tuple[int, int, list[str]]:
    """(whole bytes, split bytes, the largest whole tensors' patterns) in bf16, at the release's size."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from deepspeed_ext.checkpoint.families import get_family
    config = AutoConfig.for_model(get_family(family).model_type)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    patterns = split_patterns(family)
    whole = split = 0
    whole_by: dict[str, int] = {}
    for name, param in model.named_parameters():
        size = 2 * param.numel()
        # A weight's bias follows it; gated-DeltaNet layers are split by deepspeed-ext itself, all but their norm.
        weight = re.sub(r"\.bias$", ".weight", name)
        is_split = next((s for p, s in patterns if p.match(weight)), False) or (
            ".linear_attn." in name and not name.endswith(".norm.weight"))
        if is_split:
            split += size
        else:
            whole += size
            key = re.sub(r"\.\d+\.", ".*.", name)
            whole_by[key] = whole_by.get(key, 0) + size
    largest = sorted(whole_by, key=whole_by.__getitem__, reverse=True)[:3]
    return whole, split, [f"{k} {whole_by[k] / 2**30:.1f}" for k in largest]


def main() -> None:
    from deepspeed_ext.checkpoint.families import family_names
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("families", nargs="*")
    args = parser.parse_args()
    print(f"| family | whole on every rank (GiB, bf16) | split (GiB) | per rank at TP={args.tp} (GiB) | largest whole |")
    print("|---|---|---|---|---|")
    for family in args.families or family_names():
        whole, split, largest = sizes(family)
        print(f"| `{family}` | {whole / 2**30:.1f} | {split / 2**30:.1f} | {(whole + split / args.tp) / 2**30:.1f} | "
              f"{'; '.join(largest)} |", flush=True)


if __name__ == "__main__":
    main()
