"""Fault injection for the save path's tests: a process killed at a named point, deterministically.

``DEEPSPEED_EXT_FAULT=POINT[@TAG][:RANK][=ACTION]`` makes the process SIGKILL itself (as ``kill -9`` or the OOM
killer would) the first time it reaches ``POINT`` while saving ``TAG`` (any tag when left out), on rank ``RANK``
(every rank when left out). ``ACTION`` instead: ``error`` raises an ``OSError`` (EIO) there, as a failing disk
would (one rank's write failing while the others' succeed); ``job`` also kills the process's parent first (in a
save's background writer: the training process, so the whole job dies mid-write); ``sleepS`` waits S seconds
(a slow disk). Several faults, one per save, are separated by commas. The points, in the order a save reaches
them (in the background writer, with ``async_save``, from ``mid-file`` on):

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
import time

ENV = "DEEPSPEED_EXT_FAULT"
POINTS = ("mid-file", "recovery-scripts", "files-written", "before-marker", "before-publish", "before-latest",
          "before-cleanup")

#: The tag being saved (set by the save hook), for a fault that names one.
current_tag: str | None = None


def reached(point: str) -> None:
    """Act as ``DEEPSPEED_EXT_FAULT`` says if it names ``point`` (for the tag being saved, on this rank): SIGKILL
    this process, raise ``OSError``, kill the parent too, or sleep."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    assert point in POINTS, point
    for fault in spec.split(","):
        where, _, action = fault.partition("=")
        where, _, rank = where.partition(":")
        name, _, tag = where.partition("@")
        if name != point or (tag and tag != current_tag) or (rank and rank != os.environ.get("RANK", "0")):
            continue
        if action == "error":
            raise OSError(errno.EIO, f"injected I/O error at {point} ({ENV})")
        if action.startswith("sleep"):
            time.sleep(float(action[len("sleep"):]))
            return
        if action == "job":
            os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
