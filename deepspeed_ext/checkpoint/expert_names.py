"""The model's own parameter names for a checkpoint DeepSpeed AutoEP trained.

AutoEP replaces each MoE block's experts and router by its own modules, so its checkpoints name them its way.
Every AutoEP preset deepspeed-ext serves (mixtral, qwen3_moe, qwen3_5_moe, deepseek_v3) maps them from transformers'
names the same way, one block at a time (``<block>`` is e.g. ``model.layers.3.mlp``), but where a family's block
names things otherwise (its ``Family.autoep_renamed``: Qwen3.5's one ``shared_expert``, MiniMax-M2's router bias
held by the block):

=====================================================  ==================================================
AutoEP                                                  transformers (5.x)
=====================================================  ==================================================
``<block>.router.gate.weight`` ``[E, H]``               ``<block>.gate.weight``
``<block>.router.e_score_correction_bias`` ``[E]``      ``<block>.gate.e_score_correction_bias`` (DeepSeek)
``<block>.experts.w1``, ``.w3`` ``[E, I, H]`` each      ``<block>.experts.gate_up_proj`` ``[E, 2I, H]``: w1 (the
                                                        gate) then w3 (the up projection) along dim 1
``<block>.experts.w2`` ``[E, H, I]``                    ``<block>.experts.down_proj``
=====================================================  ==================================================

:func:`model_named` presents such a checkpoint under transformers' names (the writers of HF and MaxText
checkpoints, and ``verify``'s model check, know the model's names only); the universal form keeps AutoEP's, as
upstream's converter writes it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from deepspeed_ext.checkpoint.fingerprint import Fingerprints
from deepspeed_ext.checkpoint.source import CheckpointSource, Reshards, SourceInfo
from deepspeed_ext.checkpoint.tensor import STEP, LogicalTensor
from deepspeed_ext.errors import CheckpointError
from deepspeed_ext.module_inject.layout import TPLayout

#: ``<block>.<AutoEP suffix>`` <-> ``<block>.<model suffix>``, for the tensors renamed one to one.
_RENAMED = (
    ("router.gate.weight", "gate.weight"),
    ("router.e_score_correction_bias", "gate.e_score_correction_bias"),
    ("experts.w2", "experts.down_proj"),
)
#: The two AutoEP stacks fused into one model tensor along dim 1, in order, and that tensor.
_FUSED_PARTS, _FUSED = ("experts.w1", "experts.w3"), "experts.gate_up_proj"


def _block(name: str, suffix: str) -> str | None:
    """The block ``name`` is ``<block>.<suffix>`` of, or None."""
    return name[:-len(suffix) - 1] if name.endswith("." + suffix) else None


def _renames(model_type: str | None) -> tuple[tuple[str, str], ...]:
    """The one-to-one renames for ``model_type``'s blocks: its family's own first (see
    ``Family.autoep_renamed``), then the default ones (None: every family's own, for names that come from a model,
    which pick the rename that applies to them)."""
    from deepspeed_ext.checkpoint.families import autoep_renamed
    return autoep_renamed(model_type) + _RENAMED


def _model_name(name: str, renames: tuple[tuple[str, str], ...] = _RENAMED) -> tuple[str, int | None]:
    """The model's tensor an AutoEP tensor ``name`` is, and which part of a fused one (None: all of it)."""
    for index, part in enumerate(_FUSED_PARTS):
        if (block := _block(name, part)) is not None:
            return f"{block}.{_FUSED}", index
    for autoep, model in renames:
        if (block := _block(name, autoep)) is not None:
            return f"{block}.{model}", None
    return name, None


def has_autoep_names(names: list[str] | Any) -> bool:
    """Whether these parameter names are AutoEP's (an expert stack ``...experts.w1``)."""
    return any(_block(name, _FUSED_PARTS[0]) is not None for name in names)


def model_named(source: CheckpointSource) -> CheckpointSource:
    """``source`` under the model's own names where it has AutoEP's, else ``source`` itself."""
    if not has_autoep_names(source.info.layouts):
        return source
    return ModelNamedSource(source)


class ModelNamedSource:
    """A source with AutoEP names, seen under the model's (see the module docstring). Reads through to it: a
    fused ``gate_up_proj`` is read as its two stacks, each block from the pieces of both that it spans."""

    def __init__(self, source: CheckpointSource):
        self.source = source
        model_type = (source.info.model_config or {}).get("model_type")
        self._plan = self._planned(list(source.info.layouts), _renames(model_type))

    @staticmethod
    def _planned(names: list[str], renames: tuple[tuple[str, str], ...]) -> dict[str, tuple[str, ...]]:
        """The model's name -> the source names it is made of, in the source's order (a fused tensor's parts in
        their order along dim 1)."""
        parts: dict[str, dict[int, str]] = {}
        for name in names:
            model, part = _model_name(name, renames)
            parts.setdefault(model, {})[part or 0] = name
        for model, found in parts.items():
            if model.endswith("." + _FUSED) and len(found) != len(_FUSED_PARTS):
                raise CheckpointError(f"AutoEP expert stack {next(iter(found.values()))!r} has no "
                                      f"{' / '.join(_FUSED_PARTS)} partner beside it to fuse into {model!r}")
        return {model: tuple(found[index] for index in sorted(found)) for model, found in parts.items()}

    # ------------------------------------------------------------------ the source interface
    @cached_property
    def info(self) -> SourceInfo:
        info = self.source.info
        layouts: dict[str, TPLayout] = {}
        for name, parts in self._plan.items():
            first = info.layouts[parts[0]]
            if len(parts) == 1:
                layouts[name] = first
            else:  # the fused tensor, whole: how AutoEP had it split says nothing about it any more
                shape = (first.shape[0], sum(info.layouts[p].shape[1] for p in parts), *first.shape[2:])
                layouts[name] = TPLayout.replicated(shape, 1)
        fingerprints = info.fingerprints
        if fingerprints is not None:  # renamed ones keep theirs; a fused tensor has none of its own
            fingerprints = replace(fingerprints, tensors={name: fingerprints.tensors[parts[0]]
                                                           for name, parts in self._plan.items()
                                                           if len(parts) == 1 and parts[0] in fingerprints.tensors})
        return replace(info, layouts=layouts, fingerprints=fingerprints)

    @property
    def read_paths(self) -> list[Path]:
        return self.source.read_paths

    def summary(self) -> dict[str, Any]:
        return self.source.summary()

    def raise_if_damaged(self) -> None:
        self.source.raise_if_damaged()

    def tensors(self) -> Iterator[LogicalTensor]:
        owner = {part: name for name, parts in self._plan.items() for part in parts}
        pending: dict[str, LogicalTensor] = {}
        for tensor in self.source.tensors():
            name = owner.get(tensor.name, tensor.name)
            parts = self._plan.get(name, (tensor.name, ))
            pending[tensor.name] = tensor
            if any(part not in pending for part in parts):
                continue  # the fused tensor's other stack comes later
            found = [pending.pop(part) for part in parts]
            yield replace(found[0], name=name) if len(found) == 1 else _fused(name, found)
        if pending:
            raise CheckpointError(f"{self.source.info.path}: AutoEP tensors left unpaired: {sorted(pending)[:3]}")


def _fused(name: str, parts: list[LogicalTensor]) -> LogicalTensor:
    """``gate_up_proj``: the stacks ``parts`` ([E, I_k, ...] each) concatenated along dim 1."""
    experts, rest = parts[0].shape[0], parts[0].shape[2:]
    widths = [part.shape[1] for part in parts]
    shape = (experts, sum(widths), *rest)
    inner = math.prod(rest)
    per_expert = [width * inner for width in widths]  # elements of each part per expert
    expert_size = sum(per_expert)

    def loader(state: str) -> torch.Tensor | int:
        if state == STEP:
            return parts[0].load(state)
        return torch.cat([part.load_tensor(state) for part in parts], dim=1)

    def range_loader(state: str, low: int, high: int) -> torch.Tensor:
        pieces = []
        position = low
        while position < high:
            expert, offset = divmod(position, expert_size)
            start = 0
            for part, size in zip(parts, per_expert, strict=True):
                if offset < start + size:
                    first = expert * size + offset - start
                    count = min(high - position, start + size - offset)
                    pieces.append(_range(part, state, first, first + count))
                    position += count
                    break
                start += size
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    return LogicalTensor(name=name, shape=shape, layout=TPLayout.replicated(shape, 1), states=parts[0].states,
                         loader=loader, dtype=parts[0].dtype, range_loader=range_loader)


def _range(part: LogicalTensor, state: str, low: int, high: int) -> torch.Tensor:
    if part.range_loader is not None:
        return part.range_loader(state, low, high).clone()  # the next read may release the pages of this one
    return part.load_tensor(state).reshape(-1)[low:high]


# --------------------------------------------------------------------------- the other way: AutoEP's names
def autoep_name_map(model_names: list[str]) -> dict[str, tuple[str, int | None]]:
    """For a checkpoint under the model's names: AutoEP name -> (the model's tensor, which half of its dim 1 it is,
    None: all of it). Only MoE blocks (those with ``experts.gate_up_proj``) are renamed; every other name is its
    own."""
    blocks = {block for name in model_names if (block := _block(name, _FUSED)) is not None}
    mapped: dict[str, tuple[str, int | None]] = {}
    renames = _renames(None)
    for name in model_names:
        if (block := _block(name, _FUSED)) is not None:
            mapped.update({f"{block}.{part}": (name, index) for index, part in enumerate(_FUSED_PARTS)})
            continue
        renamed = next((f"{block}.{autoep}" for autoep, model in renames
                        if (block := _block(name, model)) is not None and block in blocks), name)
        mapped[renamed] = (name, None)
    return mapped


class AutoEPNamed:
    """A checkpoint under the model's names (``from-hf`` / ``from-maxtext`` output) read by an AutoEP engine under
    AutoEP's: ``w1`` / ``w3`` are the halves of ``gate_up_proj``'s dim 1, the rest renamed one to one. Serves the
    restore (``resharded_range`` on each EP rank's experts), reading only those rows."""

    def __init__(self, source: Reshards):
        self.source = source
        self._map = autoep_name_map(list(source.names))

    # What is not per parameter: the source's own.
    @property
    def path(self) -> Path:
        return self.source.path

    @property
    def has_optimizer_states(self) -> bool:
        return self.source.has_optimizer_states

    @property
    def model_states(self) -> dict[str, Any]:
        return self.source.model_states

    def optimizer_state_for_universal(self) -> dict[str, Any]:
        return self.source.optimizer_state_for_universal()

    @property
    def names(self) -> list[str]:
        return list(self._map)

    def has(self, name: str, state: str) -> bool:
        return name in self._map and bool(self.source.has(self._map[name][0], state))

    def step(self, name: str) -> torch.Tensor | int | None:
        return self.source.step(self._map[name][0])

    def scalar(self, name: str, state: str) -> torch.Tensor | int:
        return self.source.scalar(self._map[name][0], state)

    def states_of(self, name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return self.source.states_of(self._map[name][0])

    def resharded(self, name: str, state: str, target: TPLayout, rank: int) -> torch.Tensor:
        shape = target.local_shape(rank)
        return self.resharded_range(name, state, target, rank, 0, math.prod(shape)).reshape(shape)

    def resharded_range(self, name: str, state: str, target: TPLayout, rank: int, low: int,
                        high: int) -> torch.Tensor:
        model_name, half = self._map[name]
        if half is None:
            return self.source.resharded_range(model_name, state, target, rank, low, high)
        # The fused tensor cut the way ``target`` cuts the stack (dim 0, the experts), both halves of dim 1.
        rows = target.shape[1]
        fused = replace(target, shape=(target.shape[0], 2 * rows, *target.shape[2:]))
        inner = math.prod(target.shape[2:])
        half_size = rows * inner  # one expert's elements of this half
        pieces, position = [], low
        while position < high:
            expert, offset = divmod(position, half_size)
            count = min(high - position, half_size - offset)
            first = expert * 2 * half_size + half * half_size + offset
            pieces.append(self.source.resharded_range(model_name, state, fused, rank, first, first + count))
            position += count
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def autoep_named(source: Reshards, engine_names: list[str]) -> Reshards:
    """``source`` as an AutoEP engine with ``engine_names`` asks for it: itself when it already has AutoEP's names
    (a checkpoint AutoEP trained), else :class:`AutoEPNamed` when it has the model's."""
    if not has_autoep_names(engine_names) or has_autoep_names(list(source.names)):
        return source
    return AutoEPNamed(source)


def model_named_fingerprints(fingerprints: Fingerprints, model_type: str | None = None) -> Fingerprints:
    """Fingerprints under AutoEP's names, under the model's (``model_type``'s): renamed one to one, and ``w1`` +
    ``w3`` added up into ``gate_up_proj`` (a fingerprint's count and sums add over the pieces of a tensor)."""
    from deepspeed_ext.checkpoint.fingerprint import Fingerprint
    tensors: dict[str, dict[str, Fingerprint]] = {}
    renames = _renames(model_type)
    for name, states in fingerprints.tensors.items():
        model, part = _model_name(name, renames)
        if part is None:
            tensors[model] = dict(states)
            continue
        fused = tensors.setdefault(model, {})
        for state, print_ in states.items():
            before = fused.get(state, Fingerprint(0, 0.0, 0.0))
            fused[state] = Fingerprint(before.numel + print_.numel, before.total + print_.total,
                                       before.total_sq + print_.total_sq)
    return replace(fingerprints, tensors=tensors)
