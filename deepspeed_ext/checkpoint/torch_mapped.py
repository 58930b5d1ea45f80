"""``torch.load(path, mmap=True, weights_only=True)`` through a mapping the kernel does not refuse for its size.

torch maps the whole file private and writable (copy-on-write) and reads a storage's pages only when they are
touched. Under Linux's default overcommit rule (``vm.overcommit_memory`` 0) a single private writable mapping larger
than the machine's memory plus swap is refused outright (ENOMEM), whatever will be touched of it: on a 24 GiB
machine the 57 GB optimizer partition of a TP=2 ZeRO-1 checkpoint at Llama-3.1-405B's shapes could not be opened at
all, though a conversion reads it a block at a time. ``MAP_NORESERVE`` asks for the same private copy-on-write
mapping without reserving memory for copies that no reader makes (the file is opened read-only; a write would
change this process's copy, never the file), and the kernel accepts it at any size.

torch has no public way to load over a mapping of one's own. This is the torch fence's other piece (with
:mod:`.zipsave`): ``torch.serialization._load`` (its ``overall_storage`` parameter), ``_open_zipfile_reader`` and
``_weights_only_unpickler`` are checked up front (:func:`unsupported`); where they are not what this module calls,
or the platform has no ``MAP_NORESERVE``, :func:`load` is plain ``torch.load(mmap=True)``.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import mmap
import os
import platform
import sys
import weakref
from pathlib import Path
from typing import Any

import torch

#: Linux's MAP_NORESERVE on the architectures it has this value on (Python 3.11's mmap does not name it).
_LINUX_MAP_NORESERVE = 0x4000


def _map_noreserve() -> int | None:
    flag = getattr(mmap, "MAP_NORESERVE", None)
    if flag is not None:
        return int(flag)
    if sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64", "arm64"):
        return _LINUX_MAP_NORESERVE
    return None


class _Mapping:
    """``size`` bytes of a file mapped at ``address``, unmapped when the last array over them is gone. numpy's array
    interface wraps the memory (an ndarray, then torch's storage, hold this object): Python's own ``mmap`` would keep
    a duplicate of the file's descriptor open for as long as any tensor of the file lives, thousands of them for a
    universal checkpoint's files."""

    def __init__(self, address: int, size: int) -> None:
        self.__array_interface__ = {"data": (address, False), "shape": (size,), "typestr": "|u1", "version": 3}
        weakref.finalize(self, _libc().munmap, address, size)


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64)
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    return libc


def _mapped(fd: int, size: int) -> torch.UntypedStorage:
    """The whole file ``fd`` (``size`` bytes) mapped private, writable copy-on-write, unreserved, as a storage."""
    import numpy as np
    flags = mmap.MAP_PRIVATE | (_map_noreserve() or 0)  # supported(): never None here
    address = _libc().mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    if address is None or address == ctypes.c_void_p(-1).value:
        error = ctypes.get_errno()
        raise OSError(error, f"unable to map {size} bytes: {os.strerror(error)}")
    return torch.from_numpy(np.asarray(_Mapping(address, size))).untyped_storage()


@functools.cache
def unsupported() -> str | None:
    """Why :func:`load` falls back to ``torch.load(mmap=True)``: torch's private pieces are not what it calls, or
    the platform has no ``MAP_NORESERVE``; None where it maps the file itself."""
    if _map_noreserve() is None or sys.maxsize < 2**62:
        return f"no MAP_NORESERVE on {sys.platform} {platform.machine()} (64-bit Linux)"
    serialization = torch.serialization
    for name in ("_load", "_open_zipfile_reader", "_weights_only_unpickler"):
        if not hasattr(serialization, name):
            return f"torch.serialization.{name} is missing"
    try:
        parameters = list(inspect.signature(serialization._load).parameters)
    except (TypeError, ValueError):
        return "torch.serialization._load has no signature"
    if parameters[:3] != ["zip_file", "map_location", "pickle_module"] or "overall_storage" not in parameters:
        return f"torch.serialization._load{tuple(parameters)} takes no overall_storage after its first three"
    if not hasattr(getattr(serialization, "_weights_only_unpickler"), "Unpickler"):
        return "torch.serialization._weights_only_unpickler has no Unpickler"
    return None


def supported() -> bool:
    return unsupported() is None


def load(path: Path) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True, mmap=True)``, the file mapped private and
    unreserved (the caller holds torch's safe globals). Storages are views of the mapping, read when touched."""
    with open(path, "rb") as opened:
        size = os.fstat(opened.fileno()).st_size
        if not supported() or size == 0:  # (an empty file: nothing to map; torch says what is wrong with it)
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        # The storages are views of the mapping and keep it for as long as any tensor needs it.
        whole = _mapped(opened.fileno(), size)
        serialization: Any = torch.serialization  # private names: typed as torch declares them not
        with serialization._open_zipfile_reader(opened) as archive:
            return serialization._load(archive, "cpu", serialization._weights_only_unpickler,
                                       overall_storage=whole, encoding="utf-8")
