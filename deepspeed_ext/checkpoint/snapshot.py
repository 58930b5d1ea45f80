"""A save's state copied into host buffers: the snapshot a save in the background writes from when it is not a fork.

A forked writer sees the training state as it was at the fork, for free, but only on the host: an accelerator's
memory is not in the child, and a forked child cannot use the accelerator. Forking a process that runs threads
(data loaders, NCCL's, OpenMP's, JAX's) can also leave the child waiting on a lock no thread will release. So
``"async_save": {"snapshot": "copy"}`` (the only way on an accelerator) copies what DeepSpeed's files hold instead:

* every storage the files reference is copied once, whole (torch.save writes whole storages, so the files come
  out byte for byte the same), into a host buffer of its exact size from a :class:`HostPool`: allocated during the
  first save (pinned where an accelerator copies into it), then reused by every later save of the same shapes;
* a storage on an accelerator is copied on a side stream, after the work already queued on the current one, without
  waiting: ``save_checkpoint`` returns once the copies are issued, and the next optimizer step's kernels are queued
  behind them (:meth:`Snapshot.order_after`), so training never overwrites a tensor before its copy is taken, and
  never waits on the host for it. A storage in host memory (a CPU engine's, ZeRO-Offload's) is copied on a thread
  once the ranks agreed the save started (torch lets go of the GIL while it copies a tensor), and the next optimizer
  step waits for that thread before it writes the state in place: the forward and backward before it overlap the
  copies;
* a copy of an accelerator's storage is written with the location torch.save would give the storage itself
  (``cuda:0``, through torch's public ``register_package``), so the files are the synchronous save's there too,
  and a load that does not remap them puts them where they were;
* the files' Python structure is deep-copied around the copies (views of one storage stay views of one copy,
  as torch.save would write them), so whatever DeepSpeed or the user changes afterwards in a state dict is not in
  the files either.

The writer (a thread) waits for the copies (:meth:`Snapshot.wait`), writes the files from the host buffers and hands
them back to the pool (:meth:`Snapshot.release`). A tensor torch cannot view in a buffer (a sparse or wrapper
subclass tensor) is deep-copied as torch copies it, on its own device.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import pickle
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

#: The identity of a storage: its device, where its memory starts, how long it is.
StorageKey = tuple[str, int, int]


class HostPool:
    """Host buffers, by size, handed out to a snapshot and given back when its files are written: a training run
    saves the same storages every time, so after the first save nothing is allocated again (``nbytes`` says how
    much the pool holds: the memory a save in the background costs)."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, bool], list[torch.UntypedStorage]] = {}
        self._lock = threading.Lock()
        self.nbytes = 0
        self.pinned_nbytes = 0  # of which page-locked

    def take(self, nbytes: int, pinned: bool) -> tuple[torch.UntypedStorage, bool]:
        """A buffer of ``nbytes``, page-locked if ``pinned`` asks and the accelerator can pin it (an accelerator
        copies into pinned memory without the host waiting); whether it is."""
        with self._lock:
            for kind in ((True, False) if pinned else (False, )):
                free = self._free.get((nbytes, kind))
                if free:
                    return free.pop(), kind
        buffer, kind = None, pinned
        if pinned:
            try:
                buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage()
            except RuntimeError:  # no pinned memory left (or none here): pageable, the copy then waits
                kind = False
        if buffer is None:
            buffer = torch.empty(nbytes, dtype=torch.uint8).untyped_storage()
        with self._lock:
            self.nbytes += nbytes
            self.pinned_nbytes += nbytes if kind else 0
        return buffer, kind

    def give_back(self, buffers: Iterable[tuple[torch.UntypedStorage, bool]]) -> None:
        with self._lock:
            for buffer, pinned in buffers:
                self._free.setdefault((buffer.nbytes(), pinned), []).append(buffer)


#: Where each host buffer holding a copy of an accelerator's storage is (its address), and the location torch.save
#: gives that storage ("cuda:0"): torch.save writes the copy with it (:func:`_location_of_copy`).
_DEVICE_COPIES: dict[int, str] = {}
_DEVICE_COPIES_LOCK = threading.Lock()


def _location_of_copy(storage: Any) -> str | None:
    """torch.save's tagger for the copies of accelerator storages (None for any other storage: torch's own
    taggers answer)."""
    if getattr(storage, "device", None) is None or storage.device.type != "cpu" or not _DEVICE_COPIES:
        return None
    with _DEVICE_COPIES_LOCK:
        return _DEVICE_COPIES.get(storage.data_ptr())


def _no_restore(storage: Any, location: str) -> None:
    """The tagger's deserializer: nothing of its own (torch's own deserializers restore the location it wrote)."""
    return None


@functools.cache
def _register_location_tagger() -> None:
    # Before torch's own taggers (priority 10 and on): the copies are CPU storages, which torch would tag "cpu".
    torch.serialization.register_package(1, _location_of_copy, _no_restore)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """The storage's bytes as a flat uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def storage_key(storage: torch.UntypedStorage) -> StorageKey:
    return (str(storage.device), storage.data_ptr(), storage.nbytes())


def find_tensors(obj: Any) -> tuple[list[torch.Tensor], list[Any]]:
    """The tensors and the bare storages in ``obj``, as torch.save would reach them (by pickling, so anything
    torch.save can write is walked the same way), each once; without reading their data."""
    tensors: dict[int, torch.Tensor] = {}
    storages: dict[int, Any] = {}

    class Finder(pickle.Pickler):
        def reducer_override(self, found: Any) -> Any:
            if isinstance(found, torch.Tensor):
                tensors.setdefault(id(found), found)
                return int, ()  # nothing below a tensor is walked: its data stay unread
            if isinstance(found, (torch.UntypedStorage, torch.TypedStorage)):
                storages.setdefault(id(found), found)
                return int, ()
            return NotImplemented

    class Nowhere:
        def write(self, data: bytes) -> None:
            pass

    Finder(Nowhere(), protocol=2).dump(obj)
    return list(tensors.values()), list(storages.values())


class Snapshot:
    """What one save writes, copied (:func:`take`): ``states`` (one per file, in order) and, through
    :meth:`view_of`, any other tensor of the same storages (what the fingerprints sum)."""

    def __init__(self, pool: HostPool):
        self._pool = pool
        self._copies: dict[StorageKey, torch.UntypedStorage] = {}
        self._buffers: list[tuple[torch.UntypedStorage, bool]] = []
        self._streams: dict[str, tuple[Any, Any]] = {}  # device -> (side stream, its event once recorded)
        self._device_copies: list[int] = []  # the addresses of the buffers holding accelerator storages
        self._host_copies: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []  # (buffer, host storage)
        self._host_thread: threading.Thread | None = None
        self._host_error: BaseException | None = None
        self.states: list[Any] = []

    # --- taking it ---------------------------------------------------------------------------------------------

    def _copy_of(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        key = storage_key(storage)
        found = self._copies.get(key)
        if found is not None:
            return found
        on_device = storage.device.type != "cpu"
        buffer, pinned = self._pool.take(storage.nbytes(), pinned=on_device)
        self._buffers.append((buffer, pinned))
        if on_device:
            module = torch.get_device_module(storage.device.type)
            if str(storage.device) not in self._streams:
                side = module.Stream(device=storage.device)
                side.wait_stream(module.current_stream(storage.device))  # after what is queued to fill it
                self._streams[str(storage.device)] = (side, None)
            side, _ = self._streams[str(storage.device)]
            _register_location_tagger()
            with _DEVICE_COPIES_LOCK:
                _DEVICE_COPIES[buffer.data_ptr()] = torch.serialization.location_tag(storage)
            self._device_copies.append(buffer.data_ptr())
            with module.stream(side):
                _bytes_of(buffer).copy_(_bytes_of(storage), non_blocking=True)
                # A temporary of DeepSpeed's (a gathered ZeRO-3 weight) may be freed before the copy ran: its
                # memory is not handed out again until the side stream is past it.
                _bytes_of(storage).record_stream(side)
        else:
            self._host_copies.append((buffer, storage))  # copied on a thread (start_host_copies)
        self._copies[key] = buffer
        return buffer

    def view_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as it is in the snapshot: the same view of its storage's copy (copied now if no file holds it)."""
        if tensor.untyped_storage().nbytes() == 0:
            return torch.empty(tensor.shape, dtype=tensor.dtype)
        buffer = self._copy_of(tensor.untyped_storage())
        view = torch.empty(0, dtype=tensor.dtype).set_(buffer, tensor.storage_offset(), tensor.size(),
                                                       tensor.stride())
        return view

    def seed(self, memo: dict[int, Any], tensors: list[torch.Tensor], storages: list[Any]) -> None:
        """``memo`` made to answer each tensor and bare storage with its copy, for copy.deepcopy."""
        for found in storages:
            untyped = found if isinstance(found, torch.UntypedStorage) else found.untyped_storage()
            buffer = self._copy_of(untyped)
            memo[id(found)] = buffer if isinstance(found, torch.UntypedStorage) else torch.TypedStorage(
                wrap_storage=buffer, dtype=found.dtype, _internal=True)  # type: ignore[no-untyped-call]
        with_state = []
        for tensor in tensors:
            if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.is_sparse or tensor.is_quantized \
                    or tensor.layout is not torch.strided or tensor.device.type == "meta" \
                    or tensor.untyped_storage().nbytes() == 0:
                # Deep-copied as torch copies it. An empty storage too (ZeRO-3's placeholder of each partitioned
                # weight): empty ones have no address to tell them apart by, torch's deep copy keeps each one
                # distinct as torch.save does, and it costs nothing.
                continue
            view = self.view_of(tensor)
            if tensor.requires_grad:
                view.requires_grad_(True)
            if type(tensor) is torch.nn.Parameter:
                view = torch.nn.Parameter(view, requires_grad=tensor.requires_grad)
            memo[id(tensor)] = view
            if tensor.__dict__:  # attributes torch.save writes with the tensor
                with_state.append((tensor, view))
        for tensor, view in with_state:
            view.__dict__.update(copy.deepcopy(tensor.__dict__, memo))

    def close_copies(self) -> None:
        """Every device copy is issued: their events recorded."""
        for device, (side, _) in list(self._streams.items()):
            module = torch.get_device_module(torch.device(device).type)
            event = module.Event()
            event.record(side)
            self._streams[device] = (side, event)

    def start_host_copies(self) -> None:
        """The host storages copied on a thread from now on (:meth:`order_after` and :meth:`wait` wait for it)."""
        if self._host_copies and self._host_thread is None:
            self._host_thread = threading.Thread(target=self._copy_host, name="deepspeed-ext-snapshot", daemon=True)
            self._host_thread.start()

    def _host_copies_done(self) -> None:
        """Wait for the host copies (started now if they were not: nothing reads a buffer before its copy)."""
        self.start_host_copies()
        if self._host_thread is not None:
            self._host_thread.join()

    def _copy_host(self) -> None:
        try:
            for buffer, storage in self._host_copies:
                # A tensor's copy lets go of the GIL while it copies (a storage's copy_ holds it: training would
                # stop for the whole copy)
                _bytes_of(buffer).copy_(_bytes_of(storage))
        except BaseException as exc:  # raised by wait(), in the writer
            self._host_error = exc
        self._host_copies = []

    # --- after it is taken ------------------------------------------------------------------------------------

    def order_after(self) -> None:
        """Before the next optimizer step: the host copies finished (the step writes those storages in place; the
        forward and backward before it overlapped them), and the current streams' next kernels queued behind the
        device copies (training waits on the device, not on the host, and only until the copies are done)."""
        self._host_copies_done()
        for device, (_, event) in self._streams.items():
            if event is not None:
                torch.get_device_module(torch.device(device).type).current_stream(device).wait_event(event)

    def wait(self) -> None:
        """Block until every copy is in its host buffer (the writer, before it reads them); raises a failed copy."""
        self._host_copies_done()
        for _, event in self._streams.values():
            if event is not None:
                event.synchronize()
        if self._host_error is not None:
            raise self._host_error

    @property
    def nbytes(self) -> int:
        return sum(buffer.nbytes() for buffer, _ in self._buffers)

    def release(self) -> None:
        """The buffers back to the pool (once the files are written; the snapshot is not read again)."""
        if self._host_thread is None:
            self._host_copies = []  # never started: nothing reads the buffers
        with contextlib.suppress(BaseException):  # a failed copy was raised to the writer already
            self.wait()
        with _DEVICE_COPIES_LOCK:
            for address in self._device_copies:
                _DEVICE_COPIES.pop(address, None)
        buffers, self._buffers, self._copies, self.states = self._buffers, [], {}, []
        self._device_copies = []
        self._pool.give_back(buffers)


def take(states: list[Any], pool: HostPool, also: Callable[[Snapshot], None] | None = None) -> Snapshot:
    """A :class:`Snapshot` of ``states`` (what each file holds), its buffers from ``pool``, its device copies issued
    (its host copies start with :meth:`Snapshot.start_host_copies`); ``also`` is called with it before the device
    copies are closed off, to take views of more tensors (:meth:`Snapshot.view_of`)."""
    snapshot = Snapshot(pool)
    try:
        memo: dict[int, Any] = {}
        tensors, storages = find_tensors(states)
        snapshot.seed(memo, tensors, storages)
        snapshot.states = copy.deepcopy(states, memo)
        if also is not None:
            also(snapshot)
        snapshot.close_copies()
    except BaseException:
        snapshot.close_copies()
        snapshot.release()
        raise
    return snapshot
