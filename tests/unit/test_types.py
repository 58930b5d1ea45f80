"""deepspeed_ext/checkpoint/ type-checks under ``mypy --strict`` (configured in mypy.ini).

Among what it catches: a reader that does not implement :class:`CheckpointSource` (formats.py checks every
format's ``open_source`` against it), as when the CLI called a ``summary`` one reader lacked.
"""

import ast
import gc
import sys
from pathlib import Path

from mypy import api

from deepspeed_ext.checkpoint.formats import FORMATS

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "mypy.ini"
# Warm, the check takes seconds; cold (a fresh checkout), about 20 s, most of it torch's annotations. The
# cache is .gitignored.
CACHE = ROOT / ".mypy_cache"


def test_checkpoint_package_is_strictly_typed():
    # mypy raises the recursion limit and retunes the garbage collector for its own run: put them back.
    recursion_limit, gc_threshold = sys.getrecursionlimit(), gc.get_threshold()
    try:
        stdout, stderr, status = api.run(["--config-file", str(CONFIG), "--cache-dir", str(CACHE),
                                          str(ROOT / "deepspeed_ext" / "checkpoint")])
    finally:
        sys.setrecursionlimit(recursion_limit)
        gc.set_threshold(*gc_threshold)
    assert status == 0, f"mypy (config: {CONFIG.name}) found problems:\n{stdout}{stderr}"


def test_every_format_reader_is_checked_against_the_source_protocol():
    # Formats are imported by name at run time: formats.py lists each one's reader for the type checker, by hand.
    tree = ast.parse((ROOT / "deepspeed_ext" / "checkpoint" / "formats.py").read_text())
    imported = {alias.asname or alias.name: f"{node.module}.{alias.name}"
                for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    readers = next(node.value for node in ast.walk(tree)
                   if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == "_READERS")
    assert isinstance(readers, ast.Dict)
    checked = {imported[value.value.id] for value in readers.values
               if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name)
               and value.attr == "open_source"}
    assert checked == {fmt.module for fmt in FORMATS.values()}
