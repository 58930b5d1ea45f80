"""The Python environments the tests use beside this one, and what a test does when one is missing.

scripts/setup.sh builds them all for the suite; a developer may not have run it. So a test that needs a missing
environment, or an optional package (an extra), skips there, but fails under CI (``CI=true``, as CI services set
it): a CI run that quietly tested less would pass without testing. tests/conftest.py turns any other skip into a
failure under CI too, but those its PLATFORM_SKIPS allows.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import pytest

REPO = Path(__file__).resolve().parents[2]
#: MaxText's own model code and the Orbax it restores with (scripts/setup-maxtext.sh).
MAXTEXT_PYTHON = REPO / ".venv-maxtext" / "bin" / "python"


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def unavailable(what: str) -> NoReturn:
    """Skip the calling test for want of ``what``, or, under CI, fail it. Called at a test module's top level, it
    skips (or fails the collection of) the whole module."""
    if in_ci():
        pytest.fail(f"{what}, under CI=true: scripts/setup.sh test builds every environment the suite uses",
                    pytrace=False)  # the message says it all
    pytest.skip(what, allow_module_level=True)


def require(module: str, extra: str) -> ModuleType:
    """``import module``, for a test, or a test module at its top, that needs the package ``extra`` brings
    (``pytest.importorskip`` would skip under CI too). Only a module that is not installed is :func:`unavailable`;
    one that is installed and fails to import raises as it does."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = str(exc)
    unavailable(f"{module} is not installed here ({extra}): {missing}")  # outside the except: no chained traceback
