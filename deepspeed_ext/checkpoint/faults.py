"""Fault injection for the save path's tests: a process killed at a named point, deterministically.

``DEEPSPEED_EXT_FAULT=POINT[@TAG][:RANK][=error]`` makes the process SIGKILL itself (as ``kill -9`` or the OOM
killer would) the first time it reaches ``POINT`` while saving ``TAG`` (any tag when left out), on rank ``RANK``
(every rank when left out); with ``=error`` it raises an ``OSError`` (EIO) there instead, as a failing disk would
(one rank's write failing while the others' succeed). The points, in the order a save reaches them:

* ``mid-file``: inside a checkpoint file, after its first block of tensor data is written;
* ``recovery-scripts``: as DeepSpeed copies its recovery scripts (``zero_to_fp32.py``) into the save, a write
  outside its checkpoint engine;
* ``files-written``: this rank's files are written, before the ranks agree that every rank's were;
* ``before-marker``: every file is written and durable, before the commit marker;
* ``before-publish``: the marker is written, before the tag is moved into place;
* ``before-latest``: the tag is in place, before ``latest`` names it;
* ``before-cleanup``: ``latest`` is written, before the tag it replaced is removed.

Unset, :func:`reached` is one dictionary look-up.
"""

from __future__ import annotations

import errno
import os
import signal

ENV = "DEEPSPEED_EXT_FAULT"
POINTS = ("mid-file", "recovery-scripts", "files-written", "before-marker", "before-publish", "before-latest", "before-cleanup")

#: The tag being saved (set by the save hook), for a fault that names one.
current_tag: str | None = None


def reached(point: str) -> None:
    """SIGKILL this process (or raise ``OSError``) if ``DEEPSPEED_EXT_FAULT`` names ``point`` (for the tag being
    saved, on this rank)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    assert point in POINTS, point
    spec, _, action = spec.partition("=")
    where, _, rank = spec.partition(":")
    name, _, tag = where.partition("@")
    if name != point or (tag and tag != current_tag):
        return
    if rank and rank != os.environ.get("RANK", "0"):
        return
    if action == "error":
        raise OSError(errno.EIO, f"injected I/O error at {point} ({ENV})")
    os.kill(os.getpid(), signal.SIGKILL)
