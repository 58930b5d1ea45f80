"""zipsave writes torch.save's exact bytes, and shows an observer every byte of the states it asks for; the final
name only ever holds a whole, fsynced file; torch's private pieces are fenced (a changed one falls back to
torch.save, which writes the same bytes), and a failed write is an error, not a fallback."""

from __future__ import annotations

import fnmatch
import gc
import logging
import os
import signal
import stat
import subprocess
import sys
import tempfile

import pytest
import torch

from deepspeed_ext.checkpoint import zipsave
from deepspeed_ext.checkpoint.fingerprint import ROW_ELEMENTS, Fingerprint, partial_sums

#: What DeepSpeed and its checkpoint tools look for in a tag's directory: a temporary file must match none.
DEEPSPEED_PATTERNS = ("*model_states.pt", "*optim_states.pt", "*.pt", "mp_rank_*", "zero_pp_rank_*", "layer_*",
                      "bf16_zero_pp_rank_*", "expp_rank_*")


@pytest.fixture(autouse=True)
def probed():
    """supported()'s and the symlink check's probes done before a test patches what they use (a test that wants
    them run again clears their caches with ``fresh_support``)."""
    zipsave.supported()
    zipsave._aliases_work()


@pytest.fixture
def system_tmp(tmp_path, monkeypatch):
    """The system's temporary directory (where zipsave's symlink goes), empty, to see what is left in it."""
    path = tmp_path / "system-tmp"
    path.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    return path


@pytest.fixture
def fresh_support():
    """supported() and the symlink check run again (within the test, and after it with torch as it is)."""
    zipsave._support.cache_clear()
    zipsave._aliases_work.cache_clear()
    yield
    zipsave._support.cache_clear()
    zipsave._aliases_work.cache_clear()


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


def _reference(tmp_path, obj, name="file.pt") -> bytes:
    """torch.save's bytes for ``obj`` under ``name`` (the archive inside is named after the file)."""
    (tmp_path / "ref").mkdir(exist_ok=True)
    torch.save(obj, tmp_path / "ref" / name)
    return (tmp_path / "ref" / name).read_bytes()


def test_zipsave_is_on_with_the_pinned_torch():
    """supported() is production's switch: where it is False every save quietly falls back to torch.save. The
    torch the suite pins (requirements-demo.txt) must have what zipsave needs, so that a torch upgrade that turns
    it off fails here, with the reason, and the tests below (which expect zipsave's own writer: ``is True``) run
    it rather than skip it."""
    assert zipsave.supported(), f"zipsave is off on torch {torch.__version__}: {zipsave._support()}"


@pytest.mark.parametrize("name", list(_objects()))
def test_same_bytes_as_torch_save(tmp_path, monkeypatch, name):
    monkeypatch.setattr(zipsave, "MIN_DEFERRED_BYTES", 1 << 16)
    monkeypatch.setattr(zipsave, "BLOCK_BYTES", 1 << 16)  # many blocks, and a region spanning several
    obj = _objects()[name]
    (tmp_path / "new").mkdir()
    assert zipsave.save(obj, str(tmp_path / "new" / "file.pt")) is True
    assert (tmp_path / "new" / "file.pt").read_bytes() == _reference(tmp_path, obj)
    assert os.listdir(tmp_path / "new") == ["file.pt"]
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
    assert zipsave.save({"flat": flat}, str(tmp_path / "f.pt"), observer) is True
    assert (tmp_path / "f.pt").read_bytes() == _reference(tmp_path, {"flat": flat}, "f.pt")
    for i, state in enumerate(states):
        pieces = observer.seen[i]
        assert all(p.numel() % ROW_ELEMENTS == 0 for p in pieces[:-1])
        assert torch.equal(torch.cat(pieces), state)
        added = [sum(partial_sums(p)[k] for p in pieces) for k in range(3)]
        assert Fingerprint(int(added[0]), added[1], added[2]).agrees(Fingerprint.of(state))


# --- the fence: a changed private piece, or a zip laid out otherwise, falls back to torch.save ------------------


def _fallback_bookkeeping(monkeypatch):
    """The order of the fallback's steps: ``on_fallback``, then torch.save."""
    events = []
    original = torch.save

    def recording_save(*args, **kwargs):
        events.append("torch.save")
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "save", recording_save)
    return events, lambda: events.append("on_fallback")


def _renamed_parameter(original):
    def _save(obj, zip_file, pickle_module, protocol, _disable_byteorder_record):
        return original(obj, zip_file, pickle_module, protocol, _disable_byteorder_record)
    return _save


def _any_arguments(original):
    def _save(*args, **kwargs):
        return original(*args, **kwargs)
    return _save


@pytest.mark.parametrize("wrapper", [_renamed_parameter, _any_arguments])
def test_a_changed_save_signature_turns_zipsave_off_and_torch_save_writes(
        tmp_path, monkeypatch, caplog, system_tmp, fresh_support, wrapper):
    obj = _objects()["deferred"]
    reference = _reference(tmp_path, obj)
    monkeypatch.setattr(torch.serialization, "_save", wrapper(torch.serialization._save))  # torch.save still works
    zipsave._support.cache_clear()
    assert not zipsave.supported()
    assert "torch.serialization._save(" in zipsave._support()
    assert zipsave._aliases_work()  # (its probe saves are not the fallback's)
    events, on_fallback = _fallback_bookkeeping(monkeypatch)
    (tmp_path / "new").mkdir()
    with caplog.at_level(logging.DEBUG, logger="deepspeed_ext"):
        assert zipsave.save(obj, tmp_path / "new" / "file.pt", _Observer([]), on_fallback) is False
    assert events == ["on_fallback", "torch.save"]
    assert (tmp_path / "new" / "file.pt").read_bytes() == reference
    assert os.listdir(tmp_path / "new") == ["file.pt"]
    assert os.listdir(system_tmp) == []
    lines = [r.getMessage() for r in caplog.records if "written by torch.save" in r.getMessage()]
    assert len(lines) == 1 and str(tmp_path / "new" / "file.pt") in lines[0] and "_save" in lines[0]


def test_a_private_piece_failing_at_save_time_falls_back(tmp_path, monkeypatch, caplog, system_tmp):
    """supported() said yes, then torch's _save fails on zipsave's writer (not a write): torch.save writes."""
    obj = _objects()["optimizer-like"]
    reference = _reference(tmp_path, obj)
    original = torch.serialization._save

    def _save(obj, zip_file, pickle_module, pickle_protocol, _disable_byteorder_record):
        if isinstance(zip_file, zipsave._Recorder):
            raise RuntimeError("simulated: this torch's _save wants something else of its writer")
        return original(obj, zip_file, pickle_module, pickle_protocol, _disable_byteorder_record)

    monkeypatch.setattr(torch.serialization, "_save", _save)
    zipsave._aliases_work()
    events, on_fallback = _fallback_bookkeeping(monkeypatch)
    (tmp_path / "new").mkdir()
    with caplog.at_level(logging.DEBUG, logger="deepspeed_ext"):
        assert zipsave.save(obj, str(tmp_path / "new" / "file.pt"), on_fallback=on_fallback) is False
    assert events == ["on_fallback", "torch.save"]
    assert (tmp_path / "new" / "file.pt").read_bytes() == reference
    assert os.listdir(tmp_path / "new") == ["file.pt"]
    assert os.listdir(system_tmp) == []
    assert any("simulated" in r.getMessage() and "file.pt" in r.getMessage() for r in caplog.records)


def test_a_layout_error_while_patching_falls_back(tmp_path, monkeypatch, system_tmp):
    monkeypatch.setattr(zipsave, "MIN_DEFERRED_BYTES", 1 << 16)
    obj = _objects()["deferred"]
    reference = _reference(tmp_path, obj)

    def failing_patch(*args):
        raise zipsave.LayoutError("simulated: a zip laid out otherwise")

    monkeypatch.setattr(zipsave, "_patch", failing_patch)
    zipsave._aliases_work()
    events, on_fallback = _fallback_bookkeeping(monkeypatch)
    observer = _Observer([obj["flat"]])
    (tmp_path / "new").mkdir()
    assert zipsave.save(obj, str(tmp_path / "new" / "file.pt"), observer, on_fallback) is False
    assert observer.seen  # patching comes after the data: what the observer was shown is rolled back
    assert events == ["on_fallback", "torch.save"]
    assert (tmp_path / "new" / "file.pt").read_bytes() == reference
    assert os.listdir(tmp_path / "new") == ["file.pt"]
    assert os.listdir(system_tmp) == []


def test_an_unexpected_serialization_id_falls_back_before_any_data(tmp_path, monkeypatch, caplog, system_tmp):
    monkeypatch.setattr(zipsave, "MIN_DEFERRED_BYTES", 1 << 16)
    obj = _objects()["deferred"]
    reference = _reference(tmp_path, obj)
    monkeypatch.setattr(zipsave, "_hash_combine", lambda seed, value: seed + value + 1)  # another torch's id
    observer = _Observer([obj["flat"]])
    (tmp_path / "new").mkdir()
    with caplog.at_level(logging.DEBUG, logger="deepspeed_ext"):
        assert zipsave.save(obj, str(tmp_path / "new" / "file.pt"), observer) is False
    # for that reason (zipsave turned off would fall back too, with nothing shown)
    assert any("serialization id" in r.getMessage() and "file.pt" in r.getMessage() for r in caplog.records)
    assert observer.seen == {}  # checked before anything was written or shown
    assert (tmp_path / "new" / "file.pt").read_bytes() == reference
    assert os.listdir(tmp_path / "new") == ["file.pt"]


def test_a_non_ascii_path_falls_back_with_torch_saves_bytes(tmp_path, system_tmp):
    obj = _objects()["small"]
    name = "état_model_states.pt"
    reference = _reference(tmp_path, obj, name)  # torch names the archive 'archive' for such a path
    (tmp_path / "new").mkdir()
    called = []
    assert zipsave.save(obj, str(tmp_path / "new" / name), on_fallback=lambda: called.append(1)) is False
    assert called == [1]
    assert (tmp_path / "new" / name).read_bytes() == reference
    assert os.listdir(tmp_path / "new") == [name]
    assert os.listdir(system_tmp) == []


def test_without_symlinks_a_fallback_is_written_in_a_hidden_directory(tmp_path, monkeypatch):
    obj = _objects()["small"]
    reference = _reference(tmp_path, obj)
    monkeypatch.setattr(zipsave, "_aliases_work", lambda: False)
    monkeypatch.setattr(zipsave, "_support", lambda: "simulated: zipsave is off")
    (tmp_path / "new").mkdir()
    assert zipsave.save(obj, str(tmp_path / "new" / "file.pt")) is False
    assert (tmp_path / "new" / "file.pt").read_bytes() == reference
    assert os.listdir(tmp_path / "new") == ["file.pt"]


def test_the_probe_is_cheap_and_checks_the_bytes(monkeypatch, fresh_support):
    import time
    start = time.perf_counter()
    assert zipsave._support() is None
    assert time.perf_counter() - start < 2.0  # a few ms to tens of ms; generous for a loaded machine
    zipsave._support.cache_clear()
    monkeypatch.setattr(zipsave, "_hash_combine", lambda seed, value: seed ^ (value + 7))
    assert "probe" in zipsave._support()


# --- the final name only ever holds a whole file -----------------------------------------------------------------


def _is_temporary(name: str) -> bool:
    return (name.startswith(".") and name.endswith(zipsave.TEMPORARY_SUFFIX)
            and not any(fnmatch.fnmatch(name, pattern) for pattern in DEEPSPEED_PATTERNS))


class _Interrupting(_Observer):
    """Raises ``error`` at the second piece, after checking, at each piece, that the final name does not exist
    (or holds the ``previous`` file still) and a hidden temporary file (matching no DeepSpeed pattern) does."""

    def __init__(self, tensors, final, error, previous=None):
        super().__init__(tensors)
        self.final, self.error, self.previous, self.pieces = final, error, previous, 0

    def regions(self, address, nbytes):
        return [zipsave.Region(r.offset, r.tensor, self.consume, r.piece_elements)
                for r in super().regions(address, nbytes)]

    def consume(self, piece):
        if self.previous is None:
            assert not os.path.exists(self.final)
        else:
            with open(self.final, "rb") as handle:
                assert handle.read() == self.previous
        others = [name for name in os.listdir(os.path.dirname(self.final)) if name != os.path.basename(self.final)]
        assert len(others) == 1 and _is_temporary(others[0])
        self.pieces += 1
        if self.error is not None and self.pieces == 2:
            raise self.error


def test_the_final_name_does_not_exist_while_the_data_are_written(tmp_path, monkeypatch, system_tmp):
    monkeypatch.setattr(zipsave, "BLOCK_BYTES", 1 << 16)
    flat = torch.randn(1 << 20)
    (tmp_path / "tag").mkdir()
    final = str(tmp_path / "tag" / "mp_rank_00_model_states.pt")
    observer = _Interrupting([flat], final, None)
    assert zipsave.save({"flat": flat}, final, observer) is True
    assert observer.pieces > 2
    assert os.listdir(tmp_path / "tag") == ["mp_rank_00_model_states.pt"]
    assert os.listdir(system_tmp) == []  # the symlink went once torch had the file open


@pytest.mark.parametrize("error", [RuntimeError("the observer failed"), KeyboardInterrupt()])
@pytest.mark.parametrize("existing", [False, True])
def test_an_interrupted_save_leaves_the_final_name_as_it_was(tmp_path, monkeypatch, system_tmp, error, existing):
    monkeypatch.setattr(zipsave, "BLOCK_BYTES", 1 << 16)
    directory = tmp_path / "tag"
    directory.mkdir()
    final = directory / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    previous = b"the previous file" if existing else None
    if existing:
        final.write_bytes(previous)
    flat = torch.randn(1 << 20)
    fell_back = []
    with pytest.raises(type(error)):
        zipsave.save({"flat": flat}, str(final), _Interrupting([flat], str(final), error, previous),
                     lambda: fell_back.append(1))
    assert fell_back == []  # an observer's error is not the zip's: no torch.save
    assert os.listdir(directory) == ([final.name] if existing else [])
    if existing:
        assert final.read_bytes() == previous
    assert os.listdir(system_tmp) == []


_KILLED_SAVE = """
import os, signal, sys
import torch
from deepspeed_ext.checkpoint import zipsave
zipsave.BLOCK_BYTES = 1 << 16
flat = torch.randn(1 << 20)
class Killer:
    pieces = 0
    def regions(self, address, nbytes):
        return [zipsave.Region(0, flat, self.consume, 1024)]
    def consume(self, piece):
        self.pieces += 1
        if self.pieces == 3:
            os.kill(os.getpid(), signal.SIGKILL)
zipsave.save({"flat": flat}, sys.argv[1], Killer())
"""


def test_a_kill_9_mid_save_leaves_nothing_under_the_final_name(tmp_path):
    directory, system_tmp = tmp_path / "tag", tmp_path / "system-tmp"
    directory.mkdir()
    system_tmp.mkdir()
    final = directory / "mp_rank_00_model_states.pt"
    run = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(final)], capture_output=True, text=True,
                         env={**os.environ, "TMPDIR": str(system_tmp)})
    assert run.returncode == -signal.SIGKILL, run.stderr
    assert not final.exists()
    left = os.listdir(directory)
    assert len(left) == 1 and _is_temporary(left[0])  # hidden, and no DeepSpeed tool lists it
    assert os.listdir(system_tmp) == []


# --- durability: fsynced before the rename, the rename fsynced -------------------------------------------------


@pytest.mark.parametrize("how", ["zipsave", "fallback"])
def test_the_file_is_fsynced_before_it_is_renamed_and_the_directory_after(tmp_path, monkeypatch, how):
    zipsave.supported(), zipsave._aliases_work()  # their probes (no fsync) done before recording
    if how == "fallback":
        monkeypatch.setattr(zipsave, "_support", lambda: "simulated: zipsave is off")
    events = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd):
        st = os.fstat(fd)
        events.append(("fsync-dir" if stat.S_ISDIR(st.st_mode) else "fsync", st.st_ino))
        return fsync(fd)

    def recording_replace(src, dst, **kwargs):
        events.append(("replace", os.stat(src).st_ino))
        return replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    final = tmp_path / "file.pt"
    assert zipsave.save(_objects()["deferred"], str(final)) is (how == "zipsave")
    inode, directory = os.stat(final).st_ino, os.stat(tmp_path).st_ino
    assert events == [("fsync", inode), ("replace", inode), ("fsync-dir", directory)]


# --- a full disk is an error, not a fallback ----------------------------------------------------------------------


@pytest.fixture
def full_disk(tmp_path):
    """A 1 MiB tmpfs (root only; skipped where it cannot be mounted, a failure under CI=true, which runs as root:
    tests/conftest.py)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    run = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if run.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {run.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        gc.collect()  # a failed write's traceback (a cycle through the test's frame) holds torch's writer
        if subprocess.run(["umount", str(mount)]).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)])  # never left mounted
            pytest.fail("a file on the full disk is still open")


@pytest.mark.parametrize("how", ["one 4 MB storage", "small storages", "fallback"])
def test_a_full_disk_propagates_and_leaves_nothing(full_disk, monkeypatch, system_tmp, how):
    if how == "small storages":  # written by torch's own writer: its RuntimeError is the failed write
        obj = {f"w{i}": torch.randn(1 << 14) for i in range(64)}
    else:
        obj = {"flat": torch.randn(1 << 20)}
    if how == "fallback":
        monkeypatch.setattr(zipsave, "_support", lambda: "simulated: zipsave is off")
    fell_back = []
    final = full_disk / "mp_rank_00_model_states.pt"
    with pytest.raises((OSError, RuntimeError)) as raised:
        zipsave.save(obj, str(final), on_fallback=lambda: fell_back.append(1))
    assert not isinstance(raised.value, zipsave.LayoutError)
    assert fell_back == ([1] if how == "fallback" else [])  # not a fallback to torch.save
    assert os.listdir(full_disk) == []
    assert os.listdir(system_tmp) == []
    # and the disk, now free, takes the next file
    assert zipsave.save({"x": torch.ones(1000)}, str(final)) is (how != "fallback")
    assert os.listdir(full_disk) == [final.name]


_SIZE_LIMITED_SAVES = """
import os, resource, signal, sys
import torch
from deepspeed_ext.checkpoint import zipsave
assert zipsave.supported()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
objects = {"one 4 MB storage": {"flat": torch.randn(1 << 20)},
           "small storages": {f"w{i}": torch.randn(1 << 14) for i in range(64)}}
for how, obj in objects.items():
    try:
        zipsave.save(obj, sys.argv[1], on_fallback=lambda: print("fell back"))
    except (OSError, RuntimeError) as exc:
        print(how, "raised", type(exc).__name__, os.listdir(os.path.dirname(sys.argv[1])))
"""


def test_a_file_size_limit_propagates_and_leaves_nothing(tmp_path):
    """RLIMIT_FSIZE stands in for a full disk where a tmpfs cannot be mounted (not root)."""
    system_tmp = tmp_path / "system-tmp"
    system_tmp.mkdir()
    final = tmp_path / "tag" / "mp_rank_00_model_states.pt"
    final.parent.mkdir()
    run = subprocess.run([sys.executable, "-c", _SIZE_LIMITED_SAVES, str(final)], capture_output=True, text=True,
                         env={**os.environ, "TMPDIR": str(system_tmp)})
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 2 and all(" raised " in line and line.endswith(" []") for line in lines), run.stdout
    assert os.listdir(final.parent) == []
    assert os.listdir(system_tmp) == []
