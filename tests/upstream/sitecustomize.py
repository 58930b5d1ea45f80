"""DeepSpeed's own test suite with its ``ds_to_universal`` conversion step done by deepspeed-ext
(``scripts/upstream-uc-tests.sh``), in every process it starts.

DeepSpeed's universal-checkpoint tests convert with ``deepspeed.checkpoint.ds_to_universal.main(args)`` (imported
as ``convert_to_universal``), most of them inside the ranks their ``DistributedTest`` spawns, then check the files
and load them with DeepSpeed's loader. With this directory on ``PYTHONPATH`` and ``DSX_AS_DS_TO_UNIVERSAL=1``, each
interpreter (the ranks included: they inherit the environment) puts deepspeed-ext's converter in that function's
place as the module loads, with its arguments (``input_folder``: the tag directory; ``output_folder``: the
universal directory, ``latest_universal`` beside it). ``DSX_CONVERSIONS_LOG``: a file each conversion appends a
line to, the run's proof that the tests judged deepspeed-ext's output.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

UPSTREAM = "deepspeed.checkpoint.ds_to_universal"


def _to_universal(args: Any) -> None:
    from deepspeed_ext.api import convert
    out = Path(args.output_folder)
    # Upstream's converter writes into an existing directory; ours replaces it whole (an empty one included).
    convert(args.input_folder, out, to="universal", tag_directory=True, overwrite=out.exists())
    log = os.environ.get("DSX_CONVERSIONS_LOG")
    if log:
        with open(log, "a") as handle:
            handle.write(f"{os.getpid()} {args.input_folder} -> {out}\n")


class _ReplaceTheConverter(importlib.abc.MetaPathFinder):
    """Finds upstream's module as usual, and replaces its ``main`` once the module has run."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != UPSTREAM:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            module.main = _to_universal

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("DSX_AS_DS_TO_UNIVERSAL") == "1":
    sys.meta_path.insert(0, _ReplaceTheConverter())
