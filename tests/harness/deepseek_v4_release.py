"""A tiny DeepSeek-V4 written the way DeepSeek's release ships it, as transformers 5.22 reads it (its conversion
mapping for ``deepseek_v4`` and its FP8 quantizer's loading path):

* names without ``model.``: ``embed.weight``, ``layers.<i>.attn.wq_a.weight``, ``layers.<i>.ffn.experts.<e>.w1.weight``,
  ``layers.<i>.attn.kv_norm.weight``, ``norm.weight``, ``hc_head_fn``, ``head.weight``;
* the linear weights block FP8 with power-of-two scales (``scale_fmt: ue8m0``, E8M0 bytes) named ``x.scale`` beside
  ``x.weight``, quantized by transformers' own quantizer (``Fp8Quantize``); the compressor and indexer projections
  the model keeps out of quantization (``_keep_in_fp32_modules``) and the output projection unquantized;
* the routed experts FP4 (``expert_dtype: fp4``): two E2M1 values a byte (the low nibble first) in ``int8``
  ``[rows, columns / 2]``, one E8M0 scale per 32 values of a row in ``x.scale``; quantized here by DeepSeek's rule
  as its inference kernels state it (``scale = 2 ** ceil(log2(amax / 6))``, the nearest E2M1 value, a tie to the
  even one), written independently of deepspeed-ext's quantizer (transformers has no FP4 quantizer, only the
  dequantization);
* a multi-token-prediction layer under ``mtp.0.`` (which transformers ignores on load): a representative few of
  its tensors, quantized as the decoder's are.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from deepspeed_ext.checkpoint.model_config import is_quantizable_linear
from harness.hf import save_pretrained as save

#: save_pretrained's names -> the release's (transformers' conversion mapping reads both).
_RENAMED = (("model.embed_tokens.weight", "embed.weight"), ("model.norm.weight", "norm.weight"),
            ("model.hc_head.hc_", "hc_head_"), ("model.layers.", "layers."))


def _release_name(name: str) -> str:
    # The attention's key/value norm as DeepSeek's code names it (save_pretrained writes attn.norm, the compressors'
    # spelling; transformers reads both).
    name = name.replace(".attn.norm.weight", ".attn.kv_norm.weight")
    for saved, release in _RENAMED:
        if name.startswith(saved):
            return release + name[len(saved):]
    return name


def _fp8(name: str, value: torch.Tensor, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """``x.weight`` as the release stores it: FP8 and its E8M0 block scales as ``x.scale`` (transformers'
    quantizer, ``scale_fmt: ue8m0``); unquantized where the weight is not whole tiles, as that quantizer does."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    class _Quantizer:  # what Fp8Quantize reads of transformers' FP8 quantizer
        class quantization_config:  # noqa: N801
            weight_block_size = list(block)
            scale_fmt = "ue8m0"

    quantized = Fp8Quantize(_Quantizer())._quantize_one(name, value)
    scales = quantized.pop(name[:-len(".weight")] + ".weight_scale_inv", None)
    return {**quantized, **({} if scales is None else {name[:-len(".weight")] + ".scale": scales})}


#: E2M1's magnitudes by code (the sign is bit 3).
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def fp4_reference(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``value [rows, columns]`` as DeepSeek's FP4 (see the module's text) -> (packed ``int8 [rows, columns / 2]``,
    E8M0 scales ``[rows, columns / 32]``); an all-zero block gets scale 1."""
    rows, cols = value.shape
    x = value.float().reshape(rows, cols // 32, 32)
    amax = x.abs().amax(dim=-1, keepdim=True)
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6)), torch.zeros_like(amax))
    scaled = (x / torch.exp2(exponent)).clamp(-6, 6)
    distance = (scaled.abs().unsqueeze(-1) - _E2M1).abs()
    code = distance.argmin(dim=-1)  # the first of two equally near values: the lower one ...
    upper = code.clamp(max=6) + 1
    tie = (code < 7) & (distance.gather(-1, upper.unsqueeze(-1)).squeeze(-1) == distance.min(dim=-1).values)
    code = torch.where(tie & (code % 2 == 1), upper, code)  # ... unless its code is odd
    code = (code | (torch.signbit(scaled).long() << 3)).reshape(rows, cols)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, (exponent.squeeze(-1) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _fp4(name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """An expert's ``x.weight [rows, columns]`` as FP4, its scales as ``x.scale``."""
    packed, scales = fp4_reference(value)
    return {name: packed, name[:-len(".weight")] + ".scale": scales}


def _quantized_names(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> set[str]:
    """The files' names of the linear weights the release quantizes FP8 (found by value, as the files rename
    them): every linear transformers' quantizer replaces (the grouped ``wo_a`` too) but the output projection
    and the modules kept out of quantization."""
    kept = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    weights = [module.weight.detach() for name, module in model.named_modules()
               if is_quantizable_linear(module) and not name.startswith("lm_head")
               and not any(name == key or name.endswith("." + key) for key in kept)]
    return {name for name, value in tensors.items()
            if any(value.shape == weight.shape and torch.equal(value, weight) for weight in weights)}


def _mtp_layer(config, seed: int) -> dict[str, torch.Tensor]:
    """A representative few tensors of a multi-token-prediction layer (unquantized; the caller quantizes)."""
    generator = torch.Generator().manual_seed(seed)
    hidden, inner = config.hidden_size, config.moe_intermediate_size
    return {"mtp.0.enorm.weight": torch.ones(hidden), "mtp.0.hnorm.weight": torch.ones(hidden),
            "mtp.0.e_proj.weight": torch.randn(hidden, hidden, generator=generator) * 0.02,
            "mtp.0.attn.wq_a.weight": torch.randn(config.q_lora_rank, hidden, generator=generator) * 0.02,
            "mtp.0.ffn.experts.0.w1.weight": torch.randn(inner, hidden, generator=generator) * 0.02,
            "mtp.0.norm.weight": torch.ones(hidden)}


def write_release(model: torch.nn.Module, directory: Path, block: tuple[int, int] = (16, 16),
                  mtp: bool = True, seed: int = 11) -> Path:
    """``model`` (a DeepSeek-V4) saved as DeepSeek's release is (see the module's text), in one file."""
    save(model, directory)
    files = sorted(directory.glob("*.safetensors"))
    tensors = {name: value for file in files for name, value in load_file(file).items()}
    for file in files:
        file.unlink()
    (directory / "model.safetensors.index.json").unlink()
    dense = _quantized_names(model, tensors)
    dtype = next(iter(tensors.values())).dtype
    if mtp:
        tensors.update((name, value.to(dtype)) for name, value in _mtp_layer(model.config, seed).items())
        dense |= {"mtp.0.e_proj.weight", "mtp.0.attn.wq_a.weight"}
    out: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        release = _release_name(name)
        if ".experts." in name and name.endswith(".weight") and value.dim() == 2:
            out.update(_fp4(release, value))
        elif name in dense:
            out.update(_fp8(release, value, block))
        else:
            out[release] = value
    save_file(dict(sorted(out.items())), directory / "model.safetensors", metadata={"format": "pt"})
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config.update(quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                       "weight_block_size": list(block), "scale_fmt": "ue8m0"},
                  expert_dtype="fp4", num_nextn_predict_layers=1 if mtp else 0)
    config_path.write_text(json.dumps(config, indent=2))
    return directory
