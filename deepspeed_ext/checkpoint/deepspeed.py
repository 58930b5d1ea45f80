"""Source: a regular DeepSpeed checkpoint (TP slices × ZeRO-1/2 partitions) as a stream of full tensors.

Files (see docs/universal-checkpoints.md):

* ``<tag>/mp_rank_{tp:02d}_model_states.pt`` — one per TP rank: ``param_shapes`` (TP-local shapes in
  flat-buffer order), degrees, steps, ``universal_checkpoint_info`` (upstream's tags), client state.
* ``<tag>/[bf16_]zero_pp_rank_{dp}_mp_rank_{tp:02d}_optim_states.pt`` — one per (dp, tp): flat fp32
  master partition and flat Adam moments per param group, plus ``param_slice_mappings`` giving each
  parameter's ``(start, numel)`` inside that rank's flat partition.

Everything is opened memory-mapped; a parameter's fragments are narrowed out of the flat buffers,
concatenated over DP ranks, and merged over TP ranks with the parameter's :class:`TPLayout`. No
temporary files, and only the bytes of the parameter being merged are read.
"""

from __future__ import annotations

import math
import re
import shutil
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import torch

from deepspeed_ext.checkpoint import output, serialization
from deepspeed_ext.checkpoint.metadata import UCInfo, read_uc_info
from deepspeed_ext.checkpoint.source import OpenOptions, SourceInfo
from deepspeed_ext.checkpoint.tensor import ADAM_STATES, MASTER_WEIGHTS, STEP, LogicalTensor
from deepspeed_ext.errors import CheckpointError, LayoutError, MissingMetadataError
from deepspeed_ext.module_inject.autotp import layouts_from_universal_checkpoint_info, name_patterns, unsharded_weights
from deepspeed_ext.module_inject.layout import TPLayout

MODEL_STATES_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
ZERO3_MODEL_STATES_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
OPTIM_STATES_RE = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_?optim_states\.pt$")
UC_INFO_KEY = "universal_checkpoint_info"

HOW_TO_GET_METADATA = ("save it through deepspeed_ext.initialize with "
                       "\"deepspeed_ext\": {\"universal_checkpoint\": {\"enabled\": true}} in the DeepSpeed config, "
                       "or with DeepSpeed >= 0.18.9, whose AutoTP stores universal_checkpoint_info")


def resolve_tag_dir(path: str | Path, tag: str | None = None, latest_file: str = "latest") -> Path:
    """The tag directory from a save dir (+ optional tag, else its ``latest`` file) or a tag dir itself."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if tag is not None:
        tag_dir = path / tag
        if not tag_dir.is_dir():
            raise CheckpointError(f"{tag_dir}: no such tag directory")
        return tag_dir
    if any(MODEL_STATES_RE.match(p.name) or ZERO3_MODEL_STATES_RE.match(p.name) for p in path.iterdir()):
        return path
    latest = path / latest_file
    if latest.is_file():
        tag = latest.read_text().strip()
        tag_dir = path / tag
        if not tag_dir.is_dir():
            raise CheckpointError(f"{latest}: names tag {tag!r}, but {tag_dir} does not exist")
        return tag_dir
    raise CheckpointError(f"{path}: neither a tag directory (no mp_rank_*_model_states.pt) nor a save directory "
                          f"with a '{latest_file}' file; pass --tag")


@dataclass
class _Fragment:
    dp_rank: int
    group: int
    start: int
    numel: int


@dataclass
class _Zero0Slot:
    """Where one parameter's fp32 master and moments live in a stage-0 optimizer state."""

    key: int  # the entry in the torch optimizer's ``state`` (and in ``_Zero0State.masters``)
    start: int  # element offset inside that entry (non-zero only in FP16_Optimizer's flat groups)
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


@dataclass
class _Zero0State:
    """The optimizer of one TP rank of a checkpoint saved without ZeRO, decoded.

    DeepSpeed's three stage-0 wrappers store it differently (``optimizer`` in the model states):

    * ``FP16_Optimizer`` (fp16/bf16 with a fused Adam): one flat fp32 master per param group
      (``fp32_groups_flat``), moments keyed by group, parameters concatenated without padding;
    * ``FP16_UnfusedOptimizer`` (fp16/bf16 with any other optimizer): one fp32 master per parameter
      (``fp32_groups``), moments keyed by the parameter's running index;
    * no wrapper (fp32): the torch optimizer's own state dict; the module's fp32 weights are the masters.

    None of them names its parameters. The names come from deepspeed-ext's UC info when it recorded them,
    else from the module state dict's order (buffers and tied aliases dropped), which is the order
    ``module.parameters()`` hands the optimizer; every parameter's size is checked against the buffers.
    """

    kind: str
    base: dict[str, Any]  # the torch optimizer state dict (``state``, ``param_groups``)
    masters: dict[int, torch.Tensor]  # key -> 1-D fp32 master
    slots: OrderedDict[str, _Zero0Slot]

    @classmethod
    def read(cls, model_states: dict[str, Any], optimizer: dict[str, Any], recorded: list[list[str]] | None,
             source: Path) -> _Zero0State:
        module = model_states.get("module") or {}

        def shape(name: str) -> tuple[int, ...]:
            if name not in module:
                raise CheckpointError(f"{source}: optimizer parameter {name!r} is not in the module state dict")
            return tuple(module[name].shape)

        names = _flatten(recorded) if recorded is not None else _param_names_of_module(
            module, model_states.get("buffer_names") or [])
        masters: dict[int, torch.Tensor] = {}
        slots: OrderedDict[str, _Zero0Slot] = OrderedDict()
        position = 0

        def take(count: int) -> list[str]:
            nonlocal position
            if position + count > len(names):
                raise CheckpointError(f"{source}: the optimizer holds more parameters than the module "
                                      f"({len(names)} named){_NAMES_HINT}")
            position += count
            return names[position - count:position]

        if "fp32_groups_flat" in optimizer:
            kind, base = "FP16_Optimizer", optimizer.get("optimizer_state_dict")
            for group, flat in enumerate(optimizer["fp32_groups_flat"]):
                masters[group] = flat
                offset = 0
                while offset < flat.numel():
                    (name, ) = take(1)
                    slots[name] = _Zero0Slot(group, offset, shape(name))
                    offset += slots[name].numel
                if offset != flat.numel():
                    raise CheckpointError(f"{source}: flat fp32 group {group} has {flat.numel()} elements, but its "
                                          f"parameters add up to {offset}{_NAMES_HINT}")
        elif "fp32_groups" in optimizer:
            kind, base = "FP16_UnfusedOptimizer", optimizer.get("optimizer_state_dict")
            key = 0
            for tensors in optimizer["fp32_groups"]:
                for name, master in zip(take(len(tensors)), tensors, strict=True):
                    masters[key] = master.reshape(-1)
                    slots[name] = _Zero0Slot(key, 0, tuple(master.shape))
                    key += 1
        elif "state" in optimizer and "param_groups" in optimizer:
            kind, base = "torch optimizer (no ZeRO)", optimizer
            for group in optimizer["param_groups"]:
                for name, key in zip(take(len(group["params"])), group["params"], strict=True):
                    if key not in optimizer["state"]:
                        continue  # frozen, or never stepped: nothing to convert (as ZeRO leaves it out)
                    slots[name] = _Zero0Slot(int(key), 0, shape(name))
                    masters[key] = module[name].reshape(-1)
        else:
            raise CheckpointError(f"{source}: unsupported optimizer state without ZeRO (keys: "
                                  f"{sorted(optimizer)[:8]})")
        if not isinstance(base, dict) or "state" not in base:
            raise CheckpointError(f"{source}: {kind} state has no wrapped optimizer state dict")
        for name, slot in slots.items():
            master = masters[slot.key]
            if master.dtype != torch.float32:
                raise CheckpointError(f"{source}: fp32 master of {name!r} is {master.dtype}")
            if slot.start + slot.numel > master.numel() or (kind != "FP16_Optimizer"
                                                            and master.numel() != slot.numel):
                raise CheckpointError(f"{source}: {name!r} {slot.shape} does not fit its optimizer entry "
                                      f"{slot.key} ({master.numel()} elements){_NAMES_HINT}")
        return cls(kind=kind, base=base, masters=masters, slots=slots)


_NAMES_HINT = ("; the parameter order could not be recovered (several param groups or frozen parameters): save "
               "through deepspeed_ext.initialize, which records it in deepspeed_ext.json")


def _flatten(groups: list[list[str]]) -> list[str]:
    return [name for group in groups for name in group]


def _param_names_of_module(module: dict[str, Any], buffer_names: list[str]) -> list[str]:
    """Parameter names of a saved module state dict in registration order; tied aliases and buffers dropped.

    ``torch.load`` keeps tensors that shared storage at save time sharing it, which is how a tied
    ``lm_head.weight`` is recognised as the embedding it aliases.
    """
    buffers = set(buffer_names)
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    names = []
    for name, tensor in module.items():
        if name in buffers or not torch.is_tensor(tensor) or tensor.numel() == 0:
            continue  # an empty shard (a TP rank beyond the KV-head count) has no optimizer entry either
        identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if identity in seen:
            continue
        seen.add(identity)
        names.append(name)
    return names


def open_source(path: Path, options: OpenOptions) -> DeepSpeedCheckpoint:
    """The format registry's reader (:mod:`deepspeed_ext.checkpoint.formats`)."""
    config = dict(options.model_config) if options.model_config is not None else None
    return DeepSpeedCheckpoint(path, options.tag, model_config=config)


class DeepSpeedCheckpoint:
    """A regular DeepSpeed checkpoint tag directory, read lazily."""

    def __init__(self, path: str | Path, tag: str | None = None, model_config: dict[str, Any] | None = None):
        """``model_config``: the HF config to report instead of the one recorded at save time (``--config``)."""
        self.given = Path(path)
        self._model_config = model_config
        self.tag_dir = resolve_tag_dir(path, tag)
        self.tag = self.tag_dir.name
        files = sorted(p.name for p in self.tag_dir.iterdir())
        # ZeRO-3 writes zero_pp_rank_{dp}_mp_rank_{tp}_model_states.pt on every rank; the DP-0 file of each
        # TP rank carries the same metadata a ZeRO-1/2 mp_rank file does.
        zero3_files = {int(m.group(2)): self.tag_dir / f for f in files
                       if (m := ZERO3_MODEL_STATES_RE.match(f)) and int(m.group(1)) == 0}
        self.partitioned_weights = bool(zero3_files)
        model_files = zero3_files or {
            int(m.group(1)): self.tag_dir / f
            for f in files if (m := MODEL_STATES_RE.match(f))
        }
        if not model_files:
            raise CheckpointError(f"{self.tag_dir}: no mp_rank_*_model_states.pt files")
        self._all_model_state_files = [self.tag_dir / f for f in files
                                       if MODEL_STATES_RE.match(f) or ZERO3_MODEL_STATES_RE.match(f)]
        self._model_files = model_files
        self._model_states_cache: dict[int, dict[str, Any]] = {}
        first = self.rank_model_states(min(model_files))
        self.tp_degree = int(first.get("mp_world_size") or 1)
        dims = first.get("checkpoint_parallel_dimensions") or {}
        if int(dims.get("pp_degree", 1) or 1) != 1:
            raise CheckpointError(f"{self._model_files[min(model_files)]}: pipeline parallelism is not supported")
        missing = [r for r in range(self.tp_degree) if r not in model_files]
        if missing:
            raise CheckpointError(f"{self.tag_dir}: TP degree is {self.tp_degree} but mp_rank files for TP ranks "
                                  f"{missing} are missing")
        self.dp_degree = int(first.get("dp_world_size") or 1)
        self._check_model_states_agree(first)
        optim = {}
        for f in files:
            m = OPTIM_STATES_RE.match(f)
            if m:
                optim[(int(m.group(3)), int(m.group(2)))] = self.tag_dir / f
        self._optim_files = optim
        # Without ZeRO (stage 0) DeepSpeed keeps the optimizer (its fp32 master and moments) inside each
        # TP rank's model-states file; DP ranks hold replicas and only DP rank 0 writes.
        self.optimizer_in_model_states = not optim
        self._optim_cache: dict[tuple[int, int], dict[str, Any]] = {}
        # Memory-mapped optimizer-file pieces the last full_tensor() read, and where each file is mapped.
        self._in_flight: list[tuple[tuple[int, int], torch.Tensor]] = []
        self._mappings: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self._zero0_cache: dict[int, _Zero0State] = {}
        if self.optimizer_in_model_states:
            for tp in range(self.tp_degree):
                if not isinstance(self.rank_model_states(tp).get("optimizer"), dict):
                    raise CheckpointError(f"{self._model_files[tp]}: no optimizer state (no *_optim_states.pt "
                                          "files and no 'optimizer' entry; was it saved without an optimizer?)")
            return
        missing = [(tp, dp) for tp in range(self.tp_degree) for dp in range(self.dp_degree) if (tp, dp) not in optim]
        if missing:
            tp, dp = missing[0]
            raise CheckpointError(f"{self.tag_dir}: missing optimizer file for dp_rank {dp}, mp_rank {tp:02d} "
                                  f"({len(missing)} missing)")
        self._check_optimizer_files_agree()

    # ------------------------------------------------------------------ consistency
    def _check_model_states_agree(self, first: dict[str, Any]) -> None:
        """Every TP rank's model states must come from the same save: same step, same TP and DP degrees."""
        reference = self._model_files[min(self._model_files)]
        expected = {key: first.get(key) for key in ("global_steps", "mp_world_size", "dp_world_size")}
        for tp, path in sorted(self._model_files.items()):
            if path == reference:
                continue
            states = self.rank_model_states(tp)
            if states.get("global_steps") != expected["global_steps"]:
                raise CheckpointError(f"{path}: saved at global step {states.get('global_steps')}, but "
                                      f"{reference.name} at step {expected['global_steps']}: files of two checkpoints "
                                      "are mixed")
            for key, what in (("mp_world_size", "TP"), ("dp_world_size", "DP")):
                if states.get(key) != expected[key]:
                    raise CheckpointError(f"{path}: says {what}={states.get(key)}, but {reference.name} says "
                                          f"{what}={expected[key]}")

    def _check_optimizer_files_agree(self) -> None:
        """Every optimizer file must hold this checkpoint's DP partitioning and optimizer step."""
        reference, reference_step = None, None
        for key, path in sorted(self._optim_files.items()):
            state = self.optimizer_state(*key)
            counts = state.get("partition_count")
            counts = counts if isinstance(counts, list | tuple) else [counts] if counts is not None else []
            if any(int(count) != self.dp_degree for count in counts):
                raise CheckpointError(f"{path}: partitioned over {int(counts[0])} DP ranks, but the model states say "
                                      f"DP={self.dp_degree}")
            groups = self._base_state(*key).get("state") or {}
            step = next((group["step"] for group in groups.values() if isinstance(group, dict) and "step" in group),
                        None)
            step = f"{float(step):g}" if step is not None else "none"
            if reference is None:
                reference, reference_step = path, step
            elif step != reference_step:
                raise CheckpointError(f"{path}: optimizer step {step}, but {reference.name} has step {reference_step}: "
                                      "files of two checkpoints are mixed")

    @property
    def path(self) -> Path:
        return self.tag_dir

    @cached_property
    def info(self) -> SourceInfo:
        recorded = self.uc_info
        return SourceInfo(format="deepspeed",
                          given=self.given,
                          path=self.tag_dir,
                          layouts=self.layouts,
                          states=(MASTER_WEIGHTS, *ADAM_STATES, STEP),
                          global_step=int(self.model_states.get("global_steps") or 0),
                          tp_degree=self.tp_degree,
                          dp_degree=self.dp_degree,
                          zero_stage=self.zero_stage,
                          tag=self.tag,
                          model_config=self._model_config or (recorded.model_config if recorded else None),
                          model_class=recorded.model_class if recorded else None,
                          versions=dict(recorded.versions) if recorded else {},
                          metadata=self.metadata_source)

    @property
    def read_paths(self) -> list[Path]:
        """What converting this checkpoint reads, which no output may touch."""
        return output.read_paths(self.tag_dir)

    @property
    def names(self) -> list[str]:
        return list(self.layouts)

    #: Every parameter has master weights and Adam moments (a checkpoint without them is refused).
    has_optimizer_states = True

    def has(self, name: str, state: str = MASTER_WEIGHTS) -> bool:
        return name in self.layouts

    # ------------------------------------------------------------------ files
    def rank_model_states(self, tp_rank: int) -> dict[str, Any]:
        """TP rank ``tp_rank``'s model states (memory-mapped, loaded once)."""
        if tp_rank not in self._model_states_cache:
            self._model_states_cache[tp_rank] = serialization.load(self._model_files[tp_rank])
        return self._model_states_cache[tp_rank]

    @property
    def model_state_files(self) -> list[Path]:
        """Every model-states file (under ZeRO-3 one per rank)."""
        return list(self._all_model_state_files)

    def copy_model_states(self, directory: Path) -> None:
        """Copy every model-states file into ``directory`` (a universal checkpoint being built).

        Without ZeRO they also hold the whole optimizer, which the universal form already has per
        parameter, so those copies leave it out instead of doubling the checkpoint.
        """
        for path in self.model_state_files:
            if self.optimizer_in_model_states:
                states = dict(serialization.load(path))
                states["optimizer"] = None
                serialization.save(states, directory / path.name)
            else:
                shutil.copy2(path, directory / path.name)

    def optimizer_state(self, tp_rank: int, dp_rank: int) -> dict[str, Any]:
        """The ``optimizer_state_dict`` of one (tp, dp) optimizer file (memory-mapped, cached); without
        ZeRO, the ``optimizer`` entry of the TP rank's model states."""
        key = (tp_rank, dp_rank)
        if self.optimizer_in_model_states:
            key = (tp_rank, 0)
            if key not in self._optim_cache:
                self._optim_cache[key] = self.rank_model_states(tp_rank)["optimizer"]
            return self._optim_cache[key]
        if key not in self._optim_cache:
            path = self._optim_files[key]
            data = serialization.load(path)
            state = data.get("optimizer_state_dict") if isinstance(data, dict) else None
            if not isinstance(state, dict):
                raise CheckpointError(f"{path}: no optimizer_state_dict")
            required_keys = (("fp32_flat_groups", "optimizer_state_dict") if self.partitioned_weights else
                             ("param_slice_mappings", "single_partition_of_fp32_groups", "base_optimizer_state"))
            for required in required_keys:
                if required not in state:
                    raise CheckpointError(f"{path}: optimizer_state_dict has no {required!r} (elastic or "
                                          "non-ZeRO optimizer checkpoints are not supported)")
            self._optim_cache[key] = state
        return self._optim_cache[key]

    @cached_property
    def zero_stage(self) -> int:
        if self.optimizer_in_model_states:
            return 0
        state = self.optimizer_state(0, 0)
        return int(state.get("zero_stage", 1))

    @cached_property
    def optimizer_kind(self) -> str:
        """Which DeepSpeed optimizer wrapper wrote the state (decides where its tensors live)."""
        if self.optimizer_in_model_states:
            return self._zero0(0).kind
        if self.partitioned_weights:
            return "DeepSpeedZeroOptimizer_Stage3"
        # BF16_Optimizer (bf16 with fp32 gradient accumulation) writes the ZeRO-1 keys minus zero_stage.
        return "DeepSpeedZeroOptimizer" if "zero_stage" in self.optimizer_state(0, 0) else "BF16_Optimizer"

    def _zero0(self, tp: int) -> _Zero0State:
        if tp not in self._zero0_cache:
            names = self.uc_info.optimizer_param_names if self.uc_info is not None else None
            if names is not None:
                # Recorded on TP rank 0; a rank that holds an empty shard of a parameter (beyond the KV-head
                # count) has no optimizer entry for it, as DeepSpeed leaves empty parameters out.
                layouts = self.uc_info.layouts
                names = [[name for name in group
                          if name not in layouts or math.prod(layouts[name].local_shape(tp)) != 0]
                         for group in names]
            self._zero0_cache[tp] = _Zero0State.read(self.rank_model_states(tp), self.optimizer_state(tp, 0), names,
                                                     self._model_files[tp])
        return self._zero0_cache[tp]

    # ------------------------------------------------------------------ metadata
    @property
    def model_states(self) -> dict[str, Any]:
        return self.rank_model_states(0)

    @cached_property
    def _saved_shapes(self) -> OrderedDict[str, list[tuple[int, ...] | None]]:
        """``{name: [shape TP rank 0 saved, rank 1, ...]}`` in flat-buffer order, from ``param_shapes``.

        None where a rank saved no such parameter: DeepSpeed leaves empty parameters out of the optimizer
        (and so out of ``param_shapes``), which is what a rank beyond the model's KV-head count holds of
        each attention projection. :attr:`layouts` checks that such a rank's shard is indeed empty.
        """
        per_rank = []
        for tp in range(self.tp_degree):
            if self.optimizer_in_model_states:
                per_rank.append(OrderedDict((name, slot.shape) for name, slot in self._zero0(tp).slots.items()))
                continue
            groups = self.rank_model_states(tp).get("param_shapes")
            if groups is None:
                raise CheckpointError(f"{self._model_files[tp]}: no param_shapes")
            if isinstance(groups, dict):
                groups = [groups]
            merged = OrderedDict()
            for group in groups:
                for name, shape in group.items():
                    merged[name] = tuple(shape)
            per_rank.append(merged)
        names = list(dict.fromkeys(name for shapes in per_rank for name in shapes))
        return OrderedDict((name, [shapes.get(name) for shapes in per_rank]) for name in names)

    @cached_property
    def uc_info(self) -> UCInfo | None:
        return read_uc_info(self.tag_dir)

    @cached_property
    def metadata_source(self) -> str:
        if self.uc_info is not None:
            return "deepspeed_ext"
        if self.model_states.get(UC_INFO_KEY):
            return "deepspeed"
        return "none (TP=1)" if self.tp_degree == 1 else "none"

    @cached_property
    def layouts(self) -> dict[str, TPLayout]:
        """Every parameter's TP layout: ours if saved, else rebuilt from upstream's UC info."""
        if self.uc_info is not None:
            layouts = self.uc_info.layouts
            if self.uc_info.tp_size != self.tp_degree:
                raise CheckpointError(f"{self.tag_dir}: deepspeed_ext.json describes TP={self.uc_info.tp_size}, "
                                      f"model states say TP={self.tp_degree}")
        elif self.model_states.get(UC_INFO_KEY):
            layouts = layouts_from_universal_checkpoint_info(self.model_states[UC_INFO_KEY],
                                                             self._saved_shapes,
                                                             source=str(self._model_files[0]))
        elif self.tp_degree == 1:
            layouts = {name: TPLayout.replicated(shapes[0], 1) for name, shapes in self._saved_shapes.items()}
        else:
            raise MissingMetadataError(
                f"{self._model_files[0]}: TP={self.tp_degree} checkpoint has no tensor-parallel metadata (neither "
                f"deepspeed_ext.json nor universal_checkpoint_info), so its slices cannot be merged; "
                f"{HOW_TO_GET_METADATA}")
        for name, shapes in self._saved_shapes.items():
            layout = layouts.get(name)
            if layout is None:
                raise MissingMetadataError(f"{self.tag_dir}: no TP layout for parameter {name!r}")
            for tp, shape in enumerate(shapes):
                expected = layout.local_shape(tp)
                if shape is None and math.prod(expected) != 0:
                    raise CheckpointError(f"{self._model_files[tp]}: parameter {name!r} is missing, but its layout "
                                          f"({layout.describe()}) gives TP rank {tp} a shard of {expected}")
                if shape is not None and expected != shape:
                    raise CheckpointError(f"{self._model_files[tp]}: parameter {name!r} has shape {shape} but its "
                                          f"layout ({layout.describe()}) expects {expected}")
        return {name: layouts[name] for name in self._saved_shapes}

    @cached_property
    def _fragments(self) -> dict[tuple[str, int], list[_Fragment]]:
        """``(name, tp) -> fragments`` in DP order.

        ZeRO-1/2 record them (``param_slice_mappings``). ZeRO-3 gives every parameter ``ceil(numel/dp)``
        slots in each rank's flat partition, in ``param_shapes`` order, the tail rank padded.
        """
        if self.partitioned_weights:
            return self._zero3_fragments()
        out: dict[tuple[str, int], list[_Fragment]] = {}
        if self.optimizer_in_model_states:
            for tp in range(self.tp_degree):
                for name, slot in self._zero0(tp).slots.items():
                    out[(name, tp)] = [_Fragment(0, slot.key, slot.start, slot.numel)]
            return out
        for tp in range(self.tp_degree):
            for dp in range(self.dp_degree):
                mappings = self.optimizer_state(tp, dp)["param_slice_mappings"]
                for group, mapping in enumerate(mappings):
                    for name, address in mapping.items():
                        out.setdefault((name, tp), []).append(_Fragment(dp, group, int(address.start),
                                                                        int(address.numel)))
        return out

    def _zero3_fragments(self) -> dict[tuple[str, int], list[_Fragment]]:
        out: dict[tuple[str, int], list[_Fragment]] = {}
        dp = self.dp_degree
        for tp in range(self.tp_degree):
            groups = self.rank_model_states(tp)["param_shapes"]
            for group, shapes in enumerate(groups if isinstance(groups, list) else [groups]):
                offset = 0
                for name, shape in shapes.items():
                    numel = int(torch.Size(shape).numel())
                    part = -(-numel // dp)
                    for dp_rank in range(dp):
                        length = max(0, min(part, numel - dp_rank * part))
                        if length:
                            out.setdefault((name, tp), []).append(_Fragment(dp_rank, group, offset, length))
                    offset += part
                flat = self._flat(tp, 0, group, MASTER_WEIGHTS)
                if offset != flat.numel():
                    raise CheckpointError(f"{self._optim_files[(tp, 0)]}: flat partition of group {group} has "
                                          f"{flat.numel()} elements, param_shapes imply {offset} (ZeRO-3 "
                                          "sub_group_size smaller than a param group is not supported)")
        return out

    # ------------------------------------------------------------------ reading tensors
    def _base_state(self, tp: int, dp: int) -> dict[str, Any]:
        """The wrapped torch optimizer's state dict (``state`` keyed by flat group, ``param_groups``)."""
        if self.optimizer_in_model_states:
            return self._zero0(tp).base
        opt = self.optimizer_state(tp, dp)
        return opt["optimizer_state_dict"] if self.partitioned_weights else opt["base_optimizer_state"]

    def _flat(self, tp: int, dp: int, group: int, state: str) -> torch.Tensor:
        """The 1-D tensor holding ``state`` for ``group`` (a flat param group; without ZeRO, the key in the
        optimizer's ``state``)."""
        if self.optimizer_in_model_states:
            zero0 = self._zero0(tp)
            if state == MASTER_WEIGHTS:
                return zero0.masters[group]
            moments = zero0.base["state"].get(group) or {}
            if state not in moments:
                raise CheckpointError(f"{self._model_files[tp]}: no optimizer state {state!r} for optimizer "
                                      f"entry {group} (only Adam-family optimizers are supported)")
            return moments[state].reshape(-1)
        opt = self.optimizer_state(tp, dp)
        if state == MASTER_WEIGHTS:
            key = "fp32_flat_groups" if self.partitioned_weights else "single_partition_of_fp32_groups"
            return opt[key][group]
        group_state = self._base_state(tp, dp)["state"].get(group)
        if group_state is None or state not in group_state:
            raise CheckpointError(f"{self._optim_files[(tp, dp)]}: no optimizer state {state!r} for param group "
                                  f"{group} (only Adam-family optimizers are supported)")
        return group_state[state]

    def _flat_range(self, name: str, tp: int, state: str, low: int, high: int) -> torch.Tensor:
        """Elements ``[low, high)`` of TP rank ``tp``'s flattened shard of ``name``, read from the DP
        fragments that hold them (a view into the memory-mapped file when one fragment does)."""
        pieces, offset = [], 0
        for f in self._fragments.get((name, tp), []):
            first, last = max(low, offset), min(high, offset + f.numel)
            if first < last:
                piece = self._flat(tp, f.dp_rank, f.group, state).narrow(0, f.start + first - offset, last - first)
                pieces.append(piece)
                if not self.optimizer_in_model_states:
                    self._in_flight.append(((tp, f.dp_rank), piece))
            offset += f.numel
        if sum(p.numel() for p in pieces) != high - low:
            raise CheckpointError(f"{self.tag_dir}: parameter {name!r} on TP rank {tp}: DP fragments cover "
                                  f"{sum(p.numel() for p in pieces)} of elements [{low}, {high})")
        if not pieces:
            return torch.empty(0, dtype=torch.float32)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def local_tensor(self, name: str, tp: int, state: str) -> torch.Tensor:
        """TP rank ``tp``'s shard of ``name`` for ``state``, reassembled from its DP fragments."""
        shape = self.layouts[name].local_shape(tp)
        return self._flat_range(name, tp, state, 0, int(torch.Size(shape).numel())).view(shape)

    def region(self, name: str, tp: int, state: str, offset: int | None, length: int | None) -> torch.Tensor:
        """``narrow(partition_dim, offset, length)`` of TP rank ``tp``'s shard in its split view (``offset``
        None: the whole shard), reading only the flat range that the narrowed rows span."""
        layout = self.layouts[name]
        view = layout.local_view_shape(tp)
        if offset is None:
            return self.local_tensor(name, tp, state).reshape(view)
        dim = layout.partition_dim
        size = list(view)
        size[dim] = length
        if not length or 0 in view:
            return torch.empty(size, dtype=torch.float32)
        strides = torch.empty(view, device="meta").stride()
        outer = math.prod(view[:dim])
        low = offset * strides[dim]
        high = ((outer - 1) * view[dim] + offset + length) * strides[dim]
        flat = self._flat_range(name, tp, state, low, high)
        # Element (o, offset + i, k) of the shard sits at o*view[dim]*stride + i*stride + k of ``flat``.
        return flat.as_strided(size, strides, flat.storage_offset())

    def resharded(self, name: str, state: str, target: TPLayout, rank: int) -> torch.Tensor:
        """Rank ``rank``'s shard of ``name`` under the *target* layout (another TP degree), read directly
        from this checkpoint's TP slices and ZeRO partitions: only the overlapping byte ranges.

        May be a view into a memory-mapped file; the caller copies what it keeps.
        """
        self._release_in_flight()
        try:
            return self.layouts[name].reshard(target, rank,
                                              lambda src, offset, length: self.region(name, src, state, offset,
                                                                                      length))
        except LayoutError as exc:
            raise CheckpointError(f"{self.tag_dir}: parameter {name!r}: {exc}") from exc

    def full_tensor(self, name: str, state: str = MASTER_WEIGHTS) -> torch.Tensor:
        """The full fp32 tensor of ``name`` (master weights or an Adam moment), merged over TP ranks.

        May be a view into the memory-mapped optimizer file; sinks copy what they keep.
        """
        self._release_in_flight()
        layout = self.layouts[name]
        # Replicated tensors are merged too: merge() refuses replicas that differ between TP ranks.
        shards = [self.local_tensor(name, tp, state) for tp in range(self.tp_degree)]
        try:
            full = layout.merge(shards)
        except Exception as exc:
            raise CheckpointError(f"{self.tag_dir}: cannot merge {name!r}: {exc}") from exc
        return full

    def _release_in_flight(self) -> None:
        """Drop the optimizer-file pages the previous tensor read from RSS (it has been consumed by now).

        Releasing is safe even if a caller still holds a view: the pages are read back from the file."""
        for key, piece in self._in_flight:
            if key not in self._mappings:
                self._mappings[key] = serialization.file_mappings(self._optim_files[key])
            serialization.release_pages(piece, self._mappings[key])
        self._in_flight.clear()

    def step(self, name: str) -> torch.Tensor | int:
        fragments = self._fragments.get((name, 0))
        group = fragments[0].group if fragments else 0
        group_state = self._base_state(0, fragments[0].dp_rank if fragments else 0)
        value = group_state["state"].get(group, {}).get(STEP)
        if value is None:
            raise CheckpointError(f"{self._optim_files[(0, 0)]}: no optimizer step for param group {group}")
        return value

    def tensors(self) -> Iterator[LogicalTensor]:
        """One :class:`LogicalTensor` per optimizer parameter, in checkpoint order; nothing read yet."""
        module = self.model_states.get("module") or {}
        for name, layout in self.layouts.items():

            def loader(state: str, name: str = name) -> torch.Tensor | int:
                return self.step(name) if state == STEP else self.full_tensor(name, state)

            weights = module.get(name)
            yield LogicalTensor(name=name,
                                shape=layout.shape,
                                layout=layout,
                                states=(MASTER_WEIGHTS, *ADAM_STATES, STEP),
                                loader=loader,
                                dtype=weights.dtype if torch.is_tensor(weights) else torch.float32)

    # ------------------------------------------------------------------ summary
    def optimizer_state_for_universal(self) -> dict[str, Any]:
        """What upstream stores as ``zero/optimizer_state.pt``: DP0/TP0 state minus the flat tensors."""
        state = self.optimizer_state(0, 0)
        flat_keys = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups",
                     "fp32_flat_groups", "optimizer_state_dict", "fp32_groups_flat", "fp32_groups", "state",
                     "param_groups")
        out = {k: v for k, v in state.items() if k not in flat_keys}
        base = self._base_state(0, 0)
        out["param_groups"] = base["param_groups"]
        if self.partitioned_weights:
            # DeepSpeed's ZeRO-3 universal loader reads the step and hyper-parameters from here; the flat
            # moments stay out (they are in zero/<param>/ already).
            out["optimizer_state_dict"] = {
                "state": {group: {STEP: st[STEP]} for group, st in base["state"].items() if STEP in st},
                "param_groups": base["param_groups"],
            }
        return out

    def summary(self) -> dict[str, Any]:
        first = self.model_states
        module = first.get("module") or {}
        lp_dtypes = sorted({str(t.dtype).replace("torch.", "") for t in module.values() if torch.is_tensor(t)})
        return {
            "kind": "deepspeed",
            "path": str(self.tag_dir),
            "tag": self.tag,
            "tp_degree": self.tp_degree,
            "dp_degree": self.dp_degree,
            "zero_stage": self.zero_stage,
            "optimizer": self.optimizer_kind,
            "model_dtypes": lp_dtypes,
            "optimizer_dtype": str(self._flat(0, 0, 0, MASTER_WEIGHTS).dtype).replace("torch.", ""),
            "global_steps": first.get("global_steps"),
            "deepspeed_version": str(first.get("ds_version")),
            "metadata": self.metadata_source,
            "num_parameters": sum(layout.numel for layout in self.layouts.values()),
            # Weight matrices AutoTP kept whole on every TP rank (e.g. fused MoE experts it cannot shard).
            "unsharded_weights": name_patterns(unsharded_weights(self.layouts)),
        }
