"""The universal source: a universal checkpoint read parameter by parameter, whole, in ranges, or resharded to
a live engine's TP layout."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from deepspeed_ext.checkpoint import output, ranges, serialization
from deepspeed_ext.checkpoint.deepspeed import keys
from deepspeed_ext.checkpoint.deepspeed.files import resolve_tag_dir
from deepspeed_ext.checkpoint.locate import LATEST_UNIVERSAL, ZERO_DIR
from deepspeed_ext.checkpoint.metadata import METADATA_FILE as UC_INFO_FILE
from deepspeed_ext.checkpoint.metadata import UCInfo, read_uc_info
from deepspeed_ext.checkpoint.source import CheckpointSource, OpenOptions, SourceInfo, frozen_summary
from deepspeed_ext.checkpoint.states import (
    ADAM_STATES,
    KNOWN_SCALARS,
    MASTER_WEIGHTS,
    MODULE_WEIGHTS,
    STEP,
    has_optimizer,
    optimizer_settings,
    optimizer_states_summary,
    ordered_states,
)
from deepspeed_ext.checkpoint.tensor import LogicalTensor
from deepspeed_ext.checkpoint.universal.files import KNOWN_TENSOR_STATES, OPTIMIZER_STATE_FILE, as_int
from deepspeed_ext.errors import CheckpointError
from deepspeed_ext.module_inject.layout import TPLayout


def open_source(path: Path, options: OpenOptions) -> CheckpointSource:
    """The format registry's reader (:mod:`deepspeed_ext.checkpoint.formats`)."""
    config = dict(options.model_config) if options.model_config is not None else None
    return UniversalCheckpoint(path, options.tag, model_config=config)


class UniversalCheckpoint:
    """A universal checkpoint directory (ours or upstream's), read lazily and memory-mapped."""

    def __init__(self, path: str | Path, tag: str | None = None, model_config: dict[str, Any] | None = None):
        """``model_config``: the HF config to report instead of the one recorded with it (``--config``)."""
        path = Path(path)
        self.given = path
        self._model_config = model_config
        if (path / ZERO_DIR).is_dir() and tag is None:
            self.path = path
        else:
            self.path = resolve_tag_dir(path, tag, latest_file=LATEST_UNIVERSAL)
        self.zero = self.path / ZERO_DIR
        if not self.zero.is_dir():
            raise CheckpointError(f"{self.path}: not a universal checkpoint (no {ZERO_DIR}/ directory)")
        # Per thread: the tensor file it reads in blocks (kept mapped between blocks) and its last block.
        self._reads = threading.local()
        self._refuse_missing_parameters()

    @property
    def read_paths(self) -> list[Path]:
        return output.read_paths(self.path)

    @cached_property
    def names(self) -> list[str]:
        """The parameters under ``zero/``. A directory the checkpoint does not list that holds master weights alone
        is a second name of a listed tensor, not a parameter: upstream writes one for each tensor the module state
        dict holds twice (AutoEP's router, also reachable as ``<block>.gate``)."""
        found = sorted(p.name for p in self.zero.iterdir() if p.is_dir())
        listed, _ = self._listed_names()
        if not listed:
            return found
        listed_set = set(listed)
        return [name for name in found if name in listed_set or has_optimizer(self._state_files(name))]

    def _state_files(self, name: str) -> list[str]:
        """The states ``zero/<name>/`` holds a file of, by name."""
        try:
            return [entry[:-3] for entry in os.listdir(self.zero / name) if entry.endswith(".pt")]
        except OSError:
            return []

    @cached_property
    def param_states(self) -> dict[str, tuple[str, ...]]:
        """Each parameter's states, from the files it has: the master, its optimizer's tensor states, its scalars.
        Upstream's ZeRO-3 output keeps the step only in ``zero/optimizer_state.pt`` (no ``step.pt`` at all): there
        a parameter with optimizer states has that step."""
        files = self._files_by_param
        step_elsewhere = not self._step_files
        found = {}
        for name, states in files.items():
            scalars = [state for state in states if self._is_scalar(name, state)]
            if step_elsewhere and has_optimizer(states) and self.step(name) is not None:
                scalars.append(STEP)
            found[name] = ordered_states([state for state in states if state not in scalars], scalars)
        return found

    @cached_property
    def _scalar_names(self) -> dict[str, bool]:
        return {}

    def _is_scalar(self, name: str, state: str) -> bool:
        """Whether ``state`` is a scalar (a bare value in its file) rather than a tensor (``{'param': ...}``): known
        for the usual names, else told by the first file of that name (the same for every parameter)."""
        if state in KNOWN_SCALARS or state in KNOWN_TENSOR_STATES:
            return state in KNOWN_SCALARS
        if state not in self._scalar_names:
            data = serialization.load(self.file(name, state))
            self._scalar_names[state] = not (torch.is_tensor(data) and data.dim() > 0
                                             or isinstance(data, dict) and keys.PARAM in data)
        return self._scalar_names[state]

    def _refuse_missing_parameters(self) -> None:
        """At opening: refuse a parameter the checkpoint lists but does not hold under ``zero/`` (a conversion
        killed midway, a directory deleted); the list is our UC info's, else the copied model states'."""
        found = set(self.names)
        expected, listed_by = self._listed_names()
        missing = [name for name in expected if name not in found]
        if missing:
            raise CheckpointError(f"{self.zero / missing[0]}: missing ({listed_by} lists {len(missing)} parameter(s) "
                                  f"with no directory under {ZERO_DIR}/, e.g. {missing[:3]})")

    def _listed_names(self) -> tuple[list[str], str]:
        """The parameters the checkpoint says it holds, and the file that says so."""
        if self.uc_info is not None:
            return list(self._recorded_shapes), str(self.path / UC_INFO_FILE)
        if self.model_state_files:
            return list(self._recorded_shapes), str(self.model_state_files[0])
        return [], ""

    @cached_property
    def uc_info(self) -> UCInfo | None:
        return read_uc_info(self.path)

    @cached_property
    def frozen(self) -> frozenset[str]:
        """The frozen parameters our UC info lists: weights only (no moments, no step), as saved."""
        return frozenset(self.uc_info.frozen or ()) if self.uc_info is not None else frozenset()

    def file(self, name: str, state: str) -> Path:
        return self.zero / name / f"{state}.pt"

    def has(self, name: str, state: str = MASTER_WEIGHTS) -> bool:
        return self.file(name, state).is_file()

    def states_of(self, name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """``name``'s tensor states (the master first) and its scalar states."""
        states, scalars = self.param_states[name], self._scalars
        return tuple(s for s in states if s not in scalars), tuple(s for s in states if s in scalars)

    def load(self, name: str, state: str = MASTER_WEIGHTS) -> torch.Tensor:
        """The full tensor of ``name``/``state``, memory-mapped: only pages that are touched get read."""
        path = self.file(name, state)
        data = serialization.load(path)
        tensor = data.get(keys.PARAM) if isinstance(data, dict) else data
        if not torch.is_tensor(tensor):
            raise CheckpointError(f"{path}: no tensor under 'param'")
        shape = self._recorded_shapes.get(name)
        if not isinstance(data, dict) and shape is not None and tuple(tensor.shape) != shape:
            # Upstream's form from ZeRO-3 at TP=1: the bare flat tensor, shaped by what the checkpoint records.
            if tensor.dim() != 1 or tensor.numel() != math.prod(shape):
                raise CheckpointError(f"{path}: {tensor.numel()} elements, but {name!r} is {shape}")
            tensor = tensor.view(shape)
        return tensor

    @cached_property
    def _recorded_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each parameter's full shape as the checkpoint records it: our UC info's, else the copied model
        states' ``param_shapes`` (ZeRO-3 records full shapes there)."""
        if self.uc_info is not None:
            return {name: layout.shape for name, layout in self.uc_info.layouts.items()}
        if not self.model_state_files:
            return {}
        groups = self.model_states.get(keys.PARAM_SHAPES) or []
        return {name: tuple(int(d) for d in shape)
                for group in (groups if isinstance(groups, list) else [groups]) if isinstance(group, dict)
                for name, shape in group.items()}

    def _mapped(self, name: str, state: str) -> torch.Tensor:
        """The memory-mapped full tensor of ``name``/``state``, kept mapped for the blocks that follow (one per
        thread); the pages of this thread's previous block are released from RSS first."""
        reads = self._reads
        previous = getattr(reads, "block", None)
        if previous is not None:
            serialization.release_pages(previous, reads.mappings)
            reads.block = None
        if getattr(reads, "key", None) != (name, state):
            reads.key, reads.tensor, reads.stored = None, None, None  # unmaps (and closes) the previous file
            reads.tensor = self.load(name, state)
            reads.mappings = serialization.file_mappings(self.file(name, state))
            reads.key = (name, state)
        tensor: torch.Tensor = reads.tensor
        return tensor

    def _block(self, block: torch.Tensor) -> torch.Tensor:
        self._reads.block = block  # released at this thread's next read
        return block

    def full_range(self, name: str, state: str, low: int, high: int) -> torch.Tensor:
        """Elements ``[low, high)`` of the full tensor, flattened: a view of the mapped file."""
        return self._block(self._mapped(name, state).reshape(-1)[low:high])

    def _full_for(self, name: str, state: str, target: TPLayout) -> torch.Tensor:
        """The memory-mapped full tensor, checked against the model's shape."""
        full = self._mapped(name, state)
        if tuple(full.shape) != target.shape:
            raise CheckpointError(f"{self.file(name, state)}: shape {tuple(full.shape)} does not match the model's "
                                  f"{name!r} {target.shape}")
        return full

    def resharded(self, name: str, state: str, target: TPLayout, rank: int) -> torch.Tensor:
        """Rank ``rank``'s shard of ``name`` under ``target``: a view of the memory-mapped full tensor
        where the layout allows, so only the shard's pages are read."""
        return target.slice(self._full_for(name, state, target), rank)

    def resharded_range(self, name: str, state: str, target: TPLayout, rank: int, low: int,
                        high: int) -> torch.Tensor:
        """Elements ``[low, high)`` of :meth:`resharded`, flattened, in a new tensor: only the pages that hold
        them are read, with ``pread`` (:mod:`.ranges`: a ZeRO-3 rank's partition of its TP slice, and of a
        row-parallel weight only its part of each row)."""
        full = self._full_for(name, state, target)
        reads = self._reads
        if reads.stored is None:  # once per mapped tensor: where its bytes are, and a descriptor to read them
            reads.stored = ranges.stored(full.reshape(-1))
        here: ranges.Stored = reads.stored
        whole = TPLayout.replicated(target.shape, 1)  # the full tensor: a replicated source of one rank
        return ranges.resharded_range(whole, target, rank, low, high,
                                      lambda _, start, stop: [(here, start, stop - start)])

    def scalar(self, name: str, state: str) -> torch.Tensor | int:
        """A scalar state of ``name`` (the step), from its file."""
        value = self.step(name) if state == STEP else (serialization.load(self.file(name, state))
                                                        if self.has(name, state) else None)
        if value is None:
            raise CheckpointError(f"{self.file(name, state)}: no optimizer {state}")
        found: torch.Tensor | int = value
        return found

    def step(self, name: str) -> torch.Tensor | int | None:
        path = self.file(name, STEP)
        step: torch.Tensor | int | None
        if path.is_file():
            step = serialization.load(path)
            return step
        state = self.optimizer_state
        try:  # ZeRO-3 universal output keeps the step only in optimizer_state.pt
            step = state[keys.OPTIMIZER_STATE_DICT][keys.STATE][0][STEP]
        except (KeyError, TypeError, IndexError):
            return None
        return step

    @cached_property
    def optimizer_state(self) -> dict[str, Any]:
        path = self.zero / OPTIMIZER_STATE_FILE
        state: dict[str, Any] = serialization.load(path) if path.is_file() else {}
        return state

    def optimizer_state_for_universal(self) -> dict[str, Any]:
        return self.optimizer_state

    @cached_property
    def model_state_files(self) -> list[Path]:
        return sorted(p for p in self.path.iterdir()
                      if keys.MODEL_STATES_RE.match(p.name) or keys.ZERO3_MODEL_STATES_RE.match(p.name))

    @cached_property
    def model_states(self) -> dict[str, Any]:
        if not self.model_state_files:
            raise CheckpointError(f"{self.path}: no mp_rank_*_model_states.pt files")
        states: dict[str, Any] = serialization.load(self.model_state_files[0])
        return states

    @cached_property
    def has_optimizer_states(self) -> bool:
        """Whether the checkpoint holds an optimizer's states (a universal checkpoint from HF weights does not)."""
        return any(has_optimizer(states) for states in self.param_states.values())

    def model_dtype(self, name: str) -> torch.dtype:
        """The dtype the source model held ``name`` in: its copied module weights', else the stored tensor's."""
        module = self.model_states.get(keys.MODULE) if self.model_state_files else None
        value = module.get(name) if isinstance(module, dict) else None
        return value.dtype if torch.is_tensor(value) else self.load(name).dtype

    @cached_property
    def layouts(self) -> dict[str, TPLayout]:
        """The source's TP layouts as recorded; a parameter without one (upstream's output) as one tensor."""
        recorded = self.uc_info.layouts if self.uc_info else {}
        return {name: recorded[name] if name in recorded else TPLayout.replicated(tuple(self.load(name).shape), 1)
                for name in self.names}

    @cached_property
    def info(self) -> SourceInfo:
        recorded = self.uc_info
        states = self.model_states if self.model_state_files else {}
        every = {state for states in self.param_states.values() for state in states}
        return SourceInfo(format="universal",
                          given=self.given,
                          path=self.path,
                          layouts=self.layouts,
                          states=ordered_states(every - set(self._scalars), every & set(self._scalars)),
                          global_step=int(states.get(keys.GLOBAL_STEPS) or 0),
                          tp_degree=int(states.get(keys.MP_WORLD_SIZE) or 1),
                          dp_degree=int(states.get(keys.DP_WORLD_SIZE) or 1),
                          tag=self.path.name,
                          model_config=self._model_config or (recorded.model_config if recorded else None),
                          model_class=recorded.model_class if recorded else None,
                          versions=dict(recorded.versions) if recorded else {},
                          metadata="deepspeed_ext" if recorded else "none",
                          fingerprints=recorded.fingerprints if recorded else None,
                          optimizer_settings=optimizer_settings(
                              self.optimizer_state.get(keys.PARAM_GROUPS), states.get(keys.DS_CONFIG),
                              recorded.engine_settings if recorded else None, self.optimizer_state.get(keys.CLIP_GRAD),
                              states.get(keys.DS_VERSION), int(states.get(keys.DP_WORLD_SIZE) or 1)),
                          engine_settings=recorded.engine_settings if recorded else None,
                          frozen=tuple(name for name in self.names if name in self.frozen),
                          adapters=recorded.adapters if recorded else None)

    @cached_property
    def _scalars(self) -> tuple[str, ...]:
        every = {state for states in self.param_states.values() for state in states}
        return tuple(sorted(state for state in every if state in KNOWN_SCALARS or self._scalar_names.get(state)))

    def _expected_states(self, name: str, states: tuple[str, ...]) -> tuple[str, ...]:
        """The states ``name`` must have: those the checkpoint's record lists for it, and the states that come
        together (Adam's two moments: one without the other is a file lost)."""
        recorded = self.uc_info.fingerprints if self.uc_info is not None else None
        expected = [state for state in recorded.tensors[name] if state != MODULE_WEIGHTS] \
            if recorded is not None and name in recorded.tensors else []  # no file holds the module's own copy
        if any(state in states for state in ADAM_STATES):
            expected += ADAM_STATES
            if self._step_files:  # Adam keeps a step; where the parameters' files hold it, each has its own
                expected.append(STEP)
        return tuple(dict.fromkeys(expected))

    @cached_property
    def _files_by_param(self) -> dict[str, list[str]]:
        """The states each parameter's directory holds a file of (listed once)."""
        return {name: self._state_files(name) for name in self.names}

    @cached_property
    def _step_files(self) -> bool:
        """Whether the parameters keep their step in files of their own (``step.pt``; not upstream's ZeRO-3 form)."""
        return any(STEP in states for states in self._files_by_param.values())

    def tensors(self) -> Iterator[LogicalTensor]:
        any_optimizer = self.has_optimizer_states
        scalars = self._scalars
        for name, layout in self.layouts.items():
            states = self.param_states[name]
            # A torn conversion may lack one file of one parameter.
            missing = [state for state in self._expected_states(name, states) if state not in states]
            if any_optimizer and not has_optimizer(states) and name not in self.frozen:  # frozen: weights alone
                missing.append(next(s for s in self.param_states.values() if has_optimizer(s))[1])
            if missing:
                raise CheckpointError(f"{self.file(name, missing[0])}: missing ({name} has "
                                      f"{'/'.join(states) or 'nothing'})")

            def loader(state: str, name: str = name) -> torch.Tensor | int:
                if state not in scalars:
                    return self.load(name, state)
                return self.scalar(name, state)

            def range_loader(state: str, low: int, high: int, name: str = name) -> torch.Tensor:
                return self.full_range(name, state, low, high)

            yield LogicalTensor(name=name, shape=layout.shape, layout=layout, states=states, loader=loader,
                                dtype=self.model_dtype(name), range_loader=range_loader,
                                scalars=tuple(s for s in states if s in scalars), trainable=name not in self.frozen)

    def raise_if_damaged(self) -> None:
        """Nothing to check as it streams: this format's files are checked by ``verify`` (a manifest, where
        deepspeed-ext wrote them)."""

    def summary(self) -> dict[str, Any]:
        states = self.model_states
        opt = self.optimizer_state
        first = self.names[0] if self.names else None
        stepped = next((name for name, states in self.param_states.items() if STEP in states), None)
        master = [self.load(n) for n in self.names]  # memory-mapped: only headers are read
        return {
            "kind": "universal",
            "path": str(self.path),
            "tag": self.path.name,
            "source_tp_degree": states.get(keys.MP_WORLD_SIZE),
            "source_dp_degree": states.get(keys.DP_WORLD_SIZE),
            "zero_stage": int(opt.get(keys.ZERO_STAGE, 1)) if opt else None,
            "tensor_dtypes": sorted({str(t.dtype).replace("torch.", "") for t in master}),
            "global_steps": states.get(keys.GLOBAL_STEPS),
            "optimizer_step": None if first is None else as_int(self.step(stepped or first)),
            "optimizer_states": optimizer_states_summary(self.param_states),
            "deepspeed_version": str(states.get(keys.DS_VERSION)),
            "metadata": "deepspeed_ext" if self.uc_info else "none",
            "num_parameters": sum(t.numel() for t in master),
            **frozen_summary(self.layouts, self.frozen),
        }
