"""Who takes a pooled run's request number: the test process before it writes the request
(``harness.runner._TrainPool.run``), or the pool's rank 0 before it leaves while idle (``train.py``'s ``serve``).
Whoever creates ``claim.N`` first decides whether the pool serves request N or leaves; the other sees it taken."""

from __future__ import annotations

import os
from pathlib import Path


def claim(directory: Path, number: int) -> bool:
    """Create ``directory/claim.NUMBER``; False where the other side has already."""
    try:
        os.close(os.open(directory / f"claim.{number}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True
