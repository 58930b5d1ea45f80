"""The one place where deepspeed-ext reads and writes ``torch.save`` files.

Every read uses ``weights_only=True`` with an explicit allow-list of the few DeepSpeed classes that
its checkpoint files legitimately contain, so a checkpoint cannot run code when it is opened. Reads are
memory-mapped: a tensor's bytes are paged in only when (and where) they are touched, or read with ``pread``
from where :func:`mapped_location` finds them (the restore, :mod:`.ranges`).
"""

from __future__ import annotations

import collections
import ctypes
import functools
import os
import pickle
import re
import sys
import threading
import types
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from deepspeed_ext.checkpoint import torch_mapped
from deepspeed_ext.checkpoint.torch_zip import is_storage_record
from deepspeed_ext.checkpoint.zipcheck import record_data_offset
from deepspeed_ext.errors import CheckpointError, first_line

if TYPE_CHECKING:
    from concurrent.futures import Future


#: The DeepSpeed classes its checkpoint files legitimately contain (plain data classes and an IntEnum), by the
#: name their pickles give.
DEEPSPEED_CLASSES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.checkpoint.universal_checkpoint.SubparamShape",
)


class DeepSpeedStandIn:
    """A DeepSpeed data object read without importing DeepSpeed (seconds of a command's start): the fields its
    pickle set, readable as attributes like the real object's. :func:`save` writes it under the real class's
    name, pickled as the real object is (``NEWOBJ`` + its fields), so nothing we write differs from what DeepSpeed
    wrote, and writing does not import DeepSpeed either."""

    deepspeed_class: str = ""

    def __repr__(self) -> str:
        fields = ", ".join(f"{key}={value!r}" for key, value in vars(self).items())
        return f"{self.deepspeed_class.rsplit('.', 1)[-1]}({fields})"


class ZeroStageStandIn(int):
    """DeepSpeed's ``ZeroStageEnum`` (an IntEnum) read without DeepSpeed: the stage as an int."""

    deepspeed_class = "deepspeed.runtime.zero.config.ZeroStageEnum"

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return type(self), (int(self), )  # as an Enum member pickles: its class called with its value


def _stand_in(name: str) -> type:
    if name.endswith(".ZeroStageEnum"):
        return ZeroStageStandIn
    return type(name.rsplit(".", 1)[-1], (DeepSpeedStandIn, ), {"deepspeed_class": name,
                                                                 "__module__": __name__})


_STAND_INS = {name: _stand_in(name) for name in DEEPSPEED_CLASSES}


def _deepspeed_class(name: str) -> Any:
    import importlib
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def allowed_globals() -> list[Any]:
    """What a checkpoint's pickles may name: DeepSpeed's classes where DeepSpeed is already imported (a live
    engine: what it gets back is its own), else stand-ins, so a command that only reads does not import it."""
    if "deepspeed" in sys.modules:
        return [*(_deepspeed_class(name) for name in DEEPSPEED_CLASSES), collections.OrderedDict]
    return [*((cls, name) for name, cls in _STAND_INS.items()), collections.OrderedDict]


def holds_stand_in(obj: Any) -> bool:
    """Whether ``obj`` (dicts, lists and tuples looked into) holds a stand-in."""
    if isinstance(obj, (DeepSpeedStandIn, ZeroStageStandIn)):
        return True
    if isinstance(obj, dict):
        return any(holds_stand_in(value) for value in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(holds_stand_in(value) for value in obj)
    return False


class _DeepSpeedNamesPickler(pickle._Pickler):
    """Python's own pickler, but a stand-in class is written as the global DeepSpeed's class is written (its module
    and name), without looking it up: the C pickler imports a class's module to check the name, which is the
    DeepSpeed import the stand-ins avoid. Everything else is pickled as the C pickler pickles it (the two are kept
    alike by CPython's own tests; test_serialization compares the files). typeshed leaves out the pure-Python
    pickler's methods, hence the ignores."""

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if not (isinstance(obj, type) and issubclass(obj, (DeepSpeedStandIn, ZeroStageStandIn))):
            super().save_global(obj, name)  # type: ignore[misc]
            return
        module, _, attr = obj.deepspeed_class.rpartition(".")
        # GLOBAL, as both picklers write a class at torch.save's protocol 2 (valid at every protocol)
        self.write(pickle.GLOBAL + f"{module}\n{attr}\n".encode())  # type: ignore[attr-defined]
        self.memoize(obj)  # type: ignore[attr-defined]


#: What torch.save pickles with where the object holds stand-ins (a module, as torch.save expects).
_DEEPSPEED_NAMES = types.ModuleType("deepspeed_ext_deepspeed_names")
_DEEPSPEED_NAMES.Pickler = _DeepSpeedNamesPickler  # type: ignore[attr-defined]


_LOAD_LOCK = threading.Lock()


def load(path: str | os.PathLike[str], *, mmap: bool = True) -> Any:
    """Load a ``torch.save`` file safely; errors name the file and the problem."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    if mmap:
        _read_metadata_exactly(path)
    try:
        # safe_globals swaps a process-wide list: two threads loading at once would undo each other's.
        with _LOAD_LOCK, torch.serialization.safe_globals(allowed_globals()):
            # Mapped without a reservation: a file larger than the machine's memory is refused otherwise
            # (:mod:`.torch_mapped`).
            return torch_mapped.load(path) if mmap else torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{path}: refused to unpickle (only tensors and allow-listed DeepSpeed types are "
                              f"loaded): {first_line(exc)}") from exc
    except Exception as exc:  # a damaged pickle surfaces as any of IndexError, KeyError, struct.error, ...
        raise CheckpointError(f"{path}: cannot read torch file: {first_line(exc)}") from exc


#: What torch's reader fetches past a record's header in one buffered read, with margin.
_READER_SPAN = 16 << 10


def _read_metadata_exactly(path: Path) -> None:
    """Bring the bytes ``torch.load`` reads of a torch zip file (its pickle and small records from the start, each
    storage's local header, the central directory) into the page cache with readahead off, before torch reads
    them through its own descriptor.

    torch's read of the pickle from the file's start is a cache miss there, and the kernel answers it with
    readahead whose pages carry a mark (PG_readahead): a later read that reaches a marked page starts more
    readahead, even on a ``POSIX_FADV_RANDOM`` descriptor. The restore's ``pread`` of a partition at the start of
    a file (:mod:`.ranges`) then read on into the next rank's partition: 1.78x its share on DP rank 0 at
    TP=1 x DP=2 from a universal checkpoint. Read here first, torch finds every byte cached and starts no
    readahead. The mapped storages themselves are not read."""
    if not hasattr(os, "posix_fadvise"):
        return
    import zipfile
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # torch.load names the problem
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        with zipfile.ZipFile(os.fdopen(os.dup(fd), "rb", buffering=0)) as archive:
            records = archive.infolist()
        storages = [info.header_offset for info in records if is_storage_record(info.filename)]
        size = os.fstat(fd).st_size
        first = min(storages, default=size)
        os.pread(fd, min(size, first + _READER_SPAN), 0)
        for offset in storages:
            os.pread(fd, _READER_SPAN, offset)
    except (OSError, zipfile.BadZipFile, ValueError):
        pass  # not a zip torch file (torch.load reports it), or unreadable: torch.load names the problem
    finally:
        os.close(fd)


def save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save`` that never leaves a half-written file under the final name.

    The zip records' CRC-32 is not computed: it halves torch.save's throughput, and ``torch.load`` never
    checks it (it reads tensors memory-mapped). Integrity is what the converters' manifests are for.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with zip_crc32(False):
            torch.save(obj, tmp, pickle_module=_DEEPSPEED_NAMES if holds_stand_in(obj) else pickle)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as exc:  # torch reports a failed write (disk full, size limit) as RuntimeError
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"{path}: cannot write: {first_line(exc)} (disk full or file size limit?)") from exc


def save_streamed(obj: Any, placeholder: torch.Tensor, blocks: Iterable[torch.Tensor],
                  path: str | os.PathLike[str]) -> str:
    """``torch.save(obj, path)`` where ``placeholder``, the one tensor in ``obj`` (uninitialized, never read),
    stands for the concatenation of ``blocks``: the tensor is written block by block at its offset in the file,
    never held whole. Returns the file's CRC-32C (8 hex digits), computed from the blocks as they are written.

    torch writes the file with the tensor's bytes left out (``skip_data``); its storage record is then filled
    with ``pwrite``. The result is the file ``torch.save`` writes of the whole tensor.
    """
    import google_crc32c
    path = Path(path)
    if not hasattr(torch.serialization, "skip_data"):  # torch < 2.5: the tensor is filled, then saved whole
        return _save_filled(obj, placeholder, blocks, path)
    tmp = path.with_name(path.name + ".tmp")
    nbytes = placeholder.numel() * placeholder.element_size()
    try:
        with zip_crc32(False), torch.serialization.skip_data():
            torch.save(obj, tmp)
        offset = _storage_offset(tmp, nbytes)
        checksum = google_crc32c.Checksum()
        with open(tmp, "r+b") as handle:
            checksum.update(handle.read(offset))
            position = offset
            for block in blocks:
                data: Any = block.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
                checksum.update(data)  # takes the array itself (a read-only buffer), not a memoryview of it
                position = pwrite_all(handle.fileno(), data, position)
            if position != offset + nbytes:
                raise CheckpointError(f"{path}: the blocks hold {position - offset} bytes, the tensor {nbytes}")
            handle.seek(position)
            checksum.update(handle.read())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as exc:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"{path}: cannot write: {first_line(exc)} (disk full or file size limit?)") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    digest: bytes = checksum.hexdigest()
    return digest.decode()


def pwrite_all(fd: int, data: Any, offset: int) -> int:
    """All of ``data`` (any buffer) at ``offset`` of ``fd`` (pwrite may write less than asked); the offset after."""
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
    return offset


def _save_filled(obj: Any, placeholder: torch.Tensor, blocks: Iterable[torch.Tensor], path: Path) -> str:
    """:func:`save_streamed` without ``skip_data``: the placeholder is filled (the tensor held whole), then saved."""
    from deepspeed_ext.checkpoint.manifest import file_checksum
    flat, position = placeholder.view(-1), 0
    for block in blocks:
        flat[position:position + block.numel()].copy_(block.reshape(-1))
        position += block.numel()
    if position != flat.numel():
        raise CheckpointError(f"{path}: the blocks hold {position * placeholder.element_size()} bytes, the tensor "
                              f"{flat.numel() * placeholder.element_size()}")
    save(obj, path)
    return file_checksum(path)




def _storage_offset(path: Path, nbytes: int) -> int:
    """Where the bytes of the one tensor storage of the torch file ``path`` begin (torch aligns them to 64)."""
    import zipfile
    with open(path, "rb") as handle:
        with zipfile.ZipFile(handle) as archive:
            records = [info for info in archive.infolist() if is_storage_record(info.filename)]
        if len(records) != 1 or records[0].file_size != nbytes:
            raise CheckpointError(f"{path}: expected one tensor storage of {nbytes} bytes")
        offset = record_data_offset(handle, records[0].header_offset)
    if offset is None:
        raise CheckpointError(f"{path}: no zip local header for its tensor storage")
    return offset


@contextmanager
def zip_crc32(enabled: bool) -> Iterator[None]:
    """torch.save with (or without) zip CRC-32s on this thread, then the caller's setting back (torch keeps the
    switch per thread, so writer threads each set their own)."""
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(enabled)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(previous)


def usable_cores() -> int:
    """The cores this process may run on (its affinity: ``taskset``, a container's cpuset), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def worker_threads() -> int:
    """Writer threads for a conversion: one a core, at least two (one computes while the other waits on a write).
    Each streams its own tensors block by block, so memory grows by a few blocks a thread, never with the model."""
    return max(2, usable_cores())


def one_torch_thread() -> None:
    """A worker thread's torch operations on that thread alone (OpenMP's thread count is set per calling thread):
    the workers are the parallelism, one a core. With torch's intra-op threads on as well, every small operation of
    every worker waited at OpenMP's barrier for a thread the other workers had descheduled: a bf16 -> fp32 copy of
    1 Mi elements took 8 ms on two busy cores, 0.3 ms on one thread (docs/performance.md)."""
    torch.set_num_threads(1)


class BackgroundWriter:
    """Runs file writes on worker threads while the caller prepares the next tensors.

    torch.save's zip writer releases the GIL, so on a multi-core machine merging one parameter overlaps
    with writing the previous ones. At most ``max_pending`` writes are queued (each holds one tensor),
    which bounds the memory this adds; the first failure is re-raised by the next ``submit`` or ``close``.
    """

    def __init__(self, workers: int | None = None, max_pending: int | None = None):
        from concurrent.futures import ThreadPoolExecutor
        workers = worker_threads() if workers is None else workers
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="deepspeed-ext-writer",
                                        initializer=one_torch_thread)
        self._pending: collections.deque[Future[Any]] = collections.deque()
        self._max_pending = 2 * workers if max_pending is None else max_pending

    def submit(self, write: Any, *args: Any) -> None:
        while len(self._pending) >= self._max_pending:
            self._pending.popleft().result()
        self._pending.append(self._pool.submit(write, *args))

    def close(self) -> None:
        """Wait for every queued write; raise the first failure."""
        try:
            while self._pending:
                self._pending.popleft().result()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:  # already failing: stop queued writes, keep the original error
            for future in self._pending:
                future.cancel()
            self._pool.shutdown(wait=True, cancel_futures=True)


_MADV_DONTNEED = 4
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


#: A file-backed line of /proc/self/maps: ``low-high perms offset dev inode   path``.
_MAPS_LINE = r"^([0-9a-f]+)-([0-9a-f]+) \S+ ([0-9a-f]+) \S+ (\d+) +"


def _maps_text() -> str:
    """/proc/self/maps in one read: the kernel writes the whole table again for every read call, so reading it a
    line at a time (as iterating the file does) cost several times as much (6 ms a call with torch, DeepSpeed and
    transformers mapped, once or twice per tensor file a restore opens). Empty where there is none (not Linux)."""
    if not sys.platform.startswith("linux"):
        return ""
    with open("/proc/self/maps", "rb", buffering=0) as maps:
        chunks = []
        while chunk := maps.read(1 << 20):
            chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", "surrogateescape")


def _file_maps() -> list[tuple[int, int, int, int, str]]:
    """This process's file mappings, ``(low, high, offset in the file of low, inode, path)`` (Linux; elsewhere
    none)."""
    return [(int(low, 16), int(high, 16), int(offset, 16), int(inode), path)
            for low, high, offset, inode, path in re.findall(_MAPS_LINE + "(/.*)$", _maps_text(), re.M)]


def file_mappings(path: str | os.PathLike[str]) -> list[tuple[int, int]]:
    """The address ranges where this process has ``path`` memory-mapped (Linux; elsewhere none)."""
    target = re.escape(str(Path(path).resolve()))
    return [(int(low, 16), int(high, 16))
            for low, high, *_ in re.findall(_MAPS_LINE + target + "$", _maps_text(), re.M)]


def mapped_location(tensor: torch.Tensor) -> tuple[Path, int] | None:
    """The file a memory-mapped tensor's bytes come from (:func:`load` maps every storage from its uncompressed
    zip record) and the byte offset of its first element there; None for a tensor in ordinary memory, a
    strided one, or where mappings cannot be listed (not Linux). What :mod:`.ranges` reads with ``pread``; the
    restore never writes to the tensors it maps, so the private mapping still holds the file's bytes."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        return None
    address = tensor.data_ptr()
    for low, high, offset, inode, mapped in _file_maps():
        if low <= address < high:
            # A file deleted or replaced since it was mapped is not what its name opens now.
            try:
                same = os.stat(mapped).st_ino == inode
            except OSError:
                same = False
            return (Path(mapped), address - low + offset) if same else None
    return None


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library, loaded once (``CDLL`` costs tens of microseconds; pages are released per tensor)."""
    return ctypes.CDLL(None)


def release_pages(tensor: torch.Tensor, mappings: list[tuple[int, int]]) -> None:
    """Drop the pages of a tensor memory-mapped from a checkpoint file out of this process's resident set.

    A mapped file's touched pages count in RSS until the mapping goes, so streaming through a multi-GB
    optimizer file would end with all of it resident. The pages stay in the page cache, and touching the
    tensor again reads them back, so this never loses data. Only ranges inside ``mappings`` (read-only
    file mappings from :func:`file_mappings`) are released: on ordinary memory the call would zero it.
    """
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    for low, high in mappings:
        if low <= start and end <= high:
            first = max(low, start // PAGE * PAGE)
            last = min(high, -(-end // PAGE) * PAGE)
            _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)
            return
