"""Error types. Every message is one line that names the file (or parameter) and the problem."""

from __future__ import annotations


class DeepSpeedExtError(Exception):
    """Base class of every error deepspeed-ext raises on purpose."""


class CheckpointError(DeepSpeedExtError):
    """A checkpoint on disk is missing, malformed or inconsistent."""


class DamagedFilesError(CheckpointError):
    """Files of a checkpoint fail their checksums (a commit marker's, or their zip records' CRC-32s): damaged, or
    never completely written."""


class MissingConfigError(CheckpointError):
    """A checkpoint that needs a model config (HF weights, a MaxText checkpoint) has none: pass --config."""


class MissingMetadataError(CheckpointError):
    """A checkpoint lacks the tensor-parallel metadata needed to merge its slices."""


class UnsupportedGeometryError(DeepSpeedExtError):
    """A parallel layout DeepSpeed itself cannot train or restore; raised before any work starts."""


class LayoutError(DeepSpeedExtError):
    """A tensor-parallel layout is inconsistent with the tensor it describes."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (library errors can run to many lines), else its type."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class MissingExtraError(DeepSpeedExtError):
    """A command needs a library the base install leaves out; the message names the pip command that adds it."""
