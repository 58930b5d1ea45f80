"""A pytest plugin for DeepSpeed's own test suite: its ``ds_to_universal`` conversion step done by deepspeed-ext.

DeepSpeed's universal-checkpoint tests convert with ``deepspeed.checkpoint.ds_to_universal.main(args)`` (imported
as ``convert_to_universal``) and then check the files and load them with DeepSpeed's loader. Loaded with ``-p``
before the tests are collected, this plugin puts deepspeed-ext's converter in that function's place, with its
arguments (``input_folder``: the tag directory; ``output_folder``: the universal directory, ``latest_universal``
beside it), so the same tests judge deepspeed-ext's output. ``scripts/upstream-uc-tests.sh`` runs them both ways.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def _to_universal(args: Any) -> None:
    from deepspeed_ext.api import convert
    out = Path(args.output_folder)
    # Upstream's converter writes into an existing directory; ours replaces it whole (an empty one included).
    convert(args.input_folder, out, to="universal", tag_directory=True, overwrite=out.exists())
    log = os.environ.get("DSX_CONVERSIONS_LOG")
    if log:  # which conversions deepspeed-ext did: the run's proof that the tests judged its output
        with open(log, "a") as handle:
            handle.write(f"{args.input_folder} -> {out}\n")


def pytest_configure(config: Any) -> None:
    import deepspeed.checkpoint.ds_to_universal as upstream
    upstream.main = _to_universal
