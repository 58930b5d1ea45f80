"""Saves written in the background: a writer per rank, and how the ranks' writers agree on the commit.

``engine.save_checkpoint`` with ``"async_save": true`` hands what each file holds to a writer. By default on a CPU
engine the writer is a fork of the rank (:func:`start`): the fork *is* the snapshot: the child sees the training
state as it was at that instant, whatever the parent does next (the kernel copies a page only when one of them
writes it), so the parent returns after the fork (milliseconds) and trains on while the child writes, fsyncs and
commits. With the copy snapshot (:mod:`.snapshot`; the only way on an accelerator) the writer is a thread
(:class:`WriterThread`) that writes from host copies of the state. Nothing in a writer is collective, and it uses
none of the training process's communicators; the ranks' writers agree through small files in the save's
staging directory (``<staging>/.ranks/``):

* each writer, once its files are durable, leaves ``<rank>.ok`` (holding what the commit needs from it: its
  share of the fingerprints) or, on a failure, an empty ``<rank>.failed`` (an empty file fits on a full disk);
* a writer that died without a word (killed) is reported by its own rank's training process, which finds it
  dead at its next step or save and leaves the ``.failed`` for it;
* the coordinating rank's writer waits for every rank's word, and commits only when all of them are ``ok``:
  the commit marker last, one rename, then ``latest`` (:func:`.commit.commit`, safe to kill at any instant).

A forked writer ends with one line of JSON to its parent through a pipe (``{"ok": ..., "message": ...}``): for the
coordinator, whether the save was committed. The parent reads it when the writer has exited
(:meth:`BackgroundSave.poll` / :meth:`BackgroundSave.wait`). A writer dies with its training process
(``PR_SET_PDEATHSIG``): a killed job leaves the save uncommitted, never half-committed.

Nothing here imports torch or DeepSpeed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepspeed_ext.errors import first_line

#: The directory inside a save's staging directory where the ranks' writers leave their word.
RANKS_DIR = ".ranks"
_POLL_S = 0.01


class BackgroundFailure(Exception):
    """A writer's part of the save failed (one line: what and where)."""


class OtherRankFailed(BackgroundFailure):
    """The coordinator gave up because another rank's writer failed (that rank says why)."""


@dataclass(frozen=True)
class Outcome:
    """How a writer ended: for the coordinating rank's, whether the save was committed."""

    ok: bool
    message: str | None = None
    #: The coordinator relays another rank's failure (:class:`OtherRankFailed`): that rank's message says more.
    relayed: bool = False


def ranks_dir(staging: str | os.PathLike[str]) -> Path:
    return Path(staging) / RANKS_DIR


def report_rank(staging: str | os.PathLike[str], rank: int, problem: str | None,
                payload: dict[str, Any] | None = None) -> None:
    """This rank's word for the coordinator: ``<rank>.ok`` with ``payload`` (written aside and renamed into
    place, so the coordinator never reads half of it), or an empty ``<rank>.failed``."""
    directory = ranks_dir(staging)
    directory.mkdir(exist_ok=True)
    if problem is None:
        aside = directory / f".{rank}.ok.tmp"
        aside.write_text(json.dumps(payload or {}))
        os.replace(aside, directory / f"{rank}.ok")
        return
    mark_failed(staging, rank)


def mark_failed(staging: str | os.PathLike[str], rank: int) -> None:
    """Leave ``<rank>.failed`` (empty) where the save's staging directory still exists; never raises."""
    try:
        ranks_dir(staging).mkdir(exist_ok=True)
        os.close(os.open(ranks_dir(staging) / f"{rank}.failed", os.O_CREAT | os.O_WRONLY, 0o644))
    except OSError:
        pass  # the save is gone already (committed and cleaned up, or discarded)


def note_writer(staging: str | os.PathLike[str], rank: int) -> None:
    """``<rank>.pid``: where this rank's writer runs, so a coordinator on the same host can tell that a writer
    died without leaving its word (its training process killed, the writer with it)."""
    directory = ranks_dir(staging)
    directory.mkdir(exist_ok=True)
    (directory / f"{rank}.pid").write_text(f"{socket.gethostname()} {os.getpid()}")


def wait_for_ranks(staging: str | os.PathLike[str], count: int,
                   stop: Callable[[], str | None] | None = None) -> dict[int, dict[str, Any]]:
    """Block until ``count`` ranks said ``ok`` (their payloads, by rank), or raise :class:`BackgroundFailure`
    as soon as one rank failed, or died without a word (same host), or ``stop()`` names a reason."""
    directory = ranks_dir(staging)
    host = socket.gethostname()
    while True:
        try:
            names = set(os.listdir(directory))
        except FileNotFoundError:
            raise OtherRankFailed(f"{staging}: the save's staging directory was removed while it was written")
        failed = sorted(int(name.split(".")[0]) for name in names if name.endswith(".failed"))
        if failed:
            raise OtherRankFailed(f"rank {failed[0]}'s part of the save failed")
        done = sorted(int(name.split(".")[0]) for name in names if name.endswith(".ok"))  # not ".<rank>.ok.tmp"
        if len(done) >= count:
            return {rank: json.loads((directory / f"{rank}.ok").read_text()) for rank in done}
        for name in names:
            if name.endswith(".pid"):
                rank = int(name.split(".")[0])
                if rank not in done and _dead_on(host, directory / name):
                    raise OtherRankFailed(f"rank {rank}'s background writer died before its files were written "
                                          "(its training process was killed?)")
        reason = stop() if stop is not None else None
        if reason is not None:
            raise BackgroundFailure(reason)
        time.sleep(_POLL_S)


def _dead_on(host: str, pid_file: Path) -> bool:
    try:
        where, pid = pid_file.read_text().split()
    except (OSError, ValueError):
        return False
    if where != host:
        return False  # another host's writer: its own rank reports it
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


class ReleasedPages:
    """In a forked writer: hands each block of memory back to the kernel once it is in its file
    (``madvise(MADV_DONTNEED)`` on the pages wholly inside it), unless something the writer still reads lies
    there (``keep``: ranges of a later file's storages, or of what is still to be summed).

    Until the writer lets go of a page, the training process's first write to it (the next optimizer step) makes
    the kernel copy it, fault by fault; a page given back is the training process's alone again, written in
    place. So the memory the save costs, and the time those copies take, shrink to what training rewrites before
    the writer has written it."""

    def __init__(self, keep: Callable[[], list[tuple[int, int]]]):
        import ctypes
        import mmap
        self._keep = keep
        self._page = mmap.PAGESIZE
        self._madvise = ctypes.CDLL(None, use_errno=True).madvise
        self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def __call__(self, address: int, nbytes: int) -> None:
        start = -(-address // self._page) * self._page
        end = (address + nbytes) // self._page * self._page
        if end <= start or any(low < end and start < high for low, high in self._keep()):
            return
        self._madvise(start, end - start, 4)  # MADV_DONTNEED; a refusal only leaves the page shared


class BackgroundSave:
    """The parent's handle on one rank's forked writer (:func:`start`)."""

    def __init__(self, pid: int, result_fd: int, *, tag: str, save_dir: str, staging: Path, rank: int,
                 coordinator: bool):
        self.pid, self._result_fd = pid, result_fd
        self.tag, self.save_dir, self.staging, self.rank, self.coordinator = tag, save_dir, staging, rank, coordinator
        self.started = time.monotonic()
        self.outcome: Outcome | None = None
        #: What to run once the save is known to be committed (on this rank), e.g. a trainer's deferred rotation.
        self.after_commit: list[Callable[[], None]] = []

    def order_next_step(self) -> None:
        """Nothing to order: the fork is the snapshot."""

    def poll(self) -> Outcome | None:
        """The writer's outcome if it has exited (reaped here), else None."""
        if self.outcome is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self._finish(status)
        return self.outcome

    def wait(self) -> Outcome:
        """Block until the writer has exited; its outcome."""
        if self.outcome is None:
            _, status = os.waitpid(self.pid, 0)
            self._finish(status)
        assert self.outcome is not None
        return self.outcome

    def kill(self) -> None:
        """Stop the writer now (the save is abandoned; a commit killed at any instant leaves it unpublished or
        whole) and reap it."""
        if self.outcome is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.wait()

    def _finish(self, status: int) -> None:
        with os.fdopen(self._result_fd, "r") as pipe:
            text = pipe.read()
        if os.WIFSIGNALED(status):
            number = os.WTERMSIG(status)
            self.outcome = Outcome(False, f"the background writer was killed ({signal.Signals(number).name}) "
                                          "before it finished")
        else:
            try:
                data = json.loads(text.strip().splitlines()[-1])
                self.outcome = Outcome(bool(data["ok"]), data.get("message"), bool(data.get("relayed")))
            except (ValueError, IndexError, KeyError, TypeError):
                self.outcome = Outcome(False, f"the background writer exited with status {os.WEXITSTATUS(status)} "
                                              "without saying how it ended")
        if not self.outcome.ok:
            mark_failed(self.staging, self.rank)  # a writer that died without its word: the coordinator waits


def start(work: Callable[[], str | None], *, tag: str, save_dir: str, staging: Path, rank: int,
          coordinator: bool) -> BackgroundSave:
    """Fork a writer that runs ``work()`` on the state as it is now, and return at once.

    ``work`` returns None when its part went well, or raises (:class:`BackgroundFailure` for an expected failure,
    one line); the child then ends with :func:`os._exit`, never returning into the parent's code."""
    read_fd, write_fd = os.pipe()
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the writer
        code = 1
        try:
            os.close(read_fd)
            _die_with(parent)
            outcome = _run(work)
            os.write(write_fd, (json.dumps({"ok": outcome.ok, "message": outcome.message,
                                            "relayed": outcome.relayed}) + "\n").encode())
            code = 0 if outcome.ok else 1
        finally:
            os._exit(code)
    os.close(write_fd)
    return BackgroundSave(pid, read_fd, tag=tag, save_dir=save_dir, staging=staging, rank=rank,
                          coordinator=coordinator)


class WriterThread:
    """A writer on a thread of the training process (the copy snapshot: :mod:`.snapshot`), with the handle a
    forked writer's :class:`BackgroundSave` has. Its ``work`` is given ``stopped``, which says whether
    :meth:`kill` asked it to give up (checked between the blocks it writes and before it commits); it dies with the
    process, as a forked writer dies with its parent."""

    pid = None  # no process of its own

    def __init__(self, work: Callable[[Callable[[], bool]], None], *, tag: str, save_dir: str, staging: Path,
                 rank: int, coordinator: bool, order_next_step: Callable[[], None] | None = None):
        import threading
        self.tag, self.save_dir, self.staging, self.rank, self.coordinator = tag, save_dir, staging, rank, coordinator
        self.started = time.monotonic()
        self.outcome: Outcome | None = None
        self.after_commit: list[Callable[[], None]] = []
        self._order_next_step = order_next_step
        self._stop = threading.Event()
        self._result: Outcome | None = None
        # Not a daemon: a script that returns while its save is written keeps the process until it is committed
        # (the exit also waits for it: deepspeed_ext.runtime.background_save.wait_at_exit).
        self._thread = threading.Thread(target=self._main, args=(work, ), name=f"deepspeed-ext-save-{tag}")
        self._thread.start()

    def _main(self, work: Callable[[Callable[[], bool]], None]) -> None:
        self._result = _run(lambda: work(self._stop.is_set))

    def order_next_step(self) -> None:
        """Before the next training step: its kernels queued behind the snapshot's device copies."""
        if self._order_next_step is not None and self.outcome is None:
            self._order_next_step()

    def ended(self) -> bool:
        """Whether the thread has ended (its outcome not yet taken: :meth:`poll` takes it)."""
        return not self._thread.is_alive()

    def poll(self) -> Outcome | None:
        if self.outcome is None and not self._thread.is_alive():
            self._finish()
        return self.outcome

    def wait(self) -> Outcome:
        if self.outcome is None:
            self._thread.join()
            self._finish()
        assert self.outcome is not None
        return self.outcome

    def kill(self) -> None:
        """Ask the writer to give up (it stops before its next block, or before the commit) and wait for it."""
        if self.outcome is None:
            self._stop.set()
            self.wait()

    def _finish(self) -> None:
        self.outcome = self._result or Outcome(False, "the background writer ended without saying how")
        if not self.outcome.ok:
            mark_failed(self.staging, self.rank)


def _run(work: Callable[[], str | None]) -> Outcome:
    try:
        work()
    except OtherRankFailed as exc:
        return Outcome(False, str(exc), relayed=True)
    except BackgroundFailure as exc:
        return Outcome(False, str(exc))
    except BaseException as exc:  # anything else: its type and first line, with the traceback on stderr
        traceback.print_exc()
        return Outcome(False, f"{type(exc).__name__}: {first_line(exc)}")
    return Outcome(True)


def _die_with(parent: int) -> None:
    """The writer is killed when its training process dies (Linux), as a thread of it would be."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before the line above took effect
        os._exit(1)
