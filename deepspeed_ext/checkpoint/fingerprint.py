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

import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from deepspeed_ext.checkpoint.states import MODULE_WEIGHTS
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
#: Elements reduced at a time (a whole number of rows).
CHUNK_ELEMENTS = 1 << 24
#: Elements converted to float32 at a time when a tensor is neither float32 nor float64 (bf16 weights): 4 MiB
#: of float32, in a buffer each thread keeps (:func:`_as_float32`). A converted chunk of 64 MiB was mapped afresh
#: and page-faulted in each time: six times as slow as the reduction itself on a 2-core VM.
CONVERT_ELEMENTS = 1 << 20


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
            return _same_non_finite(self, other, rounding)
        scale_sq = max(self.total_sq, other.total_sq)
        scale_abs = math.sqrt(self.numel * scale_sq)  # >= the sum of absolute values (Cauchy-Schwarz)
        return (abs(self.total - other.total) <= (SUMMATION_RTOL + 2 * rounding) * scale_abs
                and abs(self.total_sq - other.total_sq) <= (SUMMATION_RTOL + 4 * rounding) * scale_sq)


def _same_non_finite(a: Fingerprint, b: Fingerprint, rounding: float) -> bool:
    """Fingerprints of which one sum is NaN or infinite agree where each non-finite sum is the same on both sides
    (NaN with NaN, +Inf with +Inf) and a sum finite on both sides agrees up to rounding. An infinite sum never
    matches a finite one: a value that became Inf is a difference, not a rounding."""
    for x, y, tolerance in ((a.total, b.total, SUMMATION_RTOL + 2 * rounding),
                            (a.total_sq, b.total_sq, SUMMATION_RTOL + 4 * rounding)):
        if math.isfinite(x) and math.isfinite(y):
            if abs(x - y) > tolerance * max(abs(x), abs(y)) * math.sqrt(max(a.numel, 1)):
                return False
        elif not (x == y or (math.isnan(x) and math.isnan(y))):
            return False
    return True


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
    native = flat.dtype in (torch.float32, torch.float64)
    for chunk in torch.split(flat, CHUNK_ELEMENTS if native else CONVERT_ELEMENTS):
        if not native:
            chunk = _as_float32(chunk)
        body = chunk.numel() - chunk.numel() % ROW_ELEMENTS
        if body:
            rows = chunk[:body].view(-1, ROW_ELEMENTS)
            total += float(rows.sum(1).double().sum())
            total_sq += _rows_sum_sq(rows)
        tail = chunk[body:].double()
        total += float(tail.sum())
        total_sq += float(torch.dot(tail, tail))
    return flat.numel(), total, total_sq


def partial_sums_on_device(tensor: torch.Tensor) -> torch.Tensor:
    """:func:`partial_sums` of a tensor on an accelerator, as a float64 tensor ``[numel, sum, sum of squares]`` on
    its device: the same rows summed the same way, with nothing copied to the host. A caller takes every tensor's
    sums at once, one synchronisation in place of several per tensor. The squares are always scaled by a power of two
    (exact) where :func:`partial_sums` first looks at the largest row, which would wait for the device."""
    import torch
    flat = tensor.detach().reshape(-1)
    out = torch.zeros(3, dtype=torch.float64, device=flat.device)
    out[0] = flat.numel()
    for chunk in torch.split(flat, CONVERT_ELEMENTS):
        if chunk.dtype not in (torch.float32, torch.float64):
            chunk = chunk.float()
        body = chunk.numel() - chunk.numel() % ROW_ELEMENTS
        if body:
            rows = chunk[:body].view(-1, ROW_ELEMENTS)
            out[1] += rows.sum(1).double().sum()
            if rows.shape[1] % SQUARE_ROW_ELEMENTS == 0:
                rows = rows.reshape(-1, SQUARE_ROW_ELEMENTS)
            exponent = (-torch.frexp(rows.abs().amax())[1]).clamp(-126, 126).double()
            scaled = torch.linalg.vector_norm(rows * torch.pow(2.0, exponent).to(rows.dtype), dim=1).double()
            out[2] += scaled.square().sum() * torch.pow(2.0, -2 * exponent)
        tail = chunk[body:].double()
        out[1] += tail.sum()
        out[2] += torch.dot(tail, tail)
    return out


_conversion = threading.local()


def _as_float32(chunk: torch.Tensor) -> torch.Tensor:
    """``chunk.to(torch.float32)``, for a CPU tensor into this thread's conversion buffer, valid until the
    thread's next call. A fresh 4 MiB per chunk is not served again from the heap on a worker thread (its malloc
    arena maps blocks that large afresh): to-maxtext's producers page-faulted every converted chunk in, and summing
    bf16 blocks on two threads took 2.5-5x as long as with one buffer each (and 70x the system time)."""
    import torch
    if chunk.device.type != "cpu":
        return chunk.to(torch.float32)
    buffer: torch.Tensor | None = getattr(_conversion, "buffer", None)
    if buffer is None or buffer.numel() < chunk.numel():
        buffer = _conversion.buffer = torch.empty(max(CONVERT_ELEMENTS, chunk.numel()), dtype=torch.float32)
    converted = buffer[:chunk.numel()]
    converted.copy_(chunk)
    return converted


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
    one the record lacks is not checked (an older checkpoint, a parameter frozen when it was saved). The module's
    own weights (``MODULE_WEIGHTS``) are the exception: a copy of the masters that not every side holds apart
    (a ZeRO-3 engine, a universal checkpoint, a writer that read the masters), checked only where both have it.
    """
    wanted = set(states) if states is not None else None
    checked, mismatches = 0, []
    for name, saved_states in recorded.tensors.items():
        for state, saved in saved_states.items():
            if wanted is not None and state not in wanted:
                continue
            live = found.get(name, state)
            if live is None and state == MODULE_WEIGHTS:
                continue
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
