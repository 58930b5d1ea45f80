"""Fuzz helpers shared by tests/unit/test_fuzz.py and tests/e2e/test_fuzz_e2e.py: damage one file of a copy of
a valid checkpoint, read everything, accept only success or deepspeed-ext's own errors."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from deepspeed_ext.checkpoint.formats import open_checkpoint
from deepspeed_ext.errors import DeepSpeedExtError

EXAMPLES = int(os.environ.get("DEEPSPEED_EXT_FUZZ_EXAMPLES", "25"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 25,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

#: Keys the readers look up, renamed in place (same length, so offsets in the file stay valid).
KEYS = [b"param", b"exp_avg", b"single_partition_of_fp32_groups", b"param_slice_mappings", b"dtype", b"shape",
        b"data_offsets", b"global_steps", b"mp_world_size", b"base_optimizer_state", b"param_shapes"]


@st.composite
def damage(draw):
    kind = draw(st.sampled_from(["truncate", "flip", "rename"]))
    return kind, draw(st.integers(0, 10**9)), draw(st.integers(0, 7)), draw(st.sampled_from(KEYS))


#: Orbax's files a reader parses: its metadata (JSON), the OCDBT manifests and the data files.
ORBAX_FILES = ("_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt")


def _readable(path: Path) -> bool:
    return (path.suffix in (".pt", ".safetensors", ".json") or path.name in ORBAX_FILES
            or (path.parent.name == "d" and "ocdbt" in path.parent.parent.name))


def _damage(root: Path, choice: int, spec) -> Path:
    files = sorted(p for p in root.rglob("*") if p.is_file() and _readable(p))
    target = files[choice % len(files)]
    kind, where, bit, key = spec
    data = bytearray(target.read_bytes())
    if kind == "truncate":
        data = data[:where % max(len(data), 1)]
    elif kind == "flip" and data:
        data[where % len(data)] ^= 1 << bit
    elif kind == "rename":
        at = data.find(key)
        if at >= 0:
            data[at] = ord("X")
    target.write_bytes(bytes(data))
    return target


def read_everything(path: Path) -> None:
    ckpt = open_checkpoint(path)
    for tensor in ckpt.tensors():
        for state in tensor.states:
            tensor.load(state)


def fuzz(pristine: Path, scratch: Path, choice: int, spec) -> None:
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(pristine, scratch)
    target = _damage(scratch, choice, spec)
    try:
        read_everything(scratch)
    except DeepSpeedExtError as exc:
        assert str(scratch) in str(exc) or target.name in str(exc), (spec, target, exc)
