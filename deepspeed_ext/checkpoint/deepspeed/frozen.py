"""The frozen parameters of a DeepSpeed tag: weights no optimizer holds (``requires_grad=False``: a LoRA model's
base, a frozen embedding or tower), which are in no optimizer file but are the model's all the same.

Where DeepSpeed keeps them (0.19.8):

* ZeRO-0/1/2: in each model-parallel rank's model states, ``module`` (the module's state dict, every parameter
  in its low precision), beside the trainable ones. ZeRO-2 also fills ``frozen_param_fragments`` with the same
  tensors; ZeRO-1 leaves it None.
* a pipeline engine (ZeRO-1): no ``module``; each layer's state dict in ``layer_<index>-model_<TP rank>-model_states
  .pt``, its parameters named ``<index>.<name in the layer>`` in the engine.
* ZeRO-3: ``module`` holds placeholders; each (TP, DP) rank's model states hold ``frozen_param_shapes`` (the TP-local
  shape) and ``frozen_param_fragments`` (that DP rank's flat partition, padded to an equal size on every rank).

They are read as the low-precision tensors DeepSpeed saved, each TP rank's slice from the files that hold it,
memory-mapped; their TP layout is the one deepspeed-ext recorded (it tags every parameter), else the one
upstream's ``universal_checkpoint_info`` gives, else one tensor held alike by every TP rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from deepspeed_ext.checkpoint import serialization
from deepspeed_ext.checkpoint.deepspeed import keys
from deepspeed_ext.errors import CheckpointError, LayoutError, MissingMetadataError
from deepspeed_ext.module_inject.layout import TPLayout
from deepspeed_ext.module_inject.upstream import layouts_from_universal_checkpoint_info

#: ``read(tp, low, high)``: elements ``[low, high)`` of TP rank ``tp``'s slice of one frozen parameter, flattened.
SliceReader = Callable[[int, int, int], torch.Tensor]


@dataclass
class FrozenWeights:
    """The frozen parameters of a tag: each one's TP layout, dtype and a reader of each TP rank's slice."""

    layouts: dict[str, TPLayout] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    readers: dict[str, SliceReader] = field(default_factory=dict)

    def __contains__(self, name: object) -> bool:
        return name in self.layouts

    def full_range(self, name: str, low: int, high: int) -> torch.Tensor:
        """Elements ``[low, high)`` of the full tensor, flattened, in the saved dtype (a view into the memory-mapped
        file where one piece holds them). A replicated tensor is checked to be the same on every TP rank."""
        layout, read = self.layouts[name], self.readers[name]
        if layout.is_replicated:
            block = read(0, low, high)
            for tp in range(1, layout.tp_size):
                if not torch.equal(read(tp, low, high), block):
                    raise LayoutError(f"replicated tensor differs between TP rank 0 and TP rank {tp}")
            return block
        return layout.reshard_range(TPLayout.replicated(layout.shape, 1), 0, low, high, read)

    def resharded_range(self, name: str, target: TPLayout, rank: int, low: int, high: int) -> torch.Tensor:
        """Elements ``[low, high)`` of rank ``rank``'s shard under ``target``, flattened, in the saved dtype."""
        return self.layouts[name].reshard_range(target, rank, low, high, self.readers[name])


def find_frozen(model_states: Callable[[int], Mapping[str, Any]], grid_states: Callable[[int, int], Mapping[str, Any]],
                model_files: Callable[[int], Path], mp_degree: int, tp_degree: int, dp_degree: int,
                partitioned: bool, trainable: set[str], recorded: Mapping[str, TPLayout] | None,
                upstream_info: Mapping[str, Any] | None, tag_dir: Path | None = None,
                recorded_frozen: Sequence[str] | None = None) -> FrozenWeights:
    """The frozen parameters of a tag: what its model states hold of the module beyond the ``trainable`` names
    (every parameter an optimizer partition holds), its buffers and second names of one tensor (a tied weight).
    ``model_states(mp)``: a model-parallel rank's model states (ZeRO-3: its DP rank 0's); ``grid_states(tp, dp)``:
    ZeRO-3's per-rank ones. Pipeline stages hold their own layers: each parameter is read from the first stage
    that holds it."""
    found = FrozenWeights()
    if recorded_frozen is not None and not recorded_frozen:
        return found  # the engine that saved it froze nothing
    stages = mp_degree // tp_degree
    if not partitioned and tag_dir is not None and model_states(0).get(keys.MODULE) is None:
        layers = _layer_modules(tag_dir, tp_degree)
        if layers is not None:  # a pipeline engine's layer files stand for the module of every stage
            model_states, stages, mp_degree = (lambda tp: {keys.MODULE: layers[tp]}), 1, tp_degree
    shapes: dict[str, list[tuple[int, ...]]] = {}
    for stage in range(stages):
        per_tp = [_frozen_shapes(model_states(stage * tp_degree + tp), partitioned, trainable, recorded_frozen)
                  for tp in range(tp_degree)]
        for name, (shape, dtype) in per_tp[0].items():
            if name in shapes:
                continue
            missing = next((tp for tp in range(tp_degree) if name not in per_tp[tp]), None)
            if missing is not None:
                raise CheckpointError(f"{model_files(stage * tp_degree + missing)}: frozen parameter {name!r} is "
                                      f"missing (TP rank 0's files hold it)")
            shapes[name] = [per_tp[tp][name][0] for tp in range(tp_degree)]
            found.dtypes[name] = dtype
            found.readers[name] = (_partition_reader(name, shape, grid_states, tp_degree, dp_degree, stage)
                                   if partitioned else _module_reader(name, model_states, stage, tp_degree))
    for name, saved in shapes.items():
        found.layouts[name] = _layout(name, saved, recorded, upstream_info, found.readers[name], model_files(0))
    return found


def _layer_modules(tag_dir: Path, tp_degree: int) -> list[dict[str, torch.Tensor]] | None:
    """Per TP rank, a pipeline engine's module state dict put together from its layer files (memory-mapped),
    under the engine's parameter names; None where the tag has no layer files."""
    files: dict[int, list[tuple[int, Path]]] = {}
    for path in sorted(tag_dir.iterdir()):
        if m := keys.LAYER_MODEL_STATES_RE.match(path.name):
            files.setdefault(int(m.group(2)), []).append((int(m.group(1)), path))
    if not files:
        return None
    modules: list[dict[str, torch.Tensor]] = []
    for tp in range(tp_degree):
        module: dict[str, torch.Tensor] = {}
        for index, path in sorted(files.get(tp, [])):
            state = serialization.load(path)
            if not isinstance(state, dict):
                raise CheckpointError(f"{path}: a layer's state dict is a {type(state).__name__}, not a dict")
            module.update({f"{index}.{key}": value for key, value in state.items()})
        modules.append(module)
    return modules


def _frozen_shapes(states: Mapping[str, Any], partitioned: bool, trainable: set[str],
                   recorded: Sequence[str] | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{name: (TP-local shape, dtype)}`` of the frozen parameters one rank's model states hold: those the saving
    engine recorded (deepspeed-ext's ``frozen_params``), else those ZeRO-2/3 list (``frozen_param_shapes``), else
    what the module holds beyond the trainable parameters and the buffers, a second name of a trainable tensor
    left out (the same storage, or the same values in the same shape: AutoEP's router under two names)."""
    if recorded is not None:
        wanted = set(recorded)
        if partitioned:
            return {name: value for name, value in _frozen_shapes(states, True, trainable).items() if name in wanted}
        module = states.get(keys.MODULE) or {}
        return {name: (tuple(module[name].shape), module[name].dtype) for name in recorded
                if torch.is_tensor(module.get(name)) and name not in trainable}  # held by an optimizer: trained
    if partitioned:
        shapes = states.get(keys.FROZEN_PARAM_SHAPES) or {}
        fragments = states.get(keys.FROZEN_PARAM_FRAGMENTS) or {}
        return {name: (tuple(int(n) for n in shape), fragments[name].dtype) for name, shape in shapes.items()
                if name in fragments and torch.is_tensor(fragments[name]) and name not in trainable}
    module = states.get(keys.MODULE) or {}
    buffers = set(states.get(keys.BUFFER_NAMES) or [])
    seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = set()
    for name, value in module.items():  # a tensor under two names (a tied weight) is one parameter
        if name in trainable and torch.is_tensor(value):
            seen.add(_identity(value))
    listed = states.get(keys.FROZEN_PARAM_SHAPES)  # ZeRO-2 names them (ZeRO-1 leaves it None)
    held = [value for name, value in module.items() if name in trainable and torch.is_tensor(value)]
    found = {}
    for name, value in module.items():
        if (name in trainable or name in buffers or not torch.is_tensor(value) or not value.is_floating_point()
                or _identity(value) in seen or (listed is not None and name not in listed)):
            continue
        if listed is None and any(other.shape == value.shape and other.dtype == value.dtype
                                  and torch.equal(other, value) for other in held):
            continue  # a second name of a trainable tensor, saved as a copy
        seen.add(_identity(value))
        found[name] = (tuple(value.shape), value.dtype)
    return found


def _identity(tensor: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    """What makes two saved tensors one: the same bytes of the same storage, seen the same way."""
    return (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()), tuple(tensor.shape),
            tuple(tensor.stride()))


def _module_reader(name: str, model_states: Callable[[int], Mapping[str, Any]], stage: int,
                   tp_degree: int) -> SliceReader:
    def read(tp: int, low: int, high: int) -> torch.Tensor:
        tensor: torch.Tensor = model_states(stage * tp_degree + tp)[keys.MODULE][name]
        return tensor.reshape(-1)[low:high]
    return read


def _partition_reader(name: str, shape: tuple[int, ...], grid_states: Callable[[int, int], Mapping[str, Any]],
                      tp_degree: int, dp_degree: int, stage: int) -> SliceReader:
    """ZeRO-3: a TP rank's slice is its DP ranks' fragments one after another (rank ``d`` holds elements
    ``[d * size, (d + 1) * size)``, the last ones padded past the end)."""
    numel = math.prod(shape)

    def fragment(tp: int, dp: int) -> torch.Tensor:
        tensor: torch.Tensor = grid_states(stage * tp_degree + tp, dp)[keys.FROZEN_PARAM_FRAGMENTS][name]
        return tensor.reshape(-1)

    def read(tp: int, low: int, high: int) -> torch.Tensor:
        size = fragment(tp, 0).numel()
        if size * dp_degree < numel:
            raise LayoutError(f"frozen parameter {name!r}: {dp_degree} DP fragments of {size} elements cannot hold "
                              f"its {numel}")
        pieces = [fragment(tp, dp)[max(low - dp * size, 0):min(high - dp * size, size)]
                  for dp in range(low // size if size else 0, min(dp_degree, -(-high // size) if size else 0))]
        if not pieces:
            return fragment(tp, 0)[:0]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return read


def _layout(name: str, saved: Sequence[tuple[int, ...]], recorded: Mapping[str, TPLayout] | None,
            upstream_info: Mapping[str, Any] | None, read: SliceReader, reference: Path) -> TPLayout:
    """A frozen parameter's TP layout, checked against the shape each TP rank saved."""
    tp_degree = len(saved)
    if recorded is not None and name in recorded:
        layout = recorded[name]
    elif tp_degree == 1 or _held_alike(saved, read):
        layout = TPLayout.replicated(saved[0], tp_degree)
    elif upstream_info:
        layout = layouts_from_universal_checkpoint_info(upstream_info, {name: list(saved)}, str(reference))[name]
    else:
        raise MissingMetadataError(f"{reference}: frozen parameter {name!r} differs between the TP ranks and the "
                                   "checkpoint has no tensor-parallel metadata to merge its slices by")
    for tp, shape in enumerate(saved):
        if layout.local_shape(tp) != shape:
            raise CheckpointError(f"{reference}: frozen parameter {name!r} has shape {shape} on TP rank {tp} but its "
                                  f"layout ({layout.describe()}) expects {layout.local_shape(tp)}")
    return layout


def _held_alike(saved: Sequence[tuple[int, ...]], read: SliceReader) -> bool:
    """Whether every TP rank holds the same tensor (a frozen embedding AutoTP left whole)."""
    numel = math.prod(saved[0])
    if any(shape != saved[0] for shape in saved):
        return False
    first = read(0, 0, numel)
    return all(torch.equal(read(tp, 0, numel), first) for tp in range(1, len(saved)))
