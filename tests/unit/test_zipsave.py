"""zipsave writes torch.save's exact bytes, and shows an observer every byte of the states it asks for."""

from __future__ import annotations

import pytest
import torch

from deepspeed_ext.checkpoint import zipsave
from deepspeed_ext.checkpoint.fingerprint import ROW_ELEMENTS, Fingerprint, partial_sums

pytestmark = pytest.mark.skipif(not zipsave.supported(), reason="this torch lacks write_record_metadata")


def _objects() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(700_000, generator=g)
    return {
        "small": {"a": torch.randn(100, generator=g), "b": torch.arange(10), "text": "x"},
        "deferred": {"flat": flat, "view": flat[10:20], "half": torch.randn(600_000, generator=g).bfloat16(),
                     "empty": torch.zeros(0), "nested": [1, "s", {"k": torch.ones(3, dtype=torch.int64)}]},
        "optimizer-like": {"state": {0: {"exp_avg": flat.narrow(0, 5, 300_000), "step": torch.tensor(3.0)}},
                           "fp32": [flat[:400_000]], "other": torch.ones(300_000, dtype=torch.float64)},
    }


@pytest.mark.parametrize("name", list(_objects()))
def test_same_bytes_as_torch_save(tmp_path, monkeypatch, name):
    monkeypatch.setattr(zipsave, "MIN_DEFERRED_BYTES", 1 << 16)
    monkeypatch.setattr(zipsave, "BLOCK_BYTES", 1 << 16)  # many blocks, and a region spanning several
    obj = _objects()[name]
    (tmp_path / "ref").mkdir()
    (tmp_path / "new").mkdir()
    torch.save(obj, tmp_path / "ref" / "file.pt")  # the archive inside is named after the file
    zipsave.save(obj, str(tmp_path / "new" / "file.pt"))
    assert (tmp_path / "new" / "file.pt").read_bytes() == (tmp_path / "ref" / "file.pt").read_bytes()
    loaded = torch.load(tmp_path / "new" / "file.pt", weights_only=True)
    assert str(loaded) == str(obj)


class _Observer:
    def __init__(self, tensors):
        self.tensors, self.seen = tensors, {}

    def regions(self, address, nbytes):
        out = []
        for i, t in enumerate(self.tensors):
            start = t.data_ptr() - address
            if 0 <= start and start + t.numel() * t.element_size() <= nbytes:
                self.seen[i] = []
                out.append(zipsave.Region(start, t, self.seen[i].append, ROW_ELEMENTS))
        return sorted(out, key=lambda r: r.offset)


def test_observer_sees_each_state_whole_in_row_aligned_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(zipsave, "BLOCK_BYTES", 1 << 16)
    flat = torch.randn(1 << 20, generator=torch.Generator().manual_seed(1))
    states = [flat.narrow(0, 123, 70_000), flat.narrow(0, 200_000, 5_000), flat.narrow(0, 300_000, 100_000)]
    observer = _Observer(states)
    (tmp_path / "ref").mkdir()
    torch.save({"flat": flat}, tmp_path / "ref" / "f.pt")
    zipsave.save({"flat": flat}, str(tmp_path / "f.pt"), observer)
    assert (tmp_path / "f.pt").read_bytes() == (tmp_path / "ref" / "f.pt").read_bytes()
    for i, state in enumerate(states):
        pieces = observer.seen[i]
        assert all(p.numel() % ROW_ELEMENTS == 0 for p in pieces[:-1])
        assert torch.equal(torch.cat(pieces), state)
        added = [sum(partial_sums(p)[k] for p in pieces) for k in range(3)]
        assert Fingerprint(int(added[0]), added[1], added[2]).agrees(Fingerprint.of(state))
