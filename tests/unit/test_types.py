"""The whole package type-checks under ``mypy --strict`` (configured in mypy.ini).

Among what it catches: a reader that does not implement :class:`CheckpointSource` (every format's ``open_source``
is annotated with it), as when the CLI called a ``summary`` one reader lacked.
"""

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


def test_the_package_is_strictly_typed():
    # mypy raises the recursion limit and retunes the garbage collector for its own run: put them back.
    recursion_limit, gc_threshold = sys.getrecursionlimit(), gc.get_threshold()
    try:
        stdout, stderr, status = api.run(["--config-file", str(CONFIG), "--cache-dir", str(CACHE),
                                          str(ROOT / "deepspeed_ext")])
    finally:
        sys.setrecursionlimit(recursion_limit)
        gc.set_threshold(*gc_threshold)
    assert status == 0, f"mypy (config: {CONFIG.name}) found problems:\n{stdout}{stderr}"


def test_every_format_entry_names_what_its_module_has():
    # Formats are imported by name at run time: each entry's module must have the reader (annotated with the
    # source protocol, so mypy checks every reader against it in its own module), the writer and options class
    # it names, and each hook function it names.
    import importlib
    import typing

    from deepspeed_ext.checkpoint.source import CheckpointSource
    for fmt in FORMATS.values():
        module = importlib.import_module(fmt.module)
        assert typing.get_type_hints(module.open_source)["return"] is CheckpointSource, fmt.name
        for hook in (fmt.options, fmt.files_check, fmt.model_check):
            assert hook is None or callable(getattr(module, hook, None)), (fmt.name, hook)
        if fmt.options is not None:
            assert callable(getattr(module, "write", None)), fmt.name
