"""Integrity manifest: every file of a converted checkpoint with its size and CRC-32C.

CRC-32C (``google-crc32c``, hardware-accelerated: about 13 GB/s here against sha256's 1.7 GB/s) detects
corrupted or truncated files without slowing a conversion that runs at the disk's speed; it is not a
defence against deliberate tampering.

Writers record each file as soon as it is written (on the writer thread, while its pages are still cached),
and write ``deepspeed_ext.manifest.json`` into the output before publishing it. ``deepspeed-ext verify``
checks an output against it: a file that is missing, has another size or other bytes, or is not listed.
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepspeed_ext.checkpoint import durable
from deepspeed_ext.errors import CheckpointError

MANIFEST_FILE = "deepspeed_ext.manifest.json"
ALGORITHM = "crc32c"
_CHUNK = 16 << 20
MANIFEST_VERSION = 1
#: Per-rank manifests of a distributed conversion, merged by rank 0 before publishing.
RANK_MANIFEST = ".deepspeed_ext.manifest.rank{rank}.json"


def file_checksum(path: Path) -> str:
    """The file's CRC-32C as 8 hex digits."""
    import google_crc32c
    checksum = google_crc32c.Checksum()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            checksum.update(chunk)
    digest: bytes = checksum.hexdigest()
    return digest.decode()


class ManifestRecorder:
    """Collects ``{relative path: {size, crc32c}}`` for the files written under ``root``; thread-safe."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.entries: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def add(self, path: Path, checksum: str | None = None) -> None:
        """Record ``path``; ``checksum``: its CRC-32C where the writer computed it as it wrote."""
        entry = {"size": path.stat().st_size, ALGORITHM: checksum or file_checksum(path)}
        with self._lock:
            self.entries[path.relative_to(self.root).as_posix()] = entry

    def write_rank_part(self, rank: int) -> None:
        """This rank's entries, for rank 0 to merge (:meth:`merge_rank_parts`)."""
        _write_json(self.root / RANK_MANIFEST.format(rank=rank), self.entries)

    def merge_rank_parts(self, world: int) -> None:
        for rank in range(1, world):
            part = self.root / RANK_MANIFEST.format(rank=rank)
            self.entries.update(json.loads(part.read_text()))
            part.unlink()

    def write(self) -> Path:
        """Record every file not recorded yet, then write the manifest (the output's last file). The files are
        checksummed on one thread per core: this is the write's last step, with nothing left to run beside it
        (a 1.1 GiB MaxText output took 0.30 s on two threads against 0.46 s on one, on a 2-core VM)."""
        recorded = {MANIFEST_FILE, *self.entries}
        pending = [path for path in sorted(p for p in self.root.rglob("*") if p.is_file())
                   if path.relative_to(self.root).as_posix() not in recorded]
        with ThreadPoolExecutor(max_workers=max(1, min(len(pending), os.cpu_count() or 1))) as pool:
            for _ in pool.map(self.add, pending):  # the first failure is raised here
                pass
        target = self.root / MANIFEST_FILE
        _write_json(target, {"version": MANIFEST_VERSION, "algorithm": ALGORITHM,
                             "files": dict(sorted(self.entries.items()))})
        return target


def _write_json(path: Path, data: Any) -> None:
    durable.replace_file(path, json.dumps(data, indent=1, sort_keys=True) + "\n")


@dataclass
class FilesChecked:
    """What checking a checkpoint's files found (``verify``): the directory reported on, what was checked in
    words, each problem (one line naming the file), and the files a manifest does not list."""

    root: Path
    description: str
    problems: list[str] = field(default_factory=list)
    unlisted: list[Path] = field(default_factory=list)


def manifest_files_checked(root: Path) -> FilesChecked:
    """``root``'s files against the manifest there; a checkpoint without one is reported as not checked."""
    if not (root / MANIFEST_FILE).is_file():
        return FilesChecked(root, "no manifest (not written by deepspeed-ext: file checksums not checked)")
    count, problems, unlisted = check_manifest(root)
    return FilesChecked(root, f"{count} files against the manifest", problems, unlisted)


def check_manifest(root: Path) -> tuple[int, list[str], list[Path]]:
    """(files checked, problems, files the manifest does not list) of ``root`` against its manifest; each
    problem names the file. Unlisted files are returned apart: a user may have added them (a README, a
    tokenizer) beside an intact output."""
    root = Path(root)
    path = root / MANIFEST_FILE
    if not path.is_file():
        return 0, [f"{path}: no manifest (outputs of earlier deepspeed-ext versions have none)"], []
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if manifest.get("algorithm") != ALGORITHM:
            raise ValueError(f"unknown algorithm {manifest.get('algorithm')!r}")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: not a readable manifest: {exc}") from exc
    problems = []
    for relative, entry in files.items():
        file = root / relative
        if not file.is_file():
            problems.append(f"{file}: missing")
        elif file.stat().st_size != entry["size"]:
            problems.append(f"{file}: {file.stat().st_size} bytes, the manifest says {entry['size']}")
        elif file_checksum(file) != entry[ALGORITHM]:
            problems.append(f"{file}: contents differ from the manifest ({ALGORITHM} mismatch)")
    listed = set(files) | {MANIFEST_FILE}
    unlisted = [file for file in sorted(p for p in root.rglob("*") if p.is_file())
                if file.relative_to(root).as_posix() not in listed]
    return len(files), problems, unlisted
