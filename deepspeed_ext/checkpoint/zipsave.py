"""``torch.save(obj, path)``'s file, byte for byte, with each tensor storage read from memory once.

torch.save reads a storage twice: miniz computes the zip record's CRC-32 over all of it, then the file write
copies all of it again, by then evicted from the caches (a storage of an optimizer partition is hundreds of MB).
Here torch writes the zip with every large storage's bytes left out and no CRC-32 (``write_record_metadata``,
the way ``torch.serialization.skip_data`` does); then each storage is written at its record's offset in blocks
small enough to stay in the cache. Each block's CRC-32, its ``pwrite`` and whatever an ``observer`` wants
to read from the same bytes (the resume fingerprints' sums) all read it while it is cached. Last, the CRC-32
fields (each record's data descriptor and central directory entry) and the ``.data/serialization_id`` record,
which torch derives from the CRCs, are patched in place. The result is the file torch.save writes, which the
tests check byte for byte.

The final name only ever holds a whole file. Everything is written under a temporary name beside it
(``.<name>.<random>.deepspeed_ext-tmp``: hidden, and matching none of DeepSpeed's file patterns, neither
``*model_states.pt`` nor the ``mp_rank_``/``zero_pp_rank_`` prefixes its checkpoint tools walk for), fsynced, and
renamed onto the final name; the directory is then fsynced. A process killed mid-save leaves at most that
temporary file (and, in the system's temporary directory, perhaps the symlink below), never a file under the final
name whose central directory is whole and whose data are holes. torch names the archive inside the zip after the
file name it is given (its basename without the extension), so torch is given a symlink named as the final file,
in a scratch directory of its own in the system's temporary directory, that points at the temporary file; it is
removed as soon as torch has the file open.

torch's private pieces (``torch.serialization._save``, ``torch._C.PyTorchFileWriter``) are fenced.
:func:`supported` checks once per process that they have the signatures used here and that a probe save is
torch.save's file byte for byte. At save time, anything those pieces or the layout checks raise, other than a
failed write, makes :func:`save` write that file with torch.save itself (through the same temporary name, fsync
and rename). A failed write (a full disk) is an error, not a reason to fall back.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import pickle
import secrets
import struct
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from deepspeed_ext.checkpoint import durable, faults
from deepspeed_ext.checkpoint.serialization import pwrite_all
from deepspeed_ext.checkpoint.torch_zip import ID_RECORD
from deepspeed_ext.checkpoint.zipcheck import crc32, record_data_offset
from deepspeed_ext.errors import first_line

logger = logging.getLogger("deepspeed_ext")

#: Bytes written, checksummed and observed at a time: a few MiB stay in the last-level cache between the passes.
BLOCK_BYTES = 4 << 20
#: Storages smaller than this are written by torch as usual (their CRC-32 is read back, a few bytes).
MIN_DEFERRED_BYTES = 1 << 20
#: The end of a temporary file's name (the file is also hidden: its name starts with a dot).
TEMPORARY_SUFFIX = ".deepspeed_ext-tmp"
_DESCRIPTOR = b"PK\x07\x08"
_CENTRAL = b"PK\x01\x02"
_U64 = (1 << 64) - 1
#: ``torch.serialization._save``'s parameters, as this module passes them (by position).
_SAVE_PARAMETERS = ("obj", "zip_file", "pickle_module", "pickle_protocol", "_disable_byteorder_record")
_WRITER_METHODS = ("write_record", "write_record_metadata", "write_end_of_file")
#: The probe's one storage written by this module (the threshold lowered to its size): 1 KiB.
_PROBE_DEFERRED_BYTES = 1 << 10


class LayoutError(RuntimeError):
    """The zip torch wrote is not laid out as this module expects (:func:`save` then writes with torch.save)."""


class _Fallback(Exception):
    """This file cannot be written here with this torch: torch.save writes it. The message says why."""


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
    """Whether :func:`save` writes files itself on this torch (otherwise it writes each with torch.save). Checked
    once per process (:func:`_support`; its ``cache_clear`` checks again)."""
    return _support() is None


#: Told ``(address, nbytes)`` of each block of a large storage once it is in the file (and no longer read).
Written = Callable[[int, int], None]


def save(obj: Any, path: str | os.PathLike[str], observer: Observer | None = None,
         on_fallback: Callable[[], None] | None = None, written: Written | None = None) -> bool:
    """Write ``torch.save(obj, path)``'s exact bytes (pickle protocol 2, the zip format), showing ``observer``
    the bytes of each large storage as they are written. Large CPU storages are held until torch's pickling
    is done, then written (a device storage's host copy would be held too: this is meant for CPU state).
    ``written`` is told the memory of each block of them once it is written (a forked writer gives it back).

    Returns True when this module wrote the file, False when torch.save did: this torch is not
    :func:`supported`, the path is not ASCII (torch then names the archive differently), or torch's private
    pieces or its zip were not as expected for this file. Before torch.save writes it, ``on_fallback`` is called
    (to forget what ``observer`` was shown) and one debug line on the ``deepspeed_ext`` logger names the file and
    the reason. Either way the file is whole under ``path``, and fsynced, when this returns.

    A failed write (``OSError``, or the ``RuntimeError`` torch's writer raises when the disk is full) propagates,
    as does anything ``observer`` raises: ``path`` is then as it was before (absent, or its previous file) and
    the temporary file is removed."""
    path = os.fsdecode(path)
    reason = _unsupported(path)
    if reason is None:
        try:
            with _staged(path) as staged:
                _write(obj, staged, observer, MIN_DEFERRED_BYTES, written)
            return True
        except _Fallback as exc:
            reason = str(exc)
    logger.debug("%s: written by torch.save, not zipsave (%s)", path, reason)
    if on_fallback is not None:
        on_fallback()
    with _staged(path, alias=_aliases_work()) as staged:
        torch.save(obj, staged.alias)
    return False


def _unsupported(path: str) -> str | None:
    """Why :func:`save` cannot write ``path`` itself; None where it can."""
    if not path.isascii():
        return "a non-ASCII path: torch writes it through a Python file, and names the archive 'archive'"
    if not getattr(torch.serialization, "get_crc32_options", lambda: True)():
        return "torch.save is set to write no CRC-32 (torch.serialization.set_crc32_options(False))"
    if getattr(getattr(torch.serialization, "_serialization_tls", None), "skip_data", False):
        return "inside torch.serialization.skip_data()"
    return _support()


# --- the fence: checked once per process -------------------------------------------------------------------------


@functools.cache
def _support() -> str | None:
    """None where :func:`save` can write files on this torch; otherwise why not (logged once, at debug level).

    The private pieces have the signatures used here (``torch.serialization._save``'s leading parameters, by
    name and kind, with nothing else required; ``PyTorchFileWriter``'s methods; ``_get_storage_alignment``), and
    a probe save of a small object, with one storage written by this module, is torch.save's file byte for byte.
    """
    try:
        reason = _api_mismatch() or _probe()
    except _Fallback as exc:
        reason = f"the probe save fell back: {exc}"
    except Exception as exc:  # whatever this torch does differently: it is not used
        reason = f"the probe save failed: {type(exc).__name__}: {first_line(exc)}"
    if reason is not None:
        logger.debug("zipsave is off, torch.save writes each file: %s", reason)
    return reason


def _api_mismatch() -> str | None:
    """Why torch's private pieces are not what :func:`_write` calls; None where they are."""
    save_function = getattr(torch.serialization, "_save", None)
    if not callable(save_function):
        return "torch.serialization._save is missing"
    try:
        signature = inspect.signature(save_function)
    except (TypeError, ValueError):
        return "torch.serialization._save has no signature"
    parameters = list(signature.parameters.values())
    leading, rest = parameters[:len(_SAVE_PARAMETERS)], parameters[len(_SAVE_PARAMETERS):]
    by_position = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    if (tuple(parameter.name for parameter in leading) != _SAVE_PARAMETERS
            or any(parameter.kind not in by_position for parameter in leading)
            or any(parameter.default is inspect.Parameter.empty and parameter.kind not in variadic
                   for parameter in rest)):
        return f"torch.serialization._save{signature} is not _save({', '.join(_SAVE_PARAMETERS)})"
    writer = getattr(torch._C, "PyTorchFileWriter", None)
    missing = [name for name in _WRITER_METHODS if not callable(getattr(writer, name, None))]
    if writer is None or missing:
        return f"torch._C.PyTorchFileWriter lacks {', '.join(missing) or 'itself'}"
    alignment = getattr(torch.serialization, "_get_storage_alignment", None)
    if not callable(alignment):
        return "torch.serialization._get_storage_alignment is missing"
    value = alignment()
    if type(value) is not int or value <= 0:
        return f"torch.serialization._get_storage_alignment() is {value!r}"
    if type(getattr(torch.serialization, "DEFAULT_PROTOCOL", None)) is not int:
        return "torch.serialization.DEFAULT_PROTOCOL is not an int"
    return None


def _probe() -> str | None:
    """Why a small save by :func:`_write` (one storage written by this module, one by torch, an empty one) is not
    torch.save's file byte for byte; None where it is. A few ms (no fsync)."""
    obj = {"deferred": torch.arange(_PROBE_DEFERRED_BYTES // 4, dtype=torch.float32), "small": torch.arange(3),
           "empty": torch.zeros(0), "text": "probe"}
    deferred = []

    def write(staged: _Staged) -> None:
        deferred.append(_write(obj, staged, None, _PROBE_DEFERRED_BYTES))

    same = _same_as_torch_save(obj, write)
    if deferred != [1]:
        return f"the probe save wrote {deferred} storages itself, not 1"
    return None if same else "the probe save's file is not torch.save's byte for byte"


@functools.cache
def _aliases_work() -> bool:
    """Whether torch.save, given the symlink :func:`_staged` makes, writes the file it writes under the final name
    (the archive named after the symlink); where not, a fallback is written in a hidden directory beside it."""
    obj = {"x": torch.arange(3)}
    try:
        return _same_as_torch_save(obj, lambda staged: torch.save(obj, staged.alias))
    except Exception as exc:
        logger.debug("torch.save through a symlink failed (%s: %s): fallbacks are written in a hidden directory",
                     type(exc).__name__, first_line(exc))
        return False


def _same_as_torch_save(obj: Any, write: Callable[[_Staged], None]) -> bool:
    """Whether ``write`` (given a staged ``probe.pt``) leaves torch.save(obj)'s bytes under that name."""
    with tempfile.TemporaryDirectory(prefix="deepspeed_ext-probe-") as scratch:
        reference, ours = os.path.join(scratch, "torch", "probe.pt"), os.path.join(scratch, "staged", "probe.pt")
        os.mkdir(os.path.dirname(reference))
        os.mkdir(os.path.dirname(ours))
        torch.save(obj, reference)
        with _staged(ours, sync=False) as staged:
            write(staged)
        return _read(ours) == _read(reference)


def _read(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


# --- a file written under a temporary name, then renamed onto its own ----------------------------------------------


@dataclass
class _Staged:
    """A file being written: ``real`` is its temporary name, and ``alias`` the name torch is given: a symlink,
    named as the final file, to ``real`` (in ``scratch``, a directory of its own, until :meth:`drop_alias`), or
    ``real`` itself when that is in ``folder``, a hidden directory beside the final file named as it."""

    real: str
    alias: str
    scratch: str | None = None
    folder: str | None = None

    def drop_alias(self) -> None:
        if self.scratch is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.alias)
            with contextlib.suppress(OSError):
                os.rmdir(self.scratch)
            self.scratch = None

    def drop(self) -> None:
        """Everything left but the final file (the temporary file, if still there)."""
        self.drop_alias()
        with contextlib.suppress(OSError):  # its space back at once, even while torch's writer, kept alive by
            os.truncate(self.real, 0)  # the traceback of a failed write, holds it open
        with contextlib.suppress(OSError):
            os.unlink(self.real)
        if self.folder is not None:
            with contextlib.suppress(OSError):
                os.rmdir(self.folder)


@contextlib.contextmanager
def _staged(path: str, alias: bool = True, sync: bool = True) -> Iterator[_Staged]:
    """Where ``path`` is written: when the body returns, the file is fsynced, renamed onto ``path``, and the
    directory fsynced (``sync``: the file is on the disk before its final name is); on any exception, the
    temporary file is removed and ``path`` left as it was."""
    directory, name = os.path.split(os.path.abspath(path))
    staged = _stage(directory, name, alias)
    try:
        yield staged
        staged.drop_alias()
        if sync:
            durable.fsync_file(staged.real)
        os.replace(staged.real, path)
    except BaseException:
        staged.drop()
        raise
    if staged.folder is not None:
        os.rmdir(staged.folder)
    if sync:
        durable.fsync_dir(directory)


def _stage(directory: str, name: str, alias: bool) -> _Staged:
    for _ in range(100):
        token = secrets.token_hex(4)
        if not alias:
            folder = os.path.join(directory, f".{token}{TEMPORARY_SUFFIX}")
            try:
                os.mkdir(folder)
            except FileExistsError:
                continue
            real = os.path.join(folder, name)
            return _Staged(real, real, folder=folder)
        real = os.path.join(directory, f".{_clipped(name)}.{token}{TEMPORARY_SUFFIX}")
        try:
            os.close(os.open(real, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666))
        except FileExistsError:
            continue
        staged = _Staged(real, real)
        try:
            staged.scratch = _scratch(directory)
            staged.alias = os.path.join(staged.scratch, name)
            os.symlink(real, staged.alias)
        except BaseException:
            staged.drop()
            raise
        return staged
    raise FileExistsError(f"{directory}: no free temporary name for {name}")


def _clipped(name: str) -> str:
    """``name``, cut to leave room in a file name (255 bytes) for the temporary file's dot, token and suffix."""
    while len(os.fsencode(name)) > 200:
        name = name[:-1]
    return name


def _scratch(directory: str) -> str:
    """A new directory for the symlink: in the system's temporary directory, where nothing of DeepSpeed's looks
    (a symlink left by a kill -9 would be listed by a walk of the checkpoint); beside the file where that fails."""
    try:
        return tempfile.mkdtemp(prefix="deepspeed_ext-")
    except OSError:
        return tempfile.mkdtemp(prefix=".", suffix=TEMPORARY_SUFFIX, dir=directory)


# --- the write ------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _fenced(what: str, recorder: _Recorder | None = None) -> Iterator[None]:
    """Inside, what torch's private pieces or the layout checks raise becomes :class:`_Fallback`, but a failed
    write: ``OSError``, ``MemoryError``, and what torch's writer raised writing (``recorder.write_error``)."""
    try:
        yield
    except (OSError, MemoryError):
        raise
    except Exception as exc:
        if recorder is not None and exc is recorder.write_error:
            raise
        raise _Fallback(f"{what}: {type(exc).__name__}: {first_line(exc)}") from exc


def _write(obj: Any, staged: _Staged, observer: Observer | None, min_deferred: int,
           written: Written | None = None) -> int:
    """``torch.save(obj, staged.alias)``'s bytes into ``staged.real``, with the storages of ``min_deferred``
    bytes or more written here; how many were. Raises :class:`_Fallback` where torch's pieces or its zip are not
    as expected: before anything is shown to ``observer``, but where the patching, after, fails."""
    with _fenced("torch's zip writer"):
        make_writer: Any = torch._C.PyTorchFileWriter
        alignment = torch.serialization._get_storage_alignment()
    try:  # No CRC-32 from miniz: they are computed below from the cached blocks, and patched in.
        writer = make_writer(staged.alias, False, alignment)
    except TypeError as exc:  # its arguments changed (a RuntimeError is a file that cannot be created)
        raise _Fallback(f"torch's zip writer: TypeError: {first_line(exc)}") from exc
    staged.drop_alias()  # the file is open
    recorder = _Recorder(writer, min_deferred)
    try:
        with _fenced("torch.serialization._save", recorder):
            pickle_into: Any = torch.serialization._save  # torch.save's own pickling, into the writer it is given
            try:
                pickle_into(obj, recorder, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
            except BaseException:
                with contextlib.suppress(Exception):  # as torch.save does: its destructor must not write again
                    writer.write_end_of_file()
                raise
            recorder.end_of_file()
    finally:
        # Dropping torch's writer closes its stream: everything is in the file before it is reopened.
        del writer
        recorder.writer = None
    with open(staged.real, "r+b") as handle:
        with _fenced("torch's zip"):
            records = _records(handle)
            deferred = []
            for name, storage in recorder.deferred:
                record = records.get(f"{records.archive}/{name}")
                if record is None or record.size != storage.nbytes():
                    raise LayoutError(f"no record {name} of {storage.nbytes()} bytes")
                deferred.append((record, storage))
            old_id = _check(handle, records)
        faults.reached("mid-file")  # the zip's structure is written, its storages not yet (tests)
        crcs = {record.name: _write_storage(handle.fileno(), storage, record.data_offset, observer, written)
                for record, storage in deferred}
        with _fenced("patching torch's zip"):
            _patch(handle, records, crcs, old_id)
    return len(deferred)


class _Recorder:
    """Stands in for torch's zip writer in ``torch.serialization._save``: large storages get their record's
    header only (their bytes are written later, in blocks); everything else goes through. A ``RuntimeError``
    from the writer's writes is kept in ``write_error``: a failed write, not a reason to fall back."""

    def __init__(self, writer: Any, min_deferred: int):
        self.writer = writer
        self.min_deferred = min_deferred
        self.deferred: list[tuple[str, torch.UntypedStorage]] = []
        self.write_error: BaseException | None = None

    def write_record(self, name: str, data: Any, nbytes: int) -> None:
        if (isinstance(data, torch.UntypedStorage) and data.device.type == "cpu" and nbytes >= self.min_deferred
                and nbytes == data.nbytes()):
            self._writes("write_record_metadata", name, nbytes)
            self.deferred.append((name, data))
        else:
            self._writes("write_record", name, data, nbytes)

    def end_of_file(self) -> None:
        self._writes("write_end_of_file")

    def _writes(self, method: str, *args: Any) -> None:
        try:
            getattr(self.writer, method)(*args)  # (no bound method left in a traceback: the writer is let go)
        except RuntimeError as exc:  # torch reports a failed write (a full disk) as RuntimeError
            self.write_error = exc
            raise

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


def _write_storage(fd: int, storage: torch.UntypedStorage, offset: int, observer: Observer | None,
                   written: Written | None = None) -> int:
    """``storage``'s bytes at ``offset`` of ``fd`` in cached blocks, each shown to ``observer``'s regions,
    checksummed from the cache, and its writeback to the disk started (the file is fsynced once complete: the
    disk then works while the next blocks are copied, instead of after), then told to ``written``; the CRC-32 of
    the whole."""
    data = torch.empty(0, dtype=torch.uint8).set_(storage)
    regions = observer.regions(storage.data_ptr(), storage.nbytes()) if observer is not None else ()
    crc, position, address = 0, 0, storage.data_ptr()

    def put(block: Any, start: int) -> None:  # one cached block: checksummed, written, its writeback started
        nonlocal crc
        crc = crc32(block, crc)
        pwrite_all(fd, block, offset + start)
        durable.start_writeback(fd, offset + start, block.nbytes)
        if written is not None:
            written(address + start, block.nbytes)

    def plain(stop: int) -> None:  # bytes no region covers (padding, another rank's share, ...)
        nonlocal position
        for start in range(position, stop, BLOCK_BYTES):
            put(data[start:min(stop, start + BLOCK_BYTES)].numpy(), start)
        position = max(position, stop)

    for region in regions:
        plain(region.offset)
        flat = region.tensor
        size = flat.element_size()
        step = max(region.piece_elements, BLOCK_BYTES // size // region.piece_elements * region.piece_elements)
        for piece in torch.split(flat, step):
            piece_bytes: Any = piece.view(torch.uint8).numpy()
            region.consume(piece)
            put(piece_bytes, position)
            position += piece_bytes.nbytes
    plain(storage.nbytes())
    return crc


def storage_ranges(obj: Any) -> list[tuple[int, int]]:
    """``(address, end)`` of every CPU storage ``torch.save(obj)`` would write, found by pickling ``obj`` as
    torch does (tensors reduce to their storages) into nothing: no tensor is missed however it is held."""
    found: list[tuple[int, int]] = []

    class Finder(pickle.Pickler):
        def persistent_id(self, value: Any) -> Any:
            if isinstance(value, torch.storage.TypedStorage):
                value = value._untyped_storage
            if isinstance(value, torch.UntypedStorage):
                if value.device.type == "cpu" and value.nbytes():
                    found.append((value.data_ptr(), value.data_ptr() + value.nbytes()))
                return "storage"
            return None

    class Nowhere:
        def write(self, data: Any) -> None:
            pass

    Finder(Nowhere(), protocol=torch.serialization.DEFAULT_PROTOCOL).dump(obj)
    return found


def _hash_combine(seed: int, value: int) -> int:
    """c10::hash_combine on 64-bit size_t: how torch folds the records' CRC-32s into the serialization id."""
    return (seed ^ ((value + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & _U64)) & _U64


def _check(handle: Any, records: _Records) -> bytes:
    """Before any storage is written: the serialization id is the names' hash then the CRCs' combination, each
    20 digits, the second computed by torch with every CRC-32 zero, and each record to patch has a data
    descriptor after its data. Returns the id as torch wrote it."""
    fd = handle.fileno()
    id_record = records.by_suffix("/" + ID_RECORD)
    old_id = os.pread(fd, id_record.size, id_record.data_offset)
    combined_zero = 0
    for record in records.values():
        if record is not id_record and record.size:  # torch leaves empty records out of it
            combined_zero = _hash_combine(combined_zero, 0)
    if len(old_id) != 40 or old_id[20:] != b"%020d" % combined_zero:
        raise LayoutError(f"serialization id {old_id!r} is not laid out as expected")
    for record in records.values():
        if record.size and os.pread(fd, 4, record.data_offset + record.size) != _DESCRIPTOR:
            raise LayoutError(f"{record.name}: no data descriptor after the data")
    return old_id


def _patch(handle: Any, records: _Records, crcs: dict[str, int], old_id: bytes) -> None:
    """Each record's CRC-32 into its data descriptor and central directory entry, after the serialization id,
    which torch computes from the other records' CRC-32s, is rewritten (its layout checked by :func:`_check`)."""
    fd = handle.fileno()
    for record in records.values():
        if record.name not in crcs:  # written by torch: a few bytes, read back
            crcs[record.name] = crc32(os.pread(fd, record.size, record.data_offset)) if record.size else 0
    id_record = records.by_suffix("/" + ID_RECORD)
    combined = 0
    for record in records.values():
        if record is not id_record and record.size:
            combined = _hash_combine(combined, crcs[record.name])
    new_id = old_id[:20] + b"%020d" % combined
    os.pwrite(fd, new_id, id_record.data_offset)
    crcs[id_record.name] = crc32(new_id)
    for record in records.values():
        if record.size:
            packed = struct.pack("<I", crcs[record.name])
            os.pwrite(fd, packed, record.data_offset + record.size + 4)
            os.pwrite(fd, packed, record.central_offset + 16)
