"""``deepspeed-ext from-hf`` on a block-FP8 Hugging Face checkpoint at Llama-3-8B's shapes, against ``cp -r``.

Generates once (cached under --workdir) an HF checkpoint in the block-FP8 format of the FP8 releases
(``quantization_config``: ``quant_method: fp8``, ``fmt: e4m3``, ``activation_scheme: dynamic``,
``weight_block_size: [128, 128]``): every linear weight of the decoder layers (q/k/v/o_proj, gate/up/down_proj)
as ``float8_e4m3fn`` with a float32 ``<name>_scale_inv`` of one value per 128x128 tile beside it; embeddings,
norms and the untied lm_head in bf16. Shapes are Llama-3-8B's (hidden 4096, intermediate 14336, 32 / 8 heads,
vocab 128256) with --layers decoder layers; values are random (FP8 bytes drawn without the NaN patterns 0x7f /
0xff, positive random scales), written with ``safetensors.torch.save_file`` in shards of --max-shard-size with a
``model.safetensors.index.json``. ``open_checkpoint(SRC).summary()`` must report the quantization.

Then ``--rounds`` rounds, the order alternating each round, of ``deepspeed-ext from-hf SRC -o OUT -q`` and
``cp -r SRC DST``, each with its input read into the page cache first (warm) and its output deleted before it;
wall time includes the final ``sync`` and peak RSS comes from ``/usr/bin/time -v`` (both ``convert.timed``).
"above import" is the peak less that of ``python -c "import deepspeed_ext.cli, torch"``. from-hf writes fp32
masters for the dequantized weights (4 bytes for each FP8 byte), so the output is larger than the input: rates
are given per byte read (the source's size) and per byte written (the output's size), and against cp's bytes
per second (cp reads and writes the same bytes).

    python bench/fp8_from_hf.py                        # 4 layers: 3.0 GB of FP8 + bf16 (generation ~1 min)
    python bench/fp8_from_hf.py --layers 8 --rounds 5  # twice the decoder bytes
    python bench/fp8_from_hf.py --clean                # delete the generated checkpoint at the end
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import du, timed, warm  # noqa: E402
from maxtext_rss import peak_rss  # noqa: E402
from synth_checkpoint import SHAPES, llama_config_dict  # noqa: E402

QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [128, 128]}
BLOCK = 128
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
COMMANDS = ("deepspeed-ext from-hf", "cp -r")
GB = 1e9
GIB = 2**30

#: (name, shape, dtype) of one tensor of the checkpoint.
Spec = tuple[str, tuple[int, ...], torch.dtype]


def fp8_config(shapes: str, layers: int) -> dict[str, Any]:
    return {**llama_config_dict({**SHAPES[shapes], "num_hidden_layers": layers}),
            "torch_dtype": "bfloat16", "quantization_config": QUANTIZATION_CONFIG}


def tensor_specs(config: dict[str, Any]) -> list[Spec]:
    """(name, shape, dtype) of every tensor of the FP8 checkpoint, in file order."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden), "self_attn.v_proj": (kv, hidden),
              "self_attn.o_proj": (hidden, q), "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
              "mlp.down_proj": (hidden, inter)}
    specs: list[Spec] = [("model.embed_tokens.weight", (vocab, hidden), torch.bfloat16)]
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        for linear in LINEARS:
            rows, cols = shapes[linear]
            specs.append((f"{prefix}{linear}.weight", (rows, cols), torch.float8_e4m3fn))
            specs.append((f"{prefix}{linear}.weight_scale_inv", (-(-rows // BLOCK), -(-cols // BLOCK)),
                          torch.float32))
        specs.append((f"{prefix}input_layernorm.weight", (hidden,), torch.bfloat16))
        specs.append((f"{prefix}post_attention_layernorm.weight", (hidden,), torch.bfloat16))
    specs.append(("model.norm.weight", (hidden,), torch.bfloat16))
    specs.append(("lm_head.weight", (vocab, hidden), torch.bfloat16))
    return specs


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return int(torch.Size(shape).numel()) * dtype.itemsize


def random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    if name.endswith("_blocks"):  # MXFP4: two E2M1 values a byte, every nibble a finite value
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
    if name.endswith("_scales"):  # MXFP4: E8M0 exponents near 2^-5 (255 is NaN)
        return torch.randint(118, 127, shape, dtype=torch.uint8, generator=generator)
    if dtype == torch.float8_e4m3fn:
        # Bytes 0..253 with 127..253 moved up one: every byte but 0x7f and 0xff (e4m3fn's NaNs), so all finite.
        raw = torch.randint(0, 254, shape, dtype=torch.uint8, generator=generator)
        raw += raw >= 127
        return raw.view(torch.float8_e4m3fn)
    if name.endswith("_scale_inv"):
        return torch.rand(shape, generator=generator) * 1e-3 + 1e-5
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    return torch.empty(shape, dtype=dtype).normal_(0.0, 0.02, generator=generator)


def generate(config: dict[str, Any], out: Path, max_shard_size: int, specs: list[Spec] | None = None) -> None:
    """The checkpoint of ``specs`` (by default the FP8 one of ``config``) in shards of at most ``max_shard_size``
    bytes (a tensor never straddles two), one shard in memory at a time."""
    from safetensors.torch import save_file
    shards: list[list[Spec]] = [[]]
    size = 0
    for spec in (tensor_specs(config) if specs is None else specs):
        if shards[-1] and size + nbytes(*spec[1:]) > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes(*spec[1:])
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    total = 0
    for index, specs in enumerate(shards, 1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: random_tensor(name, shape, dtype, generator) for name, shape, dtype in specs}
        save_file(tensors, str(partial / file), metadata={"format": "pt"})
        for name, tensor in tensors.items():
            weight_map[name] = file
            total += tensor.numel() * tensor.element_size()
        del tensors
    (partial / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    partial.rename(out)


def cached_source(args: argparse.Namespace) -> Path:
    src = Path(args.workdir) / f"hf_fp8_{args.shapes}_l{args.layers}"
    if not (src / "model.safetensors.index.json").is_file():
        need = sum(nbytes(shape, dtype) for _, shape, dtype in tensor_specs(fp8_config(args.shapes, args.layers)))
        free = shutil.disk_usage(Path(args.workdir).parent if not Path(args.workdir).exists() else args.workdir).free
        # The source, cp's copy of it and from-hf's output (up to 4x the FP8 bytes, 2x the bf16 ones in fp32).
        if free < 7 * need:
            raise SystemExit(f"{free / GB:.0f} GB free; the source, its copy and from-hf's output need up to "
                             f"{7 * need / GB:.0f} GB")
        print(f"generating {src} ({need / GB:.2f} GB) ...", flush=True)
        start = time.perf_counter()
        generate(fp8_config(args.shapes, args.layers), src, int(args.max_shard_size * GB))
        print(f"generated in {time.perf_counter() - start:.0f} s", flush=True)
    return src


def check_quantization(src: Path) -> str:
    """``open_checkpoint(src).summary()`` reads the block-FP8 format: its quantization line."""
    from deepspeed_ext.api import open_checkpoint
    summary = open_checkpoint(src).summary()
    if "quantization" not in summary:
        raise SystemExit(f"open_checkpoint({src}).summary() reports no quantization: {summary}")
    return str(summary["quantization"])


def measure(args: argparse.Namespace, src: Path) -> dict[str, list[dict[str, float]]]:
    out = Path(args.workdir) / "fp8_from_hf_out"
    commands = {"deepspeed-ext from-hf": [sys.executable, "-m", "deepspeed_ext", "from-hf", str(src), "-o", str(out),
                                          "-q"],
                "cp -r": ["cp", "-r", str(src), str(out)]}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in commands}
    for round_ in range(args.rounds):
        for name in (COMMANDS if round_ % 2 == 0 else reversed(COMMANDS)):
            shutil.rmtree(out, ignore_errors=True)
            warm(src)
            result = timed(commands[name], cold=None)
            result["output"] = du(out)
            runs[name].append(result)
            print(f"round {round_ + 1}: {name}: {result['wall']:.1f} s, peak RSS {result['rss']:.2f} GiB, "
                  f"output {result['output'] / GB:.2f} GB", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    return runs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", choices=sorted(SHAPES), default="llama3-8b", help="tensor shapes (small: a quick try)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-shard-size", type=float, default=5.0, help="GB per safetensors shard of the source")
    p.add_argument("--workdir", default="/tmp/deepspeed_ext_bench")
    p.add_argument("--save", help="also write the results to this JSON file")
    p.add_argument("--clean", action="store_true", help="delete the generated checkpoint at the end")
    args = p.parse_args()
    src = cached_source(args)
    quantization = check_quantization(src)
    specs = tensor_specs(fp8_config(args.shapes, args.layers))
    size = du(src)
    fp8 = sum(nbytes(shape, dtype) for _, shape, dtype in specs if dtype == torch.float8_e4m3fn)
    largest_fp8 = max(int(torch.Size(shape).numel()) for _, shape, dtype in specs if dtype == torch.float8_e4m3fn)
    largest_name, largest_shape, largest_dtype = max(specs, key=lambda s: int(torch.Size(s[1]).numel()))
    shards = len(set(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"].values()))
    baselines = [peak_rss([sys.executable, "-c", "import deepspeed_ext.cli, torch"])[0] for _ in range(3)]
    baseline = statistics.median(baselines)
    runs = measure(args, src)
    if args.clean:
        shutil.rmtree(src)

    med = {name: {key: statistics.median(r[key] for r in results) for key in results[0]}
           for name, results in runs.items()}
    cp_rate = size / med["cp -r"]["wall"]
    print(f"\nsource: {src} ({size / GB:.3f} GB in {shards} shard(s); "
          f"{args.shapes} shapes, {args.layers} layers; FP8 weights {fp8 / GB:.3f} GB, bf16 + scales "
          f"{(size - fp8) / GB:.3f} GB)")
    print(f"open_checkpoint(...).summary()['quantization']: {quantization}")
    print(f"largest FP8 weight: {largest_fp8 / 1e6:.1f}M elements = {largest_fp8 * 4 / GIB:.3f} GiB in fp32; "
          f"largest tensor: {largest_name} {list(largest_shape)} {str(largest_dtype).replace('torch.', '')} = "
          f"{nbytes(largest_shape, largest_dtype) / GIB:.3f} GiB")
    print(f"import-only peak RSS (python -c 'import deepspeed_ext.cli, torch'): {baseline:.2f} GiB "
          f"(runs: {', '.join(f'{b:.2f}' for b in baselines)})")
    print(f"medians of {args.rounds} rounds, input warm in the page cache, wall time includes the final sync\n")
    print("| command | wall s (median) | wall s (min-max) | peak RSS GiB | above import GiB | read GB | written GB | "
          "read GB/s | written GB/s | written B/s vs cp's B/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    results = {}
    for name in COMMANDS:
        m, walls = med[name], [r["wall"] for r in runs[name]]
        read_rate, write_rate = size / m["wall"], m["output"] / m["wall"]
        results[name] = {**m, "walls": walls, "input": size, "read_rate": read_rate, "write_rate": write_rate,
                         "write_rate_vs_cp": write_rate / cp_rate, "rss_above_import": m["rss"] - baseline}
        above = f"{m['rss'] - baseline:.2f}" if name != "cp -r" else ""  # cp imports nothing
        print(f"| {name} | {m['wall']:.2f} | {min(walls):.2f}-{max(walls):.2f} | {m['rss']:.2f} | "
              f"{above} | {size / GB:.3f} | {m['output'] / GB:.3f} | {read_rate / GB:.2f} | "
              f"{write_rate / GB:.2f} | {write_rate / cp_rate:.2f} |")
    ours = med["deepspeed-ext from-hf"]
    print(f"\nfrom-hf: output / input {ours['output'] / size:.2f}; "
          f"wall x cp -r {ours['wall'] / med['cp -r']['wall']:.2f}; "
          f"read B/s vs cp {size / ours['wall'] / cp_rate:.2f}")
    if args.save:
        Path(args.save).write_text(json.dumps({"source_bytes": size, "fp8_bytes": fp8, "baseline_rss_gib": baseline,
                                               "quantization": quantization, "results": results}, indent=2))


if __name__ == "__main__":
    main()
