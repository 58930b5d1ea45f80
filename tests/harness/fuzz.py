"""Fuzz helpers shared by tests/unit/test_fuzz.py and tests/e2e/test_fuzz_e2e.py: damage one file of a copy of
a valid checkpoint, read it as the converters do and check it as ``verify`` does, and accept only damage that is
detected or that belongs to a class no reader can detect, named in :data:`UNDETECTABLE`.

What the readers promise (docs/reliability.md), and so what an example must show:

* Any file: damage that breaks what a reader parses (a torch zip, a safetensors header, JSON, Orbax's metadata
  and data) ends in a deepspeed-ext error naming the checkpoint or the file, never in another exception, from
  the reader and from ``verify`` alike.
* A file a manifest lists (every output of deepspeed-ext) or a commit marker lists (every save through
  deepspeed-ext): any change of its bytes is detected. ``verify`` checks each such file against its recorded
  size and checksum; for a DeepSpeed tag the converters also check its files as they read them
  (``raise_if_damaged``), so the read must fail too.
* Damage that is not detected must leave what a reader returns as it was, or be of a class in
  :data:`UNDETECTABLE`. Anything else fails the example, naming the file, the damage and the class it is not.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st

from deepspeed_ext.api import verify
from deepspeed_ext.checkpoint.commit import COMMIT_FILE, read_marker
from deepspeed_ext.checkpoint.formats import open_checkpoint
from deepspeed_ext.checkpoint.manifest import MANIFEST_FILE
from deepspeed_ext.errors import DeepSpeedExtError

EXAMPLES = int(os.environ.get("DEEPSPEED_EXT_FUZZ_EXAMPLES", "25"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 25,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

#: Keys the readers look up, renamed in place (same length, so offsets in the file stay valid).
KEYS = [b"param", b"exp_avg", b"single_partition_of_fp32_groups", b"param_slice_mappings", b"dtype", b"shape",
        b"data_offsets", b"global_steps", b"mp_world_size", b"base_optimizer_state", b"param_shapes"]

#: The damage no reader can detect, by name: an undetected example passes only as one of these, and only after
#: the harness has checked that it is one. Each is confined to files nothing checksums (no manifest and no commit
#: marker lists them: a Hugging Face directory transformers wrote, or a manifest or marker itself); in a file one
#: lists, every changed byte is detected.
UNDETECTABLE = {
    "unread-bytes": "bytes no reader uses (a field of a manifest or marker nothing reads, a JSON file the readers "
                    "never open): everything read is bit for bit what the intact checkpoint gives",
    "unchecked-tensor-bytes": "a changed byte inside a tensor's data (a flipped low mantissa bit, typically), in a "
                              "file no manifest or marker lists and with no fingerprint recorded for it: nothing "
                              "says what the bytes were",
    "unchecked-metadata-value": "a JSON value (config.json, a safetensors header) turned into another valid one, "
                                "in a file no manifest or marker lists: the new value is as plausible as the old",
}


@st.composite
def damage(draw):
    kind = draw(st.sampled_from(["truncate", "flip", "rename"]))
    return kind, draw(st.integers(0, 10**9)), draw(st.integers(0, 7)), draw(st.sampled_from(KEYS))


#: Orbax's files a reader parses: its metadata (JSON), the OCDBT manifests and the data files.
ORBAX_FILES = ("_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt")


def _readable(path: Path) -> bool:
    return (path.suffix in (".pt", ".safetensors", ".json") or path.name in ORBAX_FILES
            or (path.parent.name == "d" and "ocdbt" in path.parent.parent.name))


@dataclass(frozen=True)
class Hit:
    """The damage done to one file."""

    target: Path  # the damaged file, in the scratch copy
    relative: str  # its path under the checkpoint's root
    kind: str  # truncate, flip or rename
    offset: int | None  # the first byte changed (a truncation: the new length); None if no byte changed

    def __str__(self) -> str:
        return f"{self.kind} at byte {self.offset} of {self.relative}"


def _damage(root: Path, choice: int, spec) -> Hit:
    files = sorted(p for p in root.rglob("*") if p.is_file() and _readable(p))
    target = files[choice % len(files)]
    kind, where, bit, key = spec
    data = bytearray(target.read_bytes())
    offset = None
    if kind == "truncate":
        if where % max(len(data), 1) < len(data):
            offset = where % len(data)
            data = data[:offset]
    elif kind == "flip" and data:
        offset = where % len(data)
        data[offset] ^= 1 << bit
    elif kind == "rename":  # the drawn key, or the next of KEYS the file holds (a key it lacks tests nothing)
        start = KEYS.index(key)
        at = next((at for k in KEYS[start:] + KEYS[:start] if (at := data.find(k)) >= 0), -1)
        if at >= 0:
            offset = at
            data[at] = ord("X")
    target.write_bytes(bytes(data))
    return Hit(target, target.relative_to(root).as_posix(), kind, offset)


def _digest(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        flat = value.detach().contiguous().reshape(-1).view(torch.uint8)
        return str(value.dtype), tuple(value.shape), hashlib.sha1(flat.numpy().tobytes()).hexdigest()
    return repr(value)


def read_everything(path: Path) -> dict[str, Any]:
    """Open ``path`` as the CLI does, load every state of every tensor, then check what a converter checks before
    it publishes (a DeepSpeed tag's files against their checksums). Returns what was read: the model config, the
    step and each state's dtype, shape and bytes (as a digest)."""
    ckpt = open_checkpoint(path)
    read: dict[str, Any] = {"model_config": ckpt.info.model_config, "step": ckpt.info.global_step}
    for tensor in ckpt.tensors():
        for state in tensor.states:
            read[f"{tensor.name} ({state})"] = _digest(tensor.load(state))
    ckpt.raise_if_damaged()
    return read


@dataclass(frozen=True)
class Checksums:
    """Which files of a checkpoint a recorded checksum covers, relative to its root."""

    #: Listed by a manifest: ``verify`` checks every byte.
    manifest: frozenset[str]
    #: Listed by a commit marker: ``verify`` and the converters (as they read) check every byte.
    marker: frozenset[str]

    @classmethod
    def of(cls, root: Path) -> Checksums:
        manifest, marker = set(), set()
        for path in root.rglob(MANIFEST_FILE):
            base = path.parent.relative_to(root)
            manifest |= {(base / name).as_posix() for name in json.loads(path.read_text())["files"]}
        for path in root.rglob(COMMIT_FILE):
            recorded = read_marker(path.parent)
            assert recorded is not None, path
            base = path.parent.relative_to(root)
            marker |= {(base / name).as_posix() for name in recorded.files}
        return cls(frozenset(manifest), frozenset(marker))


#: Per intact checkpoint (its path): what reading it gives, and its checksums.
_intact: dict[Path, tuple[dict[str, Any], Checksums]] = {}


def _reference(pristine: Path) -> tuple[dict[str, Any], Checksums]:
    if pristine not in _intact:
        _intact[pristine] = (read_everything(pristine), Checksums.of(pristine))
    return _intact[pristine]


def _parses(text: bytes) -> bool:
    try:
        json.loads(text)
    except ValueError:  # also a UnicodeDecodeError
        return False
    return True


def _undetectable(pristine: Path, hit: Hit, read: dict[str, Any], reference: dict[str, Any]) -> str | None:
    """The class in :data:`UNDETECTABLE` that undetected damage ``hit`` (to a file nothing checksums) belongs to,
    or None when it belongs to none: then a reader missed damage it promises to find."""
    if read == reference:
        return "unread-bytes"
    assert hit.offset is not None
    if hit.kind == "truncate":  # a file cut short is always visible to what parses it
        return None
    damaged, original = hit.target.read_bytes(), (pristine / hit.relative).read_bytes()
    if hit.target.suffix == ".safetensors":
        header_end = 8 + struct.unpack("<Q", original[:8])[0]
        if hit.offset >= header_end:
            return "unchecked-tensor-bytes"
        return "unchecked-metadata-value" if _parses(damaged[8:header_end]) else None
    if hit.target.suffix == ".json" and _parses(damaged):
        return "unchecked-metadata-value"
    return None


def _named(exc: DeepSpeedExtError, scratch: Path, hit: Hit) -> None:
    assert str(scratch) in str(exc) or hit.target.name in str(exc), (str(hit), exc)


def fuzz(pristine: Path, scratch: Path, choice: int, spec) -> str:
    """Damage one file of a copy of ``pristine`` at ``scratch``, read and verify it; fail unless the outcome is
    allowed. Returns the outcome: ``unchanged`` (the damage changed no byte), ``detected``, or the
    :data:`UNDETECTABLE` class the example was shown to belong to (also recorded as a hypothesis event:
    ``--hypothesis-show-statistics`` counts them)."""
    reference, checksums = _reference(pristine)
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(pristine, scratch)
    hit = _damage(scratch, choice, spec)
    outcome = _outcome(pristine, scratch, hit, reference, checksums)
    event(outcome)
    return outcome


def _outcome(pristine: Path, scratch: Path, hit: Hit, reference: dict[str, Any], checksums: Checksums) -> str:
    if hit.offset is None:
        return "unchanged"
    read: dict[str, Any] | None = None
    try:
        read = read_everything(scratch)
    except DeepSpeedExtError as exc:
        _named(exc, scratch, hit)
    try:
        verified = verify(scratch).ok
    except DeepSpeedExtError as exc:  # e.g. a manifest that no longer parses
        _named(exc, scratch, hit)
        verified = False
    if hit.relative in checksums.marker:
        assert read is None, f"{hit}: the commit marker lists this file, yet the read did not detect the change"
    if hit.relative in checksums.manifest | checksums.marker:
        assert not verified, f"{hit}: a checksum covers this file, yet verify passed it"
    if read is None or not verified:
        return "detected"
    undetectable = _undetectable(pristine, hit, read, reference)
    assert undetectable is not None, (f"{hit}: undetected, and of no class in UNDETECTABLE: what a reader returns "
                                      "changed, and nothing said so")
    return undetectable
