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
``_weights_only_unpickler`` are checked up front (:func:`supported`); where they are not what this module calls,
or the platform has no ``MAP_NORESERVE``, :func:`load` is plain ``torch.load(mmap=True)``.
"""

from __future__ import annotations

import functools
import inspect
import mmap
import os
import platform
import sys
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


@functools.cache
def unsupported() -> str | None:
    """Why :func:`load` falls back to ``torch.load(mmap=True)``: torch's private pieces are not what it calls, or
    the platform has no ``MAP_NORESERVE``; None where it maps the file itself."""
    if _map_noreserve() is None:
        return f"no MAP_NORESERVE on {sys.platform} {platform.machine()}"
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
    if not supported():
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    flags = mmap.MAP_PRIVATE | int(_map_noreserve() or 0)
    with open(path, "rb") as opened:
        size = os.fstat(opened.fileno()).st_size
        if size == 0:  # nothing to map: torch says what is wrong with the file
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        mapping = mmap.mmap(opened.fileno(), size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        # The storages keep the mapping (frombuffer holds the buffer) for as long as any tensor needs it.
        whole = torch.frombuffer(mapping, dtype=torch.uint8).untyped_storage()
        del mapping
        serialization: Any = torch.serialization  # private names: typed as torch declares them not
        with serialization._open_zipfile_reader(opened) as archive:
            return serialization._load(archive, "cpu", serialization._weights_only_unpickler,
                                       overall_storage=whole, encoding="utf-8")
