"""ranges: the restore's pread path returns exactly the bytes the memory-mapped path did, for any ranges."""

import os
import random
import sys
import zipfile

import pytest
import torch

from deepspeed_ext.checkpoint import ranges, serialization
from deepspeed_ext.errors import CheckpointError
from deepspeed_ext.module_inject.layout import TPLayout

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds mapped files in /proc/self/maps")


def _saved(tmp_path, name, tensors):
    path = tmp_path / name
    serialization.save(tensors, path)
    return path, serialization.load(path)  # memory-mapped, as every reader loads


def test_each_storage_is_found_where_torch_stored_it_uncompressed_and_aligned(tmp_path):
    path, loaded = _saved(tmp_path, "opt.pt", {"a": torch.randn(3000), "b": torch.randn(7, 5), "c": torch.ones(1)})
    with zipfile.ZipFile(path) as archive:
        records = {info.filename.rsplit("/", 1)[-1]: info for info in archive.infolist() if "/data/" in info.filename}
    assert all(info.compress_type == zipfile.ZIP_STORED for info in records.values())
    offsets = []
    for key, tensor in loaded.items():
        stored = ranges.stored(tensor)
        assert stored.file is not None and stored.file.path == path.resolve(), key
        assert stored.offset % 64 == 0, key  # torch aligns each storage to 64 bytes
        offsets.append(stored.offset)
    with open(path, "rb") as handle:  # each offset is a record's data, right after its local header
        for info in records.values():
            handle.seek(info.header_offset + 26)
            name_length, extra_length = (int.from_bytes(handle.read(2), "little") for _ in range(2))
            assert info.header_offset + 30 + name_length + extra_length in offsets


def test_a_view_into_a_storage_is_found_at_its_own_offset(tmp_path):
    _, loaded = _saved(tmp_path, "flat.pt", {"flat": torch.arange(5000, dtype=torch.float32)})
    flat = loaded["flat"]
    whole, view = ranges.stored(flat), ranges.stored(flat[1234:])
    assert view.offset == whole.offset + 1234 * 4
    assert ranges.stored(flat.view(50, 100)[:, :3]).file is None  # strided: read from memory instead
    assert ranges.stored(torch.randn(10)).file is None  # ordinary memory


def test_pread_returns_the_mapped_bytes_for_random_ranges(tmp_path):
    """Unaligned starts and ends, pieces shorter than a page, pieces in one page, pieces out of file order,
    several files and a tensor in memory in one gather: the same bytes as slicing the mapping."""
    rng = random.Random(19)
    _, first = _saved(tmp_path, "a.pt", {"x": torch.randn(300_000), "y": torch.randn(4099)})
    _, second = _saved(tmp_path, "b.pt", {"z": torch.randn(100_000).to(torch.float32)})
    tensors = [first["x"], first["y"], second["z"], torch.randn(777)]
    stored = [ranges.stored(t) for t in tensors]
    assert [s.file is None for s in stored] == [False, False, False, True]
    for _ in range(300):
        pieces, expected = [], []
        for _ in range(rng.randint(0, 12)):
            which = rng.randrange(len(tensors))
            numel = tensors[which].numel()
            count = rng.choice([0, 1, 3, 511, 512, 513, 1024, 1500, rng.randint(0, numel)])
            count = min(count, numel)
            start = rng.randint(0, numel - count)
            pieces.append((stored[which], start, count))
            expected.append(tensors[which][start:start + count])
        got = ranges.gather(pieces)
        want = torch.cat(expected) if expected else torch.empty(0)
        assert got.dtype == want.dtype and torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_rows_are_read_without_the_elements_between_them_in_few_calls(tmp_path, monkeypatch):
    """A row-parallel weight's half rows (2 KiB of every 4 KiB at hidden 1024, fp32): exactly those bytes,
    and one preadv for all of them, since their pages touch."""
    _, loaded = _saved(tmp_path, "w.pt", {"w": torch.randn(512, 1024)})
    full = loaded["w"]
    here = ranges.stored(full.reshape(-1))
    calls = []
    real = os.preadv

    def counting(fd, views, offset):
        calls.append(sum(len(v) for v in views))
        return real(fd, views, offset)

    monkeypatch.setattr(ranges.os, "preadv", counting)
    read_flat, read_rows = ranges.readers(lambda _, start, stop: [(here, start, stop - start)])
    for half in range(2):
        calls.clear()
        rows = read_rows(0, 512 * half, 200, 1024, 512)
        assert torch.equal(rows, full[:200, 512 * half:512 * (half + 1)])
        assert len(calls) == 1
    # unaligned rows, through reshard_range as the restore reads a ZeRO-3 partition of a TP=2 row slice
    target = TPLayout.split((512, 1024), 2, 1, (512, 512), "row")
    whole = TPLayout.replicated((512, 1024), 1)
    for rank in range(2):
        for low, high in ((0, 1), (3, 70_001), (100_000, 131_072), (511, 513)):
            got = whole.reshard_range(target, rank, low, high, read_flat, read_rows)
            assert torch.equal(got, target.slice(full, rank).reshape(-1)[low:high]), (rank, low, high)


def test_runs_on_pages_that_do_not_touch_are_separate_reads(tmp_path, monkeypatch):
    """Coalescing never reads a page no piece needs: rows 16 KiB apart take one call each."""
    _, loaded = _saved(tmp_path, "w.pt", {"w": torch.randn(64, 4096)})
    full = loaded["w"]
    here = ranges.stored(full.reshape(-1))
    calls = []
    real = os.preadv
    monkeypatch.setattr(ranges.os, "preadv", lambda fd, views, offset: calls.append(offset) or real(fd, views, offset))
    _, read_rows = ranges.readers(lambda _, start, stop: [(here, start, stop - start)])
    assert torch.equal(read_rows(0, 7, 10, 4096, 100), full[:10, 7:107])
    assert len(calls) == 10


def test_a_truncated_file_is_refused(tmp_path):
    path, loaded = _saved(tmp_path, "t.pt", {"t": torch.randn(100_000)})
    stored = ranges.stored(loaded["t"])
    os.truncate(path, stored.offset + 1000)
    with pytest.raises(CheckpointError, match="truncated"):
        ranges.gather([(stored, 90_000, 100)])
