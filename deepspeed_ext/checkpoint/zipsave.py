"""``torch.save(obj, path)``'s file, byte for byte, with each tensor storage read from memory once.

torch.save reads a storage twice: miniz computes the zip record's CRC-32 over all of it, then the file write
copies all of it again, by then evicted from the caches (a storage of an optimizer partition is hundreds of MB).
Here torch writes the zip with every large storage's bytes left out and no CRC-32 (``write_record_metadata``,
the way ``torch.serialization.skip_data`` does); then each storage is written at its record's offset in blocks
small enough to stay in the cache. Each block's CRC-32 (zlib), its ``pwrite`` and whatever an ``observer`` wants
to read from the same bytes (the resume fingerprints' sums) all read it while it is cached. Last, the CRC-32
fields (each record's data descriptor and central directory entry) and the ``.data/serialization_id`` record,
which torch derives from the CRCs, are patched in place. The result is the file torch.save writes, which the
tests check byte for byte; a layout this module does not recognise raises before anything is patched, and the
caller then saves with torch.save itself.
"""

from __future__ import annotations

import os
import pickle
import struct
import zipfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from deepspeed_ext.checkpoint.serialization import pwrite_all, record_data_offset

#: Bytes written, checksummed and observed at a time: a few MiB stay in the last-level cache between the passes.
BLOCK_BYTES = 4 << 20
#: Storages smaller than this are written by torch as usual (their CRC-32 is read back, a few bytes).
MIN_DEFERRED_BYTES = 1 << 20
_DESCRIPTOR = b"PK\x07\x08"
_CENTRAL = b"PK\x01\x02"
_ID_RECORD = ".data/serialization_id"
_U64 = (1 << 64) - 1


class LayoutError(RuntimeError):
    """The zip torch wrote is not laid out as this module expects: save with torch.save instead."""


@dataclass(frozen=True)
class Region:
    """A tensor whose bytes lie inside a storage being written: ``consume`` is called with consecutive pieces of
    ``tensor`` (flat), in order, each a multiple of ``piece_elements`` but the last, while they are cached."""

    offset: int  # bytes from the start of the storage
    tensor: torch.Tensor  # flat, contiguous
    consume: Callable[[torch.Tensor], None]
    piece_elements: int


class Observer(Protocol):
    def regions(self, address: int, nbytes: int) -> Sequence[Region]:
        """The regions of the storage at ``address`` (``nbytes`` long) to show, sorted and not overlapping."""
        ...


def supported() -> bool:
    """Whether this torch has what :func:`save` needs (the metadata-only record and the private ``_save``)."""
    return (hasattr(torch._C, "PyTorchFileWriter") and hasattr(torch._C.PyTorchFileWriter, "write_record_metadata")
            and callable(getattr(torch.serialization, "_save", None))
            and callable(getattr(torch.serialization, "_get_storage_alignment", None)))


def save(obj: Any, path: str, observer: Observer | None = None) -> None:
    """Write ``torch.save(obj, path)``'s exact bytes (pickle protocol 2, the zip format), showing ``observer``
    the bytes of each large storage as they are written. Large CPU storages are held until torch's pickling
    is done, then written (a device storage's host copy would be held too: this is meant for CPU state).
    Raises :class:`LayoutError` (and leaves a file the caller must overwrite) if torch's zip is not what this
    module expects."""
    path = os.fspath(path)
    path.encode("ascii")  # torch names the archive after an ASCII path only; the caller falls back on other names
    # No CRC-32 from miniz: they are computed below from the cached blocks, and patched in.
    writer = torch._C.PyTorchFileWriter(path, False, torch.serialization._get_storage_alignment())
    recorder = _Recorder(writer)
    pickle_into: Any = torch.serialization._save  # torch.save's own pickling, into the writer it is given
    pickle_into(obj, recorder, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()
    # Dropping torch's writer closes its stream: everything is in the file before it is reopened.
    del writer
    recorder.writer = None
    with open(path, "r+b") as handle:
        records = _records(handle)
        crcs: dict[str, int] = {}
        for name, storage in recorder.deferred:
            record = records.get(f"{records.archive}/{name}")
            if record is None or record.size != storage.nbytes():
                raise LayoutError(f"{path}: no record {name} of {storage.nbytes()} bytes")
            crcs[record.name] = _write_storage(handle.fileno(), storage, record.data_offset, observer)
        _patch(handle, records, crcs)


class _Recorder:
    """Stands in for torch's zip writer in ``torch.serialization._save``: large storages get their record's
    header only (their bytes are written later, in blocks); everything else goes through."""

    def __init__(self, writer: Any):
        self.writer = writer
        self.deferred: list[tuple[str, torch.UntypedStorage]] = []

    def write_record(self, name: str, data: Any, nbytes: int) -> None:
        if (isinstance(data, torch.UntypedStorage) and data.device.type == "cpu" and nbytes >= MIN_DEFERRED_BYTES
                and nbytes == data.nbytes()):
            self.writer.write_record_metadata(name, nbytes)
            self.deferred.append((name, data))
        else:
            self.writer.write_record(name, data, nbytes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.writer, name)


@dataclass(frozen=True)
class _Record:
    name: str
    data_offset: int
    size: int
    central_offset: int  # of its central directory entry


class _Records(dict[str, _Record]):
    archive: str = ""

    def by_suffix(self, suffix: str) -> _Record:
        matches = [record for name, record in self.items() if name.endswith(suffix)]
        if len(matches) != 1:
            raise LayoutError(f"{len(matches)} zip records end in {suffix!r}")
        return matches[0]


def _records(handle: Any) -> _Records:
    """The zip's records in write order, with where their data and central directory entries are."""
    with zipfile.ZipFile(handle) as archive:
        infos = archive.infolist()
        start = archive.start_dir
    handle.seek(start)
    central = handle.read()
    records, position = _Records(), 0
    for info in infos:
        if central[position:position + 4] != _CENTRAL:
            raise LayoutError("central directory entry not where expected")
        name_length, extra_length, comment_length = struct.unpack_from("<HHH", central, position + 28)
        if central[position + 46:position + 46 + name_length].decode() != info.filename:
            raise LayoutError("central directory out of order")
        # miniz writes an empty record without a data descriptor (its CRC-32 is 0, as it stays)
        if info.compress_type != zipfile.ZIP_STORED or not (info.flag_bits & 0x08 or info.file_size == 0):
            raise LayoutError(f"{info.filename}: compressed, or without a data descriptor")
        data_offset = record_data_offset(handle, info.header_offset)
        if data_offset is None:
            raise LayoutError(f"{info.filename}: no local header at {info.header_offset}")
        records[info.filename] = _Record(info.filename, data_offset, info.file_size, start + position)
        position += 46 + name_length + extra_length + comment_length
    if not records:
        raise LayoutError("an empty zip")
    records.archive = next(iter(records)).split("/", 1)[0]
    return records


def _write_storage(fd: int, storage: torch.UntypedStorage, offset: int, observer: Observer | None) -> int:
    """``storage``'s bytes at ``offset`` of ``fd`` in cached blocks, each shown to ``observer``'s regions and
    checksummed from the cache; the CRC-32 of the whole."""
    data = torch.empty(0, dtype=torch.uint8).set_(storage)
    regions = observer.regions(storage.data_ptr(), storage.nbytes()) if observer is not None else ()
    crc, position = 0, 0

    def plain(stop: int) -> None:  # bytes no region covers (padding, another rank's share, ...)
        nonlocal crc, position
        for start in range(position, stop, BLOCK_BYTES):
            block: Any = data[start:min(stop, start + BLOCK_BYTES)].numpy()
            crc = zlib.crc32(block, crc)
            pwrite_all(fd, block, offset + start)
        position = max(position, stop)

    for region in regions:
        plain(region.offset)
        flat = region.tensor
        size = flat.element_size()
        step = max(region.piece_elements, BLOCK_BYTES // size // region.piece_elements * region.piece_elements)
        for piece in torch.split(flat, step):
            piece_bytes: Any = piece.view(torch.uint8).numpy()
            crc = zlib.crc32(piece_bytes, crc)
            pwrite_all(fd, piece_bytes, offset + position)
            region.consume(piece)
            position += piece_bytes.nbytes
    plain(storage.nbytes())
    return crc


def _hash_combine(seed: int, value: int) -> int:
    """c10::hash_combine on 64-bit size_t: how torch folds the records' CRC-32s into the serialization id."""
    return (seed ^ ((value + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & _U64)) & _U64


def _patch(handle: Any, records: _Records, crcs: dict[str, int]) -> None:
    """Each record's CRC-32 into its data descriptor and central directory entry, after the serialization id,
    which torch computes from the other records' CRC-32s, is rewritten."""
    fd = handle.fileno()
    for record in records.values():
        if record.name not in crcs:  # written by torch: a few bytes, read back
            crcs[record.name] = zlib.crc32(os.pread(fd, record.size, record.data_offset)) if record.size else 0
    id_record = records.by_suffix("/" + _ID_RECORD)
    old_id = os.pread(fd, id_record.size, id_record.data_offset)
    combined_zero, combined = 0, 0
    for record in records.values():
        if record is not id_record and record.size:  # torch leaves empty records out of it
            combined_zero = _hash_combine(combined_zero, 0)
            combined = _hash_combine(combined, crcs[record.name])
    # The id is the names' hash then the CRCs' combination, each 20 digits: torch wrote the second with every
    # CRC-32 zero. Anything else means another torch; nothing has been patched yet.
    if len(old_id) != 40 or old_id[20:] != b"%020d" % combined_zero:
        raise LayoutError(f"serialization id {old_id!r} is not laid out as expected")
    new_id = old_id[:20] + b"%020d" % combined
    os.pwrite(fd, new_id, id_record.data_offset)
    crcs[id_record.name] = zlib.crc32(new_id)
    patched = [record for record in records.values() if record.size]
    for record in patched:
        if os.pread(fd, 4, record.data_offset + record.size) != _DESCRIPTOR:
            raise LayoutError(f"{record.name}: no data descriptor after the data")
    for record in patched:
        packed = struct.pack("<I", crcs[record.name])
        os.pwrite(fd, packed, record.data_offset + record.size + 4)
        os.pwrite(fd, packed, record.central_offset + 16)
