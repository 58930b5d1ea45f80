"""Zarr v3 storage chunks written straight to files, without tensorstore: the format of one array that Orbax
writes outside OCDBT, uncompressed, which to-maxtext ``--no-ocdbt --compression none`` writes.

Orbax gives every zarr3 array the ``sharding_indexed`` codec, with an inner chunk as large as the storage chunk
(``tensorstore_utils._build_zarr3_metadata`` in orbax-checkpoint 0.12.8). Outside OCDBT, each storage chunk is
then one file, ``<array>/c/<i>/<j>/...`` (zarr v3's default chunk keys, ``/`` between the chunk's grid
coordinates), holding:

* the inner chunk: the chunk's elements in C order, little-endian (the ``bytes`` codec); at the array's far
  edges padded to the whole chunk shape (zarr v3 stores edge chunks whole; the padding, zeros here, is never read);
* the shard index: for each inner chunk (here one) its offset and length in bytes, as little-endian uint64;
* the index's CRC-32C (Castagnoli), little-endian uint32 (the index codecs ``bytes`` then ``crc32c``).

Tensorstore, and so Orbax and MaxText, read these files as their own. :meth:`ChunkFiles.of` accepts an array only
when its metadata says exactly this layout (anything else stays with tensorstore), so a codec Orbax adds one day
is never written wrongly. The copy of each chunk into its file is the only pass over it: in the bench's bare floor
(layout and write, nothing checked) that halved tensorstore's cost at the margin on a 2-core VM, but inside
to-maxtext, whose other per-byte work dominates, it gained 0.3 s of 1.5 warm and nothing cold (docs/performance.md,
round three). As tensorstore's file store does with each file it writes, each chunk file and its directory are
fsynced once written, so a chunk on the disk is whole before the checkpoint is published. Each file's CRC-32C is
summed from the bytes as they are written and reported (:attr:`ChunkFiles.written`): the output's manifest takes
it instead of reading every file back once the save is done.
"""

from __future__ import annotations

import os
import struct
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np

from deepspeed_ext.checkpoint import durable
from deepspeed_ext.errors import CheckpointError

#: The codec chain this module writes: one uncompressed inner chunk per shard file, index at the end with CRC-32C.
_INNER_CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}]
_INDEX_CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]


@dataclass(frozen=True)
class ChunkFiles:
    """Where and how one zarr3 array's storage chunks are written as files (:meth:`of` checks the layout)."""

    directory: Path
    shape: tuple[int, ...]
    chunk: tuple[int, ...]
    dtype: np.dtype
    #: Told of each chunk file once it is written and synced: its path relative to :attr:`directory`, its size and
    #: the CRC-32C of its bytes as 8 hex digits (a manifest's entry, summed as the file was written).
    written: Callable[[str, int, str], None] | None = field(default=None, compare=False)

    @classmethod
    def of(cls, spec: Mapping[str, Any], dtype: np.dtype) -> ChunkFiles | None:
        """The files of the array tensorstore opened with ``spec`` (its resolved JSON spec, ``store.spec().to_json()``)
        and ``dtype``, or None where its layout is not the one this module writes: another driver or store, a
        compressed or transposed chunk, several inner chunks per file, other chunk keys, a big-endian host."""
        metadata, kvstore = spec.get("metadata") or {}, spec.get("kvstore") or {}
        if spec.get("driver") != "zarr3" or kvstore.get("driver") != "file" or sys.byteorder != "little":
            return None
        if spec.get("transform") not in (None, _identity_transform(metadata.get("shape"))):
            return None
        grid = metadata.get("chunk_grid") or {}
        keys = metadata.get("chunk_key_encoding") or {"name": "default"}
        if grid.get("name") != "regular" or keys.get("name") != "default" \
                or (keys.get("configuration") or {}).get("separator", "/") != "/":
            return None
        chunk = tuple(grid.get("configuration", {}).get("chunk_shape") or ())
        codecs = metadata.get("codecs") or []
        if len(codecs) != 1 or codecs[0].get("name") != "sharding_indexed":
            return None
        sharding = codecs[0].get("configuration") or {}
        if (tuple(sharding.get("chunk_shape") or ()) != chunk or sharding.get("codecs") != _INNER_CODECS
                or sharding.get("index_codecs") != _INDEX_CODECS or sharding.get("index_location", "end") != "end"):
            return None
        shape = tuple(metadata.get("shape") or ())
        if len(shape) != len(chunk) or not all(chunk) or not all(shape):
            return None
        return cls(Path(kvstore["path"]), shape, chunk, np.dtype(dtype))

    def write_slab(self, index: tuple[int | slice, ...], piece: np.ndarray) -> int:
        """Write ``piece``, the array's elements at ``index`` (an int or a slice per axis, as numpy indexes), which
        covers whole storage chunks; returns the bytes written. Each chunk's file is written whole, once."""
        starts, stops = self._bounds(index)
        block = np.asarray(piece).reshape(tuple(b - a for a, b in zip(starts, stops, strict=True)))
        if block.dtype != self.dtype:
            raise CheckpointError(f"internal: {self.directory}: a slab of {block.dtype}, the array holds {self.dtype}")
        written = 0
        for coords in np.ndindex(*((b - a + c - 1) // c for a, b, c in zip(starts, stops, self.chunk, strict=True))):
            grid = [a // c + i for a, c, i in zip(starts, self.chunk, coords, strict=True)]
            part = block[tuple(slice(i * c, (i + 1) * c) for i, c in zip(coords, self.chunk, strict=True))]
            written += self._write_chunk(grid, part)
        return written

    def _bounds(self, index: tuple[int | slice, ...]) -> tuple[list[int], list[int]]:
        """Each axis's ``[start, stop)`` of ``index``, checked to lie on chunk boundaries (or the array's end)."""
        if len(index) != len(self.shape):
            raise CheckpointError(f"internal: {self.directory}: slab index {index} for an array of {len(self.shape)} "
                                  "axes")
        starts, stops = [], []
        for axis, (item, size, chunk) in enumerate(zip(index, self.shape, self.chunk, strict=True)):
            if isinstance(item, slice):
                start, stop, step = item.indices(size)
                if step != 1:
                    raise CheckpointError(f"internal: {self.directory}: a strided slab {index}")
            else:
                start, stop = item, item + 1
            if start % chunk or (stop % chunk and stop != size) or not 0 <= start < stop <= size:
                raise CheckpointError(f"internal: {self.directory}: slab {index} does not cover whole chunks "
                                      f"{self.chunk} along axis {axis}")
            starts.append(start)
            stops.append(stop)
        return starts, stops

    def _write_chunk(self, grid: list[int], part: np.ndarray) -> int:
        """One storage chunk's file: its elements, padded with zeros to the chunk shape where it is an edge chunk,
        then the index and its CRC-32C."""
        if part.shape != self.chunk:
            padded = np.zeros(self.chunk, dtype=self.dtype)
            padded[tuple(slice(0, n) for n in part.shape)] = part
            part = padded
        # No copy where the part is laid out already (bytes, since a buffer cannot carry ml_dtypes' bfloat16).
        elements = np.ascontiguousarray(part).reshape(-1).view(np.uint8)
        data = elements.data
        index = struct.pack("<QQ", 0, data.nbytes)
        tail = index + struct.pack("<I", google_crc32c.value(index))
        relative = "/".join(("c", *map(str, grid)))
        target = self.directory / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for buffer in (data, memoryview(tail)):
                done = 0
                while done < buffer.nbytes:
                    done += os.write(fd, buffer[done:])
            os.fsync(fd)  # what tensorstore's file store does for every file (its file_io_sync, on by default)
        finally:
            os.close(fd)
        durable.fsync_dir(target.parent)
        if self.written is not None:  # the bytes just written, summed from the same buffer (no read back)
            self.written(relative, data.nbytes + len(tail),
                         f"{google_crc32c.extend(google_crc32c.value(elements), tail):08x}")
        return data.nbytes + len(tail)


def _identity_transform(shape: Any) -> dict[str, Any] | None:
    """The index transform tensorstore reports for an array opened whole (no slicing or transposition)."""
    if not isinstance(shape, list):
        return None
    return {"input_exclusive_max": [[n] for n in shape], "input_inclusive_min": [0] * len(shape)}

