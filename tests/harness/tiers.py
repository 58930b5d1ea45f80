"""The fast tier (``bash scripts/test.sh --fast``: ``-m "not e2e and not full"``, README) and the whole suite.

A unit test run for every model family, layout and dtype is most of the fast tier's time while its first few
cases find most of what the rest would: the fast tier runs a sample of such cases, and the whole suite (CI) runs
every one. :func:`sampled` marks the cases outside the sample ``full``."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import pytest

#: Cases the whole suite runs and the fast tier leaves out.
FULL = pytest.mark.full


def sampled(cases: Sequence[Any], fast: Collection[Any], ids: Callable[[Any], str] | None = None) -> list[Any]:
    """``cases`` as ``pytest.param`` s for ``@pytest.mark.parametrize``, those not in ``fast`` marked ``full``.
    ``fast`` must name cases that exist: a sample that drifted from the cases would quietly test less."""
    missing = [case for case in fast if case not in cases]
    assert not missing, f"the fast tier's sample names cases that do not exist: {missing}"
    return [pytest.param(*(case if isinstance(case, tuple) else (case, )), marks=() if case in fast else FULL,
                         id=ids(case) if ids is not None else None) for case in cases]
