"""The fingerprints of a live DeepSpeed engine's training state (what a save records and a resume checks),
summed where each rank holds its share and added up over the ranks by rank 0 (one gather, one broadcast).

Where each state lives in the engine is asked of :mod:`~deepspeed_ext.checkpoint.engine_private`; the sums and
their comparison are :mod:`~deepspeed_ext.checkpoint.fingerprint`'s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from deepspeed_ext.checkpoint import engine_private
from deepspeed_ext.checkpoint.fingerprint import ROW_ELEMENTS, Fingerprint, Fingerprints, partial_sums
from deepspeed_ext.checkpoint.model_config import persistent_buffers
from deepspeed_ext.checkpoint.states import MASTER_WEIGHTS, MODULE_WEIGHTS, ordered_states
from deepspeed_ext.checkpoint.zipsave import Region
from deepspeed_ext.module_inject.autotp import LAYOUT_ATTR


def engine_fingerprints(engine: Any, with_moments: bool = True) -> tuple[Fingerprints, list[str]]:
    """The fingerprints of a live DeepSpeed engine's training state, and any problem found on the way.

    Collective: every rank of the engine calls it. Each rank sums what it owns (its TP slice, or TP rank 0 for
    a replicated tensor; its ZeRO partition, or DP rank 0 without ZeRO), then rank 0 gathers the sums, adds them
    up and hands every rank the result; the full tensors are never assembled.
    """
    return reduce_engine_sums(local_engine_sums(engine, with_moments))


@dataclass
class LocalSums:
    """One rank's share of an engine's fingerprints, before rank 0 adds the ranks' shares up."""

    params: list[str]
    states: tuple[str, ...]
    sums: torch.Tensor  # [param, state, (numel, sum, sum of squares)], float64
    buffers: list[tuple[str, torch.dtype]]
    buffer_sums: torch.Tensor  # [buffer, (numel, sum, sum of squares)]
    spread: torch.Tensor  # (lowest step, -lowest step, highest step, -highest step, global steps, -global steps)
    with_moments: bool
    #: The pipeline stage this rank runs and the number of stages (0, 1 without pipeline parallelism): stages
    #: hold different parameters.
    stage: int = 0
    stages: int = 1

    def to_json(self) -> dict[str, Any]:
        """Plain lists and strings (floats exact): what a rank hands the others, by a gather or in a file."""
        return {"params": self.params, "states": list(self.states), "sums": self.sums.tolist(),
                "buffers": [[name, str(dtype).removeprefix("torch.")] for name, dtype in self.buffers],
                "buffer_sums": self.buffer_sums.tolist(), "spread": self.spread.tolist(),
                "with_moments": self.with_moments, "stage": self.stage, "stages": self.stages}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LocalSums:
        states = tuple(data["states"])
        return cls(list(data["params"]), states,
                   torch.tensor(data["sums"], dtype=torch.float64).reshape(len(data["params"]), len(states), 3),
                   [(name, getattr(torch, dtype)) for name, dtype in data["buffers"]],
                   torch.tensor(data["buffer_sums"], dtype=torch.float64).reshape(len(data["buffers"]), 3),
                   torch.tensor(data["spread"], dtype=torch.float64), bool(data["with_moments"]),
                   int(data["stage"]), int(data["stages"]))


def local_engine_sums(engine: Any, with_moments: bool = True) -> LocalSums:
    """This rank's share of :func:`engine_fingerprints`: no collective, so it can run on a thread while the
    engine saves (nothing it reads changes during a save)."""
    return SumsPlan(engine, with_moments).finish()


class SumsPlan:
    """What this rank sums for :func:`local_engine_sums`, before it is summed: each owned state is summed either
    from the bytes a checkpoint writer reads anyway (the plan is a :class:`zipsave.Observer`: a state that lies
    inside a storage being written is summed block by block from the cache as the block is written) or, for
    whatever no writer showed, by :meth:`finish`. Either way a state's rows of ``ROW_ELEMENTS`` are the same."""

    def __init__(self, engine: Any, with_moments: bool = True):
        tp_size, tp_rank = engine_private.model_parallel_info(engine)
        # The master and every tensor state the optimizer keeps (Adam's moments, Muon's and SGD's momentum, ...).
        states = ordered_states(engine_private.live_tensor_states(engine)) if with_moments else (MASTER_WEIGHTS, )
        # The module's bf16/fp16 weights too, where its model-states files hold them apart from the masters: a
        # bf16 export may read them instead (half the bytes, no cast) and still check what it read.
        if engine_private.module_weights_apart(engine):
            states = (*states, MODULE_WEIGHTS)
        whole = engine_private.muon_whole_offsets(engine)
        # Frozen parameters too (no optimizer steps them, their weights alone are checkpointed state): a resume
        # that left one out would train on with the wrong weights.
        params = list(engine.module.named_parameters())
        stage0 = engine_private.stage0_slots(engine)
        base = engine_private.base_optimizer(engine)
        distributed = dist.is_available() and dist.is_initialized()
        dp_group = engine_private.data_parallel_group(engine)
        dp_rank = dist.get_rank(group=dp_group) if distributed else 0

        dp_size = (dist.get_world_size() // tp_size) if distributed else 1
        #: (param index, state index) -> the tensor this rank sums; removed once a writer claimed it
        self.pending: dict[tuple[int, int], torch.Tensor] = {}
        for i, (_, param) in enumerate(params):
            layout = getattr(param, LAYOUT_ATTR, None)
            # A tensor every TP rank holds whole: TP rank 0 speaks for it. Unless ZeRO-3 partitioned it over the
            # TP ranks too (a model built under zero.Init before AutoTP ran, as the HF Trainer does): then the
            # ranks' partitions cover it once between them.
            over_tp = (engine_private.is_zero3_param(param)
                       and dist.get_world_size(group=engine_private.zero3_process_group(param)) > dp_size)
            if (layout is None or layout.is_replicated) and tp_rank != 0 and not over_tp:
                continue
            for j, state in enumerate(states):
                if engine_private.no_optimizer_holds(param, stage0):
                    # Frozen: its weights, as fp32, what every checkpoint format holds of it.
                    local = engine_private.owned_frozen_weights(param, dp_rank) if state == MASTER_WEIGHTS else None
                elif state == MODULE_WEIGHTS:  # whole on every DP rank: DP rank 0 speaks for it
                    local = param if dp_rank == 0 and param.dtype in engine_private.LOW_PRECISION else None
                else:
                    local = engine_private.owned_state(param, state, stage0, base, dp_rank, whole)
                if local is not None and local.numel():
                    self.pending[i, j] = local.detach()
        self.sums = torch.zeros(len(params), len(states), 3, dtype=torch.float64)
        self._claimed: list[tuple[tuple[int, int], torch.Tensor]] = []
        # Persistent buffers (DeepSeek-V3's router bias) are checkpointed state too: whole on every rank.
        self._buffers = [(name, buffer) for name, buffer in persistent_buffers(engine.module).items()
                         if name not in dict(params)]
        self._sum_buffers = tp_rank == 0 and dp_rank == 0
        low, high, global_steps = engine_private.live_steps(engine)
        # Each rank's lowest and highest optimizer step (param groups may count differently: DeepSpeed's Muon
        # without ZeRO keeps its Adam parameters' steps apart) and its global step travel as max and -min, so one
        # MAX all-reduce shows whether every rank agrees.
        self._spread = torch.tensor([low, -low, high, -high, global_steps, -global_steps], dtype=torch.float64)
        self._params = [name for name, _ in params]
        self._states = states
        self._with_moments = with_moments
        self._stage, self._stages = engine_private.pipeline_stage(engine)

    def point_at(self, copy_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Sum copies instead of the live tensors (a save's snapshot: ``copy_of`` gives each tensor's copy), so that
        training may go on while the sums are taken. Called before any sum is."""
        self.pending = {key: copy_of(tensor) for key, tensor in self.pending.items()}
        self._buffers = [(name, copy_of(buffer)) for name, buffer in self._buffers]

    def regions(self, address: int, nbytes: int) -> list[Any]:
        """The pending states that lie whole in ``nbytes`` of memory at ``address`` (a storage being written),
        claimed: each is summed from the pieces the writer shows it."""
        found = []
        for key, tensor in self.pending.items():
            start = tensor.data_ptr() - address
            if (tensor.is_contiguous() and tensor.device.type == "cpu" and tensor.dtype.is_floating_point
                    and 0 <= start and start + tensor.numel() * tensor.element_size() <= nbytes):
                found.append((start, key, tensor))
        found.sort(key=lambda item: item[0])
        regions, end = [], 0
        for start, key, tensor in found:
            if start < end:  # overlaps the previous one: left to finish()
                continue
            del self.pending[key]
            self._claimed.append((key, tensor))
            regions.append(Region(start, tensor.reshape(-1), functools.partial(self._add, key), ROW_ELEMENTS))
            end = start + tensor.numel() * tensor.element_size()
        return regions

    def _add(self, key: tuple[int, int], piece: torch.Tensor) -> None:
        numel, total, total_sq = partial_sums(piece)
        row = self.sums[key]
        row[0] += numel
        row[1] += total
        row[2] += total_sq

    def unread_ranges(self) -> list[tuple[int, int]]:
        """``(address, end)`` of the memory :meth:`finish` still reads: the states no writer claimed, and the
        buffers."""
        tensors = [*self.pending.values(), *(buffer for _, buffer in self._buffers)] if self._sum_buffers \
            else list(self.pending.values())
        return [(tensor.data_ptr(), tensor.data_ptr() + _span_bytes(tensor)) for tensor in tensors
                if tensor.device.type == "cpu" and tensor.numel()]

    def mark(self) -> int:
        """A point to :meth:`rollback` to if the write that follows fails."""
        return len(self._claimed)

    def rollback(self, mark: int) -> None:
        """Forget what was summed since ``mark`` (the write failed midway): those states are pending again."""
        while len(self._claimed) > mark:
            key, tensor = self._claimed.pop()
            self.sums[key] = 0.0
            self.pending[key] = tensor

    def finish(self) -> LocalSums:
        """This rank's sums: what no writer showed is summed now."""
        for key, row in _sums_of(self.pending).items():
            self.sums[key] = row
        self.pending = {}
        buffer_sums = torch.zeros(len(self._buffers), 3, dtype=torch.float64)
        if self._sum_buffers:
            for i, row in _sums_of(dict(enumerate(buffer for _, buffer in self._buffers))).items():
                buffer_sums[i] = row
        return LocalSums(self._params, self._states, self.sums,
                         [(name, buffer.dtype) for name, buffer in self._buffers], buffer_sums, self._spread,
                         self._with_moments, self._stage, self._stages)


def _span_bytes(tensor: torch.Tensor) -> int:
    """The bytes from a tensor's first element to just past its last, strides and all."""
    return (1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))) \
        * tensor.element_size()


def reduce_engine_sums(local: LocalSums) -> tuple[Fingerprints, list[str]]:
    """The engine's fingerprints from every rank's :class:`LocalSums`, and any disagreement between the ranks.
    Collective: rank 0 gathers every rank's sums, adds them up in rank order (:func:`combine_local_sums`, the same
    additions a save written in the background makes) and hands every rank the result."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return combine_local_sums([local])
    first = dist.get_rank() == 0
    gathered: list[Any] | None = [None] * dist.get_world_size() if first else None
    dist.gather_object(local.to_json(), gathered, dst=0)
    result: list[Any] = [combine_local_sums([LocalSums.from_json(data) for data in gathered or []]) if first
                         else None]
    dist.broadcast_object_list(result, src=0)
    found: tuple[Fingerprints, list[str]] = result[0]
    return found


def _sums_of(tensors: dict[Any, torch.Tensor]) -> dict[Any, torch.Tensor]:
    """Each tensor's ``[numel, sum, sum of squares]`` (float64, on the host). Those on an accelerator are summed
    there and brought over together: one synchronisation, not several per tensor."""
    from deepspeed_ext.checkpoint.fingerprint import partial_sums_on_device
    on_device = [key for key, tensor in tensors.items() if tensor.device.type not in ("cpu", "meta")]
    found = dict(zip(on_device, torch.stack([partial_sums_on_device(tensors[key]) for key in on_device]).cpu(),
                     strict=True)) if on_device else {}
    for key, tensor in tensors.items():
        if key not in found:
            found[key] = torch.tensor(partial_sums(tensor), dtype=torch.float64)
    return found


def combine_local_sums(ranks: list[LocalSums]) -> tuple[Fingerprints, list[str]]:
    """The engine's fingerprints from each rank's :class:`LocalSums`, in rank order, and any disagreement between
    the ranks. No collective: a save written in the background adds up the sums its ranks left in files, and gets
    the very same floats as a save that gathered them (the same additions in the same order)."""
    names, buffers = _union_of_names(ranks)
    states = ranks[0].states
    sums = torch.zeros(len(names), len(states), 3, dtype=torch.float64)
    buffer_sums = torch.zeros(len(buffers), 3, dtype=torch.float64)
    spread = torch.full((6, ), -float("inf"), dtype=torch.float64)
    first_stage = _first_stage_of_each_name(ranks)
    index = {name: i for i, name in enumerate(names)}
    buffer_index = {name: i for i, (name, _) in enumerate(buffers)}
    for local in ranks:
        # A name several pipeline stages hold (a tied embedding) is counted from the first of them only: each
        # holds the whole tensor's copy.
        for i, name in enumerate(local.params):
            if first_stage[name] == local.stage:
                sums[index[name]] += local.sums[i]
        for i, (name, _) in enumerate(local.buffers):
            if first_stage[name] == local.stage:
                buffer_sums[buffer_index[name]] += local.buffer_sums[i]
        spread = torch.maximum(spread, local.spread)
    found, problems = Fingerprints(), []
    for i, name in enumerate(names):
        for j, state in enumerate(states):
            numel, total, total_sq = sums[i, j].tolist()
            if numel:
                found.add(name, state, Fingerprint(int(numel), total, total_sq))
    for (name, dtype), row in zip(buffers, buffer_sums.tolist(), strict=True):
        if row[0]:
            found.add(name, MASTER_WEIGHTS, Fingerprint(int(row[0]), *row[1:]))
            if dtype in engine_private.LOW_PRECISION:
                found.roundings[name] = float(torch.finfo(dtype).eps)
            if ranks[0].with_moments:  # no optimizer steps a buffer: checkpoints carry its states as zeros
                for state in (s for s in states[1:] if s != MODULE_WEIGHTS):
                    found.add(name, state, Fingerprint(int(row[0]), 0.0, 0.0))
    for position, key in ((0, "lowest step"), (2, "step"), (4, "global_steps")):
        high, low = spread[position].item(), -spread[position + 1].item()
        if high != low:
            problems.append(f"the {key} differs between ranks ({int(low)}..{int(high)})")
        elif high >= 0 and key != "lowest step":
            setattr(found, key, int(high))
    return found, problems


def _union_of_names(ranks: list[LocalSums]) -> tuple[list[str], list[tuple[str, torch.dtype]]]:
    """The parameters and the buffers of every rank, in the order the ranks first name them (every rank names
    the same ones unless the engine is pipeline-parallel, where each stage holds its layers)."""
    names: dict[str, None] = {}
    buffers: dict[str, torch.dtype] = {}
    for local in ranks:
        names.update(dict.fromkeys(local.params))
        for name, dtype in local.buffers:
            buffers.setdefault(name, dtype)
    return list(names), list(buffers.items())


def _first_stage_of_each_name(ranks: list[LocalSums]) -> dict[str, int]:
    first: dict[str, int] = {}
    for local in ranks:
        for name in [*local.params, *(name for name, _ in local.buffers)]:
            first[name] = min(first.get(name, local.stage), local.stage)
    return first
