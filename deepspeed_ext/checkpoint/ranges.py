"""The restore's read path: element ranges of checkpoint files read with ``pread``, readahead off.

A rank restoring a ZeRO-3 partition (or any slice) should cause reads of the pages it asks for and no others.
Reading through the memory mapping does not give that: every page fault makes the kernel read around it
(``read_ahead_kb``, 8 MiB on the benchmark VM), so a rank that faults in the end of its partition also reads the
start of its neighbour's, and is charged for it. Here each needed range is read with ``os.preadv`` into a
buffer of our own, on a descriptor opened with ``POSIX_FADV_RANDOM``: the kernel then reads exactly the pages
a request spans.

The files stay what they are (torch's zip): :func:`~deepspeed_ext.checkpoint.serialization.load` still maps
them, for their structure and to find where each tensor's bytes lie
(:func:`~deepspeed_ext.checkpoint.serialization.mapped_location`; torch stores every storage uncompressed,
64-byte aligned). A tensor that is not in a file (a stand-in built in memory, or no ``/proc/self/maps``) is
copied from memory instead.

Pieces whose pages touch are read in one ``preadv``, the bytes between them into a scratch buffer: the same
pages, fewer calls. Page granularity is the floor: a rank that needs half of every 4 KiB row (a row-parallel
weight at TP=2, hidden 1024, fp32) reads whole pages, twice its bytes, unless its TP neighbour read them first.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from deepspeed_ext.checkpoint import serialization
from deepspeed_ext.errors import CheckpointError

if TYPE_CHECKING:
    from deepspeed_ext.module_inject.layout import TPLayout

PAGE = serialization.PAGE
#: iovecs per ``preadv`` (the kernel refuses more).
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


class FileReader:
    """One checkpoint file open for ``pread``, with readahead off (the kernel reads only the pages asked for)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot open: {exc.strerror}") from exc
        weakref.finalize(self, os.close, self.fd)
        if hasattr(os, "posix_fadvise"):
            # Per open file: other descriptors of the same file (other ranks, the conversions) keep readahead.
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)

    def read_into(self, views: list[memoryview], offset: int) -> None:
        """Fill ``views`` in order from ``offset`` (one ``preadv``, repeated where the kernel returns less)."""
        while views:
            got = os.preadv(self.fd, views, offset)
            if got == 0:
                raise CheckpointError(f"{self.path}: ends before byte {offset + sum(len(v) for v in views)} "
                                      "(truncated?)")
            offset += got
            while views and got >= len(views[0]):
                got -= len(views[0])
                views = views[1:]
            if got:
                views = [views[0][got:], *views[1:]]


@dataclass(frozen=True)
class Stored:
    """A contiguous tensor and where its bytes are: ``file`` from byte ``offset``, or only in memory (None)."""

    tensor: torch.Tensor
    file: FileReader | None
    offset: int = 0


#: ``(stored, start, count)``: elements ``[start, start + count)`` of ``stored.tensor`` flattened.
Piece = tuple[Stored, int, int]
#: ``pieces(src_rank, start, stop)``: where elements ``[start, stop)`` of a saved TP shard lie, in order.
PieceFinder = Callable[[int, int, int], list[Piece]]


def stored(tensor: torch.Tensor, readers: dict[Path, FileReader] | None = None) -> Stored:
    """``tensor`` (mapped by :func:`~deepspeed_ext.checkpoint.serialization.load`) with the file and offset its
    bytes are at; its reader is taken from (and added to) ``readers`` where given, so that a source that reads
    a few large files opens each once. In memory only where it is in no file."""
    location = serialization.mapped_location(tensor) if hasattr(os, "preadv") else None
    if location is None:
        return Stored(tensor, None)
    path, offset = location
    reader = readers.get(path) if readers is not None else None
    if reader is None:
        reader = FileReader(path)
        if readers is not None:
            readers[path] = reader
    return Stored(tensor, reader, offset)


def gather(pieces: Iterable[Piece], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The pieces' elements, concatenated in order, in a new 1-D tensor; each file read with ``pread``."""
    pieces = list(pieces)
    if pieces:
        dtype = pieces[0][0].tensor.dtype
    total = sum(count for _, _, count in pieces)
    out = torch.empty(total, dtype=dtype)
    if total == 0:
        return out
    size = out.element_size()
    data: Any = out.view(torch.uint8).numpy()  # a writable buffer over out, for preadv to fill
    target = memoryview(data)
    runs: dict[FileReader, list[tuple[int, int, int]]] = {}  # file -> (file offset, bytes, offset in out)
    position = 0
    for stored, start, count in pieces:
        if stored.tensor.dtype != dtype:
            raise CheckpointError(f"pieces of one range in {stored.tensor.dtype} and {dtype}")
        if count:
            if stored.file is None:
                out[position:position + count].copy_(stored.tensor.reshape(-1)[start:start + count])
            else:
                runs.setdefault(stored.file, []).append((stored.offset + start * size, count * size,
                                                          position * size))
        position += count
    for reader, file_runs in runs.items():
        _read_runs(reader, file_runs, target)
    return out


def _read_runs(reader: FileReader, runs: list[tuple[int, int, int]], target: memoryview) -> None:
    """Read each ``(file offset, bytes, offset in target)`` run. Runs whose pages touch or adjoin share one
    ``preadv`` (the bytes between them go to a scratch buffer): the kernel reads the same pages either way,
    and a row-parallel slice's thousands of short rows take a few calls, not one each."""
    runs = sorted(runs)
    scratch = memoryview(bytearray(2 * PAGE))  # a gap between runs whose pages adjoin is under two pages
    views: list[memoryview] = []
    begin = end = 0
    for offset, nbytes, at in runs:
        gap = offset - end
        if views and 0 <= gap and offset // PAGE <= (end - 1) // PAGE + 1 and len(views) + 2 <= _IOV_MAX:
            if gap:
                views.append(scratch[:gap])
        else:
            if views:
                reader.read_into(views, begin)
            views, begin = [], offset
        views.append(target[at:at + nbytes])
        end = offset + nbytes
    if views:
        reader.read_into(views, begin)


def readers(pieces: PieceFinder) -> tuple[Callable[[int, int, int], torch.Tensor],
                                           Callable[[int, int, int, int, int], torch.Tensor]]:
    """``(read_flat, read_rows)`` for :meth:`~deepspeed_ext.module_inject.layout.TPLayout.reshard_range`, both
    reading ``pieces`` with ``pread``: a strided window's rows only, not the elements between them."""

    def read_flat(src: int, start: int, stop: int) -> torch.Tensor:
        return gather(pieces(src, start, stop))

    def read_rows(src: int, start: int, count: int, stride: int, length: int) -> torch.Tensor:
        found: list[Piece] = []
        for row in range(count):
            first = start + row * stride
            found.extend(pieces(src, first, first + length))
        return gather(found).view(count, length)

    return read_flat, read_rows


def resharded_range(source: TPLayout, target: TPLayout, rank: int, low: int, high: int,
                    pieces: PieceFinder) -> torch.Tensor:
    """Elements ``[low, high)`` of rank ``rank``'s shard under ``target`` of a tensor saved under ``source``
    (a full tensor is a replicated source of one rank), flattened, in a new tensor: ``pieces`` says where each
    saved shard's elements lie, and only those ranges are read, with ``pread``. The one range read of the
    restore, for every source that reads ranges (a DeepSpeed tag's TP slices and ZeRO partitions, a universal
    checkpoint's full tensors)."""
    return source.reshard_range(target, rank, low, high, *readers(pieces))
