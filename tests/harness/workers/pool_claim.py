"""Who takes a pooled run's request number: the test process before it writes the request
(``harness.runner._TrainPool.run``), or the pool's rank 0 before it leaves while idle (``train.py``'s ``serve``).
Whoever creates ``claim.N`` first decides whether the pool serves request N or leaves; the other sees it taken.
And how an idle rank is woken when a request or ``stop`` is written (``wake``)."""

from __future__ import annotations

import os
import select
from pathlib import Path


def claim(directory: Path, number: int) -> bool:
    """Create ``directory/claim.NUMBER``; False where the other side has already."""
    try:
        os.close(os.open(directory / f"claim.{number}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


# An idle rank used to look for its next request 20 times a second: 1.5% of a core a rank, of which gloo's own
# threads are 0.9% (train.py: switch_tensor_parallel_groups). Each rank now sleeps in select() on a FIFO of its own
# and is woken by a byte there; it still looks once a second on its own (the test process gone, memory short).

def make_wake_channels(directory: Path, ranks: int) -> None:
    """The FIFOs ``directory/wake.RANK`` the ranks wait on (made before the ranks start)."""
    for rank in range(ranks):
        os.mkfifo(directory / f"wake.{rank}")


def open_wake_channel(directory: Path, rank: int) -> int:
    """This rank's FIFO, opened for reading and writing: it never reports end-of-file (a writer is always there) and
    the open does not wait for one."""
    return os.open(directory / f"wake.{rank}", os.O_RDWR | os.O_NONBLOCK)


def wait_for_wake(channel: int, timeout: float) -> None:
    """Sleep until woken or ``timeout`` seconds have passed; what woke it is consumed."""
    if select.select([channel], [], [], timeout)[0]:
        try:
            os.read(channel, 4096)
        except BlockingIOError:
            pass


def wake(directory: Path) -> None:
    """Wake every rank of the pool (a request, or ``stop``, has just been written). A rank that has not opened its
    FIFO yet is not waiting: it looks for its request before it first waits."""
    for fifo in directory.glob("wake.*"):
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # ENXIO: no reader yet
            continue
        try:
            os.write(fd, b"x")
        except BlockingIOError:  # full of unread wake-ups: it is awake anyway
            pass
        finally:
            os.close(fd)
