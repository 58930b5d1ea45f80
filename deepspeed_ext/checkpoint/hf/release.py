"""Writing into a release's layout (`--like DIR`): its naming, its config, and the tensors the source model lacks
(a vision tower, a multi-token-prediction layer), copied from it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from deepspeed_ext.checkpoint.hf.files import CONFIG_FILE, FileTensor
from deepspeed_ext.checkpoint.hf.options import HFOptions
from deepspeed_ext.checkpoint.hf.quantized import QuantizedPiece
from deepspeed_ext.checkpoint.hf.reader import HFCheckpoint
from deepspeed_ext.checkpoint.model_config import output_dtype, torch_dtype
from deepspeed_ext.checkpoint.source import (
    CheckpointSource,
)
from deepspeed_ext.checkpoint.tensor import MASTER_WEIGHTS, LogicalTensor
from deepspeed_ext.errors import CheckpointError
from deepspeed_ext.module_inject.layout import TPLayout


def like_source(source: CheckpointSource, options: HFOptions) -> HFCheckpoint | None:
    """The release whose layout to write into: ``like``, or an HF source that keeps its set-aside tensors."""
    if options.like is not None:
        like = Path(options.like)
        if not (like / CONFIG_FILE).is_file():
            raise CheckpointError(f"{like}: no {CONFIG_FILE} (--like expects the HF directory of the original "
                                  "release)")
        return HFCheckpoint(like, mtp="keep")
    if isinstance(source, HFCheckpoint) and source.kept:
        return source
    return None


def like_layout(like: HFCheckpoint, params: list[LogicalTensor],
                 pieces: dict[str, list[FileTensor | QuantizedPiece]], dtype: str, label: str) -> list[LogicalTensor]:
    """Name the pieces as ``like`` stores its text model, check they are the tensors it has, and add its tensors
    the model lacks (read from it, in their own dtype unless ``dtype`` says otherwise)."""
    from deepspeed_ext.checkpoint.model_config import shapes_mismatch
    detail = shapes_mismatch(like.shapes, {t.name: tuple(t.shape) for t in params}, "the release has")
    if detail is not None:
        raise CheckpointError(f"{like.path}: not the model of {label} (--like): the source's parameters against "
                              f"the release's: {detail}")
    if like.multimodal is not None or like.release_names:  # its multimodal naming, its own spelling (DeepSeek-V4)
        for entries in pieces.values():
            for i, entry in enumerate(entries):
                assert isinstance(entry, FileTensor)
                if like.multimodal is not None:
                    name = like.multimodal.stored_name(entry.name)
                else:  # a whole tensor under the name the release gives it (of the names transformers reads)
                    name = (entry.expert is None and like.whole_name(entry.param)) or entry.name
                entries[i] = FileTensor(like.release_names.get(name, name), entry.param, entry.shape, entry.dtype,
                                        entry.expert, entry.piece, entry.pieces)
    extra_tensors = []
    for name in like.set_aside:
        shape, code = like.stored_headers[name]
        tensor_dtype = output_dtype(dtype, torch_dtype(code))
        extra_tensors.append(LogicalTensor(name=name, shape=shape, layout=TPLayout.replicated(shape, 1),
                                           states=(MASTER_WEIGHTS, ), loader=_set_aside_loader(like, name),
                                           dtype=tensor_dtype))
        pieces[name] = [FileTensor(name, name, shape, tensor_dtype)]
    return extra_tensors


def _set_aside_loader(like: HFCheckpoint, name: str) -> Callable[[str], torch.Tensor]:
    return lambda state: like.read_stored_tensor(name)
