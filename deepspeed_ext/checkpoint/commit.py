"""Commit markers: a tag deepspeed-ext saves is complete exactly when its marker says so.

A save through deepspeed-ext is built aside, in ``<save_dir>/.deepspeed_ext-saving.<tag>/<tag>``, while
DeepSpeed writes it. When every rank's files are durable (each rank fsyncs what it wrote), the coordinating
rank writes ``deepspeed_ext.commit.json`` into it last, listing every file of the tag with its size and CRC-32,
fsyncs it, moves the tag to ``<save_dir>/<tag>`` in one rename (an existing tag of that name is swapped out
atomically, so it stays valid until then), and only then writes ``latest``. A process killed at any instant
therefore leaves ``<save_dir>/<tag>`` either absent, as it was before, or complete and committed.

Readers call :func:`require_complete` on a DeepSpeed tag directory:

* **committed** (a marker): every listed file must be there with its size, and no checkpoint file the marker
  does not list may sit beside them (files of another save); ``verify`` also checks every CRC-32;
* **uncommitted**: the tag is inside a staging directory, or its ``deepspeed_ext.json`` says a marker is due
  and there is none: refused, naming the newest complete tag where there is one;
* **unmarked**: not saved by deepspeed-ext (plain DeepSpeed, another writer, an earlier deepspeed-ext): read
  as before; ``verify`` and the converters check every zip record's CRC-32 (:mod:`.zipcheck`).

Nothing here imports torch: finding out whether a tag may be read is cheap.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from deepspeed_ext.checkpoint import durable, faults
from deepspeed_ext.checkpoint.deepspeed import keys
from deepspeed_ext.errors import CheckpointError, DamagedFilesError

COMMIT_FILE = "deepspeed_ext.commit.json"
COMMIT_FORMAT = "deepspeed_ext.commit"
COMMIT_VERSION = 1
#: ``<save_dir>/<STAGING_PREFIX><tag>/<tag>``: a save being written (or one that never finished).
STAGING_PREFIX = ".deepspeed_ext-saving."
#: The key of ``deepspeed_ext.json`` that says the tag is committed by a marker (a save of this version on).
UC_INFO_KEY = "commit_marker"
#: deepspeed-ext's UC info file (the name is :mod:`deepspeed_ext.checkpoint.metadata`'s; read here as plain JSON).
UC_INFO_FILE = "deepspeed_ext.json"
#: A tag's files that hold training state: every one must be listed by the tag's marker.
_STATE_FILE = re.compile(r".*\.(pt|bin|safetensors)$")


class TagState(str, Enum):
    COMMITTED = "committed"
    UNCOMMITTED = "uncommitted"
    UNMARKED = "unmarked"


@dataclass(frozen=True)
class FileRecord:
    size: int
    crc32: str  # 8 hex digits, CRC-32 (zlib's) of the whole file


@dataclass
class CommitMarker:
    """What ``deepspeed_ext.commit.json`` records."""

    tag: str
    files: dict[str, FileRecord]
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"format": COMMIT_FORMAT, "version": COMMIT_VERSION, "tag": self.tag, **self.details,
                "files": {name: {"size": record.size, "crc32": record.crc32}
                          for name, record in sorted(self.files.items())}}

    @classmethod
    def from_json(cls, data: Any, source: Path) -> CommitMarker:
        if not isinstance(data, dict) or data.get("format") != COMMIT_FORMAT:
            raise CheckpointError(f"{source}: not a deepspeed-ext commit marker")
        if int(data.get("version", 0)) > COMMIT_VERSION:
            raise CheckpointError(f"{source}: commit marker version {data['version']} is newer than this "
                                  f"deepspeed-ext understands ({COMMIT_VERSION}); upgrade deepspeed-ext")
        try:
            files = {str(name): FileRecord(int(entry["size"]), str(entry["crc32"]))
                     for name, entry in data["files"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{source}: malformed commit marker: {exc}") from exc
        details = {key: value for key, value in data.items() if key not in ("format", "version", "tag", "files")}
        return cls(tag=str(data.get("tag", "")), files=files, details=details)


@dataclass
class TagStatus:
    state: TagState
    marker: CommitMarker | None = None
    #: Why the tag is uncommitted (one line), or the problems of a committed tag's files.
    problems: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.state is not TagState.UNCOMMITTED and not self.problems


# --------------------------------------------------------------------------- reading


def read_marker(tag_dir: Path) -> CommitMarker | None:
    path = Path(tag_dir) / COMMIT_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable commit marker: {exc}") from exc
    return CommitMarker.from_json(data, path)


def is_staging(path: Path) -> bool:
    """``path`` is a staging directory or a tag inside one."""
    path = Path(path)
    return path.name.startswith(STAGING_PREFIX) or path.parent.name.startswith(STAGING_PREFIX)


def _expects_marker(tag_dir: Path) -> bool:
    path = tag_dir / UC_INFO_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False  # absent (not ours) or unreadable (the UC info reader says so)
    return isinstance(data, dict) and bool(data.get(UC_INFO_KEY))


def tag_status(tag_dir: str | os.PathLike[str]) -> TagStatus:
    """Whether the DeepSpeed tag at ``tag_dir`` is committed, uncommitted or unmarked; for a committed one, the
    problems found by comparing its files' names and sizes with its marker (no file is read)."""
    tag_dir = Path(tag_dir)
    if is_staging(tag_dir):
        return TagStatus(TagState.UNCOMMITTED, problems=[
            f"{tag_dir}: an unfinished save (deepspeed-ext builds each save in {STAGING_PREFIX}<tag> and moves it "
            "into place only once it is committed): the save was interrupted"])
    marker = read_marker(tag_dir)
    if marker is None:
        if _expects_marker(tag_dir):
            return TagStatus(TagState.UNCOMMITTED, problems=[
                f"{tag_dir}: the save of this tag did not finish ({UC_INFO_FILE} is there, its {COMMIT_FILE} "
                "is not): some of its files may be incomplete"])
        return TagStatus(TagState.UNMARKED)
    return TagStatus(TagState.COMMITTED, marker, marker_problems(tag_dir, marker))


def marker_problems(tag_dir: Path, marker: CommitMarker) -> list[str]:
    """Files the marker lists that are missing or of another size, and state files it does not list."""
    problems = []
    for name, record in sorted(marker.files.items()):
        path = tag_dir / name
        try:
            size = path.stat().st_size
        except OSError:
            problems.append(f"{path}: missing (listed in {COMMIT_FILE})")
            continue
        if size != record.size:
            problems.append(f"{path}: {size} bytes, {COMMIT_FILE} says {record.size} (cut short or replaced)")
    for path in sorted(_files(tag_dir)):
        name = path.relative_to(tag_dir).as_posix()
        if name not in marker.files and name != COMMIT_FILE and _STATE_FILE.match(path.name):
            problems.append(f"{path}: not part of the committed save ({COMMIT_FILE} does not list it: a file of "
                            "another save, or added afterwards)")
    return problems


def require_complete(tag_dir: str | os.PathLike[str]) -> TagStatus:
    """The tag's status; raises :class:`CheckpointError` (one line) when it is uncommitted or its files do not
    match its marker."""
    status = tag_status(tag_dir)
    message = refusal(Path(tag_dir), status)
    if message is not None:
        raise CheckpointError(message)
    return status


def refusal(tag_dir: Path, status: TagStatus | None = None) -> str | None:
    """The one line a reader refuses ``tag_dir`` with (naming the newest complete tag beside an unfinished
    save), or None when it may be read."""
    status = status or tag_status(tag_dir)
    if status.state is TagState.UNCOMMITTED:
        inside = tag_dir.parent.name.startswith(STAGING_PREFIX)
        return status.problems[0] + newest_complete_hint(tag_dir.parent.parent if inside else tag_dir.parent)
    if status.problems:
        more = f" (and {len(status.problems) - 1} more problem(s): deepspeed-ext verify lists them)" \
            if len(status.problems) > 1 else ""
        return status.problems[0] + more
    return None


def unfinished_saves(save_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """``{tag: staging directory}`` of the saves into ``save_dir`` that never finished."""
    save_dir = Path(save_dir)
    try:
        children = list(save_dir.iterdir())
    except OSError:
        return {}
    return {child.name[len(STAGING_PREFIX):]: child for child in children
            if child.name.startswith(STAGING_PREFIX) and child.is_dir()}


def newest_complete_hint(save_dir: Path) -> str:
    """``"; the newest complete tag is X ('latest')"`` where ``save_dir`` has one, else ``""``."""
    latest = Path(save_dir) / keys.LATEST
    try:
        tag = durable.read_pointer(latest)
    except OSError:
        return ""
    if tag and (Path(save_dir) / tag).is_dir() and tag_status(Path(save_dir) / tag).complete:
        return f"; the newest complete tag is {tag} ({latest} names it)"
    return ""


def unfinished_save_message(save_dir: Path, tag: str | None = None) -> str | None:
    """One line about an unfinished save of ``tag`` (any tag when None) in ``save_dir``, or None."""
    unfinished = unfinished_saves(save_dir)
    if tag is not None:
        unfinished = {tag: unfinished[tag]} if tag in unfinished else {}
    if not unfinished:
        return None
    names = ", ".join(sorted(unfinished))
    return (f"{save_dir}: the save of {names} did not finish (killed mid-save?): its partial files are in "
            f"{', '.join(str(path) for _, path in sorted(unfinished.items()))}, and it was never committed"
            + newest_complete_hint(save_dir))


def require_listed_file_intact(tag_dir: Path, name: str) -> None:
    """Where ``tag_dir``'s commit marker lists the small file ``name`` (our metadata), refuse it in one line when
    its bytes are not those the marker records: read before anything it says is believed, so a damaged record is
    named as the cause rather than what it then seems to lack."""
    from deepspeed_ext.checkpoint.zipcheck import file_crc32
    marker = read_marker(tag_dir)
    record = marker.files.get(name) if marker is not None else None
    path = tag_dir / name
    if record is None or not path.is_file():
        return
    size, value = file_crc32(path)
    crc = f"{value:08x}"
    if size != record.size or crc != record.crc32:
        raise CheckpointError(f"{path}: contents differ from {COMMIT_FILE} ({size} bytes, CRC-32 {crc}; "
                              f"recorded {record.size} bytes, {record.crc32}); the file is damaged")


def check_contents(tag_dir: str | os.PathLike[str], status: TagStatus | None = None,
                   threads: int = 2, lazy: Collection[Path] = (), mapped: bool = False) -> tuple[str, list[str]]:
    """Read every byte of a DeepSpeed tag and check it; ``(what was checked, in words; problems, one line each)``.

    * committed: every file the marker lists against its size and CRC-32 (the marker's CRC-32 of a torch file
      is derived from its records' CRC-32s and the bytes between them, so every record's data is read and
      checked against its CRC-32 too);
    * unmarked: every torch file's zip records against their CRC-32s, and a file cut short (no central
      directory) found (a file written with CRC-32 off can only be checked for its structure).

    ``lazy``: zip files of the tag whose large records' data are *not* read here (a conversion checks the records
    it reads, :class:`ContentCheck`); everything else about them is checked as above: their structure, their
    small records and, against a marker, their CRC-32 as their records' CRC-32s and the bytes between them give it.
    ``mapped``: records are summed through a mapping of their file (:func:`~.zipcheck.check_zip`: only for a caller
    that maps the same bytes anyway).
    """
    from deepspeed_ext.checkpoint.zipcheck import ZipCheckError, check_zips, file_crc32, small_records
    tag_dir = Path(tag_dir)
    status = status or tag_status(tag_dir)
    problems = list(status.problems)
    if status.state is TagState.UNCOMMITTED:
        return "nothing (the save did not finish)", problems
    if status.marker is not None:
        listed = {name: tag_dir / name for name in status.marker.files if (tag_dir / name).is_file()}
        zips = [path for path in listed.values() if _is_zip(path)]
        reports = check_zips(zips, threads=threads, read_data=dict.fromkeys(_within(zips, lazy), small_records),
                             mapped=mapped)
        for name, path in sorted(listed.items()):
            record = status.marker.files[name]
            report = reports.get(path)
            if report is not None and report.problems:
                problems += report.problems
                continue
            try:
                size, crc = file_crc32(path)
            except (OSError, ZipCheckError) as exc:
                problems.append(f"{path}: cannot read: {exc}")
                continue
            if size == record.size and f"{crc:08x}" != record.crc32:
                problems.append(f"{path}: contents differ from {COMMIT_FILE} (CRC-32 {crc:08x}, recorded "
                                f"{record.crc32})")
        return f"{len(status.marker.files)} files against the commit marker (size, CRC-32)", problems
    files = sorted(path for path in _files(tag_dir) if _STATE_FILE.match(path.name))
    torch_files = [path for path in files if path.suffix == ".pt"]
    reports = check_zips(torch_files, threads=threads, read_data=dict.fromkeys(_within(torch_files, lazy),
                                                                                 small_records), mapped=mapped)
    unchecked = [path.name for path, report in reports.items() if report.without_crc]
    for report in reports.values():
        problems += report.problems
    records = sum(report.records for report in reports.values())
    note = f"; {len(unchecked)} written without CRC-32s (structure only): {', '.join(unchecked)}" if unchecked else ""
    return (f"no commit marker (not saved by deepspeed-ext): {len(reports)} torch files, {records} zip records "
            f"against their CRC-32{note}"), problems


def _within(paths: Iterable[Path], chosen: Collection[Path]) -> list[Path]:
    """Those of ``paths`` that are among ``chosen`` (compared resolved: a mapped file is named by its real path)."""
    resolved = {Path(path).resolve() for path in chosen}
    return [path for path in paths if path.resolve() in resolved] if resolved else []


class ContentCheck:
    """:func:`check_contents` on a thread of its own, started when a conversion starts reading the tag: the check
    reads each file sequentially while the conversion reads what it needs (on a cold cache the one warms the
    other's pages), and its verdict is asked for before anything is published.

    ``lazy`` (the optimizer files, most of a tag's bytes): of these only the large records the conversion reads
    (:meth:`note_read`) have their data read and checked against their CRC-32, on the same thread as they are
    read; their structure, small records and marker CRC-32 are checked all the same. A conversion that needs the
    master weights alone (to-hf, to-maxtext without the optimizer) then reads none of the moments, which are
    twice the masters' bytes; every byte it uses is still checked against what was saved. ``verify`` checks all.

    ``mapped``: the records are summed where they lie in the page cache (:func:`~.zipcheck.check_zip`), for a
    conversion that maps the same files itself: no copy of every byte it checks (copying the model-states files
    out for their sums was about 6 % of to-maxtext's CPU time at the margin).
    """

    def __init__(self, tag_dir: Path, lazy: Collection[Path] = (), mapped: bool = False):
        import queue
        import threading
        self.tag_dir = Path(tag_dir)
        self.lazy = frozenset(Path(path).resolve() for path in lazy)
        self.mapped = mapped
        self._result: tuple[str, list[str]] | None = None
        self._error: BaseException | None = None
        self._reads: queue.SimpleQueue[tuple[Path, int | None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        #: ``(file, record)`` already read and checked, and the late reads' problems (see :meth:`note_read`).
        self._checked: set[tuple[Path, str]] = set()
        self._read_bytes = 0
        self._late: list[str] = []
        self._thread = threading.Thread(target=self._run, name="deepspeed-ext-content-check", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            checked, problems = check_contents(self.tag_dir, threads=1, lazy=self.lazy, mapped=self.mapped)
            while (read := self._reads.get()) is not None:
                problems += self._check_read(*read)
            if self.lazy:
                checked += (f"; the data of {len(self.lazy)} optimizer files checked only where read "
                            f"({len(self._checked)} records, {self._read_bytes} bytes)")
            self._result = checked, problems
        except BaseException as exc:  # handed to the caller's thread
            self._error = exc

    def note_read(self, path: Path, offset: int | None) -> None:
        """A conversion reads a tensor at byte ``offset`` of ``path`` (None: somewhere unknown, so the whole file
        is checked): where ``path`` is lazy, the record holding it is checked, once. A read noted after the verdict
        was asked for is checked at once, and its problems join the next verdict."""
        path = Path(path).resolve()
        if path not in self.lazy:
            return
        with self._lock:
            if not self._closed:
                self._reads.put((path, offset))
                return
        self._thread.join()  # its own reads done: the records it checked are known
        self._late += self._check_read(path, offset)

    def _check_read(self, path: Path, offset: int | None) -> list[str]:
        from deepspeed_ext.checkpoint.zipcheck import ZipCheckError, check_zip, records_holding
        try:
            names = None if offset is None else records_holding(path, [offset])
        except (OSError, ZipCheckError) as exc:
            return [f"{path}: cannot read: {exc}"]
        if names is not None:
            names -= {name for file, name in self._checked if file == path}
            if not names:
                return []
        report = check_zip(path, read_data=None if names is None else (lambda info: info.filename in names),
                           mapped=self.mapped)
        self._checked.update((path, name) for name in names or ["*"])
        self._read_bytes += report.bytes_checked
        return report.problems

    def close(self) -> None:
        """No more reads to check: the thread finishes what it has (reads noted later are checked at once)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._reads.put(None)

    def result(self) -> tuple[str, list[str]]:
        """Wait for the check: :func:`check_contents`'s (what was checked, the problems)."""
        self.close()
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result[0], self._result[1] + self._late

    def raise_if_damaged(self, cause: BaseException | None = None) -> None:
        """Wait for the check; raise :class:`DamagedFilesError` (one line) when a file failed it (``cause``: the
        error reading it led to, chained to this one)."""
        problems = self.result()[1]
        if problems:
            more = f" (and {len(problems) - 1} more problem(s): deepspeed-ext verify lists them)" \
                if len(problems) > 1 else ""
            raise DamagedFilesError(f"{problems[0]}{more}; nothing was written") from cause


def _is_zip(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == b"PK\x03\x04"
    except OSError:
        return False


def _files(root: Path) -> Iterable[Path]:
    for directory, _, names in os.walk(root):
        for name in names:
            yield Path(directory, name)


# --------------------------------------------------------------------------- writing (the save)


def staging_root(save_dir: str | os.PathLike[str], tag: str) -> Path:
    return Path(save_dir) / f"{STAGING_PREFIX}{tag}"


def prepare_staging(save_dir: str | os.PathLike[str], tag: str) -> Path:
    """An empty staging directory for a save of ``tag`` (what an earlier, interrupted save left is removed)."""
    root = staging_root(save_dir, tag)
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    return root


def discard_staging(save_dir: str | os.PathLike[str], tag: str) -> None:
    shutil.rmtree(staging_root(save_dir, tag), ignore_errors=True)


def build_marker(tag_dir: Path, tag: str, details: Mapping[str, Any]) -> CommitMarker:
    """The marker of ``tag_dir`` as it is: every file with its size and CRC-32 (torch's zip files: from their
    records' CRC-32s and the few bytes between them, without reading the tensors again)."""
    from deepspeed_ext.checkpoint.zipcheck import file_crc32
    files = {}
    for path in sorted(_files(tag_dir)):
        name = path.relative_to(tag_dir).as_posix()
        if name == COMMIT_FILE:
            continue
        size, crc = file_crc32(path)
        files[name] = FileRecord(size, f"{crc:08x}")
    return CommitMarker(tag=tag, files=files, details=dict(details))


def commit(save_dir: str | os.PathLike[str], tag: str, details: Mapping[str, Any], *, save_latest: bool) -> Path:
    """Commit the save of ``tag`` built in its staging directory: every file durable, the marker written last,
    the tag moved into ``save_dir`` (swapped with an existing tag of that name, which stays valid until then),
    ``latest`` pointed at it, the replaced tag removed. Run by one process once every rank's files are written.
    Returns the committed tag directory."""
    save_dir = Path(save_dir)
    staging = staging_root(save_dir, tag)
    built = staging / tag
    durable.fsync_tree(staging)
    faults.reached("before-marker")
    marker = build_marker(built, tag, {**details, "committed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    durable.write_bytes_durably(built / COMMIT_FILE, (json.dumps(marker.to_json(), indent=1) + "\n").encode())
    faults.reached("before-publish")
    final = save_dir / tag
    if final.exists() and not durable.exchange(built, final):
        # No atomic swap here: the old tag is moved aside, then the new one in (a kill between the two
        # renames leaves no directory under the tag's name; the old one is then in the staging directory).
        os.replace(final, staging / f"{tag}.replaced")
        os.replace(built, final)
    elif not final.exists():
        os.replace(built, final)
    durable.fsync_dir(save_dir)
    # DeepSpeed also writes beside the tags (zero_to_fp32.py): moved out of the staging directory.
    for leftover in staging.iterdir():
        if leftover.is_file():
            os.replace(leftover, save_dir / leftover.name)
    faults.reached("before-latest")
    if save_latest:
        durable.write_bytes_durably(save_dir / keys.LATEST, tag.encode())
    faults.reached("before-cleanup")
    shutil.rmtree(staging, ignore_errors=True)  # the replaced tag, if any (swapped into the staging directory)
    return final
