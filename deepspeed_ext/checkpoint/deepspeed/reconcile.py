"""What a DeepSpeed tag's files say about its shape, reconciled before any tensor is read: the TP and DP degrees
(from the files present and what the model states record), that every rank's model states come from one save,
each parameter's TP layout (ours, upstream's, or TP=1) against the shapes every rank saved, and the persistent
buffers every rank must hold alike.

Each disagreement is refused in one line naming the file that disagrees; the reader
(:class:`~deepspeed_ext.checkpoint.deepspeed.reader.DeepSpeedCheckpoint`) only asks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from deepspeed_ext.checkpoint.deepspeed import keys
from deepspeed_ext.errors import CheckpointError, MissingMetadataError
from deepspeed_ext.module_inject.layout import TPLayout
from deepspeed_ext.module_inject.upstream import layouts_from_universal_checkpoint_info

if TYPE_CHECKING:
    from deepspeed_ext.checkpoint.deepspeed.files import TagFiles
    from deepspeed_ext.checkpoint.metadata import UCInfo


def recorded_degree(states: Mapping[str, Any], key: str, path: Path) -> int | None:
    """``mp_world_size`` or ``dp_world_size`` as ``path`` records it; None where it records none."""
    recorded = states.get(key)
    if recorded is None:
        return None
    try:
        degree = int(recorded)
    except (TypeError, ValueError):
        raise CheckpointError(f"{path}: {key} is {recorded!r}, not a number") from None
    if degree < 1:
        raise CheckpointError(f"{path}: {key} is {recorded!r}, not a positive number")
    return degree


def degrees(files: TagFiles, first: Mapping[str, Any], reference: Path) -> tuple[int, int]:
    """The TP and DP degrees: from the files present (one model-states file per TP rank, one optimizer file per
    (TP, DP) rank under ZeRO, ZeRO-3's model states per (TP, DP) rank too), checked against what TP rank 0's model
    states record (:meth:`TagFiles.degrees`); a record that is missing is filled from the files. Without per-DP
    files (ZeRO-0) nothing but ``dp_world_size`` says the DP degree (1 without it)."""
    recorded_tp = recorded_degree(first, keys.MP_WORLD_SIZE, reference)
    recorded_dp = recorded_degree(first, keys.DP_WORLD_SIZE, reference)
    tp, dp = files.degrees(recorded_tp, recorded_dp, reference)
    return tp, dp if dp is not None else recorded_dp or 1


def pipeline_degree(first: Mapping[str, Any], reference: Path, mp_degree: int) -> int:
    """The pipeline-parallel degree ``checkpoint_parallel_dimensions`` records (1 where it records none), checked
    against the model-parallel files present: a pipeline engine writes one model-states file per stage and TP rank."""
    dims = first.get(keys.CHECKPOINT_PARALLEL_DIMS) or {}
    try:
        pp = int(dims.get(keys.CHECKPOINT_PP_DEGREE, 1) or 1)
    except (TypeError, ValueError, AttributeError):
        raise CheckpointError(f"{reference}: checkpoint_parallel_dimensions is {dims!r}, not numbers") from None
    if pp < 1 or mp_degree % pp:
        raise CheckpointError(f"{reference}: checkpoint_parallel_dimensions says PP={pp}, but there are model-states "
                              f"files for {mp_degree} model-parallel ranks, not a multiple of it")
    return pp


def check_model_states_agree(model_files: Mapping[int, Path], model_states: Callable[[int], Mapping[str, Any]],
                             tp_degree: int, dp_degree: int) -> None:
    """Every TP rank's model states must come from the same save: same step, same TP and DP degrees (where
    recorded: as TP rank 0's records them, else as the files present say)."""
    reference = model_files[0]
    first = model_states(0)
    expected_step = first.get(keys.GLOBAL_STEPS)
    for tp, path in sorted(model_files.items()):
        if tp == 0:
            continue
        states = model_states(tp)
        if states.get(keys.GLOBAL_STEPS) != expected_step:
            raise CheckpointError(f"{path}: saved at global step {states.get(keys.GLOBAL_STEPS)}, but "
                                  f"{reference.name} at step {expected_step}: files of two checkpoints are mixed")
        for key, what, degree in ((keys.MP_WORLD_SIZE, "TP", tp_degree), (keys.DP_WORLD_SIZE, "DP", dp_degree)):
            says = recorded_degree(states, key, path)
            if says is None or says == degree:
                continue
            if first.get(key) is not None:
                raise CheckpointError(f"{path}: says {what}={says}, but {reference.name} says {what}={degree}")
            raise CheckpointError(f"{path}: says {what}={says}, but the files present say {what}={degree} (and "
                                  f"{reference.name} records none)")


def layouts(uc_info: UCInfo | None, upstream_info: Mapping[str, Any] | None,
            saved_shapes: Mapping[str, Sequence[tuple[int, ...] | None]], tp_degree: int,
            model_files: Mapping[int, Path], tag_dir: Path, buffers: Mapping[str, torch.Tensor],
            how_to_get_metadata: str, pp_degree: int = 1) -> dict[str, TPLayout]:
    """Every parameter's TP layout: ours (``uc_info``) if saved, else rebuilt from upstream's
    ``universal_checkpoint_info``, else replicated at TP=1; each checked against the shape every TP rank saved
    (``saved_shapes``: None where a rank saved none, which its layout must give an empty shard). The persistent
    ``buffers`` follow the parameters, held whole on every TP rank."""
    if uc_info is not None:
        found = uc_info.layouts
        if uc_info.tp_size != tp_degree:
            raise CheckpointError(f"{tag_dir}: deepspeed_ext.json describes TP={uc_info.tp_size}, "
                                  f"model states say TP={tp_degree}")
    elif upstream_info:
        found = layouts_from_universal_checkpoint_info(upstream_info, saved_shapes, source=str(model_files[0]))
    elif tp_degree == 1:
        found = {name: TPLayout.replicated(shapes[0], 1) for name, shapes in saved_shapes.items()
                 if shapes[0] is not None}
    elif pp_degree > 1:
        # A pipeline's model-parallel ranks hold slices of each layer (Megatron-style layers) or copies of it (plain
        # layers, as upstream's own TP x PP test saves): the shapes do not tell which, and concatenating copies
        # (what upstream's converter does) doubles the tensor.
        raise MissingMetadataError(
            f"{model_files[0]}: PP={pp_degree} x TP={tp_degree} pipeline checkpoint has no tensor-parallel metadata, "
            f"so nothing says whether its {tp_degree} model-parallel ranks hold slices or copies of each layer; "
            f"train the pipeline at TP=1, or {how_to_get_metadata} (copies of plain layers are then read once, "
            "checked equal)")
    else:
        raise MissingMetadataError(
            f"{model_files[0]}: TP={tp_degree} checkpoint has no tensor-parallel metadata (neither "
            f"deepspeed_ext.json nor universal_checkpoint_info), so its slices cannot be merged; "
            f"{how_to_get_metadata}")
    for name, shapes in saved_shapes.items():
        layout = found.get(name)
        if layout is None:
            raise MissingMetadataError(f"{tag_dir}: no TP layout for parameter {name!r}")
        for tp, shape in enumerate(shapes):
            expected = layout.local_shape(tp)
            if shape is None and math.prod(expected) != 0:
                raise CheckpointError(f"{model_files[tp]}: parameter {name!r} is missing, but its layout "
                                      f"({layout.describe()}) gives TP rank {tp} a shard of {expected}")
            if shape is not None and expected != shape:
                raise CheckpointError(f"{model_files[tp]}: parameter {name!r} has shape {shape} but its "
                                      f"layout ({layout.describe()}) expects {expected}")
    params = {name: found[name] for name in saved_shapes}
    return {**params, **{name: TPLayout.replicated(tuple(buffer.shape), tp_degree) for name, buffer in buffers.items()}}


def buffers(model_states: Sequence[Mapping[str, Any]], model_files: Mapping[int, Path]) -> dict[str, torch.Tensor]:
    """The model's persistent buffers (floating-point, or integer as DeepSeek-V4's hash-routing table), from TP rank
    0's module state dict (its ``buffer_names``), refused where another TP rank's copy differs."""
    module = model_states[0].get(keys.MODULE) or {}
    names = model_states[0].get(keys.BUFFER_NAMES) or []
    found = {name: module[name] for name in names if torch.is_tensor(module.get(name)) and module[name].numel()}
    for tp in range(1, len(model_states)):
        other = model_states[tp].get(keys.MODULE) or {}
        for name, buffer in found.items():
            if not torch.is_tensor(other.get(name)) or not torch.equal(other[name], buffer):
                raise CheckpointError(f"{model_files[tp]}: buffer {name!r} differs from TP rank 0's")
    return found
