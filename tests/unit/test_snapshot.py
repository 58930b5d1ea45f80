"""The copy snapshot of a save in the background (:mod:`deepspeed_ext.checkpoint.snapshot`): what torch.save writes
from it is what it would have written from the state at the snapshot, whatever training does to the state later;
its host buffers are reused from one save to the next. (On an accelerator: scripts/gpu-check.sh.)"""

from __future__ import annotations

import argparse
import io

import torch

from deepspeed_ext.checkpoint import snapshot


def _saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _state():
    """A state dict as DeepSpeed's files hold them: a flat partition and views of it, a parameter that requires
    grad, a tensor with an attribute, a bare storage, Python objects beside them."""
    flat = torch.arange(64, dtype=torch.float32)
    master = flat.clone().requires_grad_(True)
    weight = torch.nn.Parameter(torch.randn(4, 4))
    tagged = torch.ones(3, dtype=torch.bfloat16)
    tagged.note = {"shape": [3]}
    return {"module": {"a": flat[:16].view(4, 4), "b": flat[16:48].view(4, 8).t(), "w": weight},
            "optimizer": {"partition": master, "step": torch.tensor(3), "tagged": tagged,
                          "raw": torch.arange(5, dtype=torch.int64).untyped_storage()},
            "args": argparse.Namespace(lr=0.1), "global_steps": 7, "names": ["a", "b"]}


def test_the_files_from_the_snapshot_are_the_state_at_the_snapshot_byte_for_byte():
    state = _state()
    before = _saved(state)
    taken = snapshot.take([state], snapshot.HostPool())
    copied = taken.states[0]
    # What DeepSpeed or the user changes in the state dicts' Python objects, at once ...
    state["optimizer"]["tagged"].note["shape"].append(9)
    state["args"].lr = 0.2
    state["names"].append("c")
    taken.order_after()  # ... and, once the engine's next step has waited for the copies, in the tensors
    with torch.no_grad():
        state["module"]["a"].mul_(-1)
        state["module"]["w"].add_(1)
        state["optimizer"]["partition"].add_(1)
    taken.wait()
    assert _saved(copied) == before
    # Views of one storage are views of one copy, as torch.save writes them.
    assert copied["module"]["a"].untyped_storage().data_ptr() == copied["module"]["b"].untyped_storage().data_ptr()
    assert type(copied["module"]["w"]) is torch.nn.Parameter and copied["optimizer"]["partition"].requires_grad
    assert taken.nbytes == sum(t.untyped_storage().nbytes() for t in (
        state["module"]["a"], state["module"]["w"], state["optimizer"]["partition"], state["optimizer"]["step"],
        state["optimizer"]["tagged"])) + state["optimizer"]["raw"].nbytes()


def test_views_of_other_tensors_come_from_the_same_copies_and_the_buffers_are_reused():
    state = _state()
    pool = snapshot.HostPool()
    outside = torch.arange(10.0)
    seen = {}

    def also(taken):
        seen["inside"] = taken.view_of(state["module"]["a"][1:3])  # what the fingerprints sum: a view of a file's
        seen["outside"] = taken.view_of(outside)  # ... or a tensor no file holds, copied on its own

    taken = snapshot.take([state], pool, also=also)
    taken.order_after()
    held = pool.nbytes
    assert seen["inside"].untyped_storage().data_ptr() == taken.states[0]["module"]["a"].untyped_storage().data_ptr()
    state["module"]["a"].zero_()
    outside.zero_()
    assert torch.equal(seen["inside"], torch.arange(4, 12, dtype=torch.float32).view(2, 4))
    assert torch.equal(seen["outside"], torch.arange(10.0))
    taken.release()
    again = snapshot.take([_state()], pool)  # the next save: the same storages' sizes, nothing allocated
    assert pool.nbytes == held
    assert again.nbytes == held - outside.untyped_storage().nbytes()
    again.release()


def test_a_copy_of_an_accelerator_storage_is_written_with_the_storages_own_location(tmp_path):
    """torch.save writes a host copy of a device storage with the device's location ("cuda:0"), as it writes the
    storage itself, so that the files of a save in the background are the synchronous save's on an accelerator too.
    (Here a CPU buffer stands in for the copy: the copying itself needs a device, scripts/gpu-check.sh.)"""
    import zipfile

    copy = torch.arange(6, dtype=torch.float32)
    plain = torch.arange(3, dtype=torch.float32)
    snapshot._register_location_tagger()
    snapshot._DEVICE_COPIES[copy.untyped_storage().data_ptr()] = "cuda:0"
    try:
        torch.save({"copy": copy, "plain": plain}, tmp_path / "state.pt")
    finally:
        del snapshot._DEVICE_COPIES[copy.untyped_storage().data_ptr()]
    with zipfile.ZipFile(tmp_path / "state.pt") as archive:
        pickled = archive.read("state/data.pkl")
    assert pickled.count(b"cuda:0") == 1 and pickled.count(b"cpu") == 1
    loaded = torch.load(tmp_path / "state.pt", map_location="cpu", weights_only=True)
    assert torch.equal(loaded["copy"], copy) and torch.equal(loaded["plain"], plain)


def test_empty_storages_stay_apart_as_torch_save_keeps_them():
    """ZeRO-3's placeholders (each partitioned weight an empty tensor of its own): one storage each in the file,
    as torch.save writes them, though none has an address; a tied pair sharing one stays one."""
    shared = torch.empty(0, dtype=torch.bfloat16)
    state = {"a": torch.empty(0, dtype=torch.bfloat16), "b": torch.empty(0, dtype=torch.bfloat16),
             "tied": shared, "tied_again": shared.detach(), "w": torch.ones(3)}
    taken = snapshot.take([state], snapshot.HostPool())
    taken.wait()
    assert _saved(taken.states[0]) == _saved(state)
