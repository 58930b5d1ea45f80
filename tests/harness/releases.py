"""Tiny checkpoints written the way releases ship them: block FP8 (DeepSeek-V3), MXFP4 (gpt-oss), multimodal
Gemma 3, and DeepSeek-V3's multi-token-prediction layer.

The FP8 files are quantized by transformers' own FP8 quantizer (``Fp8Quantize``) where a weight is whole tiles,
and, where ``edge_tiles`` asks, DeepSeek-style with partial tiles at the edges (transformers' quantizer leaves
those weights unquantized). The MXFP4 files hold the experts as gpt-oss's release does (transposed, blocks of 32
along the input features), their bytes from deepspeed-ext's MXFP4 rule.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from deepspeed_ext.checkpoint import quantization
from deepspeed_ext.checkpoint.model_config import is_quantizable_linear
from harness.hf import save_pretrained as save


def _edit(directory: Path, edit) -> None:
    """Rewrite every safetensors file of ``directory`` through ``edit(tensors) -> tensors``, and the index."""
    files = sorted(directory.glob("*.safetensors"))
    weight_map = {}
    for file in files:
        tensors = edit(load_file(file))
        save_file(tensors, file, metadata={"format": "pt"})
        weight_map.update({name: file.name for name in tensors})
    index = directory / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = dict(sorted(weight_map.items()))
        index.write_text(json.dumps(data, indent=2))


def _config(directory: Path, **values: Any) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(values)
    path.write_text(json.dumps(config, indent=2))


def _linear_names(model: torch.nn.Module, directory: Path) -> set[str]:
    """The names ``save_pretrained`` gave in ``directory`` to ``model``'s linear weights (those transformers'
    quantizer replaces: ``nn.Linear``, and grouped ones such as DeepSeek-V4's ``o_a_proj``), but the output
    projection and the modules the model keeps out of quantization (``_keep_in_fp32_modules``, as transformers'
    quantizer does). Found by value: some families' files rename them (DeepSeek-V4's ``attn.wq_a``)."""
    kept = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    weights = [module.weight.detach() for name, module in model.named_modules()
               if is_quantizable_linear(module) and not name.startswith("lm_head")
               and not any(name == key or name.endswith("." + key) for key in kept)]
    found = set()
    for file in sorted(directory.glob("*.safetensors")):
        for name, value in load_file(file).items():
            if any(value.shape == weight.shape and torch.equal(value, weight) for weight in weights):
                found.add(name)
    return found


def fp8_tensors(name: str, value: torch.Tensor, block: tuple[int, int], edge_tiles: bool) -> dict[str, torch.Tensor]:
    """One weight as an FP8 checkpoint stores it (transformers' quantizer; edge tiles DeepSeek's way)."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    class _Quantizer:  # what Fp8Quantize reads of transformers' FP8 quantizer
        class quantization_config:  # noqa: N801
            weight_block_size = list(block)
            scale_fmt = None

    rows, cols = value.shape[-2:]
    if rows % block[0] == 0 and cols % block[1] == 0:
        return Fp8Quantize(_Quantizer())._quantize_one(name, value)
    if not edge_tiles:
        return {name: value}
    # Pad to whole tiles with zeros (they do not change a tile's largest value), quantize, cut the padding.
    padded = torch.zeros(math.ceil(rows / block[0]) * block[0], math.ceil(cols / block[1]) * block[1],
                         dtype=value.dtype)
    padded[:rows, :cols] = value
    quantized = Fp8Quantize(_Quantizer())._quantize_one(name, padded)
    return {name: quantized[name][:rows, :cols].contiguous(), name + "_scale_inv": quantized[name + "_scale_inv"]}


def write_fp8(model: torch.nn.Module, directory: Path, block: tuple[int, int] = (16, 16),
              edge_tiles: bool = False) -> Path:
    """``model`` saved as a block-FP8 release: every linear weight but the output projection quantized (the
    experts one by one, as DeepSeek-V3 ships them)."""
    save(model, directory)
    linear = _linear_names(model, directory)
    expert = ".experts."

    def edit(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, value in tensors.items():
            if name in linear or (expert in name and name.endswith(".weight") and value.dim() == 2):
                out.update(fp8_tensors(name, value, block, edge_tiles))
            else:
                out[name] = value
        return out

    _edit(directory, edit)
    _config(directory, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                            "weight_block_size": list(block)})
    return directory


def write_mxfp4(model: torch.nn.Module, directory: Path) -> Path:
    """A gpt-oss ``model`` saved as its release: the experts' ``gate_up_proj`` / ``down_proj`` as MXFP4."""
    save(model, directory)

    def edit(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, value in tensors.items():
            if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                packed = [quantization.quantize_mxfp4(expert) for expert in value.float()]
                out[name + "_blocks"] = torch.stack([blocks for blocks, _ in packed])
                out[name + "_scales"] = torch.stack([scales for _, scales in packed])
            else:
                out[name] = value
        return out

    _edit(directory, edit)
    _config(directory, quantization_config={"quant_method": "mxfp4",
                                            "modules_to_not_convert": list(quantization.GPT_OSS_NOT_CONVERTED)})
    return directory


def gemma3_multimodal(seed: int = 7) -> torch.nn.Module:
    """A tiny Gemma 3 with a vision tower (the tiny text config, a 2-layer SigLIP)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    from deepspeed_ext.demo.models import tiny_config
    text = tiny_config("gemma3")
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=32, patch_size=8)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                          image_token_index=100, boi_token_index=98, eoi_token_index=99)
    torch.manual_seed(seed)
    return Gemma3ForConditionalGeneration(config).eval()


#: The two namings of a multimodal Gemma 3's files, per tensor group.
NAMINGS = {"new": ("model.language_model.", "model.vision_tower.", "model.multi_modal_projector.", "lm_head."),
           "legacy": ("language_model.model.", "vision_tower.", "multi_modal_projector.", "language_model.lm_head.")}


def write_multimodal(model: torch.nn.Module, directory: Path, naming: str) -> Path:
    """``model`` saved with the files in ``naming``: ``new`` (``model.language_model.*``, transformers 5's
    modules) or ``legacy`` (``language_model.model.*``, ``vision_tower.*``, as older releases and transformers
    5.22's own ``save_pretrained`` write)."""
    save(model, directory)

    def rename(name: str) -> str:
        for old, new in zip(NAMINGS["legacy"] if naming == "new" else NAMINGS["new"], NAMINGS[naming]):
            if name.startswith(old):
                return new + name[len(old):]
        return name

    _edit(directory, lambda tensors: {rename(name): value for name, value in tensors.items()})
    return directory


def add_mtp_layer(directory: Path, config: Any, seed: int = 11, block: tuple[int, int] | None = None) -> list[str]:
    """DeepSeek-V3's release layout: a multi-token-prediction layer ``model.layers.<num_hidden_layers>`` (a decoder
    layer plus ``enorm``, ``hnorm``, ``eh_proj`` and a shared head) in the last file, its projections in FP8
    tiles of ``block`` where given; its tensor names."""
    torch.manual_seed(seed)
    layer = config.num_hidden_layers
    hidden, vocab = config.hidden_size, config.vocab_size
    extra = {f"model.layers.{layer}.enorm.weight": torch.ones(hidden),
             f"model.layers.{layer}.hnorm.weight": torch.ones(hidden),
             f"model.layers.{layer}.eh_proj.weight": torch.randn(hidden, 2 * hidden) * 0.02,
             f"model.layers.{layer}.input_layernorm.weight": torch.ones(hidden),
             f"model.layers.{layer}.mlp.gate_proj.weight": torch.randn(config.intermediate_size, hidden) * 0.02,
             f"model.layers.{layer}.shared_head.norm.weight": torch.ones(hidden),
             f"model.layers.{layer}.shared_head.head.weight": torch.randn(vocab, hidden) * 0.02}
    files = sorted(directory.glob("*.safetensors"))
    dtype = next(iter(load_file(files[-1]).values())).dtype
    extra = {name: value.to(dtype) for name, value in extra.items()}
    if block is not None:
        for name in [n for n in extra if n.endswith(("eh_proj.weight", "gate_proj.weight"))]:
            extra.update(fp8_tensors(name, extra.pop(name), block, edge_tiles=True))
    _edit_one(directory, files[-1], extra)
    _config(directory, num_nextn_predict_layers=1)
    return sorted(extra)


def _edit_one(directory: Path, file: Path, extra: dict[str, torch.Tensor]) -> None:
    tensors = load_file(file)
    tensors.update(extra)
    save_file(tensors, file, metadata={"format": "pt"})
    index = directory / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].update({name: file.name for name in extra})
        index.write_text(json.dumps(data, indent=2))
