"""Hugging Face checkpoints (sharded safetensors): the sink behind ``to-hf``, the source behind ``from-hf``.

Layout written (what ``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads)::

    OUT/config.json                          the model's HF config (dtype = the weights' dtype)
    OUT/model-0000K-of-0000N.safetensors     the weights, cut at --max-shard-size (one file: model.safetensors)
    OUT/model.safetensors.index.json         {"metadata": {total_parameters, total_size}, "weight_map": ...}

Names: HF names are the model's parameter names, which are the universal names, except where a family
says transformers' files store a fused parameter in pieces (:class:`~deepspeed_ext.checkpoint.families.
ExpertSplit`: Qwen3-MoE's experts one by one). A tied output projection is left out, as
``save_pretrained`` does.

Streaming: the shard plan (names, shapes, dtypes, offsets) is known before any data is read, so every
shard file gets its safetensors header up front and each tensor is written at its offset as the source
produces it, once. The safetensors library serialises only whole in-memory dictionaries, which would hold
a shard (5 GB by default) in memory; the format itself is a length-prefixed JSON header followed by raw
little-endian bytes (https://github.com/huggingface/safetensors#format), and every file written here is
read back by ``safetensors.safe_open`` in the tests. Reading uses ``safe_open`` (memory-mapped, lazy).

One module each: :mod:`.files` (file names, the name map between the model and the files, safetensors
headers), :mod:`.options`, :mod:`.writer` (the sink, through :mod:`~deepspeed_ext.checkpoint.writing`'s flow),
:mod:`.quantized` (block-FP8 / MXFP4 weights written as releases store them), :mod:`.release` (writing into a
release's layout, ``--like``), :mod:`.reader` (the source).
"""

from __future__ import annotations

from deepspeed_ext.checkpoint.hf.files import (
                                               CONFIG_FILE,
                                               GENERATION_CONFIG,
                                               INDEX_FILE,
                                               METADATA_FINGERPRINTS,
                                               MTP_CHOICES,
                                               SINGLE_FILE,
                                               TIED_PAIR,
                                               FileTensor,
                                               companion_files,
                                               file_tensors,
                                               group_file_names,
                                               tokenizer_files,
)
from deepspeed_ext.checkpoint.hf.options import HFOptions
from deepspeed_ext.checkpoint.hf.reader import HFCheckpoint, open_source, parameter_problem
from deepspeed_ext.checkpoint.hf.writer import write

__all__ = ["CONFIG_FILE", "GENERATION_CONFIG", "INDEX_FILE", "METADATA_FINGERPRINTS", "MTP_CHOICES", "SINGLE_FILE",
           "TIED_PAIR", "FileTensor", "HFCheckpoint", "HFOptions", "companion_files", "file_tensors",
           "group_file_names", "open_source", "parameter_problem", "tokenizer_files", "write"]
