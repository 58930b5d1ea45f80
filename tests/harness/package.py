"""The package's modules by their dotted names relative to ``deepspeed_ext`` (``""`` is the package itself), read
from the source tree: what the import-graph and fence tests walk."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "deepspeed_ext"


def package_modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found
