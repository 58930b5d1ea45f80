"""Converting 70B-1T checkpoints, on paper and on sparse files: what ``from-hf`` of a DeepSeek-V3 / Kimi-K2 FP8
release and ``to-universal`` of a 70B / 405B DeepSpeed checkpoint would take, from the rates measured at the margin
(``bench/marginal.py --save``) and the peak RSS measured here on a sparse release of the real shapes.

**Sparse release** (``--run``): a block-FP8 release in DeepSeek-V3's format (its tensor names, ``float8_e4m3fn``
linear weights with float32 ``weight_scale_inv`` per 128x128 tile, bf16 embeddings, norms and router) at the real
shapes of DeepSeek-V3 or Kimi-K2 (embedding and head of the full vocabulary, the largest tensors; dense layers of
intermediate 18432; experts of 2048 and the shared expert), with ``--dense-layers`` dense and ``--moe-layers`` MoE
layers of ``--experts`` routed experts each, written as safetensors files whose data are holes (``ftruncate``: no
disk, reads give zeros, which are valid FP8 and scales). Every tensor of the real model has the shape of one of
these, so the memory a conversion needs here is what it needs at full size: the command's peak RSS is measured on
two sizes (``--experts`` and 4x as many) and printed with what the full model would take.

**On paper**: the full models' tensors are counted from the same shape rules (the MTP layer left out), and the time
is the bytes each conversion writes over the rate it wrote at the margin here, per core (``--rates``: rows of
``bench/marginal.py --save``), on one host of this machine's speed and on N.

    python bench/at_scale.py --run --model kimi-k2          # the sparse run (writes about 11 GB of output)
    python bench/at_scale.py --run --model llama-70b --dense-command to-universal
    python bench/at_scale.py --run --model llama-405b --dense-command to-hf
    python bench/at_scale.py --rates /tmp/marg.json          # the table from measured rates
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import du, timed  # noqa: E402

GB = 1e9
TILE = 128
#: The release's config values (HF config.json, the MTP layer aside); Kimi-K2's config names DeepSeek-V3's model.
MODELS = {
    "deepseek-v3": {"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
                    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
                    "num_hidden_layers": 61, "first_k_dense_replace": 3, "num_attention_heads": 128,
                    "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                    "qk_rope_head_dim": 64, "v_head_dim": 128, "num_experts_per_tok": 8, "n_group": 8,
                    "topk_group": 4, "routed_scaling_factor": 2.5},
    "kimi-k2": {"vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
                "n_routed_experts": 384, "n_shared_experts": 1, "num_hidden_layers": 61, "first_k_dense_replace": 1,
                "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
                "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "num_experts_per_tok": 8,
                "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827},
}
#: Dense models for to-universal on paper (Llama 3.1's shapes).
DENSE = {"llama-70b": {"vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672, "layers": 80,
                       "heads": 64, "kv_heads": 8},
         "llama-405b": {"vocab_size": 128256, "hidden_size": 16384, "intermediate_size": 53248, "layers": 126,
                        "heads": 128, "kv_heads": 8}}

Tensor = tuple[str, tuple[int, ...], str]  # name, shape, safetensors dtype code


def release_tensors(c: dict, dense_layers: int, moe_layers: int, experts: int) -> list[Tensor]:
    """The tensors of a DeepSeek-V3-format FP8 release with these layer and expert counts."""
    h = c["hidden_size"]
    heads, nope, rope, v = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    out: list[Tensor] = [("model.embed_tokens.weight", (c["vocab_size"], h), "BF16")]

    def linear(name: str, rows: int, cols: int) -> None:
        out.append((f"{name}.weight", (rows, cols), "F8_E4M3"))
        out.append((f"{name}.weight_scale_inv", (-(-rows // TILE), -(-cols // TILE)), "F32"))

    def mlp(prefix: str, inter: int) -> None:
        linear(f"{prefix}.gate_proj", inter, h)
        linear(f"{prefix}.up_proj", inter, h)
        linear(f"{prefix}.down_proj", h, inter)

    for layer in range(dense_layers + moe_layers):
        p = f"model.layers.{layer}"
        linear(f"{p}.self_attn.q_a_proj", c["q_lora_rank"], h)
        out.append((f"{p}.self_attn.q_a_layernorm.weight", (c["q_lora_rank"], ), "BF16"))
        linear(f"{p}.self_attn.q_b_proj", heads * (nope + rope), c["q_lora_rank"])
        linear(f"{p}.self_attn.kv_a_proj_with_mqa", c["kv_lora_rank"] + rope, h)
        out.append((f"{p}.self_attn.kv_a_layernorm.weight", (c["kv_lora_rank"], ), "BF16"))
        linear(f"{p}.self_attn.kv_b_proj", heads * (nope + v), c["kv_lora_rank"])
        linear(f"{p}.self_attn.o_proj", h, heads * v)
        out.append((f"{p}.input_layernorm.weight", (h, ), "BF16"))
        out.append((f"{p}.post_attention_layernorm.weight", (h, ), "BF16"))
        if layer < dense_layers:
            mlp(f"{p}.mlp", c["intermediate_size"])
            continue
        out.append((f"{p}.mlp.gate.weight", (experts, h), "BF16"))
        out.append((f"{p}.mlp.gate.e_score_correction_bias", (experts, ), "F32"))
        for expert in range(experts):
            mlp(f"{p}.mlp.experts.{expert}", c["moe_intermediate_size"])
        mlp(f"{p}.mlp.shared_experts", c["moe_intermediate_size"] * c["n_shared_experts"])
    out.append(("model.norm.weight", (h, ), "BF16"))
    out.append(("lm_head.weight", (c["vocab_size"], h), "BF16"))
    return out


ITEM = {"BF16": 2, "F32": 4, "F8_E4M3": 1}


def nbytes(tensor: Tensor) -> int:
    return math.prod(tensor[1]) * ITEM[tensor[2]]


def config_json(name: str, dense_layers: int, moe_layers: int, experts: int) -> dict:
    c = MODELS[name]
    return {**c, "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "torch_dtype": "bfloat16",
            "num_hidden_layers": dense_layers + moe_layers, "first_k_dense_replace": dense_layers,
            "n_routed_experts": experts, "num_experts_per_tok": min(c["num_experts_per_tok"], experts),
            "n_group": 1, "topk_group": 1, "tie_word_embeddings": False, "max_position_embeddings": 4096,
            "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu",
            "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [TILE, TILE]}}


def write_sparse(directory: Path, tensors: list[Tensor], config: dict, shard_bytes: int = 5 * 10**9) -> None:
    """The release as safetensors shards whose data are holes (ftruncate), an index and config.json."""
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    shards: list[list[Tensor]] = [[]]
    for tensor in tensors:
        if shards[-1] and sum(map(nbytes, shards[-1])) + nbytes(tensor) > shard_bytes:
            shards.append([])
        shards[-1].append(tensor)
    weight_map = {}
    for index, shard in enumerate(shards, 1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for tensor in shard:
            name, shape, code = tensor
            header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes(tensor)]}
            offset += nbytes(tensor)
            weight_map[name] = file
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        with open(partial / file, "wb") as handle:
            handle.write(struct.pack("<Q", len(text)) + text)
            handle.truncate(8 + len(text) + offset)
    total = sum(map(nbytes, tensors))
    (partial / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                      "weight_map": weight_map}))
    (partial / "config.json").write_text(json.dumps(config, indent=1))
    partial.rename(directory)


def run(args: argparse.Namespace) -> None:
    """from-hf on the sparse release with --experts and 4x as many: peak RSS, wall, bytes written."""
    for experts in (args.experts, 4 * args.experts):
        tensors = release_tensors(MODELS[args.model], args.dense_layers, args.moe_layers, experts)
        src = Path(args.workdir) / f"sparse_{args.model}_d{args.dense_layers}_m{args.moe_layers}_e{experts}"
        if not src.is_dir():
            write_sparse(src, tensors, config_json(args.model, args.dense_layers, args.moe_layers, experts))
        out = Path(args.workdir) / "at_scale_out"
        shutil.rmtree(out, ignore_errors=True)
        result = timed([sys.executable, "-m", "deepspeed_ext", "from-hf", str(src), "-o", str(out), "-q"], cold=None)
        largest = max(tensors, key=nbytes)
        print(f"{args.model}: {args.dense_layers} dense + {args.moe_layers} MoE layers of {experts} experts, "
              f"{sum(math.prod(t[1]) for t in tensors) / 1e9:.2f}B parameters, {sum(map(nbytes, tensors)) / GB:.2f} "
              f"GB (sparse; largest tensor {largest[0]} {list(largest[1])} {largest[2]}, {nbytes(largest) / GB:.2f} "
              f"GB): from-hf {result['wall']:.1f} s, peak RSS {result['rss']:.2f} GiB, wrote {du(out) / GB:.2f} GB",
              flush=True)
        shutil.rmtree(out, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(src)


#: The synthetic checkpoint's shapes (bench/synth_checkpoint.py) for each dense model.
SYNTH_SHAPES = {"llama-70b": "llama3-70b", "llama-405b": "llama3-405b"}


def run_dense(args: argparse.Namespace) -> None:
    """``--dense-command`` on a sparse DeepSpeed checkpoint of the model's shapes, one layer: peak RSS, wall, bytes."""
    from synth_checkpoint import SHAPES, llama_config_dict, make_plan, write_checkpoint
    plan = make_plan(llama_config_dict(SHAPES[SYNTH_SHAPES[args.model]]), tp=2)
    params = sum(p.layout.numel for p in plan.params)
    src = Path(args.workdir) / f"sparse_{args.model}_l1"
    if not src.is_dir():
        staging = src.with_name(src.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        write_checkpoint(plan, staging, sparse=True, log=False)
        staging.rename(src)
    out = Path(args.workdir) / "at_scale_out"
    shutil.rmtree(out, ignore_errors=True)
    need = params * (12 if args.dense_command == "to-universal" else 2)
    free = shutil.disk_usage(args.workdir).free
    if need > free:
        raise SystemExit(f"{args.dense_command} of {params / 1e9:.2f}B parameters writes {need / GB:.0f} GB; "
                         f"{free / GB:.0f} GB free")
    largest = max(plan.params, key=lambda p: p.layout.numel)
    result = timed([sys.executable, "-m", "deepspeed_ext", args.dense_command, str(src), "-o", str(out), "-q"],
                   cold=None)
    print(f"{args.model}: 1 layer, {params / 1e9:.2f}B parameters, TP=2 ZeRO-1 bf16 + Adam, "
          f"{du_apparent(src) / GB:.1f} GB (sparse; largest tensor {largest.name} {list(largest.layout.shape)}, "
          f"{largest.layout.numel * 4 / GB:.2f} GB a state in fp32): {args.dense_command} {result['wall']:.1f} s, "
          f"peak RSS {result['rss']:.2f} GiB, wrote {du(out) / GB:.2f} GB", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(src)


def du_apparent(path: Path) -> int:
    """The bytes the files under ``path`` hold, holes included."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def full_sizes() -> dict[str, dict[str, float]]:
    """Parameters, input and output bytes of each conversion at full size."""
    sizes = {}
    for name, c in MODELS.items():
        tensors = release_tensors(c, c["first_k_dense_replace"], c["num_hidden_layers"] - c["first_k_dense_replace"],
                                  c["n_routed_experts"])
        params = sum(math.prod(t[1]) for t in tensors if not t[0].endswith("_scale_inv"))
        # from-hf writes FP8 weights dequantized to fp32 (transformers' dtype for them), the rest as stored
        written = sum(math.prod(t[1]) * (4 if t[2] == "F8_E4M3" else ITEM[t[2]]) for t in tensors
                      if not t[0].endswith("_scale_inv"))
        sizes[f"{name} FP8 release -> from-hf"] = {"params": params, "read": sum(map(nbytes, tensors)),
                                                   "written": written, "workload": "from-hf fp8"}
    for name, c in DENSE.items():
        h, kv = c["hidden_size"], c["kv_heads"] * c["hidden_size"] // c["heads"]
        layer = 2 * h * h + 2 * h * kv + 3 * h * c["intermediate_size"] + 2 * h
        params = c["layers"] * layer + 2 * c["vocab_size"] * h + h
        # a ZeRO bf16 checkpoint with Adam: bf16 weights + fp32 masters and two moments; to-universal writes the fp32
        sizes[f"{name} DeepSpeed ZeRO bf16 -> to-universal"] = {"params": params, "read": 14 * params,
                                                               "written": 12 * params, "workload": "to-universal"}
    return sizes


def table(args: argparse.Namespace) -> None:
    rows = json.loads(Path(args.rates).read_text()) if args.rates else []
    rates = {(r["workload"], r["cache"]): r["extra_bytes_written"] / statistics.median(r["extra_s"]["command"])
             for r in rows}
    print("| conversion | parameters | read | written | rate here (GB/s written, measured) | one host like this one "
          "(computed) | 16 hosts, --distributed (computed) |")
    print("|---|---|---|---|---|---|---|")
    for name, size in full_sizes().items():
        rate = rates.get((size["workload"], "cold")) or rates.get((size["workload"], "warm"))
        timing = (f"{rate / GB:.2f} | {size['written'] / rate / 3600:.1f} h | {size['written'] / rate / 16 / 3600:.2f} h"
                  if rate else "n/a | n/a | n/a")
        print(f"| {name} | {size['params'] / 1e9:.0f}B | {size['read'] / 1e12:.2f} TB | {size['written'] / 1e12:.2f} "
              f"TB | {timing} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="store_true", help="convert a sparse release of the real shapes")
    p.add_argument("--model", choices=sorted(MODELS) + sorted(DENSE), default="kimi-k2")
    p.add_argument("--dense-command", choices=["to-universal", "to-hf"], default="to-universal",
                   help="what converts a dense model's sparse DeepSpeed checkpoint")
    p.add_argument("--dense-layers", type=int, default=1)
    p.add_argument("--moe-layers", type=int, default=1)
    p.add_argument("--experts", type=int, default=4, help="routed experts per MoE layer (the second run: 4x)")
    p.add_argument("--keep", action="store_true", help="keep the sparse releases")
    p.add_argument("--rates", help="bench/marginal.py --save output: the measured rates")
    p.add_argument("--workdir", default="/tmp/deepspeed_ext_bench")
    args = p.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    if args.run:
        run_dense(args) if args.model in DENSE else run(args)
    table(args)


if __name__ == "__main__":
    main()
