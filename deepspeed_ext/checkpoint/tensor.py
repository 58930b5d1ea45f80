"""The stream vocabulary: a source yields :class:`LogicalTensor` objects, a sink consumes them.

A LogicalTensor names one full parameter and knows how to load each of its states lazily, so a
sink that handles one tensor at a time keeps memory at "one tensor" whatever the model size.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass, field, replace
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch

# Re-exported (``X as X``: explicitly, for type checkers).
from deepspeed_ext.checkpoint.fingerprint import (SOURCE_WRONG, Fingerprint, Fingerprints, compare, mismatch_message,
                                                  partial_sums)
from deepspeed_ext.checkpoint.states import ADAM_STATES as ADAM_STATES
from deepspeed_ext.checkpoint.states import MASTER_WEIGHTS as MASTER_WEIGHTS
from deepspeed_ext.checkpoint.states import MODULE_WEIGHTS as MODULE_WEIGHTS
from deepspeed_ext.checkpoint.states import STEP as STEP
from deepspeed_ext.errors import CheckpointError
from deepspeed_ext.module_inject.layout import TPLayout

_T = TypeVar("_T")

#: Elements per block when a sink streams a tensor (:meth:`LogicalTensor.blocks`): 4 MiB of fp32,
#: small enough to stay in the CPU's cache between the passes a writer makes over it (sums, checksum, write).
BLOCK_ELEMENTS = 1 << 20


@dataclass
class LogicalTensor:
    """One full (unsharded) parameter with lazily loaded states.

    ``layout`` is how the source had it split over TP ranks (kept so tools can show it); ``states``
    lists the states available; ``loader(state)`` returns the full tensor of that state (``step``
    returns the optimizer step as a 0-d tensor or int). ``range_loader(state, low, high)``, where the source
    can, returns elements ``[low, high)`` of the full tensor flattened, reading only what holds them, so a
    sink can stream a tensor of any size in blocks (:meth:`blocks`).
    """

    name: str
    shape: tuple[int, ...]
    layout: TPLayout
    states: tuple[str, ...]
    loader: Callable[[str], torch.Tensor | int]
    dtype: torch.dtype = torch.float32
    extra: dict[str, Any] = field(default_factory=dict)
    range_loader: Callable[[str, int, int], torch.Tensor] | None = None
    #: The elements a block may be cut at (a multiple of it) where ``range_loader`` reads any rows of the last
    #: dimension; None: whole slices of the first dimension (an expert stack's expert).
    range_row: int | None = None
    #: Which of ``states`` are scalars (the optimizer step; carried per param group, never streamed in blocks).
    scalars: tuple[str, ...] = (STEP, )
    #: Whether the source also holds the module's own copy of the weights in ``dtype`` (``MODULE_WEIGHTS``, read
    #: like a state): a DeepSpeed ZeRO-0/1/2 checkpoint trained in bf16 or fp16. Not one of ``states``: no
    #: converter carries it, a writer may read it in place of the masters.
    module_weights: bool = False
    #: Whether an optimizer steps it. A frozen parameter (``requires_grad=False``: a LoRA model's base, a frozen
    #: embedding) has its weights alone (``fp32``), however many states the others have.
    trainable: bool = True

    def _check_readable(self, state: str) -> None:
        if state not in self.states and not (state == MODULE_WEIGHTS and self.module_weights):
            raise KeyError(f"{self.name}: no state {state!r} (have {', '.join(self.states)})")

    def load(self, state: str = MASTER_WEIGHTS) -> torch.Tensor | int:
        self._check_readable(state)
        value = self.loader(state)
        if _FIRST_READ_PROBE:
            _first_read()
        return value

    def load_tensor(self, state: str = MASTER_WEIGHTS) -> torch.Tensor:
        """A state that is a tensor (every state but ``step``, which may be an int)."""
        value = self.load(state)
        assert isinstance(value, torch.Tensor), f"{self.name}: state {state!r} is not a tensor"
        return value

    def blocks(self, state: str, low: int = 0, high: int | None = None,
               block_elements: int = BLOCK_ELEMENTS) -> Iterator[torch.Tensor]:
        """Elements ``[low, high)`` (default: all) of the full tensor of ``state`` flattened, as consecutive
        blocks of about ``block_elements``, cut at whole rows (``range_row`` elements where the source set it,
        else the slice of every dimension after the first) where they can be; one block where the source cannot read ranges (it loads the whole tensor). A block
        may be a view into a memory-mapped file: consume it before asking for the next."""
        self._check_readable(state)
        numel = math.prod(self.shape)
        high = numel if high is None else high
        if self.range_loader is None:
            yield self.load_tensor(state).reshape(-1)[low:high]
            return
        row = self.range_row or math.prod(self.shape[1:]) or 1
        step = max(1, block_elements // row) * row
        start = low
        while start < high:
            stop = min(high, (start // step + 1) * step)  # block boundaries on multiples of step (whole rows)
            yield self.range_loader(state, start, stop)
            if _FIRST_READ_PROBE:
                _first_read()
            start = stop


#: ``DEEPSPEED_EXT_FIRST_READ_FILE``: where to write the wall-clock time (``time.time()``) the first tensor
#: state was read, for ``bench/startup.py``'s time from process start to the first tensor.
_FIRST_READ_PROBE = [path] if (path := os.environ.get("DEEPSPEED_EXT_FIRST_READ_FILE")) else []


def _first_read() -> None:
    import time
    try:
        path = _FIRST_READ_PROBE.pop()
    except IndexError:  # another thread got there first
        return
    with open(path, "w") as handle:
        handle.write(repr(time.time()))


class StreamCheck:
    """A check a conversion runs on every tensor state it reads, as it streams past: :meth:`check` sees each
    value; :meth:`stream` (logical tensors) and :meth:`loader` (a ``load(name, state)`` function) put it in the
    way. Writers ask for the verdict before they publish."""

    #: Whether :meth:`check` may see a tensor in blocks (it has no whole-tensor verdict); if not, tensors pass
    #: through it whole.
    blockwise = False

    def check(self, name: str, state: str, value: _T) -> _T:
        raise NotImplementedError

    def check_range(self, name: str, state: str, low: int, high: int, value: torch.Tensor) -> torch.Tensor:
        """:meth:`check` of elements ``[low, high)`` of a state read in blocks (flattened)."""
        return self.check(name, state, value)

    def stream(self, tensors: Iterable[LogicalTensor]) -> Iterator[LogicalTensor]:
        for tensor in tensors:
            range_loader = tensor.range_loader
            if range_loader is not None and self.blockwise:
                range_loader = self._checked_range_loader(tensor.name, range_loader)
            elif range_loader is not None:
                range_loader = None
            yield replace(tensor, loader=self._checked_loader(tensor), range_loader=range_loader)

    def _checked_range_loader(self, name: str, load: Callable[[str, int, int], torch.Tensor]
                              ) -> Callable[[str, int, int], torch.Tensor]:
        return lambda state, low, high: self.check_range(name, state, low, high, load(state, low, high))

    def _checked_loader(self, tensor: LogicalTensor) -> Callable[[str], torch.Tensor | int]:
        return lambda state: self.check(tensor.name, state, tensor.loader(state))

    def loader(self, load: Callable[[str, str], Any]) -> Callable[[str, str], Any]:
        """``load(name, state)`` with every result checked."""
        return lambda name, state: self.check(name, state, load(name, state))


class FiniteCheck(StreamCheck):
    """``--check-finite``: every tensor state a conversion reads is checked for NaN/Inf as it streams past.

    Offenders are collected (a diverged run usually has many) and :meth:`raise_if_any` reports them all at
    once; writers call it before they publish, so a failed check leaves no output.
    """

    blockwise = True

    def __init__(self, source: str):
        self.source = source
        self.offenders: dict[str, list[str]] = {}
        self._lock = threading.Lock()  # Orbax materializes leaves on its own threads

    def check(self, name: str, state: str, value: _T) -> _T:
        if torch.is_tensor(value):
            finite = not value.is_floating_point() or bool(torch.isfinite(value).all())
        elif isinstance(value, np.ndarray) and value.dtype.kind == "f":
            finite = bool(np.isfinite(value).all())
        else:
            finite = True
        if not finite:
            with self._lock:
                states = self.offenders.setdefault(name, [])
                if state not in states:
                    states.append(state)
        return value

    def raise_if_any(self) -> None:
        if self.offenders:
            listed = ", ".join(f"{name} ({'/'.join(states)})" for name, states in sorted(self.offenders.items())[:5])
            more = f" and {len(self.offenders) - 5} more" if len(self.offenders) > 5 else ""
            raise CheckpointError(f"{self.source}: NaN/Inf in {len(self.offenders)} parameter(s): {listed}{more}; "
                                  "nothing was written")


class RecordCheck(StreamCheck):
    """The source states a writer reads, fingerprinted as they stream past and checked against the fingerprints
    the source recorded before anything is published (``to-hf``, ``to-maxtext``: they write cast or transformed
    arrays, so what they write cannot be compared with the source's record; what they read can).

    A state read twice (a fused tensor split into several MaxText leaves) is summed once; loads may run on
    Orbax's threads (one dict store each, under the GIL). A state read in blocks is summed block by block, each
    range once.
    """

    blockwise = True

    def __init__(self, recorded: Fingerprints, source: str):
        #: The fingerprints the source recorded; ``source``: the path errors name.
        self.recorded = recorded
        self.source = source
        self.found = Fingerprints()
        self._ranges: dict[tuple[str, str], dict[tuple[int, int], tuple[int, float, float]]] = {}

    def check_range(self, name: str, state: str, low: int, high: int, value: torch.Tensor) -> torch.Tensor:
        if state != STEP and self.recorded.get(name, state) is not None:
            ranges = self._ranges.setdefault((name, state), {})
            if (low, high) not in ranges:
                ranges[(low, high)] = partial_sums(value)
        return value

    def range_sums(self, name: str, state: str, low: int, high: int) -> tuple[int, float, float] | None:
        """The sums of elements ``[low, high)`` of ``state`` as they were read (None where they were not read in that
        block): a writer that stores exactly those values takes them for its own record instead of summing again."""
        return self._ranges.get((name, state), {}).get((low, high))

    def _found(self) -> Fingerprints:
        """The fingerprints of the states read: whole, or added up from their blocks."""
        found = Fingerprints({name: dict(states) for name, states in self.found.tensors.items()})
        for (name, state), ranges in self._ranges.items():
            if found.get(name, state) is None:
                numel, total, total_sq = (sum(sums[i] for sums in ranges.values()) for i in range(3))
                found.add(name, state, Fingerprint(int(numel), total, total_sq))
        return found

    def check(self, name: str, state: str, value: _T) -> _T:
        if state != STEP and self.found.get(name, state) is None and self.recorded.get(name, state) is not None:
            if isinstance(value, torch.Tensor):
                self.found.add(name, state, Fingerprint.of(value))
            elif isinstance(value, np.ndarray):  # sums do not see order: as laid out, with no copy
                self.found.add(name, state, Fingerprint.of(torch.from_numpy(np.ravel(value, order="K"))))
        return value

    def raise_if_wrong(self) -> None:
        """Refuse to publish where a state read disagrees with the source's record (only the states read: a
        writer may leave some out, as to-maxtext does the moments of a buffer no optimizer steps)."""
        recorded = self.recorded
        found = self._found()
        read = Fingerprints({name: {state: fingerprint for state, fingerprint in recorded.tensors[name].items()
                                    if state in states}
                             for name, states in found.tensors.items() if name in recorded.tensors})
        checked, mismatches = compare(read, found, check_step=False)
        if mismatches:
            raise CheckpointError(mismatch_message(self.source, mismatches, checked, SOURCE_WRONG))
