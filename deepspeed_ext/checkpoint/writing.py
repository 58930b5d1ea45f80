"""The one write flow every sink plugs into: prepare, plan, write, the checks' verdicts, manifest, publish.

A sink (the universal, HF and MaxText writers) owns only what is its format's: how it plans the files and writes
them. Everything else a conversion promises is here, in this order, once:

1. **prepare** (:class:`Write`): where the output goes and that it may (never the source, nothing beside it but
   what the sink is allowed; :func:`~deepspeed_ext.checkpoint.output.prepare`);
2. **plan**: the sink's own (validated before anything is written);
3. **write**: the sink writes into the staging directory, reading the source through :class:`Verdicts`' checks,
   which see every tensor state as it streams past (``--check-finite``, the source's recorded fingerprints, the
   model config's fit);
4. **verdicts** (:meth:`Verdicts.give`): each check's verdict, then the source's own checksums; any failure and
   nothing is published. A sink whose writer commits on its own (Orbax) gives them from its last callback; they
   are given once either way;
5. **manifest**: size and CRC-32C of every file (or what the sink recorded as it wrote);
6. **publish**: the staging directory renamed into place (:func:`~deepspeed_ext.checkpoint.output.staged`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from deepspeed_ext.checkpoint import output
from deepspeed_ext.checkpoint.manifest import ManifestRecorder
from deepspeed_ext.checkpoint.model_config import ConfigFit
from deepspeed_ext.checkpoint.source import CheckpointSource, WriteOptions, finite_check, protected_paths, record_check
from deepspeed_ext.checkpoint.tensor import FiniteCheck, LogicalTensor, RecordCheck, StreamCheck

_T = TypeVar("_T")


@dataclass
class Verdicts:
    """The checks one write runs on what it reads, and their verdicts before it publishes.

    ``finite``: ``--check-finite``; ``recorded``: what is read against the source's recorded fingerprints (for
    sinks that write transformed arrays; the universal writer checks what it wrote instead, in ``also``);
    ``fit``: the parameters against transformers' model for the config; ``source``: whose own checksums are
    the last verdict (None for a write of plain tensors); ``also``: the sink's own last checks."""

    source: CheckpointSource | None = None
    finite: FiniteCheck | None = None
    recorded: RecordCheck | None = None
    fit: ConfigFit | None = None
    also: list[Callable[[], None]] = field(default_factory=list)
    given: bool = False

    @classmethod
    def of(cls, source: CheckpointSource, options: WriteOptions, *, recorded: bool = True,
           fit: ConfigFit | None = None) -> Verdicts:
        return cls(source, finite_check(source, options), record_check(source.info) if recorded else None, fit)

    @property
    def checks(self) -> list[StreamCheck]:
        """The stream checks, in the order they see a value."""
        return [check for check in (self.finite, self.recorded, self.fit) if check is not None]

    def stream(self, tensors: Iterable[LogicalTensor], *, with_fit: bool = True) -> Iterator[LogicalTensor]:
        """``tensors`` with every state a sink loads seen by the checks (without the fit, where the sink puts it
        in the way of the tensors it keeps after its own selection: :meth:`fitted`)."""
        stream: Iterable[LogicalTensor] = tensors
        for check in self.checks:
            if check is not self.fit or with_fit:
                stream = check.stream(stream)
        return iter(stream)

    def fitted(self, tensors: Iterable[LogicalTensor]) -> Iterator[LogicalTensor]:
        return iter(self.fit.stream(tensors)) if self.fit is not None else iter(tensors)

    def loader(self, load: Callable[[str, str], Any]) -> Callable[[str, str], Any]:
        """``load(name, state)`` with every result seen by the checks."""
        for check in self.checks:
            load = check.loader(load)
        return load

    def give(self) -> None:
        """Raise the first failed verdict (one line, nothing published); once per write."""
        if self.given:
            return
        self.given = True
        if self.finite is not None:
            self.finite.raise_if_any()
        if self.recorded is not None:
            self.recorded.raise_if_wrong()
        if self.fit is not None:
            self.fit.result()
        if self.source is not None:
            self.source.raise_if_damaged()
        for check in self.also:
            check()


class Write:
    """One write to ``out``: the prepared output (step 1) and the verdicts of its checks; :meth:`of` for a write
    of a source. ``protect``: what the output may not touch."""

    def __init__(self, out: str | Path, *, protect: Sequence[str | Path | None], overwrite: bool,
                 verdicts: Verdicts | None = None):
        self.out = output.prepare(out, protect, overwrite=overwrite)
        self.verdicts = verdicts if verdicts is not None else Verdicts()

    @classmethod
    def of(cls, source: CheckpointSource, out: str | Path, options: WriteOptions, *,
           protect: Sequence[str | Path] | None = None, recorded: bool = True, fit: ConfigFit | None = None) -> Write:
        """A write of ``source``: the output kept off the source (and ``options.protect``, or ``protect``),
        its reads checked as ``options`` asks and against the source's record (``recorded``)."""
        return cls(out, protect=protected_paths(source, options) if protect is None else protect,
                   overwrite=options.overwrite, verdicts=Verdicts.of(source, options, recorded=recorded, fit=fit))

    def publish(self, write: Callable[[Path], _T], *, pointer: tuple[Path, str] | None = None,
                finish: Callable[[Path], None] | None = None, manifest: bool = True) -> _T:
        """Steps 3 to 6: ``write(staging)``, the verdicts, ``finish(staging)`` (what a sink writes only once the
        data is known good: configs, an index), the manifest of every file (``manifest``; False where the sink
        recorded its own as it wrote), then publish. Returns what ``write`` returned."""
        with output.staged(self.out, pointer) as partial:
            result = write(partial)
            self.verdicts.give()
            if finish is not None:
                finish(partial)
            if manifest:
                ManifestRecorder(partial).write()
        return result
