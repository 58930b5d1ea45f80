"""Refusals every rank hears: the agreement points of a multi-rank conversion or restore.

When ranks work side by side (``to-universal --distributed``, a restore in a training job's ``load_checkpoint``)
and one of them refuses (a checkpoint it cannot read, a file it cannot write), the others must not go on to
their next collective and wait there for a rank that gave up. At each agreement point every rank says whether
it failed; if any did, every rank raises the same one-line :class:`RefusedOnEveryRank`, naming the first rank
that failed and its message, and the ranks can still meet to exit together.

Every agreement point is the same collective (``all_gather_object`` of an optional message), so a rank that
fails between two points meets the others at whichever point they wait at, and they all raise there.
Without ``torch.distributed`` initialised, or with one rank, an error is raised as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from deepspeed_ext.errors import CheckpointError, DeepSpeedExtError, first_line

T = TypeVar("T")


class RefusedOnEveryRank(CheckpointError):
    """Raised by every rank together where one or more of them failed (:func:`agree`); the message is the same
    on every rank."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        #: The first rank that failed.
        self.rank = rank


def _distributed() -> Any:
    """``torch.distributed`` where a process group of more than one rank is initialised, else None."""
    import torch.distributed as dist
    return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


def _message(error: BaseException) -> str:
    """One line: our errors say what they are; another exception is named by its type."""
    text = first_line(error)
    return text if isinstance(error, DeepSpeedExtError) else f"{type(error).__name__}: {text}"


def gather(problem: str | None, value: Any = None) -> list[tuple[str | None, Any]]:
    """Collective: every rank's ``(problem, value)``, in rank order (``[(problem, value)]`` without a process
    group of more than one rank). The one exchange behind every agreement point, :func:`agree`'s and the save's
    (``runtime``), which words its own refusal."""
    dist = _distributed()
    if dist is None:
        return [(problem, value)]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (problem, value))
    return gathered


def agree(error: BaseException | None, value: Any = None) -> list[Any]:
    """Collective: every rank says whether it failed (``error``) and hands over ``value``. If any rank failed,
    every rank raises :class:`RefusedOnEveryRank` (a rank's own error as its cause); else returns each rank's
    ``value``, in rank order. Without a process group (or in a group of one): raises ``error`` itself, else
    returns ``[value]``."""
    dist = _distributed()
    if dist is None:
        if error is not None:
            raise error
        return [value]
    if isinstance(error, RefusedOnEveryRank):
        raise error  # every rank raised it at the same point, and no rank waits for this one
    gathered = gather(None if error is None else _message(error), value)
    failed = [(rank, message) for rank, (message, _) in enumerate(gathered) if message is not None]
    if failed:
        rank, message = failed[0]
        others = f" and {len(failed) - 1} other rank(s)" if len(failed) > 1 else ""
        raise RefusedOnEveryRank(f"{message} (refused on rank {rank}{others}; every rank stopped)", rank) from error
    return [value for _, value in gathered]


def on_every_rank(work: Callable[[], T]) -> T:
    """``work()`` on this rank, then an agreement point (:func:`agree`): its result where every rank succeeded;
    :class:`RefusedOnEveryRank` on every rank where any rank raised."""
    try:
        result = work()
    except Exception as exc:  # told to every rank, which all raise it
        agree(exc)
        raise  # not reached: agree raises
    agree(None)
    return result
