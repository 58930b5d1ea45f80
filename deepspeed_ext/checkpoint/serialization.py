"""The one place where deepspeed-ext reads and writes ``torch.save`` files.

Every read uses ``weights_only=True`` with an explicit allow-list of the few DeepSpeed classes that
its checkpoint files legitimately contain, so a checkpoint cannot run code when it is opened. Reads are
memory-mapped: a tensor's bytes are paged in only when (and where) they are touched.
"""

from __future__ import annotations

import collections
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from deepspeed_ext.errors import CheckpointError


def _allowed_globals() -> list[Any]:
    """DeepSpeed classes found in optimizer and universal files (plain data classes and an IntEnum)."""
    from deepspeed.checkpoint.universal_checkpoint import SubparamShape
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address, SubparamShape, collections.OrderedDict]


_ALLOWED: list[Any] | None = None


def allowed_globals() -> list[Any]:
    global _ALLOWED
    if _ALLOWED is None:
        _ALLOWED = _allowed_globals()
    return _ALLOWED


def load(path: str | os.PathLike, *, mmap: bool = True) -> Any:
    """Load a ``torch.save`` file safely; errors name the file and the problem."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: refused to unpickle (only tensors and allow-listed DeepSpeed types are "
                              f"loaded): {first_line}") from exc
    except (RuntimeError, zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: cannot read torch file: {first_line}") from exc


def save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` that never leaves a half-written file under the final name."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)
