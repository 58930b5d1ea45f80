"""A generated gpt-oss release at gpt-oss-20b's shapes (hidden 2880, 32 experts of intermediate 2880, vocab 201088,
64 query / 8 KV heads of 64) with ``--layers`` decoder layers, in the release's format: every expert's
``gate_up_proj`` / ``down_proj`` as MXFP4 (``<name>_blocks``: two E2M1 values a byte, ``[experts, out, in / 32,
16]``; ``<name>_scales``: one E8M0 exponent per 32 values), everything else bf16, ``quantization_config``
``{"quant_method": "mxfp4", ...}``. Names and shapes come from transformers' own ``GptOssForCausalLM`` built on the
meta device (no memory); values are random (every nibble is a finite E2M1 value; exponents 2^-9..2^-1).

    python bench/mxfp4_source.py --layers 2          # prints the path; cached under --workdir
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_from_hf import GB, Spec, generate, nbytes  # noqa: E402

from deepspeed_ext.checkpoint.quantization import MX_BLOCK  # noqa: E402

#: gpt-oss-20b's shapes (transformers' GptOssConfig defaults are the 120b's 128 experts and 36 layers).
GPT_OSS_20B = {"hidden_size": 2880, "intermediate_size": 2880, "num_local_experts": 32, "num_experts_per_tok": 4,
               "vocab_size": 201088, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64}
EXPERT_WEIGHTS = ("experts.gate_up_proj", "experts.down_proj")


def mxfp4_config(layers: int) -> dict[str, Any]:
    from transformers import GptOssConfig

    from deepspeed_ext.checkpoint.quantization import GPT_OSS_NOT_CONVERTED
    config = GptOssConfig(num_hidden_layers=layers, **GPT_OSS_20B).to_dict()
    config["torch_dtype"] = "bfloat16"
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": list(GPT_OSS_NOT_CONVERTED)}
    return config


def mxfp4_specs(config: dict[str, Any]) -> list[Spec]:
    """(name, shape, dtype) of every tensor the release stores, from the model transformers builds."""
    from transformers import GptOssConfig, GptOssForCausalLM
    settings = {key: value for key, value in config.items() if key != "quantization_config"}
    with torch.device("meta"):
        model = GptOssForCausalLM(GptOssConfig(**settings))
    specs: list[Spec] = []
    for name, value in model.state_dict().items():
        if name.endswith(EXPERT_WEIGHTS):
            experts, k, n = value.shape  # the model's [experts, in, out]; stored transposed, packed along in
            specs.append((f"{name}_blocks", (experts, n, k // MX_BLOCK, MX_BLOCK // 2), torch.uint8))
            specs.append((f"{name}_scales", (experts, n, k // MX_BLOCK), torch.uint8))
        else:
            specs.append((name, tuple(value.shape), torch.bfloat16))
    return specs


def cached_mxfp4_source(workdir: str, layers: int, max_shard_size: float = 5.0) -> Path:
    src = Path(workdir) / f"hf_mxfp4_gpt-oss-20b_l{layers}"
    if not (src / "model.safetensors.index.json").is_file():
        config = mxfp4_config(layers)
        specs = mxfp4_specs(config)
        print(f"generating {src} ({sum(nbytes(s, d) for _, s, d in specs) / GB:.2f} GB) ...", flush=True)
        start = time.perf_counter()
        generate(config, src, int(max_shard_size * GB), specs)
        print(f"generated in {time.perf_counter() - start:.0f} s", flush=True)
    return src


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--workdir", default="/tmp/deepspeed_ext_bench")
    args = p.parse_args()
    print(cached_mxfp4_source(args.workdir, args.layers))


if __name__ == "__main__":
    main()
