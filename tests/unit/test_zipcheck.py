"""zipcheck: a zip file's CRC-32 from its records' CRC-32, and torn or damaged torch.save files found by record."""

from __future__ import annotations

import json
import os
import platform
import struct
import time
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepspeed_ext.checkpoint import serialization, zipcheck
from deepspeed_ext.checkpoint.zipcheck import (ZipCheckError, check_zip, check_zips, crc32_combine, file_crc32,
                                               zip_file_crc32)
from deepspeed_ext.errors import CheckpointError


def _objects() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    return {
        "dtypes": {"f32": torch.randn(600_000, generator=g), "bf16": torch.randn(300_000, generator=g).bfloat16(),
                   "f16": torch.randn(100_000, generator=g).half(), "i64": torch.arange(50_000),
                   "u8": torch.randint(0, 255, (70_000,), dtype=torch.uint8, generator=g),
                   "bool": torch.rand(10_000, generator=g) > 0.5, "f64": torch.randn(9_000, generator=g).double(),
                   "step": torch.tensor(3.0), "meta": {"lr": 1e-3, "names": ["a", "b"]}},
        "many-small": {f"param.{i}": torch.randn(i % 97 + 1, generator=g) for i in range(600)}
        | {"big": torch.randn(500_000, generator=g)},
        "empty": {"empty": torch.zeros(0), "also-empty": torch.empty(0, 5, dtype=torch.int32),
                  "x": torch.randn(400_000, generator=g)},
    }


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("zips")
    out = {}
    with serialization.zip_crc32(True):  # torch's default, whatever this thread's setting was
        for name, obj in _objects().items():
            torch.save(obj, root / f"{name}.pt")
            out[name] = root / f"{name}.pt"
    return out


def _copy(path: Path, tmp_path: Path) -> Path:
    copy = tmp_path / path.name
    copy.write_bytes(path.read_bytes())
    return copy


def _full(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    return len(data), zlib.crc32(data)


def _records(path: Path) -> dict[str, tuple[int, int]]:
    """Each record's name: (data offset, size)."""
    out = {}
    with open(path, "rb") as handle:
        with zipfile.ZipFile(handle) as archive:
            infos = archive.infolist()
        for info in infos:
            offset = serialization.record_data_offset(handle, info.header_offset)
            assert offset is not None
            out[info.filename] = (offset, info.file_size)
    return out


def _biggest(path: Path) -> tuple[str, int, int]:
    name, (offset, size) = max(_records(path).items(), key=lambda item: item[1][1])
    return name, offset, size


def _zero(path: Path, offset: int, length: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(bytes(length))


# --------------------------------------------------------------------------- crc32_combine
@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=3000), cut=st.integers(min_value=0, max_value=3000),
       seed=st.integers(min_value=0, max_value=0xFFFFFFFF))
def test_crc32_combine_equals_zlib_on_random_splits(data, cut, seed):
    a, b = data[:cut], data[cut:]  # b is empty whenever cut >= len(data): len2 = 0
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(data)
    # from any starting CRC (a prefix before a): the combination is of A's CRC, whatever preceded A
    assert crc32_combine(zlib.crc32(a, seed), zlib.crc32(b), len(b)) == zlib.crc32(b, zlib.crc32(a, seed))


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=5000), start=st.integers(min_value=0, max_value=5000),
       seed=st.integers(min_value=0, max_value=0xFFFFFFFF))
def test_the_fast_crc32_is_zlibs(data, start, seed):
    view = memoryview(data)[start:]
    assert zipcheck.crc32(view, seed) == zlib.crc32(view, seed)
    assert zipcheck.crc32(data) == zlib.crc32(data)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"),
                    reason="isal is installed only where it has wheels")
def test_isal_is_used_where_it_is_installed():
    assert zipcheck.crc32 is not zlib.crc32  # the base install brings isal on this platform


@settings(max_examples=40, deadline=None)
@given(start=st.integers(min_value=0, max_value=3 * 4096 + 17), length=st.integers(min_value=1, max_value=40_000),
       seed=st.integers(min_value=0, max_value=0xFFFFFFFF))
def test_a_mapped_range_sums_as_a_read_one(tmp_path_factory, start, length, seed):
    """Any start (the mapping begins on the page below it), any length across several mapped blocks (each handed
    back once summed), any seed: the CRC-32 of a read."""
    path = tmp_path_factory.getbasetemp() / "mapped-range.bin"
    if not path.exists():
        path.write_bytes(os.urandom(60_000))
    data = path.read_bytes()
    stop = min(start + length, len(data))
    with open(path, "rb") as handle, pytest.MonkeyPatch.context() as patch:
        patch.setattr(zipcheck, "MAPPED_BLOCK_BYTES", 5000)  # several blocks, not on page boundaries
        fd = handle.fileno()
        mapped = zipcheck._crc_of_range(fd, start, stop, seed, path, mapped=True)
        read = zipcheck._crc_of_range(fd, start, stop, seed, path)
    assert mapped == read == zlib.crc32(data[start:stop], seed)


def test_a_file_that_cannot_be_mapped_is_read(tmp_path, monkeypatch):
    import mmap
    path = tmp_path / "unmappable.bin"
    path.write_bytes(os.urandom(70_000))

    def refuse(*args, **kwargs):
        raise OSError(19, "No such device")

    monkeypatch.setattr(mmap, "mmap", refuse)
    with open(path, "rb") as handle:
        summed = zipcheck._crc_of_range(handle.fileno(), 3, 70_000, 0, path, mapped=True)
    assert summed == zlib.crc32(path.read_bytes()[3:])


def test_file_crc32_without_preadv(tmp_path, monkeypatch):
    big = tmp_path / "legacy.bin"
    big.write_bytes(os.urandom(zipcheck.BLOCK_BYTES * 2 + 5))
    monkeypatch.delattr(os, "preadv", raising=False)
    assert file_crc32(big) == _full(big)


def test_crc32_combine_len2_zero_and_long_runs():
    assert crc32_combine(0x12345678, 0, 0) == 0x12345678
    assert crc32_combine(0, 0, 0) == 0
    head = b"header bytes"
    for n in (1, 63, 64, 65_537, 3_000_001):
        zeros = bytes(n)
        assert crc32_combine(zlib.crc32(head), zlib.crc32(zeros), n) == zlib.crc32(head + zeros), n
    with pytest.raises(ValueError):
        crc32_combine(1, 2, -1)


def test_crc32_combine_table_has_period_32_and_huge_lengths_agree():
    """x^(2^32) = x modulo the polynomial: the 32-entry table serves every length. A 2^40-byte run of zeros,
    built by doubling, combines the same as in two halves."""
    table = zipcheck._X_POW_2K
    assert zipcheck._multiply(table[31], table[31]) == table[0]
    zeros_crc, length = zlib.crc32(bytes(1 << 20)), 1 << 20
    while length < 1 << 40:
        zeros_crc, length = crc32_combine(zeros_crc, zeros_crc, length), length * 2
    half_crc = zlib.crc32(bytes(1 << 20))
    for _ in range(19):
        half_crc = crc32_combine(half_crc, half_crc, (1 << 20) << _)
    start = zlib.crc32(b"prefix")
    whole = crc32_combine(start, zeros_crc, 1 << 40)
    assert whole == crc32_combine(crc32_combine(start, half_crc, 1 << 39), half_crc, 1 << 39)


def test_crc32_combine_is_fast():
    lengths = [(1 << 40) - 1, (1 << 40) + 12345, 0xAAAAAAAAAA, 1 << 40]  # every bit set: the worst case
    start = time.perf_counter()
    for _ in range(50):
        for len2 in lengths:
            crc32_combine(0xDEADBEEF, 0x01234567, len2)
    per_call = (time.perf_counter() - start) / (50 * len(lengths))
    assert per_call < 1e-3, f"{per_call * 1e6:.0f} us per call"


# --------------------------------------------------------------------------- zip_file_crc32 / file_crc32
@pytest.mark.parametrize("name", list(_objects()))
def test_zip_file_crc32_equals_a_full_read(files, name):
    assert zip_file_crc32(files[name]) == _full(files[name])
    assert file_crc32(files[name]) == _full(files[name])


def test_zip_file_crc32_does_not_read_the_big_records(files, monkeypatch):
    path = files["dtypes"]
    big = sum(size for _, size in _records(path).values() if size >= zipcheck.READ_BELOW)
    read = []
    real_pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: read.append(n) or real_pread(fd, n, offset))
    assert zip_file_crc32(path) == _full(path)
    assert big > 0.9 * path.stat().st_size
    assert sum(read) <= path.stat().st_size - big


def test_a_file_without_crc32_is_read_whole(tmp_path):
    path = tmp_path / "nocrc.pt"
    serialization.save({"w": torch.randn(200_000), "b": torch.zeros(3)}, path)
    assert zip_file_crc32(path) == _full(path)


def test_file_crc32_of_other_files(tmp_path, files):
    text = tmp_path / "meta.json"
    text.write_text(json.dumps({"step": 3, "files": list(range(1000))}))
    assert file_crc32(text) == _full(text)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert file_crc32(empty) == (0, 0)
    big = tmp_path / "legacy.bin"  # several blocks
    big.write_bytes(os.urandom(zipcheck.BLOCK_BYTES * 2 + 7))
    assert file_crc32(big) == _full(big)
    torn = _copy(files["dtypes"], tmp_path)
    os.truncate(torn, torn.stat().st_size // 2)
    assert file_crc32(torn) == _full(torn)  # a zip it cannot take: read whole
    with pytest.raises(ZipCheckError, match=f"^{torn}: not a readable zip file"):
        zip_file_crc32(torn)
    with pytest.raises(CheckpointError, match=f"^{text}: "):
        zip_file_crc32(text)


def test_a_compressed_record_is_refused_by_zip_file_crc32_but_checked(tmp_path):
    path = tmp_path / "deflated.zip"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("a", os.urandom(100_000))
        archive.writestr("b", b"x" * 200_000)
    with pytest.raises(ZipCheckError, match=f"^{path}: record a is compressed"):
        zip_file_crc32(path)
    assert file_crc32(path) == _full(path)
    report = check_zip(path)
    assert report.problems == [] and report.records == 2
    offset, size = _records(path)["a"]
    _zero(path, offset + size // 2, 4096)
    report = check_zip(path)
    assert len(report.problems) == 1 and report.problems[0].startswith(f"{path}: record a (compressed) fails")


# --------------------------------------------------------------------------- check_zip
@pytest.mark.parametrize("mapped", [False, True])
@pytest.mark.parametrize("name", list(_objects()))
def test_check_zip_passes_a_sound_file(files, name, mapped):
    report = check_zip(files[name], mapped=mapped)
    records = _records(files[name])
    assert report.problems == []
    assert report.records == len(records)
    assert report.bytes_checked == sum(size for _, size in records.values())
    assert not report.without_crc


@pytest.mark.parametrize(("block_bytes", "mapped"), [(zipcheck.BLOCK_BYTES, False), (4096, False),
                                                     (zipcheck.BLOCK_BYTES, True)])
def test_a_hole_names_exactly_its_record(files, tmp_path, block_bytes, mapped):
    path = _copy(files["dtypes"], tmp_path)
    name, offset, size = _biggest(path)
    assert size > 1 << 20
    _zero(path, offset + size // 2 // 4096 * 4096, 64 << 10)
    report = check_zip(path, block_bytes=block_bytes, mapped=mapped)
    assert report.problems == [f"{path}: record {name} fails its CRC-32 (damaged, or never written: a torn save)"]
    assert report.records == len(_records(path))
    # The whole-file CRC-32 trusts the directory: only check_zip can tell.
    assert zip_file_crc32(path) != _full(path)


def test_a_hole_over_small_records_and_headers(files, tmp_path):
    path = _copy(files["many-small"], tmp_path)
    records = _records(path)
    name, offset, size = _biggest(path)
    _zero(path, offset - 200, 100)  # inside the big record's local header (its padding) and before it
    small = sorted((off, n) for n, (off, sz) in records.items() if 0 < sz < 1000)
    first_small_offset, first_small = small[len(small) // 2]
    _zero(path, first_small_offset, 8)
    report = check_zip(path)
    assert len(report.problems) >= 2, report.problems
    assert any(f"record {first_small} fails its CRC-32" in line for line in report.problems)
    assert all(line.startswith(f"{path}: record ") for line in report.problems)


def test_a_zeroed_local_header_is_named(files, tmp_path):
    path = _copy(files["empty"], tmp_path)
    name, offset, size = _biggest(path)
    with zipfile.ZipFile(path) as archive:
        header = archive.getinfo(name).header_offset
    _zero(path, header, 30)
    report = check_zip(path)
    assert report.problems == [f"{path}: record {name} has no zip local header at byte {header} "
                               f"(damaged, or never written: a torn save)"]


@pytest.mark.parametrize("mapped", [False, True])
@pytest.mark.parametrize("cut", ["half", "last 10 bytes"])
def test_a_truncated_file_is_cut_short(files, tmp_path, cut, mapped):
    path = _copy(files["dtypes"], tmp_path)
    size = path.stat().st_size
    os.truncate(path, size // 2 if cut == "half" else size - 10)
    report = check_zip(path, mapped=mapped)
    assert report.problems == [f"{path}: cut short: no zip central directory (the file was not completely written)"]
    assert report.records == 0 and report.bytes_checked == 0


@pytest.mark.parametrize("mapped", [False, True])
def test_a_record_past_the_end_of_the_file(tmp_path, mapped):
    """Central directory intact, data missing: a writer that wrote the directory before the data (as zipsave
    does) and was killed, on a file system that kept the size but not the last blocks. Mapped, the record is
    never mapped past the file's end (a SIGBUS would end the test process)."""
    path = tmp_path / "short.zip"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("a", os.urandom(300_000))
        archive.writestr("b", os.urandom(10))
    data = path.read_bytes()
    start = _records(path)["a"][0]
    directory = data.index(b"PK\x01\x02")
    # drop the tail of a's data and everything up to the directory, then shift the directory's offset back
    kept = start + 1000
    cut = directory - kept
    new = bytearray(data[:kept] + data[directory:])
    end = new.rindex(b"PK\x05\x06")
    struct.pack_into("<I", new, end + 16, directory - cut)
    path.write_bytes(bytes(new))
    report = check_zip(path, mapped=mapped)
    assert report.problems[0].startswith(f"{path}: record a runs past the end of the file"), report.problems


def test_a_file_saved_without_crc32(tmp_path):
    path = tmp_path / "nocrc.pt"
    serialization.save({"w": torch.randn(300_000), "e": torch.zeros(0), "s": {"k": torch.ones(3)}}, path)
    report = check_zip(path)
    assert report.without_crc and report.problems == [] and report.bytes_checked == 0 and report.records > 3
    _zero(path, _biggest(path)[1] + 4096, 64 << 10)  # cannot be seen
    assert check_zip(path).problems == []


def test_some_crc32_zero_is_no_file_without_crc32(files, tmp_path):
    """A writer that patches the CRC-32 in after the data (zipsave) and was killed part way leaves some at 0: those
    records are reported, the others still checked."""
    path = _copy(files["dtypes"], tmp_path)
    name = _biggest(path)[0]
    data = bytearray(path.read_bytes())
    entry = data.index(b"PK\x01\x02")  # the central directory's first entry
    while data[entry + 46:entry + 46 + len(name)] != name.encode():
        entry = data.index(b"PK\x01\x02", entry + 4)
    struct.pack_into("<I", data, entry + 16, 0)
    path.write_bytes(bytes(data))
    report = check_zip(path)
    assert not report.without_crc
    assert report.problems == [f"{path}: record {name} fails its CRC-32 (damaged, or never written: a torn save)"]


def test_an_io_error_is_that_records_problem(files, monkeypatch):
    path = files["dtypes"]
    name, offset, size = _biggest(path)
    real_pread = os.pread

    def pread(fd: int, n: int, at: int) -> bytes:
        if offset <= at < offset + size:
            raise OSError(5, "Input/output error")
        return real_pread(fd, n, at)

    def preadv(fd: int, buffers: list, at: int) -> int:
        if offset <= at < offset + size:
            raise OSError(5, "Input/output error")
        return real_preadv(fd, buffers, at)

    real_preadv = getattr(os, "preadv", None)
    monkeypatch.setattr(os, "pread", pread)
    if real_preadv is not None:
        monkeypatch.setattr(os, "preadv", preadv)
    report = check_zip(path)
    assert report.problems == [f"{path}: record {name} cannot be read: Input/output error"]
    assert report.bytes_checked == sum(size for _, size in _records(path).values()) - size


def test_not_a_zip_empty_and_missing(tmp_path):
    text = tmp_path / "latest"
    text.write_text("global_step10\n")
    report = check_zip(text)
    assert report.problems == [f"{text}: not a zip file (no zip central directory; a torch.save file is a zip)"]
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    assert check_zip(empty).problems == [f"{empty}: cut short: the file is empty (the file was not completely "
                                         f"written)"]
    missing = tmp_path / "missing.pt"
    assert check_zip(missing).problems == [f"{missing}: cannot read: No such file or directory"]


def test_a_damaged_central_directory(files, tmp_path):
    path = _copy(files["dtypes"], tmp_path)
    data = path.read_bytes()
    _zero(path, data.index(b"PK\x01\x02"), 4)
    (line, ) = check_zip(path).problems
    assert line.startswith(f"{path}: damaged zip central directory: ")


def test_check_zips_keeps_the_order(files, tmp_path):
    torn = _copy(files["dtypes"], tmp_path)
    os.truncate(torn, 1000)
    paths = [files["many-small"], torn, files["empty"], str(files["dtypes"])]
    reports = check_zips(paths, threads=3)
    assert list(reports) == [Path(path) for path in paths]
    assert [len(report.problems) for report in reports.values()] == [0, 1, 0, 0]


# --------------------------------------------------------------------------- ZIP64
def _zip64(path: Path, records: list[tuple[str, bytes]]) -> None:
    """A stored zip written the way torch writes a file over 4 GiB, at a small size: every size and offset in
    the central directory is 0xFFFFFFFF with the value in a ZIP64 extra field, ZIP64 data descriptors, ZIP64
    end records."""
    out, directory = bytearray(), bytearray()
    for name, data in records:
        offset, encoded = len(out), name.encode()
        local_extra = struct.pack("<HHQQ", 1, 16, len(data), len(data))
        pad = -(len(out) + 30 + len(encoded) + len(local_extra) + 4) % 64  # torch's alignment, its "FB" field
        local_extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad
        crc = zlib.crc32(data)
        out += struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 45, 0x08, 0, 0, 0, 0, 0xFFFFFFFF, 0xFFFFFFFF,
                           len(encoded), len(local_extra)) + encoded + local_extra
        assert len(out) % 64 == 0
        out += data
        out += struct.pack("<4sIQQ", b"PK\x07\x08", crc, len(data), len(data))
        extra = struct.pack("<HHQQQ", 1, 24, len(data), len(data), offset)
        directory += struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 45, 45, 0x08, 0, 0, 0, crc, 0xFFFFFFFF,
                                 0xFFFFFFFF, len(encoded), len(extra), 0, 0, 0, 0, 0xFFFFFFFF) + encoded + extra
    start = len(out)
    out += directory
    end64 = len(out)
    out += struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, len(records), len(records),
                       len(directory), start)
    out += struct.pack("<4sIQI", b"PK\x06\x07", 0, end64, 1)
    out += struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    path.write_bytes(bytes(out))


def test_zip64_records(tmp_path):
    path = tmp_path / "zip64.pt"
    _zip64(path, [("a/data.pkl", b"pickle" * 10), ("a/data/0", os.urandom(700_000)), ("a/data/1", b""),
                  ("a/data/2", os.urandom(100_000)), ("a/version", b"3\n")])
    with zipfile.ZipFile(path) as archive:  # zipfile reads it as ZIP64, and its CRCs match
        assert archive.testzip() is None
        assert archive.getinfo("a/data/2").header_offset > 700_000
    assert zip_file_crc32(path) == _full(path)
    report = check_zip(path)
    assert report.problems == [] and report.records == 5 and report.bytes_checked == 800_000 + 62
    offset, size = _records(path)["a/data/2"]
    _zero(path, offset + 4096, 8192)
    assert check_zip(path).problems == [f"{path}: record a/data/2 fails its CRC-32 (damaged, or never written: "
                                        f"a torn save)"]
