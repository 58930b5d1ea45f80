"""DeepSpeed's optimizer layouts: where a checkpoint keeps each parameter's fp32 master and Adam moments.

One class per layout DeepSpeed writes, chosen once per checkpoint by :func:`choose_layout`:

* :class:`Stage0Layout` — no ZeRO: the whole optimizer sits in each TP rank's model states, in one of
  three wrappers (decoded by :mod:`.zero0`); DP ranks hold replicas.
* :class:`Zero12Layout` — ZeRO-1/2: a flat fp32 partition per (param group, DP rank) in
  ``zero_pp_rank_<dp>_mp_rank_<tp>_optim_states.pt``, with ``param_slice_mappings`` giving each
  parameter's ``(start, numel)`` inside it.
* :class:`BF16OptimizerLayout` — ``BF16_Optimizer`` (bf16 with fp32 gradient accumulation): the ZeRO-1
  files without ``zero_stage``.
* :class:`Zero3Layout` — ZeRO-3: flat fp32 partitions in which every parameter takes ``ceil(numel/dp)``
  slots per rank, in ``param_shapes`` order, the last rank padded; nothing records the offsets.

The reader (:mod:`.reader`) asks a layout for a parameter's *fragments* (which flat tensor, which range, in
DP order) and for the flat tensors; TP merging and resharding are the same for every layout.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepspeed_ext.checkpoint.deepspeed import keys
from deepspeed_ext.checkpoint.deepspeed.experts import ExpertParallel, expert_group_indices
from deepspeed_ext.checkpoint.deepspeed.files import TagFiles, indexed_state
from deepspeed_ext.checkpoint.deepspeed.zero0 import SavedStage0
from deepspeed_ext.checkpoint.source import MASTER_WEIGHTS, STEP
from deepspeed_ext.checkpoint.states import MUON_MOMENTUM, USE_MUON
from deepspeed_ext.errors import CheckpointError

#: Without ZeRO, the parameter names the optimizer of TP rank ``tp`` holds, per param group, where
#: deepspeed-ext recorded them (None: recover them from the module state dict).
RecordedNames = Callable[[int], "list[list[str]] | None"]


@dataclass
class Fragment:
    """A run of one parameter's flattened TP shard inside one flat tensor."""

    dp_rank: int
    group: int  # the flat param group (without ZeRO: the key in the optimizer's ``state``)
    start: int
    numel: int
    #: The TP rank whose files hold it; None: the TP rank whose shard this is (see Zero3Layout.partition_owners).
    tp_rank: int | None = None


class OptimizerLayout:
    """How one checkpoint stores its optimizer; subclasses are DeepSpeed's layouts."""

    kind: str  # the DeepSpeed optimizer class that wrote it (``inspect`` shows it)
    zero_stage: int

    def __init__(self, files: TagFiles, tp_degree: int, dp_degree: int, experts: ExpertParallel | None = None):
        self.files = files
        self.tp_degree = tp_degree
        self.dp_degree = dp_degree
        #: AutoEP: the expert parameters, in param groups of their own partitioned over the expert-DP ranks.
        self.experts = experts

    def check(self) -> None:
        """Refuse files that are missing, of another layout, or from two different saves."""

    def state_file(self, tp: int, dp: int) -> Path:
        """The file holding the (tp, dp) optimizer state (for messages)."""
        raise NotImplementedError

    def mapped_file(self, tp: int, dp: int) -> Path | None:
        """The file whose pages a read of (tp, dp) flat tensors maps, to release them afterwards (None: keep)."""
        return None

    def saved_shapes(self, tp: int) -> OrderedDict[str, tuple[int, ...]]:
        """``{name: TP-local shape}`` of the parameters the optimizer of TP rank ``tp`` holds, in its order."""
        raise NotImplementedError

    def fragments(self, tp: int) -> dict[str, list[Fragment]]:
        """Each parameter's fragments on TP rank ``tp``, in DP order (expert parameters: see
        :meth:`expert_fragments`)."""
        raise NotImplementedError

    def expert_fragments(self) -> dict[tuple[str, int], list[Fragment]]:
        """AutoEP: ``(expert parameter, EP rank) -> fragments`` of that EP rank's experts, in the order ZeRO
        partitions them over the ranks holding them."""
        return {}

    def expert_groups(self, tp: int, dp: int) -> set[int]:
        """The flat groups of the (tp, dp) file that hold expert parameters."""
        if self.experts is None:
            return set()
        return expert_group_indices(self.base_state(tp, dp).get(keys.PARAM_GROUPS) or [])

    def flat(self, tp: int, dp: int, group: int, state: str) -> torch.Tensor:
        """The 1-D tensor holding ``state`` (master weights or a moment) for flat group ``group``."""
        raise NotImplementedError

    def base_state(self, tp: int, dp: int) -> dict[str, Any]:
        """The wrapped torch optimizer's state dict (``state`` keyed by flat group, ``param_groups``)."""
        raise NotImplementedError

    def wrapper_state(self, tp: int, dp: int) -> dict[str, Any]:
        """The DeepSpeed optimizer's own state dict (loss scaler, clip_grad, ... and its tensors)."""
        raise NotImplementedError

    #: Without ZeRO the model states hold the optimizer, which a universal checkpoint keeps per parameter.
    optimizer_in_model_states = False

    def group_state(self, tp: int, dp: int, group: int) -> dict[str, Any]:
        """The torch optimizer's state entry of flat group ``group`` (without ZeRO: the entry's key) in the (tp, dp)
        file: its tensor states and its scalars (``{}`` before the first step)."""
        state: dict[str, Any] = self.base_state(tp, dp)[keys.STATE].get(group) or {}
        return state

    def padding(self, tp: int, dp: int, group: int) -> int:
        """Elements the (tp, dp) file's optimizer states of flat group ``group`` may hold past its fp32 master:
        ZeRO-1/2 save the master without the group's padding (``group_paddings``), the torch state with it."""
        return 0

    def whole_param_offsets(self, tp: int, dp: int, group: int, state: str) -> dict[str, int] | None:
        """Where a state that holds *whole* parameters lies: ``{name: offset of the parameter's first element}`` in
        the (tp, dp) file's tensor of ``state`` for flat group ``group``; None where the state is laid out like the
        fp32 master partition (every state of every optimizer but Muon's momentum under ZeRO-1/2)."""
        return None

    def has_stepped(self) -> bool:
        """Whether the optimizer has taken a step. torch's Adam creates a group's step and moments at its first
        step, so a save before it (``save_checkpoint`` at step 0) holds only the fp32 masters: ZeRO-1/2 save an
        empty ``state``, ZeRO-3 an empty one per group (DeepSpeed's stage-0 wrappers take a step of zeros at
        start and save moments). TP rank 0, DP rank 0 answer for all: :meth:`check` refuses files at mixed steps."""
        groups = self.base_state(0, 0).get(keys.STATE) or {}
        return any(bool(group) for group in groups.values())

    def optimizer_state_for_universal(self) -> dict[str, Any]:
        """What upstream stores as ``zero/optimizer_state.pt``: the TP0/DP0 state minus its tensors."""
        state = self.wrapper_state(0, 0)
        out = {k: v for k, v in state.items() if k not in keys.TENSOR_HOLDING_KEYS}
        out[keys.PARAM_GROUPS] = self.base_state(0, 0)[keys.PARAM_GROUPS]
        if isinstance(out.get(keys.GROUP_PADDINGS), list):
            # Rank 0's padding is of its own partition; the merged tensors carry none (upstream writes 0s).
            out[keys.GROUP_PADDINGS] = [0] * len(out[keys.GROUP_PADDINGS])
        return out

    def _missing_moment(self, path: Path, state: str, what: str) -> CheckpointError:
        return CheckpointError(f"{path}: no optimizer state {state!r} for {what} (its optimizer keeps "
                               "other states there: files of two checkpoints, or of two optimizers)")


class Stage0Layout(OptimizerLayout):
    zero_stage = 0
    optimizer_in_model_states = True

    def __init__(self, files: TagFiles, tp_degree: int, dp_degree: int, recorded_names: RecordedNames):
        super().__init__(files, tp_degree, dp_degree)
        self._recorded_names = recorded_names
        self._decoded: dict[int, SavedStage0] = {}

    def check(self) -> None:
        for tp in range(self.tp_degree):
            if not isinstance(self.files.model_states(tp).get(keys.OPTIMIZER), dict):
                raise CheckpointError(f"{self.files.model_files[tp]}: no optimizer state (no *_optim_states.pt "
                                      "files and no 'optimizer' entry; was it saved without an optimizer?)")

    def decoded(self, tp: int) -> SavedStage0:
        if tp not in self._decoded:
            self._decoded[tp] = SavedStage0.read(self.files.model_states(tp), self._recorded_names(tp),
                                                 self.files.model_files[tp])
        return self._decoded[tp]

    @property
    def kind(self) -> str:  # type: ignore[override]  # which wrapper is known once rank 0 is decoded
        return self.decoded(0).kind

    def state_file(self, tp: int, dp: int) -> Path:
        return self.files.model_files[tp]

    def saved_shapes(self, tp: int) -> OrderedDict[str, tuple[int, ...]]:
        return OrderedDict((name, slot.shape) for name, slot in self.decoded(tp).slots.items())

    def fragments(self, tp: int) -> dict[str, list[Fragment]]:
        return {name: [Fragment(0, slot.key, slot.start, slot.numel)] for name, slot in self.decoded(tp).slots.items()}

    def flat(self, tp: int, dp: int, group: int, state: str) -> torch.Tensor:
        decoded = self.decoded(tp)
        if state == MASTER_WEIGHTS:
            return decoded.masters[group]
        moments = decoded.base[keys.STATE].get(group) or {}
        if state not in moments:
            raise self._missing_moment(self.files.model_files[tp], state, f"optimizer entry {group}")
        tensor: torch.Tensor = moments[state]
        return tensor.reshape(-1)

    def base_state(self, tp: int, dp: int) -> dict[str, Any]:
        return self.decoded(tp).base

    def wrapper_state(self, tp: int, dp: int) -> dict[str, Any]:
        state: dict[str, Any] = self.files.model_states(tp)[keys.OPTIMIZER]
        return state


class _PartitionedLayout(OptimizerLayout):
    """The ZeRO layouts: one optimizer file per (TP, DP) rank, each holding flat fp32 partitions."""

    #: Keys every optimizer file of this layout has.
    required_keys: tuple[str, ...] = ()
    #: Where the flat fp32 masters are.
    masters_key: str = ""
    #: Where the wrapped torch optimizer's state dict is.
    base_state_key: str = ""

    @property
    def zero_stage(self) -> int:  # type: ignore[override]  # as the files say (BF16_Optimizer's say none: 1)
        return int(self.wrapper_state(0, 0).get(keys.ZERO_STAGE, 1))

    def base_state(self, tp: int, dp: int) -> dict[str, Any]:
        return indexed_state(self.wrapper_state(tp, dp).get(self.base_state_key), self.files.optim_files[(tp, dp)])

    def check(self) -> None:
        """Every optimizer file must be of this layout and hold this checkpoint's DP partitioning and step."""
        reference, reference_step = None, None
        for key, path in sorted(self.files.optim_files.items()):
            state = self.wrapper_state(*key)
            for required in self.required_keys:
                if required not in state:
                    raise CheckpointError(f"{path}: optimizer_state_dict has no {required!r} (elastic or "
                                          "non-ZeRO optimizer checkpoints are not supported)")
            self._check_partition_counts(path, state, key)
            groups = self.base_state(*key).get(keys.STATE) or {}
            step = next((group[STEP] for group in groups.values() if isinstance(group, dict) and STEP in group),
                        None)
            step_text = f"{float(step):g}" if step is not None else "none"
            if reference is None:
                reference, reference_step = path, step_text
            elif step_text != reference_step:
                raise CheckpointError(f"{path}: optimizer step {step_text}, but {reference.name} has step "
                                      f"{reference_step}: files of two checkpoints are mixed")

    def _check_partition_counts(self, path: Path, state: dict[str, Any], key: tuple[int, int]) -> None:
        """Each flat group is partitioned over the DP ranks (an AutoEP expert group: over the ranks that hold the
        same experts, DP / EP of them)."""
        counts = state.get(keys.PARTITION_COUNT)
        if counts is None:
            return
        expert = self.expert_groups(*key)
        per_group = list(counts) if isinstance(counts, list | tuple) else None
        for group, count in enumerate(per_group if per_group is not None else [counts]):
            # ZeRO-3 records one count, its dense groups' (the expert groups' are in ds_zero_partition_groups).
            is_expert = per_group is not None and group in expert
            expected = self.experts.expert_dp_size if is_expert and self.experts is not None else self.dp_degree
            if int(count) != expected:
                why = (f"DP={self.dp_degree} / EP={self.experts.ep_size} ranks hold each expert" if is_expert
                       and self.experts is not None else f"the model states and files say DP={self.dp_degree}")
                raise CheckpointError(f"{path}: param group {group} is partitioned over {int(count)} ranks, but "
                                      f"{why}: files of two checkpoints, or a DeepSpeed partitioning not supported")

    def state_file(self, tp: int, dp: int) -> Path:
        return self.files.optim_files[(tp, dp)]

    def mapped_file(self, tp: int, dp: int) -> Path | None:
        return self.files.optim_files[(tp, dp)]

    def wrapper_state(self, tp: int, dp: int) -> dict[str, Any]:
        return self.files.optimizer_file_state(tp, dp)

    def saved_shapes(self, tp: int) -> OrderedDict[str, tuple[int, ...]]:
        merged: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        for group in self._param_shapes(tp):
            for name, shape in group.items():
                merged[name] = tuple(shape)
        return merged

    def _param_shapes(self, tp: int) -> list[dict[str, Any]]:
        groups = self.files.model_states(tp).get(keys.PARAM_SHAPES)
        if groups is None:
            raise CheckpointError(f"{self.files.model_files[tp]}: no param_shapes")
        return groups if isinstance(groups, list) else [groups]

    def flat(self, tp: int, dp: int, group: int, state: str) -> torch.Tensor:
        if state == MASTER_WEIGHTS:
            master: torch.Tensor = self.wrapper_state(tp, dp)[self.masters_key][group]
            return master
        group_state = self.base_state(tp, dp)[keys.STATE].get(group)
        if group_state is None or state not in group_state:
            raise self._missing_moment(self.files.optim_files[(tp, dp)], state, f"param group {group}")
        moment: torch.Tensor = group_state[state]
        return moment


class Zero12Layout(_PartitionedLayout):
    kind = "DeepSpeedZeroOptimizer"
    required_keys = (keys.PARAM_SLICE_MAPPINGS, keys.SINGLE_PARTITION_OF_FP32_GROUPS, keys.BASE_OPTIMIZER_STATE)
    masters_key = keys.SINGLE_PARTITION_OF_FP32_GROUPS

    base_state_key = keys.BASE_OPTIMIZER_STATE

    def fragments(self, tp: int) -> dict[str, list[Fragment]]:
        out: dict[str, list[Fragment]] = {}
        for dp in range(self.dp_degree):
            experts = self.expert_groups(tp, dp)
            for group, mapping in enumerate(self.wrapper_state(tp, dp)[keys.PARAM_SLICE_MAPPINGS]):
                if group in experts:
                    continue
                for name, address in mapping.items():
                    out.setdefault(name, []).append(Fragment(dp, group, int(address.start), int(address.numel)))
        return out

    def expert_fragments(self) -> dict[tuple[str, int], list[Fragment]]:
        out: dict[tuple[str, int], list[Fragment]] = {}
        if self.experts is None:
            return out
        for ep_rank in range(self.experts.ep_size):
            for tp, dp in self.experts.holder_files(ep_rank):
                experts = self.expert_groups(tp, dp)
                for group, mapping in enumerate(self.wrapper_state(tp, dp)[keys.PARAM_SLICE_MAPPINGS]):
                    if group not in experts:
                        continue
                    for name, address in mapping.items():
                        out.setdefault((name, ep_rank), []).append(
                            Fragment(dp, group, int(address.start), int(address.numel), tp_rank=tp))
        return out

    def padding(self, tp: int, dp: int, group: int) -> int:
        paddings = self.wrapper_state(tp, dp).get(keys.GROUP_PADDINGS) or []
        return int(paddings[group]) if group < len(paddings) else 0

    def whole_param_offsets(self, tp: int, dp: int, group: int, state: str) -> dict[str, int] | None:
        """DeepSpeed's Muon under ZeRO-1/2 keeps a param group's momentum for the *whole* parameters whose elements
        lie in a rank's partition, one after another in partition order (Newton-Schulz needs whole matrices; a
        matrix split between two partitions has its momentum on both). Only there: with the optimizer offloaded to
        the CPU, and for every other state, the state is laid out like the master partition."""
        if state != MUON_MOMENTUM or not self._muon_group(tp, dp, group) or self._optimizer_offloaded:
            return None
        mapping = self.wrapper_state(tp, dp)[keys.PARAM_SLICE_MAPPINGS][group]
        shapes = self.saved_shapes(tp)
        offsets, offset = {}, 0
        for name in mapping:
            offsets[name] = offset
            offset += int(torch.Size(shapes[name]).numel())
        held = self.flat(tp, dp, group, state).numel()
        if held != offset:
            raise CheckpointError(f"{self.files.optim_files[(tp, dp)]}: Muon's {state} of param group {group} holds "
                                  f"{held} elements, the whole parameters of its partition {offset}: a layout of "
                                  "DeepSpeed's Muon not supported")
        return offsets

    def _muon_group(self, tp: int, dp: int, group: int) -> bool:
        groups = self.base_state(tp, dp).get(keys.PARAM_GROUPS) or []
        return group < len(groups) and bool(groups[group].get(USE_MUON))

    @functools.cached_property
    def _optimizer_offloaded(self) -> bool:
        """Whether the saved run offloaded its optimizer (DeepSpeed's config, saved in the model states)."""
        found: Any = self.files.model_states(0).get(keys.DS_CONFIG)
        for key in ("zero_optimization", "offload_optimizer", "device"):
            found = found.get(key) if isinstance(found, dict) else None
        return str(found or "none").lower() != "none"


class BF16OptimizerLayout(Zero12Layout):
    """BF16_Optimizer writes ZeRO-1's files minus ``zero_stage`` (reported as stage 1, which it partitions like)."""

    kind = "BF16_Optimizer"

    def whole_param_offsets(self, tp: int, dp: int, group: int, state: str) -> dict[str, int] | None:
        return None  # its Muon keeps the momentum laid out like the master partition


class Zero3Layout(_PartitionedLayout):
    kind = "DeepSpeedZeroOptimizer_Stage3"
    required_keys = (keys.FP32_FLAT_GROUPS, keys.OPTIMIZER_STATE_DICT)
    masters_key = keys.FP32_FLAT_GROUPS

    base_state_key = keys.OPTIMIZER_STATE_DICT

    def fragments(self, tp: int) -> dict[str, list[Fragment]]:
        out: dict[str, list[Fragment]] = {}
        experts = self.expert_groups(tp, 0)
        for group, shapes in enumerate(self._param_shapes(tp)):
            if group in experts:
                continue
            numels = [(name, int(torch.Size(shape).numel())) for name, shape in shapes.items()]
            owners = self.partition_owners(tp, group, [numel for _, numel in numels])
            self._add_partitioned(out, lambda name: name, numels, owners, group)
        return out

    def expert_fragments(self) -> dict[tuple[str, int], list[Fragment]]:
        out: dict[tuple[str, int], list[Fragment]] = {}
        if self.experts is None:
            return out
        experts = self.expert_groups(0, 0)
        for group, shapes in enumerate(self._param_shapes(0)):
            if group not in experts:
                continue
            numels = [(name, int(torch.Size(shape).numel())) for name, shape in shapes.items()]
            for ep_rank in range(self.experts.ep_size):
                owners = self.experts.holder_files(ep_rank)
                flat = self.flat(*owners[0], group, MASTER_WEIGHTS).numel()
                implied = sum(-(-numel // len(owners)) for _, numel in numels)
                if flat != implied:
                    raise CheckpointError(f"{self.files.optim_files[owners[0]]}: flat partition of expert group "
                                          f"{group} has {flat} elements, param_shapes imply {implied}")
                self._add_partitioned(out, functools.partial(_with_rank, rank=ep_rank), numels, owners, group)
        return out

    @staticmethod
    def _add_partitioned(out: dict[Any, list[Fragment]], key_of: Callable[[str], Any], numels: list[tuple[str, int]],
                         owners: list[tuple[int, int]], group: int) -> None:
        """ZeRO-3's partitioning of a flat group: each parameter takes ``ceil(numel / ranks)`` slots per owner,
        in order, the last owner's padded."""
        offset = 0
        for name, numel in numels:
            part = -(-numel // len(owners))
            for index, (owner_tp, owner_dp) in enumerate(owners):
                length = max(0, min(part, numel - index * part))
                if length:
                    out.setdefault(key_of(name), []).append(Fragment(owner_dp, group, offset, length, owner_tp))
            offset += part

    def expert_groups(self, tp: int, dp: int) -> set[int]:
        """ZeRO-3 says which flat sub-groups hold AutoEP experts in ``ds_zero_partition_groups``."""
        if self.experts is None:
            return set()
        recorded = self.wrapper_state(tp, dp).get("ds_zero_partition_groups")
        if isinstance(recorded, list):
            return {int(entry.get("sub_group", index)) for index, entry in enumerate(recorded)
                    if "autoep_expert" in (entry.get("families") or [])}
        return super().expert_groups(tp, dp)

    def partition_owners(self, tp: int, group: int, numels: list[int]) -> list[tuple[int, int]]:
        """The (TP, DP) ranks that param group ``group`` of TP rank ``tp`` is partitioned over, in partition order.

        Normally the DP ranks of that TP rank. A model built under ``deepspeed.zero.Init`` before AutoTP sharded
        it (the Hugging Face Trainer with a ZeRO-3 config builds it so) keeps the parameters AutoTP leaves whole
        partitioned over every rank, TP ranks included, in global-rank order (a TP group is consecutive ranks).
        The flat partition's size tells the two apart.
        """
        flat = self.flat(tp, 0, group, MASTER_WEIGHTS).numel()
        over_dp = [(tp, dp) for dp in range(self.dp_degree)]
        over_world = [(t, dp) for dp in range(self.dp_degree) for t in range(self.tp_degree)]
        for owners in (over_dp, over_world):
            if sum(-(-numel // len(owners)) for numel in numels) == flat:
                return owners
        implied = sum(-(-numel // self.dp_degree) for numel in numels)
        raise CheckpointError(f"{self.files.optim_files[(tp, 0)]}: flat partition of group {group} has {flat} "
                              f"elements, param_shapes imply {implied} (ZeRO-3 sub_group_size smaller than a param "
                              "group is not supported)")

    def optimizer_state_for_universal(self) -> dict[str, Any]:
        out = super().optimizer_state_for_universal()
        base = self.base_state(0, 0)
        # DeepSpeed's ZeRO-3 universal loader reads the step and hyper-parameters from here; the flat
        # moments stay out (they are in zero/<param>/ already).
        out[keys.OPTIMIZER_STATE_DICT] = {
            keys.STATE: {group: {STEP: st[STEP]} for group, st in base[keys.STATE].items() if STEP in st},
            keys.PARAM_GROUPS: base[keys.PARAM_GROUPS],
        }
        return out


def _with_rank(name: str, rank: int) -> tuple[str, int]:
    return name, rank


def choose_layout(files: TagFiles, tp_degree: int, dp_degree: int, recorded_names: RecordedNames,
                  experts: ExpertParallel | None = None) -> OptimizerLayout:
    """The layout this checkpoint's files were written in, checked."""
    layout: OptimizerLayout
    if not files.optim_files:
        layout = Stage0Layout(files, tp_degree, dp_degree, recorded_names)
    else:
        missing = [(tp, dp) for tp in range(tp_degree) for dp in range(dp_degree) if (tp, dp) not in files.optim_files]
        if missing:
            tp, dp = missing[0]
            raise CheckpointError(f"{files.tag_dir}: missing optimizer file for dp_rank {dp}, mp_rank {tp:02d} "
                                  f"({len(missing)} missing)")
        if files.partitioned_weights:
            layout = Zero3Layout(files, tp_degree, dp_degree, experts)
        elif keys.ZERO_STAGE in files.optimizer_file_state(0, 0):
            layout = Zero12Layout(files, tp_degree, dp_degree, experts)
        else:
            layout = BF16OptimizerLayout(files, tp_degree, dp_degree, experts)
    layout.check()
    return layout

