"""serialization.release_pages: memory-mapped checkpoint pages leave RSS; nothing else is touched."""

import torch

from deepspeed_ext.checkpoint import serialization


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def test_release_pages_drops_mapped_pages_and_keeps_the_data(tmp_path):
    path = tmp_path / "big.pt"
    serialization.save({"flat": torch.arange(16 * 2**20, dtype=torch.float32)}, path)  # 64 MiB
    flat = serialization.load(path)["flat"]
    expected_sum = float(flat.double().sum())  # touches every page
    before = _rss_kib()
    mappings = serialization.file_mappings(path)
    assert mappings, "torch.load(mmap=True) should map the file"
    serialization.release_pages(flat, mappings)
    assert before - _rss_kib() > 48 * 1024  # most of the 64 MiB left the resident set
    assert float(flat.double().sum()) == expected_sum  # and reads back from the file unchanged


def test_release_pages_ignores_memory_outside_the_mappings(tmp_path):
    path = tmp_path / "small.pt"
    serialization.save({"x": torch.ones(1024)}, path)
    mapped = serialization.load(path)  # keeps the file mapped
    mappings = serialization.file_mappings(path)
    assert mappings
    heap = torch.arange(4 * 2**20, dtype=torch.float32)  # ordinary memory: madvise would zero it
    serialization.release_pages(heap, mappings)
    assert torch.equal(heap, torch.arange(4 * 2**20, dtype=torch.float32))
    assert mapped["x"].sum() == 1024
