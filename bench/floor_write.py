"""The floor a conversion is measured against: read every file of its input and write exactly the files it wrote
(the same relative paths, the same sizes, so the same bytes and file count), from memory, one thread, nothing
computed, checked or renamed. ``bench/marginal.py`` times it as it times the command (``... && sync``).

    python bench/floor_write.py INPUT LAYOUT.json OUT     # LAYOUT: [[relative path, size], ...]
    python bench/floor_write.py - LAYOUT.json OUT         # the writes alone, nothing read
    python bench/floor_write.py INPUT LAYOUT.json OUT '*model_states.pt'   # only the input files the command reads

The bytes written are random (a 16 MiB buffer drawn once, written over and over): pages of zeros or of one repeated
value could be cheaper for a compressing or deduplicating disk than a checkpoint's bytes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

BUFFER_BYTES = 16 << 20


def read_all(path: Path, buffer: bytearray, pattern: str = "*") -> int:
    """Every file under ``path`` whose name matches ``pattern`` read once into ``buffer`` (its contents dropped);
    the bytes read."""
    total = 0
    view = memoryview(buffer)
    for file in sorted(p for p in path.rglob(pattern) if p.is_file()):
        with open(file, "rb", buffering=0) as handle:
            while got := handle.readinto(view):
                total += got
    return total


def write_layout(layout: list[tuple[str, int]], out: Path, data: bytes) -> int:
    """Each ``(relative path, size)`` written under ``out`` from ``data`` cycled; the bytes written."""
    total = 0
    view = memoryview(data)
    for relative, size in layout:
        path = out / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = size
            while left:
                left -= os.write(fd, view[:min(left, len(view))])
        finally:
            os.close(fd)
        total += size
    return total


def main() -> None:
    source, layout_file, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    layout = [(str(relative), int(size)) for relative, size in json.loads(layout_file.read_text())]
    if str(source) != "-":
        read_all(Path(source), bytearray(BUFFER_BYTES), sys.argv[4] if len(sys.argv) > 4 else "*")
    out.mkdir(parents=True, exist_ok=False)
    write_layout(layout, out, os.urandom(BUFFER_BYTES))


if __name__ == "__main__":
    main()
