"""Integrity of ``torch.save`` files (ZIP archives) from the CRC-32 their central directory already holds.

Two uses:

* :func:`check_zip` finds a file that is torn (cut short, or with holes of zeros where a killed writer never
  wrote) or damaged, and names the record that is: each record's bytes are read and compared with the CRC-32
  torch wrote for them. A checkpoint that loads is not proof of this: ``torch.load`` maps tensors and never
  checks a CRC, so a hole reads back as zeros.
* :func:`file_crc32` gives a whole file's CRC-32 for a commit marker without reading its big tensor records:
  the CRC-32 of ``A + B`` follows from the CRC-32 of each part (:func:`crc32_combine`), and the central
  directory has it for every record, so only the few bytes between them (headers, pickles, descriptors, the
  directory) are read. It equals ``zlib.crc32`` of the whole file whenever the records match their CRC-32,
  which :func:`check_zip` verifies.

Only the standard library (and ISA-L's CRC-32, where ``isal`` is installed) is imported here, so tools that
only check files start fast; the zip record parser that :mod:`.serialization` and :mod:`.zipsave` use lives here
for that reason.
"""

from __future__ import annotations

import functools
import os
import struct
import zipfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepspeed_ext.errors import CheckpointError, first_line

try:  # ISA-L's CRC-32 (the isal package): zlib's value, about 4x as fast on one core (8 against 2 GB/s on a
    # 2-core EPYC VM) and, like zlib's, summing with the GIL released. Every CRC-32 of file bytes goes through it.
    from isal.isal_zlib import crc32 as crc32
except ImportError:  # no isal wheel for this platform: zlib's
    from zlib import crc32 as crc32

#: Records whose data are at least this long are not read by :func:`zip_file_crc32`: their central directory
#: CRC-32 stands for them. Smaller ones are read with the bytes around them (one read is cheaper than a seek).
READ_BELOW = 64 << 10
#: Bytes read at a time by default, into one buffer reused for the whole range: no fresh memory is faulted in
#: for each block, and the block can stay in the CPU's cache between the read's copy and the sum (2 and 8 MiB
#: both checked 3.5 GB/s from a warm page cache on one thread of a 2-core EPYC VM; zlib and a fresh 8 MiB
#: ``pread`` per block, 1.5 GB/s). Callers may pass ``block_bytes``.
BLOCK_BYTES = 2 << 20
#: Bytes summed per call where a record is read through a mapping (``mapped``): each block's pages are handed
#: back (``madvise(MADV_DONTNEED)``, which only drops this mapping's view of them) once summed, so the check's
#: memory stays flat.
MAPPED_BLOCK_BYTES = 8 << 20

_LOCAL_HEADER = b"PK\x03\x04"
_DESCRIPTOR = b"PK\x07\x08"
_END_OF_CENTRAL_DIRECTORY = b"PK\x05\x06"
_END_RECORD_BYTES = 22
_MAX_COMMENT = 0xFFFF
_MASK = 0xFFFFFFFF
#: zlib's CRC-32 polynomial, bit-reversed (the lowest power of x is the highest bit, as zlib computes).
_POLY = 0xEDB88320
#: The polynomial 1 (x^0) in that representation.
_ONE = 1 << 31
_TORN = "(damaged, or never written: a torn save)"


class ZipCheckError(CheckpointError):
    """A file's CRC-32 cannot be derived from its zip records (not a readable zip, or a compressed record)."""


@dataclass
class ZipReport:
    """What :func:`check_zip` found in one file."""

    #: One line each, naming the file and, where it applies, the record; empty for a sound file.
    problems: list[str] = field(default_factory=list)
    #: Records in the central directory (0 where it could not be read).
    records: int = 0
    #: Bytes of record data read and compared with their CRC-32.
    bytes_checked: int = 0
    #: The file was written with CRC-32 off (every non-empty record's CRC-32 is 0, as torch writes with
    #: ``compute_crc32=False``, which :func:`deepspeed_ext.checkpoint.serialization.save` uses): no record's data
    #: could be checked, only the file's structure.
    without_crc: bool = False


# --------------------------------------------------------------------------- CRC-32 arithmetic
def _times_x(value: int) -> int:
    """``value * x`` modulo the polynomial (in the bit-reversed representation, a right shift)."""
    return (value >> 1) ^ _POLY if value & 1 else value >> 1


def _multiply(a: int, b: int) -> int:
    """``a * b`` modulo the CRC-32 polynomial, both in zlib's bit-reversed representation: one step per bit of
    ``a``."""
    product = 0
    bit = _ONE
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = _times_x(b)
    return product


def _powers_of_x() -> list[int]:
    """``x^(2^k)`` modulo the polynomial for k = 0..31, each the square of the one before. The sequence repeats
    with period 32 (x^(2^32) = x modulo this polynomial, which the tests check), so 32 entries serve any length."""
    table = [_ONE >> 1]  # x^1
    for _ in range(31):
        table.append(_multiply(table[-1], table[-1]))
    return table


_X_POW_2K = _powers_of_x()


@functools.cache
def _times_x_pow_2k(k: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """Multiplication by ``x^(2^k)`` as four 256-entry tables, one per byte of the multiplicand: the product is
    linear in it, so it is the XOR of each byte's part. Four lookups instead of :func:`_multiply`'s 32 steps make
    :func:`crc32_combine` ~10x faster; a table costs ~0.3 ms, once, and there are 32 at most."""
    basis = [0] * 32  # basis[bit]: the product for the multiplicand with only that bit set
    power = _X_POW_2K[k]
    for bit in range(31, -1, -1):  # bit 31 is x^0, bit 30 x^1...
        basis[bit] = power
        power = _times_x(power)
    tables = ([0] * 256, [0] * 256, [0] * 256, [0] * 256)
    for byte, table in enumerate(tables):
        for value in range(1, 256):
            low = value & -value
            table[value] = table[value ^ low] ^ basis[8 * byte + low.bit_length() - 1]
    return tables


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 (zlib's) of ``A + B`` from ``crc1 = crc32(A)``, ``crc2 = crc32(B)`` and ``len2 = len(B)``.

    Appending ``len2`` bytes multiplies A's CRC register by ``x^(8 * len2)`` modulo the polynomial (zlib's
    pre- and post-inversion cancel out), then adds B's CRC. That power is the product of the entries
    ``x^(2^k)`` for the set bits of ``8 * len2``: one multiplication (four table lookups) per set bit, so the time
    grows with the number of set bits of ``len2``, not with ``len2`` (at most ~35 us below 1 TiB), which is what
    lets :func:`zip_file_crc32` skip the big records' bytes.
    """
    if len2 < 0:
        raise ValueError(f"len2 must not be negative, got {len2}")
    register = crc1 & _MASK
    k = 3  # 8 * len2 = len2 * 2^3
    while len2 and register:
        if len2 & 1:
            t0, t1, t2, t3 = _times_x_pow_2k(k & 31)
            register = t0[register & 0xFF] ^ t1[register >> 8 & 0xFF] ^ t2[register >> 16 & 0xFF] ^ t3[register >> 24]
        len2 >>= 1
        k += 1
    return register ^ (crc2 & _MASK)


# --------------------------------------------------------------------------- reading
def record_data_offset(handle: Any, header_offset: int) -> int | None:
    """Where a zip record's bytes begin in the open file ``handle``: after its local header at ``header_offset``
    (30 bytes, then its name and extra field; torch pads the extra field to align storages to 64). None where no
    local header is there."""
    handle.seek(header_offset)
    local = handle.read(30)
    if len(local) < 30 or local[:4] != b"PK\x03\x04":
        return None
    name_length, extra_length = struct.unpack_from("<HH", local, 26)
    return int(header_offset + 30 + name_length + extra_length)


def _advise(fd: int, advice_name: str) -> None:
    """``posix_fadvise`` over the whole file where the platform has it (a hint: its failure changes nothing)."""
    advice = getattr(os, advice_name, None)
    if hasattr(os, "posix_fadvise") and advice is not None:
        try:
            os.posix_fadvise(fd, 0, 0, advice)
        except OSError:
            pass


def _crc_of_range(fd: int, start: int, stop: int, crc: int, path: Path, block_bytes: int = BLOCK_BYTES,
                  mapped: bool = False) -> int:
    """``crc`` continued over the file's bytes ``[start, stop)``, read in blocks into one buffer (the sum releases
    the GIL, so other files can be read on other threads meanwhile). ``mapped``: summed where they lie in the page
    cache, through a mapping of the range, with no copy (see :func:`check_zip`)."""
    if start >= stop:
        return crc
    if mapped:
        summed = _crc_of_mapped_range(fd, start, stop, crc)
        if summed is not None:
            return summed
    buffer = memoryview(bytearray(min(block_bytes, stop - start)))
    position = start
    while position < stop:
        wanted = min(len(buffer), stop - position)
        if hasattr(os, "preadv"):
            got = os.preadv(fd, [buffer[:wanted]], position)
            block: Any = buffer[:got]
        else:  # no preadv (older macOS): a fresh bytes object per block
            block = os.pread(fd, wanted, position)
            got = len(block)
        if not got:
            raise ZipCheckError(f"{path}: ends at byte {position}, before byte {stop} (changed while it was read?)")
        crc = crc32(block, crc)
        position += got
    return crc


def _crc_of_mapped_range(fd: int, start: int, stop: int, crc: int) -> int | None:
    """:func:`_crc_of_range` through a read-only mapping of ``[start, stop)`` (within the file's size, which the
    caller checked), or None where the file cannot be mapped (the caller reads it instead)."""
    import mmap
    offset = start - start % mmap.ALLOCATIONGRANULARITY
    try:
        mapping = mmap.mmap(fd, stop - offset, prot=mmap.PROT_READ, offset=offset)
    except (OSError, ValueError, AttributeError):  # a file system without mmap, or a platform without PROT_READ
        return None
    page = mmap.PAGESIZE
    with mapping:
        view = memoryview(mapping)
        try:
            released = 0
            for low in range(start - offset, stop - offset, MAPPED_BLOCK_BYTES):
                high = min(low + MAPPED_BLOCK_BYTES, stop - offset)
                crc = crc32(view[low:high], crc)
                done = high - high % page
                if done > released and hasattr(mapping, "madvise"):
                    mapping.madvise(mmap.MADV_DONTNEED, released, done - released)
                    released = done
        finally:
            view.release()
    return crc


def _data_offset(handle: Any, header_offset: int) -> int | None:
    """Where a record's data begin (after its local header), or None where no local header is there (a damaged
    directory can give zipfile an offset before the file's start)."""
    return record_data_offset(handle, header_offset) if header_offset >= 0 else None


def _infolist(handle: Any) -> list[zipfile.ZipInfo]:
    """The records of the zip open in ``handle``, in file order. zipfile reads ZIP64 sizes and offsets too."""
    with zipfile.ZipFile(handle) as archive:
        return sorted(archive.infolist(), key=lambda info: info.header_offset)


# --------------------------------------------------------------------------- whole-file CRC-32
def zip_file_crc32(path: str | os.PathLike[str]) -> tuple[int, int]:
    """``(size, CRC-32)`` of a zip file's bytes, the CRC-32 of each stored record of at least :data:`READ_BELOW`
    bytes taken from the central directory instead of read: a commit marker for a multi-GB checkpoint file costs a
    few small reads. Equal to ``zlib.crc32`` of the whole file whenever the records match their CRC-32 (what
    :func:`check_zip` verifies); a record whose CRC-32 is 0 although it has data (written with CRC-32 off) is read.
    Raises :class:`ZipCheckError` for a file that is not a readable zip or has a compressed record.
    """
    path = Path(path)
    with open(path, "rb", buffering=0) as handle:
        fd = handle.fileno()
        # Only the bytes between the big records are read: readahead would fetch the records' pages with them.
        _advise(fd, "POSIX_FADV_RANDOM")
        size = os.fstat(fd).st_size
        try:
            records = _infolist(handle)
        except Exception as exc:  # zipfile raises most kinds (ValueError, NotImplementedError, OSError...) on damage
            raise ZipCheckError(f"{path}: not a readable zip file: {first_line(exc)}") from exc
        crc, position = 0, 0
        for info in records:
            if info.compress_type != zipfile.ZIP_STORED:
                raise ZipCheckError(f"{path}: record {info.filename} is compressed (method {info.compress_type}): "
                                    f"its CRC-32 is not that of the file's bytes")
            if info.compress_size < READ_BELOW or info.CRC == 0:
                continue  # read with the bytes around it
            start = _data_offset(handle, info.header_offset)
            if start is None:
                raise ZipCheckError(f"{path}: record {info.filename} has no zip local header at byte "
                                    f"{info.header_offset}")
            stop = start + info.compress_size
            if start < position or stop > size:
                raise ZipCheckError(f"{path}: record {info.filename} (bytes {start} to {stop}) overlaps another "
                                    f"record or runs past the end of the file ({size} bytes)")
            crc = _crc_of_range(fd, position, start, crc, path)
            crc = crc32_combine(crc, info.CRC, info.compress_size)
            position = stop
        crc = _crc_of_range(fd, position, size, crc, path)
    return size, crc


def file_crc32(path: str | os.PathLike[str]) -> tuple[int, int]:
    """``(size, CRC-32)`` of any file: a zip file (a torch.save file) through :func:`zip_file_crc32`, anything
    else (JSON, text, a legacy pickle), and a zip that function cannot take (torn, compressed), by reading it
    all: the result is always the CRC-32 of the file's bytes, only its cost differs."""
    path = Path(path)
    with open(path, "rb", buffering=0) as handle:
        magic = handle.read(len(_LOCAL_HEADER))
    if magic == _LOCAL_HEADER:
        try:
            return zip_file_crc32(path)
        except ZipCheckError:
            pass
    with open(path, "rb", buffering=0) as handle:
        fd = handle.fileno()
        _advise(fd, "POSIX_FADV_SEQUENTIAL")
        size = os.fstat(fd).st_size
        return size, _crc_of_range(fd, 0, size, 0, path)


# --------------------------------------------------------------------------- checking
def _unreadable_directory(path: Path, fd: int, size: int, exc: BaseException) -> str:
    """The line for a file zipfile cannot list: empty, cut short (no end record), not a zip, or damaged."""
    if size == 0:
        return f"{path}: cut short: the file is empty (the file was not completely written)"
    tail_start = max(0, size - _END_RECORD_BYTES - _MAX_COMMENT)
    tail = os.pread(fd, size - tail_start, tail_start)
    end = tail.rfind(_END_OF_CENTRAL_DIRECTORY)
    if end < 0 or len(tail) - end < _END_RECORD_BYTES:
        if os.pread(fd, len(_LOCAL_HEADER), 0) == _LOCAL_HEADER:
            return f"{path}: cut short: no zip central directory (the file was not completely written)"
        return f"{path}: not a zip file (no zip central directory; a torch.save file is a zip)"
    return f"{path}: damaged zip central directory: {first_line(exc)}"


#: Which records' data :func:`check_zip` reads and compares with their CRC-32 (None: every record's).
ReadData = Callable[[zipfile.ZipInfo], bool]


def _check_record(handle: Any, archive: zipfile.ZipFile, info: zipfile.ZipInfo, size: int, path: Path,
                  block_bytes: int, report: ZipReport, read_data: ReadData | None = None,
                  mapped: bool = False) -> str | None:
    """The problem with one record, if any: no local header, data past the end, a CRC-32 mismatch (where
    ``read_data`` lets its data be read), a data descriptor that disagrees with the central directory."""
    name = info.filename
    start = _data_offset(handle, info.header_offset)
    if start is None:
        return f"{path}: record {name} has no zip local header at byte {info.header_offset} {_TORN}"
    stop = start + info.compress_size
    if stop > size:
        return f"{path}: record {name} runs past the end of the file ({stop - size} bytes missing: cut short)"
    # A record whose data read_data leaves out is checked for its place in the file only.
    if not report.without_crc and info.compress_size and (read_data is None or read_data(info)):
        if info.compress_type == zipfile.ZIP_STORED:
            crc = _crc_of_range(handle.fileno(), start, stop, 0, path, block_bytes, mapped=mapped)
            report.bytes_checked += info.compress_size
            if crc != info.CRC:
                return f"{path}: record {name} fails its CRC-32 {_TORN}"
        else:  # never in a torch file; zipfile inflates it and compares the CRC-32
            try:
                with archive.open(info) as stream:
                    while stream.read(block_bytes):
                        pass
            except Exception as exc:  # BadZipFile (the CRC-32), zlib.error, EOFError, NotImplementedError...
                return f"{path}: record {name} (compressed) fails its check: {first_line(exc)}"
            report.bytes_checked += info.compress_size
    if info.flag_bits & 0x08 and info.compress_size:  # a data descriptor follows: its CRC-32 must agree
        descriptor = os.pread(handle.fileno(), 8, stop)
        field_at = 4 if descriptor[:4] == _DESCRIPTOR else 0  # the signature is optional
        stored = descriptor[field_at:field_at + 4]
        if len(stored) < 4:
            return f"{path}: record {name}'s data descriptor runs past the end of the file (cut short)"
        if int.from_bytes(stored, "little") != info.CRC:
            return f"{path}: record {name}'s data descriptor does not match the central directory {_TORN}"
    return None


def check_zip(path: str | os.PathLike[str], *, block_bytes: int = BLOCK_BYTES,
              read_data: ReadData | None = None, mapped: bool = False) -> ZipReport:
    """Read every record of a zip file (a torch.save file) and compare it with its CRC-32; report what is wrong,
    one line per problem: not a zip, cut short, a record without its local header, past the end, or failing its
    CRC-32 (a hole of zeros left by a killed writer, or damage). ``torch.load`` would not notice most of these:
    it maps tensors and reads a hole as zeros. Errors reading the file are reported too, never raised, so a
    caller can check many files and list every bad one. A file written with CRC-32 off gets ``without_crc`` and
    only its structure is checked. Reads go in blocks of ``block_bytes``; the sum releases the GIL, so files may
    be checked on several threads (:func:`check_zips`). ``read_data``: which records' data to read (the rest are
    checked for their place in the file only); default every record's.

    ``mapped``: each record's data are summed through a mapping of the file instead of copied out of it first
    (``preadv``, 6 against 15 GB/s of a warm page cache on one core of a 2-core EPYC VM). A read error there is
    a SIGBUS that ends the process instead of a line naming the file, so only a caller that reads the same bytes
    through a mapping anyway (a conversion: ``torch.load(mmap=True)``) asks for it; the records' places are
    checked against the file's size first either way, so a file cut short is reported, not mapped past its end."""
    path = Path(path)
    report = ZipReport()
    try:
        with open(path, "rb", buffering=0) as handle:
            fd = handle.fileno()
            _advise(fd, "POSIX_FADV_SEQUENTIAL")
            size = os.fstat(fd).st_size
            try:
                archive = zipfile.ZipFile(handle)
            except Exception as exc:  # zipfile raises most kinds (ValueError, NotImplementedError...) on damage
                report.problems.append(_unreadable_directory(path, fd, size, exc))
                return report
            with archive:
                records = sorted(archive.infolist(), key=lambda info: info.header_offset)
                report.records = len(records)
                with_data = [info for info in records if info.file_size]
                report.without_crc = bool(with_data) and all(info.CRC == 0 for info in with_data)
                for info in records:
                    try:
                        problem = _check_record(handle, archive, info, size, path, block_bytes, report, read_data,
                                                mapped)
                    except OSError as exc:  # an I/O error (a bad sector) is that record's problem: go on
                        problem = f"{path}: record {info.filename} cannot be read: {exc.strerror or first_line(exc)}"
                    if problem is not None:
                        report.problems.append(problem)
    except OSError as exc:
        report.problems.append(f"{path}: cannot read: {exc.strerror or first_line(exc)}")
    except ZipCheckError as exc:  # it changed while it was read
        report.problems.append(str(exc))
    return report


def check_zips(paths: Iterable[str | os.PathLike[str]], threads: int = 2,
               read_data: Mapping[Path, ReadData] | None = None, mapped: bool = False) -> dict[Path, ZipReport]:
    """:func:`check_zip` of each file, ``threads`` at a time (reads and the sums release the GIL: two threads
    keep a disk or the page cache busier than one), in the order given; ``read_data``: per file, which records'
    data to read (a file not in it: every record's); ``mapped`` as for :func:`check_zip`."""
    from concurrent.futures import ThreadPoolExecutor
    files = [Path(path) for path in paths]
    chosen = read_data or {}
    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="deepspeed-ext-zipcheck") as pool:
        return dict(zip(files, pool.map(lambda path: check_zip(path, read_data=chosen.get(path), mapped=mapped),
                                              files),
                        strict=True))


def small_records(info: zipfile.ZipInfo) -> bool:
    """A :data:`ReadData` choice: the records below :data:`READ_BELOW` bytes (pickles, small tensors), which
    :func:`zip_file_crc32` reads too."""
    return info.compress_size < READ_BELOW


def records_holding(path: str | os.PathLike[str], offsets: Iterable[int]) -> set[str]:
    """The names of the records whose data hold any of the byte ``offsets`` of the zip file at ``path`` (a
    tensor mapped from it starts at one). Raises :class:`ZipCheckError` for a file that is not a readable zip."""
    wanted = set(offsets)
    found: set[str] = set()
    with open(path, "rb", buffering=0) as handle:
        try:
            records = _infolist(handle)
        except Exception as exc:  # zipfile raises most kinds on damage
            raise ZipCheckError(f"{path}: not a readable zip file: {first_line(exc)}") from exc
        for info in records:
            start = _data_offset(handle, info.header_offset)
            if start is not None and any(start <= offset < start + info.compress_size for offset in wanted):
                found.add(info.filename)
    return found
