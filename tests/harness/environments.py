"""The Python environments the tests use beside this one, and what a test does when one is missing.

scripts/setup.sh builds them all for the suite; a developer may not have run it. So a test that needs a missing
environment skips there, but fails under CI (``CI=true``, as CI services set it): a CI run that quietly tested
less would pass without testing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: MaxText's own model code and the Orbax it restores with (scripts/setup-maxtext.sh).
MAXTEXT_PYTHON = REPO / ".venv-maxtext" / "bin" / "python"


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def unavailable(what: str) -> None:
    """Skip the calling test for want of ``what``, or, under CI, fail it."""
    if in_ci():
        pytest.fail(f"{what}, under CI=true: scripts/setup.sh test builds every environment the suite uses")
    pytest.skip(what)
