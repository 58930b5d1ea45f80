"""Where a command may write, and how an output is published: the one rule every writer follows.

* **Never the source.** The output may not be a source, contain one or lie inside one, after symlinks and
  ``..`` are resolved, with or without ``--overwrite`` (:func:`prepare`). Files that a source reaches through
  symlinks (a Hugging Face cache's ``snapshots/`` point into ``blobs/``) are protected too.
* **Built aside, published whole.** Everything is written under ``<out>.partial`` and renamed to ``<out>`` only
  when complete (:func:`staged`); an existing output is replaced only with ``--overwrite``, and only at that
  moment, so a failed or interrupted run leaves the previous output as it was and nothing under the final name.
* **Nothing outside the output.** A writer writes only inside ``<out>`` (and its ``.partial`` twin). The one
  exception is ``to-universal`` without ``-o``, which adds ``<tag>_universal/`` and the ``latest_universal``
  pointer beside the tag, as upstream's converter does, and never replaces a file of the checkpoint.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from deepspeed_ext.checkpoint import durable
from deepspeed_ext.errors import CheckpointError

PARTIAL_SUFFIX = ".partial"

#: Staging directories being built right now, and outputs published by this process: what an interrupt
#: (Ctrl-C) removes and reports. Plain set/list operations are atomic under the GIL.
_in_flight: set[Path] = set()
_published: list[Path] = []
#: Publishing (renames, the pointer file) is never cut in half: an interrupt then waits for it to finish.
_publishing = 0
_interrupt_pending = False
#: Taken to publish and to act on an interrupt, which may run on the interrupt's own thread while the main thread
#: publishes; the interrupt that ends the process keeps it, so nothing is published after it began. Reentrant: the
#: main thread's signal handler can run between two bytecodes of the main thread holding it.
_interrupt_lock = threading.RLock()
#: The interpreter the sweeper runs in (below): no site-packages, no user environment, only the standard library.
_SWEEPER = """
import fcntl, os, shutil, sys
sys.stdin.buffer.read()  # end of file once the converter is gone, every one of its threads with it
for path in sys.argv[1:]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        continue
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: another run's staging by now, not ours to remove
        doomed = f"{path}.interrupted-{os.getpid()}"
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    except OSError:
        pass
    finally:
        os.close(fd)
"""


def resolve(path: str | os.PathLike[str]) -> Path:
    """The absolute path with every symlink and ``..`` resolved (the path need not exist)."""
    return Path(os.path.realpath(os.path.abspath(os.fspath(path))))


def staging_path(out: Path) -> Path:
    return out.with_name(out.name + PARTIAL_SUFFIX)


def read_paths(directory: str | os.PathLike[str]) -> list[Path]:
    """``directory`` plus the resolved targets of the symlinks inside it: every place reading it touches."""
    directory = Path(directory)
    paths = [resolve(directory)]
    if directory.is_dir():
        for root, dirs, files in os.walk(directory):
            for name in (*dirs, *files):
                entry = Path(root, name)
                if entry.is_symlink():
                    paths.append(resolve(entry))
    return paths


def _within(inner: Path, outer: Path) -> bool:
    return inner != outer and outer in inner.parents


def prepare(out: str | os.PathLike[str], sources: Iterable[str | os.PathLike[str] | None], *, overwrite: bool) -> Path:
    """Check that ``out`` may be written by a command reading ``sources``; returns ``out`` resolved.

    Refused, whatever ``overwrite`` says: an output (or its staging twin) that is a source, contains one or
    lies inside one. Refused without ``overwrite``: an existing output that is not an empty directory.
    """
    given = Path(out)
    target = resolve(given)
    protected = [resolve(source) for source in sources if source is not None]
    relations = (("is", lambda candidate, source: candidate == source),
                 ("contains", lambda candidate, source: _within(source, candidate)),
                 ("lies inside", lambda candidate, source: _within(candidate, source) and source.is_dir()))
    # The closest relation names the problem best (`-o ROOT` of a MaxText ROOT/0/items *is* the checkpoint).
    for relation, holds in relations:
        for candidate in (target, staging_path(target)):
            source = next((source for source in protected if holds(candidate, source)), None)
            if source is not None:
                what = "the output" if candidate == target else f"the output's staging directory {candidate}"
                raise CheckpointError(f"{given}: {what} {relation} the source checkpoint {source}; deepspeed-ext "
                                      "never writes into its input (with or without --overwrite): choose an output "
                                      "outside it")
    if target.exists():
        if not target.is_dir():
            raise CheckpointError(f"{given}: exists and is not a directory; choose another output")
        if any(target.iterdir()) and not overwrite:
            raise CheckpointError(f"{given}: output already exists; pass --overwrite to replace it")
    return target


@contextmanager
def staged(out: Path, pointer: tuple[Path, str] | None = None) -> Iterator[Path]:
    """Build an output under ``<out>.partial``; publish it as ``out`` only when the block completes.

    The ``.partial`` directory is the output's lock: the run that builds it holds an exclusive ``flock`` on it
    until it is published or removed, so a second run into the same output refuses in one line instead of
    clearing the first one's work. A stale ``.partial`` (an earlier run that was killed: nobody holds its lock)
    is cleared first. On failure or interrupt the ``.partial`` is removed and an existing ``out`` is left as it
    was; on success it is replaced (the caller checked ``--overwrite`` in :func:`prepare`). ``pointer``:
    ``(file, text)`` written atomically right after publishing (``latest_universal`` beside a tag), in the same
    uninterruptible step.
    """
    partial = staging_path(out)
    _in_flight.add(partial)  # before it exists: an interrupt in between removes nothing, or what _claim made
    try:
        lock = _claim(partial, out)
    except BaseException:
        _in_flight.discard(partial)
        raise
    try:
        yield partial
        with _uninterruptible():
            _publish(partial, out)
            _in_flight.discard(partial)
            _published.append(out)
            if pointer is not None:
                write_text_atomic(*pointer)
    except KeyboardInterrupt:
        # Stays registered: a library's worker thread may still write into it until the process exits.
        shutil.rmtree(partial, ignore_errors=True)
        raise
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        _in_flight.discard(partial)
        raise
    finally:
        os.close(lock)


def _claim(partial: Path, out: Path) -> int:
    """Create ``partial`` and lock it; returns the locked descriptor. Refuses while another process holds
    the lock of an existing ``partial`` (it is building the same output right now)."""
    if partial.is_dir() and not partial.is_symlink():
        held = _try_lock(partial)
        if held is None:
            raise CheckpointError(f"{out}: another deepspeed-ext run is writing this output right now (its staging "
                                  f"directory {partial} is locked); wait for it to finish or choose another output")
        try:
            _remove(partial)  # stale: left by a run that was killed
        finally:
            os.close(held)
    elif partial.exists() or partial.is_symlink():
        _remove(partial)
    try:
        partial.mkdir(parents=True)
    except FileExistsError:
        raise CheckpointError(f"{out}: another deepspeed-ext run started writing this output at the same moment; "
                              "wait for it to finish or choose another output") from None
    lock = _try_lock(partial)
    if lock is None:  # another run locked it between our mkdir and our lock
        raise CheckpointError(f"{out}: another deepspeed-ext run is writing this output right now; wait for it to "
                              "finish or choose another output")
    return lock


def _try_lock(directory: Path) -> int | None:
    """An exclusive, non-blocking ``flock`` on ``directory``: its descriptor, or None if another holds it."""
    import fcntl
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def write_text_atomic(path: Path, text: str) -> None:
    durable.replace_file(path, text)


def _publish(partial: Path, out: Path) -> None:
    """Rename ``partial`` to ``out``; an existing ``out`` is moved aside first and removed after, so at every
    moment one complete output exists on disk."""
    if out.exists():
        old = out.with_name(f"{out.name}.replaced-{os.getpid()}")
        os.replace(out, old)
        os.replace(partial, out)
        _remove(old)
    else:
        os.replace(partial, out)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


@contextmanager
def _uninterruptible() -> Iterator[None]:
    global _publishing
    with _interrupt_lock:  # waits for good where an interrupt is already ending the process
        _publishing += 1
    try:
        yield
    finally:
        with _interrupt_lock:
            _publishing -= 1
            if not _publishing and _interrupt_pending:
                _exit_interrupted()


def discard_in_flight() -> list[Path]:
    """Remove every staging directory still being built (after an interrupt); returns them.

    Each is renamed first, so a worker thread that still writes into it by path fails, or, where it creates the
    file's directories first, re-creates the staging directory: :func:`_sweep_after_exit` removes that once the
    process has ended."""
    paths = sorted(_in_flight)
    for path in paths:
        doomed = path.with_name(f"{path.name}.interrupted-{os.getpid()}")
        try:
            os.replace(path, doomed)
        except OSError:
            doomed = path
        shutil.rmtree(doomed, ignore_errors=True)
        _in_flight.discard(path)
    return paths


def exit_on_interrupt() -> None:
    """Ctrl-C (SIGINT) ends the process at once, exit 130, after removing the staging directories and
    saying in one line what was (not) written; publishing in progress is finished first. For the CLI: a
    KeyboardInterrupt raised wherever the main thread happens to be (inside an import, a GC callback, a
    library that catches it) can be lost or turned into another error, and library threads would go on
    writing while it unwinds.

    Python runs a signal handler on the main thread only, between two bytecodes. A main thread waiting in a
    library's C code for a thread that will not finish, or in a lock while the kernel handed the signal to another
    thread (a process-directed signal goes to any thread that does not block it), would never run it: Ctrl-C would
    hang. So a thread of ours waits on the interpreter's wakeup descriptor, which the C-level handler writes on
    whichever thread the signal lands, and acts at once; the handler on the main thread stays as the fallback.
    (What that thread needs is imported with this module: an import on the way out could wait for the main
    thread, stopped in the handler.)"""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, _on_interrupt)
    try:
        wakeups, wakeup_write = os.pipe()
        os.set_blocking(wakeup_write, False)  # the C handler must never block
        previous = signal.set_wakeup_fd(wakeup_write, warn_on_full_buffer=False)
    except (OSError, ValueError):
        return
    if previous != -1:  # someone else's (an event loop's): theirs stays, the main thread's handler serves us
        signal.set_wakeup_fd(previous)
        os.close(wakeups)
        os.close(wakeup_write)
        return
    threading.Thread(target=_watch_interrupts, args=(wakeups, ), name="deepspeed-ext-interrupt", daemon=True).start()


def _watch_interrupts(wakeups: int) -> None:
    """The wakeup descriptor's reader: one byte per signal with a Python handler, its number."""
    while True:
        try:
            received = os.read(wakeups, 64)
        except OSError:
            return
        if not received:
            return
        if signal.SIGINT in received:
            _on_interrupt(signal.SIGINT, None)


def _on_interrupt(signum: int, frame: object) -> None:
    global _interrupt_pending
    _interrupt_lock.acquire()  # kept when the process ends here
    if _publishing:
        _interrupt_pending = True
        _interrupt_lock.release()
        return
    _exit_interrupted()


def _exit_interrupted() -> None:
    discarded = discard_in_flight()
    if _published:
        message = f"interrupted; already complete: {', '.join(map(str, _published))}; nothing else was written"
    else:
        message = "interrupted; nothing was written"
    try:
        # Straight to the descriptor: sys.stderr's buffer has a lock, which the main thread may hold, stopped in
        # the handler on its way into a write, while this runs on the interrupt thread.
        os.write(2, f"{_line_break_after_a_bar()}deepspeed-ext: {message}\n".encode())
    finally:
        try:
            _sweep_after_exit(discarded)
        finally:
            os._exit(130)


def _line_break_after_a_bar() -> str:
    """A newline where a progress bar is on stderr's line (tqdm ends its updates with a carriage return, not a line
    break), so the interrupt's line is a line of its own rather than the bar's tail."""
    bars = sys.modules.get("tqdm")
    live = getattr(getattr(bars, "tqdm", None), "_instances", None)
    try:
        return "\n" if live and any(not getattr(bar, "disable", True) for bar in list(live)) else ""
    except Exception:  # noqa: BLE001 - a display nicety; the line itself must still be written
        return ""


def _sweep_after_exit(paths: list[Path]) -> None:
    """Remove ``paths`` again once this process has ended. A library's own threads (tensorstore's, in C++) go on
    writing by path until the process ends, and creating a file's directories re-creates a staging directory
    just removed; only the end of the process stops them. A small process of the standard library waits for that
    end (the pipe it reads closes with the last of our threads), then removes what came back, unless another
    run holds it by then (its lock). It keeps our stderr, so a caller that reads it to its end also waits for
    the sweep (milliseconds); it runs in a session of its own, beyond the reach of a second Ctrl-C."""
    if not paths:
        return
    try:
        until_exit, held_until_exit = os.pipe()  # ours stays open (not inherited) until os._exit
        subprocess.Popen([sys.executable, "-I", "-S", "-c", _SWEEPER, *map(str, paths)], stdin=until_exit,
                         stdout=subprocess.DEVNULL, start_new_session=True)
        os.close(until_exit)
    except Exception:  # noqa: BLE001 - best effort: what we removed before stays removed
        pass
