"""Making what was written survive a crash or a power loss: fsync of files and directories, pointer files
replaced whole and durably, and directories swapped atomically.

A file's bytes reach the disk only when it is fsynced; a new name in a directory (a created file, a rename)
only when the directory is. A save that writes a commit marker must therefore fsync every file it lists, then
the marker, then the directory holding them, before anything (``latest``) points at them.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
from pathlib import Path
from typing import Any

__all__ = ["exchange", "fsync_dir", "fsync_file", "fsync_tree", "start_writeback", "write_bytes_durably"]

_SYNC_FILE_RANGE_WRITE = 2


@functools.cache
def _sync_file_range() -> Any:
    """Linux's ``sync_file_range`` from the C library, or None (another platform, or a libc without it)."""
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing ``length`` bytes of ``fd`` at ``offset`` to the disk now, without waiting for them: a file
    that will be fsynced when complete then reaches the disk while the rest of it is being written, and the
    fsync finds little left to do. Only a hint: where it is not supported nothing happens (fsync still does
    all the work)."""
    function = _sync_file_range()
    if function is not None:
        function(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # an error (a pipe, a file system without it): ignored


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush ``path``'s data and size to the disk (whoever wrote it: fsync flushes the file, not a descriptor)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush ``path``'s entries (names created, renamed or removed in it) to the disk."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # a platform without directory descriptors: renames there are as durable as it makes them
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EBADF):  # some file systems cannot sync a directory
            raise
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike[str]) -> None:
    """Every file and directory under ``root`` (and ``root``) flushed to the disk; files already clean cost
    one system call each."""
    for directory, _, files in os.walk(root):
        for name in files:
            fsync_file(os.path.join(directory, name))
        fsync_dir(directory)


def replace_file(path: str | os.PathLike[str], data: bytes | str, *, durable: bool = False) -> None:
    """``path`` replaced whole by ``data`` (text is written as UTF-8): written under a temporary name beside it
    and renamed, so a reader sees the old content or the new, never part of it. ``durable``: the file and its
    directory are fsynced too, so the same holds after a crash or a power loss (pointer files, markers); the
    files of an output that is published whole later need not be (its publication syncs the tree)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data.encode() if isinstance(data, str) else data)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def write_bytes_durably(path: str | os.PathLike[str], data: bytes) -> None:
    """``path`` replaced whole by ``data``, durably (:func:`replace_file`)."""
    replace_file(path, data, durable=True)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Swap the directory entries ``a`` and ``b`` in one atomic step (Linux ``renameat2`` with
    ``RENAME_EXCHANGE``): at every instant each name holds one of the two, whole. False where the kernel, the
    C library or the file system cannot (the caller then renames in two steps)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), os.fspath(a), None, os.fspath(b))


def read_pointer(path: Path) -> str:
    """The name a pointer file (``latest``, ``latest_universal``) holds; one line naming the file where it is not
    a name (not UTF-8 text, or empty)."""
    from deepspeed_ext.errors import CheckpointError
    try:
        name = path.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: not a tag name (not UTF-8 text); the file is damaged") from None
    if not name:
        raise CheckpointError(f"{path}: empty; it should name a tag")
    return name
