"""Resume fingerprints: a few float64 numbers per parameter state that catch a resume gone quietly wrong.

A fingerprint of a tensor is its element count, the sum and the sum of squares of its elements, accumulated in
float64 (the sum over rows of 4096 elements and the squares over runs of 512 in float32, then the rows and runs
in float64, with squares that would underflow float32 scaled first: accurate to about 1e-8 to 1e-7 relative and
as fast as reading the tensor once). At ``save_checkpoint`` every rank sums the part of each fp32 master and
Adam moment it owns (its TP slice's DP partition) and one all-reduce adds them up: no full tensor is gathered.
Writers record the fingerprints of what they write (universal, HF, MaxText); at ``load_checkpoint`` the live
engine's fingerprints are recomputed the same way and compared with the ones the checkpoint recorded.

What they catch: swapped or zeroed moments, one TP rank's slice loaded in place of another's, a tied tensor
read from the wrong shard, a wrong step, a state that never arrived. What they do not: a permutation of the
elements inside one tensor (sums do not see order), or a change smaller than the rounding of the sums.

Two fingerprints agree when the sum of squares differs by at most ``SUMMATION_RTOL`` of itself and the sum by
at most ``SUMMATION_RTOL`` of ``sqrt(count * sum of squares)`` (which bounds the sum of absolute values), plus, for
values that went through one rounding in a lower precision after they were summed (a buffer the live engine
holds in bf16), that rounding. Writers fingerprint what a read of their output returns, so a reader checks
exactly: to-maxtext sums each array as stored, undone from MaxText's layout in fp32 as from-maxtext does.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from deepspeed_ext.errors import CheckpointError

if TYPE_CHECKING:
    import torch

#: The key of the fingerprints in ``deepspeed_ext.json``, in MaxText's custom metadata and in safetensors'
#: ``__metadata__``.
FINGERPRINTS_KEY = "fingerprints"
FINGERPRINT_FORMAT = 1
#: Summing in another order (another TP/DP split moves the row boundaries) changes a float32 row's sum of
#: squares by about 1e-8 of it; 1e-6 leaves a hundredfold margin.
SUMMATION_RTOL = 1e-6
#: Elements per float32 row; the rows' sums are added in float64.
ROW_ELEMENTS = 4096
#: Elements converted at a time when a tensor is not float32 (bf16 weights): bounds the temporary memory.
CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class Fingerprint:
    """The sums of one tensor in float64."""

    numel: int
    total: float
    total_sq: float

    def to_json(self) -> list[float | int]:
        return [self.numel, self.total, self.total_sq]

    @classmethod
    def from_json(cls, data: Any) -> Fingerprint:
        numel, total, total_sq = data
        return cls(int(numel), float(total), float(total_sq))

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Fingerprint:
        """The fingerprint of a whole tensor."""
        numel, total, total_sq = partial_sums(tensor)
        return cls(int(numel), total, total_sq)

    def describe(self) -> str:
        return f"sum={self.total:.9g} sum_sq={self.total_sq:.9g} ({self.numel} elements)"

    def agrees(self, other: Fingerprint, rounding: float = 0.0) -> bool:
        """Equal up to the float64 rounding of summation order, plus ``rounding``: the largest relative
        change of any element on the way (the unit roundoff of a precision the values passed through)."""
        if self.numel != other.numel:
            return False
        if not all(math.isfinite(v) for v in (self.total, self.total_sq, other.total, other.total_sq)):
            return (self.total, self.total_sq) == (other.total, other.total_sq) or _same_nan(self, other)
        scale_sq = max(self.total_sq, other.total_sq)
        scale_abs = math.sqrt(self.numel * scale_sq)  # >= the sum of absolute values (Cauchy-Schwarz)
        return (abs(self.total - other.total) <= (SUMMATION_RTOL + 2 * rounding) * scale_abs
                and abs(self.total_sq - other.total_sq) <= (SUMMATION_RTOL + 4 * rounding) * scale_sq)


def _same_nan(a: Fingerprint, b: Fingerprint) -> bool:
    return all(math.isnan(x) == math.isnan(y) for x, y in ((a.total, b.total), (a.total_sq, b.total_sq)))


#: Elements per float32 run of squares (divides ROW_ELEMENTS).
SQUARE_ROW_ELEMENTS = 512
#: A float32 row whose sum of squares is below this has lost digits to underflow (squares of values below about
#: 1e-19, such as an Adam second moment of a rarely updated row, fall out of float32's normal range).
_TINY_ROW_SQ = 2.0 ** -80


def _rows_sum_sq(rows: torch.Tensor) -> float:
    """The sum of squares of float32 ``rows`` ([n, ROW_ELEMENTS]), each run of SQUARE_ROW_ELEMENTS in float32,
    the runs in float64.

    Where even the largest row's sum of squares underflowed (or overflowed) in float32, the rows are scaled by a
    power of two first (exact) and the scale taken out in float64: a tensor of tiny values, whose fingerprint
    would otherwise depend on where the rows start, is summed as accurately as any other. Where other rows are
    large, a tiny row's lost digits are far below the tolerance of the whole sum."""
    import torch
    # Squares accumulate in float32 in runs of SQUARE_ROW_ELEMENTS: over 4096 of a heavy-tailed tensor (Adam's
    # second moment) a run's sum was off by 1e-6 of itself, the whole tolerance; over 512 by 1e-7, as fast.
    if rows.shape[1] % SQUARE_ROW_ELEMENTS == 0:
        rows = rows.reshape(-1, SQUARE_ROW_ELEMENTS)
    row_sq = torch.linalg.vector_norm(rows, dim=1).double().square()
    largest = float(row_sq.max())
    if _TINY_ROW_SQ <= largest < math.inf or math.isnan(largest):
        return float(row_sq.sum())
    low, high = torch.aminmax(rows)
    biggest = max(abs(float(low)), abs(float(high)))
    if not 0.0 < biggest < math.inf:  # all zeros, or Inf/NaN elements: nothing to rescue
        return float(row_sq.sum())
    exponent = max(-126, min(126, -math.frexp(biggest)[1]))
    scaled = torch.linalg.vector_norm(rows * (2.0 ** exponent), dim=1).double().square()
    return float(scaled.sum()) * 2.0 ** (-2 * exponent)


def partial_sums(tensor: torch.Tensor) -> tuple[int, float, float]:
    """``(numel, sum, sum of squares)`` of ``tensor``: each row of ``ROW_ELEMENTS`` reduced in float32, the rows
    and the remainder in float64. Reads a float32 tensor once, with no copy."""
    import torch
    flat = tensor.detach().reshape(-1)
    total, total_sq = 0.0, 0.0
    for chunk in torch.split(flat, CHUNK_ELEMENTS):
        if chunk.dtype != torch.float32:
            chunk = chunk.to(torch.float64 if chunk.dtype == torch.float64 else torch.float32)
        body = chunk.numel() - chunk.numel() % ROW_ELEMENTS
        if body:
            rows = chunk[:body].view(-1, ROW_ELEMENTS)
            total += float(rows.sum(1).double().sum())
            total_sq += _rows_sum_sq(rows)
        tail = chunk[body:].double()
        total += float(tail.sum())
        total_sq += float(torch.dot(tail, tail))
    return flat.numel(), total, total_sq


@dataclass
class Fingerprints:
    """The fingerprints of a checkpoint: per parameter, per state (``fp32``, ``exp_avg``, ``exp_avg_sq``), plus
    the optimizer step and the engine's step counter where known."""

    tensors: dict[str, dict[str, Fingerprint]] = field(default_factory=dict)
    step: int | None = None
    global_steps: int | None = None
    #: The unit roundoff of a precision the recorded values went through after they were fingerprinted
    #: (0: they are exactly what was summed); see :meth:`Fingerprint.agrees`.
    rounding: float = 0.0
    #: Per tensor, a rounding of its own on top (a buffer the engine holds in bf16: the loaded value was
    #: rounded to it); not stored.
    roundings: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, state: str, fingerprint: Fingerprint) -> None:
        self.tensors.setdefault(name, {})[state] = fingerprint

    def get(self, name: str, state: str) -> Fingerprint | None:
        return self.tensors.get(name, {}).get(state)

    def subset(self, names: Iterable[str]) -> Fingerprints:
        """The fingerprints of ``names`` only (with the steps)."""
        return Fingerprints({name: self.tensors[name] for name in names if name in self.tensors},
                            self.step, self.global_steps, self.rounding)

    def merge(self, other: Fingerprints) -> None:
        for name, states in other.tensors.items():
            for state, fingerprint in states.items():
                self.add(name, state, fingerprint)
        self.step = self.step if other.step is None else other.step
        self.global_steps = self.global_steps if other.global_steps is None else other.global_steps

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "format": FINGERPRINT_FORMAT,
            "sums": "numel, sum, sum of squares",
            "step": self.step,
            "global_steps": self.global_steps,
            "tensors": {name: {state: fp.to_json() for state, fp in states.items()}
                        for name, states in self.tensors.items()},
        }
        if self.rounding:
            data["rounding"] = self.rounding
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str = "") -> Fingerprints:
        try:
            if int(data.get("format", 0)) > FINGERPRINT_FORMAT:
                raise CheckpointError(f"{source}: fingerprint format {data['format']} is newer than this "
                                      "deepspeed-ext understands; upgrade deepspeed-ext")
            step, global_steps = data.get("step"), data.get("global_steps")
            return cls(tensors={str(name): {str(state): Fingerprint.from_json(fp) for state, fp in states.items()}
                                for name, states in data["tensors"].items()},
                       step=None if step is None else int(step),
                       global_steps=None if global_steps is None else int(global_steps),
                       rounding=float(data.get("rounding", 0.0)))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{source}: malformed fingerprints: {exc!r}") from exc


@dataclass(frozen=True)
class Mismatch:
    """One disagreement between the recorded fingerprints and the ones computed now."""

    name: str
    state: str
    recorded: str
    found: str

    def describe(self) -> str:
        return f"{self.name!r} {self.state}: recorded {self.recorded}, found {self.found}"


def compare(recorded: Fingerprints, found: Fingerprints, states: Iterable[str] | None = None,
            check_step: bool = True) -> tuple[int, list[Mismatch]]:
    """``(checked, mismatches)``: every (tensor, state) both sides have (of ``states``, or all), and the steps.

    A tensor or state the live side lacks is a mismatch (it was recorded, so it should have been loaded);
    one the record lacks is not checked (an older checkpoint, a parameter frozen when it was saved).
    """
    wanted = set(states) if states is not None else None
    checked, mismatches = 0, []
    for name, saved_states in recorded.tensors.items():
        for state, saved in saved_states.items():
            if wanted is not None and state not in wanted:
                continue
            live = found.get(name, state)
            checked += 1
            if live is None:
                mismatches.append(Mismatch(name, state, saved.describe(), "nothing"))
            elif not saved.agrees(live, rounding=max(recorded.rounding, found.rounding,
                                                     found.roundings.get(name, 0.0))):
                mismatches.append(Mismatch(name, state, saved.describe(), live.describe()))
    if check_step:
        for key in ("step", "global_steps"):
            saved_step, live_step = getattr(recorded, key), getattr(found, key)
            if saved_step is not None and live_step is not None:
                checked += 1
                if saved_step != live_step:
                    mismatches.append(Mismatch("optimizer" if key == "step" else "engine", key, str(saved_step),
                                               str(live_step)))
    return checked, mismatches


RESTORED_WRONG = "the restored training state is not the one that was saved"


SOURCE_WRONG = "the source does not hold what was written into it; nothing was written"


def mismatch_message(where: str, mismatches: list[Mismatch], checked: int, meaning: str = RESTORED_WRONG) -> str:
    """One line: how many of the checked fingerprints disagree, the first few named with both values, and
    what that means (a resume gone wrong, or a damaged source)."""
    shown = "; ".join(m.describe() for m in mismatches[:3])
    more = f"; and {len(mismatches) - 3} more" if len(mismatches) > 3 else ""
    subject = "resume fingerprints" if meaning == RESTORED_WRONG else "recorded fingerprints"
    return (f"{where}: {subject} disagree for {len(mismatches)} of {checked} checked states: {shown}"
            f"{more}: {meaning}")


# --------------------------------------------------------------------------- a live engine
def engine_fingerprints(engine: Any, with_moments: bool = True) -> tuple[Fingerprints, list[str]]:
    """The fingerprints of a live DeepSpeed engine's training state, and any problem found on the way.

    Collective: every rank of the engine calls it. Each rank sums what it owns (its TP slice, or TP rank 0 for
    a replicated tensor; its ZeRO partition, or DP rank 0 without ZeRO), then one all-reduce over all ranks
    adds the sums up; the full tensors are never assembled.
    """
    return reduce_engine_sums(local_engine_sums(engine, with_moments))


@dataclass
class LocalSums:
    """One rank's share of an engine's fingerprints, before the all-reduce that adds the ranks' shares up."""

    params: list[str]
    states: tuple[str, ...]
    sums: torch.Tensor  # [param, state, (numel, sum, sum of squares)], float64
    buffers: list[tuple[str, torch.dtype]]
    buffer_sums: torch.Tensor  # [buffer, (numel, sum, sum of squares)]
    spread: torch.Tensor  # (max step, -min step, max global steps, -min global steps)
    with_moments: bool


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
        import torch
        import torch.distributed as dist

        from deepspeed_ext.checkpoint.deepspeed import zero0
        from deepspeed_ext.checkpoint.source import ADAM_STATES, MASTER_WEIGHTS
        from deepspeed_ext.checkpoint.tensor import persistent_buffers
        from deepspeed_ext.module_inject.autotp import LAYOUT_ATTR, tp_group_info

        tp_size, tp_rank = tp_group_info()
        states = (MASTER_WEIGHTS, *ADAM_STATES) if with_moments else (MASTER_WEIGHTS, )
        params = [(name, param) for name, param in engine.module.named_parameters() if param.requires_grad]
        optimizer = getattr(engine, "optimizer", None)
        stage0 = zero0.live_slots(optimizer) if optimizer is not None and not engine.zero_optimization() else {}
        base = zero0.wrapped_optimizer(optimizer) if optimizer is not None else None
        distributed = dist.is_available() and dist.is_initialized()
        dp_group = getattr(engine, "data_parallel_group", None)
        dp_rank = dist.get_rank(group=dp_group) if distributed else 0

        dp_size = (dist.get_world_size() // tp_size) if distributed else 1
        #: (param index, state index) -> the tensor this rank sums; removed once a writer claimed it
        self.pending: dict[tuple[int, int], torch.Tensor] = {}
        for i, (_, param) in enumerate(params):
            layout = getattr(param, LAYOUT_ATTR, None)
            # A tensor every TP rank holds whole: TP rank 0 speaks for it. Unless ZeRO-3 partitioned it over the
            # TP ranks too (a model built under zero.Init before AutoTP ran, as the HF Trainer does): then the
            # ranks' partitions cover it once between them.
            over_tp = hasattr(param, "ds_id") and dist.get_world_size(group=param.ds_process_group) > dp_size
            if (layout is None or layout.is_replicated) and tp_rank != 0 and not over_tp:
                continue
            for j, state in enumerate(states):
                local = _owned_state(param, state, stage0, base, dp_rank)
                if local is not None and local.numel():
                    self.pending[i, j] = local.detach()
        self.sums = torch.zeros(len(params), len(states), 3, dtype=torch.float64)
        self._claimed: list[tuple[tuple[int, int], torch.Tensor]] = []
        # Persistent buffers (DeepSeek-V3's router bias) are checkpointed state too: whole on every rank.
        self._buffers = [(name, buffer) for name, buffer in persistent_buffers(engine.module).items()
                         if name not in dict(params)]
        self._sum_buffers = tp_rank == 0 and dp_rank == 0
        steps = _live_steps(engine, base)
        # The steps travel as max and -min, so one MAX all-reduce shows whether every rank agrees.
        self._spread = torch.tensor([steps[1], -steps[0], steps[2], -steps[2]], dtype=torch.float64)
        self._params = [name for name, _ in params]
        self._states = states
        self._with_moments = with_moments

    def regions(self, address: int, nbytes: int) -> list[Any]:
        """The pending states that lie whole in ``nbytes`` of memory at ``address`` (a storage being written),
        claimed: each is summed from the pieces the writer shows it."""
        from deepspeed_ext.checkpoint.zipsave import Region
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
        import torch
        for key, tensor in self.pending.items():
            self.sums[key] = torch.tensor(partial_sums(tensor), dtype=torch.float64)
        self.pending = {}
        buffer_sums = torch.zeros(len(self._buffers), 3, dtype=torch.float64)
        if self._sum_buffers:
            for i, (_, buffer) in enumerate(self._buffers):
                buffer_sums[i] = torch.tensor(partial_sums(buffer), dtype=torch.float64)
        return LocalSums(self._params, self._states, self.sums,
                         [(name, buffer.dtype) for name, buffer in self._buffers], buffer_sums, self._spread,
                         self._with_moments)


def reduce_engine_sums(local: LocalSums) -> tuple[Fingerprints, list[str]]:
    """The engine's fingerprints from every rank's :class:`LocalSums` (collective: one all-reduce each of the
    sums and the steps), and any disagreement between the ranks."""
    import torch
    import torch.distributed as dist

    from deepspeed_ext.checkpoint.source import ADAM_STATES, MASTER_WEIGHTS
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(local.sums)
        dist.all_reduce(local.buffer_sums)
        dist.all_reduce(local.spread, op=dist.ReduceOp.MAX)
    found, problems = Fingerprints(), []
    for i, name in enumerate(local.params):
        for j, state in enumerate(local.states):
            numel, total, total_sq = local.sums[i, j].tolist()
            if numel:
                found.add(name, state, Fingerprint(int(numel), total, total_sq))
    for (name, dtype), row in zip(local.buffers, local.buffer_sums.tolist(), strict=True):
        if row[0]:
            found.add(name, MASTER_WEIGHTS, Fingerprint(int(row[0]), *row[1:]))
            if dtype in (torch.bfloat16, torch.float16):
                found.roundings[name] = float(torch.finfo(dtype).eps)
            if local.with_moments:  # no optimizer steps a buffer: checkpoints carry its moments as zeros
                for state in ADAM_STATES:
                    found.add(name, state, Fingerprint(int(row[0]), 0.0, 0.0))
    spread = local.spread
    for index, key in ((0, "step"), (2, "global_steps")):
        high, low = spread[index].item(), -spread[index + 1].item()
        if high != low:
            problems.append(f"the {key} differs between ranks ({int(low)}..{int(high)})")
        elif high >= 0:
            setattr(found, key, int(high))
    return found, problems


def _owned_state(param: Any, state: str, stage0: Mapping[Any, Any], base: Any, dp_rank: int) -> torch.Tensor | None:
    """The part of ``param``'s ``state`` this rank owns: its ZeRO partition, the whole tensor on DP rank 0
    without ZeRO, or None (another rank's, or the state does not exist yet)."""
    from deepspeed_ext.checkpoint.source import MASTER_WEIGHTS
    master = state == MASTER_WEIGHTS
    slot = stage0.get(param)
    if slot is not None:
        if dp_rank != 0:
            return None
        try:
            whole: torch.Tensor = slot.master_of() if master else slot.moment_of(base, state)
        except KeyError:
            return None
        return whole
    if hasattr(param, "ds_id"):  # ZeRO-3: the flat partition is padded to equal sizes; keep the real part
        try:
            local: torch.Tensor | None = param._z3_optimizer.get_local_fp32_param(param, None if master else state)
        except KeyError:
            return None
        if local is None:
            return None
        from deepspeed_ext.checkpoint.restore import zero3_partition
        start, stop, _ = zero3_partition(param)
        return local.reshape(-1)[:stop - start]
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return None
    if master:
        fragment: torch.Tensor = mapping.get_hp_fragment()
        return fragment
    # DeepSpeed links the moment fragments lazily (at the next step after a load): read them from the flat
    # partition's state, where the fragment sits at the same address as the master's.
    flat = base.param_groups[mapping.param_group_index]["params"][0]
    moment = base.state.get(flat, {}).get(state)
    if moment is None:
        return None
    address = mapping.hp_fragment_address
    narrowed: torch.Tensor = moment.narrow(0, address.start, address.numel)
    return narrowed


def _live_steps(engine: Any, base: Any) -> tuple[int, int, int]:
    """(the lowest and the highest step of the optimizer's states, the engine's step counter); -1 where there
    is none."""
    import torch
    steps = set()
    for state in (base.state.values() if base is not None else ()):
        step = state.get("step") if isinstance(state, Mapping) else None
        if step is not None:
            steps.add(int(step.item()) if torch.is_tensor(step) else int(step))
    low, high = (min(steps), max(steps)) if steps else (-1, -1)
    return low, high, int(getattr(engine, "global_steps", -1))
