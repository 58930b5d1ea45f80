"""A Hugging Face checkpoint's files: their names, the map between the model's parameter names and the tensors
the files store (fused experts in pieces), safetensors headers, and the positioned writes into them."""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from deepspeed_ext.checkpoint import serialization
from deepspeed_ext.checkpoint.families import EXPERT, LAYER, ExpertSplit
from deepspeed_ext.checkpoint.fingerprint import FINGERPRINTS_KEY, Fingerprint, Fingerprints
from deepspeed_ext.checkpoint.model_config import safetensors_dtype_code
from deepspeed_ext.checkpoint.quantization import STORAGE_CODES
from deepspeed_ext.checkpoint.source import (
    SourceInfo,
)
from deepspeed_ext.checkpoint.tensor import MASTER_WEIGHTS
from deepspeed_ext.errors import CheckpointError

_T = TypeVar("_T")


CONFIG_FILE = "config.json"


#: ``mtp``: what to do with decoder layers past ``num_hidden_layers`` (None: refuse them).
MTP_CHOICES = (None, "drop", "keep")


#: What ``save_pretrained`` (model, generation config, tokenizer) writes beside the weights and config, copied
#: into a to-hf output from the folder the source sits in (an HF directory, a Trainer checkpoint-N).
COMPANION_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
                   "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "processor_config.json")


GENERATION_CONFIG = "generation_config.json"


INDEX_FILE = "model.safetensors.index.json"


SINGLE_FILE = "model.safetensors"


FILENAME_PATTERN = "model{suffix}.safetensors"


#: The safetensors ``__metadata__`` entry holding the fingerprints of the weights whose first piece is in the file.
METADATA_FINGERPRINTS = f"deepspeed_ext.{FINGERPRINTS_KEY}"


#: The parameter a tied output projection shares (all supported families).
TIED_PAIR = ("lm_head.weight", "model.embed_tokens.weight")


# --------------------------------------------------------------------------- model names <-> file names
@dataclass(frozen=True)
class FileTensor:
    """One tensor of the HF files, and where it lies in a model parameter."""

    name: str  # the name in the files
    param: str  # the model (universal) parameter it is cut from
    shape: tuple[int, ...]
    dtype: torch.dtype
    expert: int | None = None  # cut from param[expert] ...
    piece: int = 0  # ... as the piece-th of `pieces` equal parts along that slice's first axis
    pieces: int = 1

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * self.dtype.itemsize

    def span(self, param_shape: tuple[int, ...]) -> tuple[int, int]:
        """Where this tensor lies in the parameter flattened, ``(start, stop)``: ``param[expert]``'s ``piece``-th
        of ``pieces`` equal parts along its first axis is contiguous."""
        numel = int(torch.Size(self.shape).numel())
        if self.expert is None:
            return 0, numel
        start = self.expert * math.prod(param_shape[1:]) + self.piece * numel
        return start, start + numel


def _pattern(template: str) -> re.Pattern[str]:
    text = re.escape(template).replace(re.escape(LAYER), r"(?P<layer>\d+)")
    return re.compile("^" + text.replace(re.escape(EXPERT), r"(?P<expert>\d+)") + "$")


def _is_rename(split: ExpertSplit) -> bool:
    """A split of one piece without ``{expert}``: the parameter is stored whole under another name."""
    return len(split.pieces) == 1 and EXPERT not in split.pieces[0]


#: In :func:`group_file_names`' pieces: a parameter stored whole under another name.
RENAMED = (-1, 0)


def _split_of(param: str, splits: tuple[ExpertSplit, ...]) -> tuple[ExpertSplit, str] | None:
    """The split that applies to model parameter ``param``, with its layer index."""
    for split in splits:
        match = _pattern(split.param).match(param)
        if match:
            return split, match.groupdict().get("layer") or ""  # a top-level parameter has no layer
    return None


def file_tensors(param: str, shape: tuple[int, ...], dtype: torch.dtype,
                 splits: tuple[ExpertSplit, ...]) -> list[FileTensor]:
    """The file tensors model parameter ``param`` becomes (itself, unless a split says otherwise)."""
    found = _split_of(param, splits)
    if found is None:
        return [FileTensor(param, param, tuple(shape), dtype)]
    split, layer = found
    if _is_rename(split):
        return [FileTensor(split.pieces[0].replace(LAYER, layer), param, tuple(shape), dtype)]
    count = len(split.pieces)
    if len(shape) < 2 or shape[1] % count:
        raise CheckpointError(f"{param}: shape {list(shape)} cannot be cut into {count} expert pieces")
    piece_shape = (shape[1] // count, *shape[2:])
    return [FileTensor(template.replace(LAYER, layer).replace(EXPERT, str(expert)), param, piece_shape, dtype,
                       expert, piece, count)
            for expert in range(shape[0]) for piece, template in enumerate(split.pieces)]


def group_file_names(names: Iterable[str], splits: tuple[ExpertSplit, ...],
                     source: str) -> dict[str, dict[tuple[int, int], str] | None]:
    """Model parameter -> its pieces in the files, ``{(expert, piece): file name}`` (None: stored whole)."""
    patterns = [(split, piece, _pattern(template)) for split in splits for piece, template in enumerate(split.pieces)]
    params: dict[str, dict[tuple[int, int], str] | None] = {}
    for name in names:
        for split, piece, pattern in patterns:
            match = pattern.match(name)
            if match:
                param = split.param.replace(LAYER, match.groupdict().get("layer") or "")
                found = params.setdefault(param, {})
                if found is None or (_is_rename(split) and found):
                    raise CheckpointError(f"{source}: holds {param} under two names")
                found[RENAMED if _is_rename(split) else (int(match.group("expert")), piece)] = name
                break
        else:
            if name in params:
                raise CheckpointError(f"{source}: holds {name} under two names (fused and per expert, or renamed)")
            params[name] = None
    for param, pieces in params.items():
        if pieces is None or RENAMED in pieces:
            continue
        split_of = _split_of(param, splits)
        assert split_of is not None  # its pieces were matched by one of the splits' patterns
        split, layer = split_of
        experts = 1 + max(expert for expert, _ in pieces)
        missing = [(e, p) for e in range(experts) for p in range(len(split.pieces)) if (e, p) not in pieces]
        if missing:
            e, p = missing[0]
            raise CheckpointError(f"{source}: {split.pieces[p].replace(LAYER, layer).replace(EXPERT, str(e))} is "
                                  f"missing ({len(missing)} expert tensors of {param} in all)")
    return params


def release_renames(names: Iterable[str], prefixes: tuple[tuple[str, str], ...], source: str) -> dict[str, str]:
    """``{the release's name: save_pretrained's}`` of the ``names`` a release spells otherwise (a family's
    :attr:`~deepspeed_ext.checkpoint.families.Family.hf_release_prefixes`: the first prefix that starts a name)."""
    names = list(names)
    renamed = {}
    for name in names:
        for release, saved in prefixes:
            if name.startswith(release):
                renamed[name] = saved + name[len(release):]
                break
    both = sorted(set(renamed.values()) & set(names))
    if both:
        raise CheckpointError(f"{source}: holds {both[0]} under two names (the release's and save_pretrained's)")
    return renamed


# --------------------------------------------------------------------------- sink
def safetensors_header(entries: list[FileTensor], metadata: Mapping[str, str], reserve: int = 0, length: int | None = None
            ) -> bytes:
    """A safetensors header: u64 little-endian length, then JSON padded with spaces to 8 bytes, after at least
    ``reserve`` spaces (room for metadata added once the data is written), or to exactly ``length`` bytes."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for entry in entries:
        code = STORAGE_CODES.get(entry.dtype) or safetensors_dtype_code(entry.dtype)
        header[entry.name] = {"dtype": code, "shape": list(entry.shape),
                              "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    if length is not None:
        if len(text) > length:
            raise CheckpointError(f"safetensors header of {len(text)} bytes does not fit its reserved {length}")
        text += b" " * (length - len(text))
    else:
        text += b" " * reserve
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def fingerprints_text(fingerprints: Fingerprints) -> str:
    return json.dumps(fingerprints.to_json(), separators=(",", ":"))


def fingerprints_room(names: Iterable[str]) -> int:
    """The most bytes the fingerprints of ``names`` can take in a header (JSON-escaped inside a string): every
    number at its longest repr."""
    widest = Fingerprints()
    for name in names:
        widest.add(name, MASTER_WEIGHTS, Fingerprint(-(10**19), -1.2345678901234567e-308, -1.2345678901234567e-308))
    return len(json.dumps(METADATA_FINGERPRINTS)) + len(json.dumps(fingerprints_text(widest))) + 2


def companion_files(info: SourceInfo) -> list[Path]:
    """The generation config and tokenizer files of the model folder ``info`` was read from: the HF directory
    itself, or the Trainer ``checkpoint-N`` folder holding a DeepSpeed or universal tag."""
    from deepspeed_ext.checkpoint.locate import HUGGINGFACE, trainer_checkpoint_of
    folder = info.path if info.format == HUGGINGFACE else trainer_checkpoint_of(info.path)
    if folder is None:
        return []
    return [folder / name for name in COMPANION_FILES if (folder / name).is_file()]


def tokenizer_files(directory: Path) -> list[Path]:
    """The tokenizer files (and generation config) in ``directory`` (``to-hf --tokenizer``); one line naming it
    when it has none."""
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such directory (--tokenizer)")
    found = [directory / name for name in COMPANION_FILES if (directory / name).is_file()]
    if not any(path.name != GENERATION_CONFIG for path in found):
        raise CheckpointError(f"{directory}: no tokenizer files (--tokenizer expects what save_pretrained writes: "
                              "tokenizer.json, tokenizer_config.json, ...)")
    return found


#: safetensors' dtype codes read by :func:`read_stored_part` (others go through safetensors itself).
_READ_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu}


@dataclass(frozen=True)
class StoredSpan:
    """Where a tensor's bytes lie in its safetensors file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # from the start of the file


def stored_spans(path: Path) -> dict[str, StoredSpan]:
    """The spans of the tensors of a safetensors file whose header safetensors has already read and checked, for
    the dtypes :func:`read_stored_part` reads; an entry whose offsets disagree with its shape is left out (read
    through safetensors, which says what is wrong)."""
    with open(path, "rb") as handle:
        (length, ) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
        size = handle.seek(0, 2)
    spans = {}
    for name, entry in header.items():
        dtype = _READ_DTYPES.get(str(entry.get("dtype"))) if isinstance(entry, dict) else None
        if dtype is None or name == "__metadata__":
            continue
        shape, (begin, end) = tuple(entry["shape"]), entry["data_offsets"]
        start = 8 + length + begin
        if end - begin == math.prod(shape) * dtype.itemsize and start + (end - begin) <= size:
            spans[name] = StoredSpan(dtype, shape, start)
    return spans


def read_stored_part(path: Path, span: StoredSpan, index: tuple[Any, ...]) -> torch.Tensor | None:
    """The part of a stored tensor that ``index`` selects, read with one ``pread`` into a fresh tensor, where it is
    one run of the file: whole (``()``), or leading integers and then one slice (rows, or an expert's rows); None
    otherwise. safetensors maps the whole file for each read, which cost more than reading the bytes here."""
    shape = span.shape
    ints = 0
    while ints < len(index) and isinstance(index[ints], int):
        ints += 1
    rest = index[ints:]
    if len(rest) > 1 or ints > len(shape) or (rest and (ints == len(shape) or not isinstance(rest[0], slice)
                                                          or rest[0].step not in (None, 1))):
        return None
    element = 0
    for dim, at in enumerate(index[:ints]):
        if not -shape[dim] <= at < shape[dim]:
            return None
        element = element * shape[dim] + at % shape[dim]
    first, last = (rest[0].indices(shape[ints])[:2] if rest else (0, shape[ints] if ints < len(shape) else 1))
    last = max(first, last)
    inner = math.prod(shape[ints + 1:])
    out_shape = ((last - first, *shape[ints + 1:]) if rest else tuple(shape[ints:]))
    element = (element * (shape[ints] if ints < len(shape) else 1) + first) * inner
    return _read_into(path, span, element, torch.empty(out_shape, dtype=span.dtype))


def read_stored_range(path: Path, span: StoredSpan, low: int, high: int) -> torch.Tensor:
    """Elements ``[low, high)`` of a stored tensor flattened, read with one ``pread``."""
    return _read_into(path, span, low, torch.empty(max(0, high - low), dtype=span.dtype))


def _read_into(path: Path, span: StoredSpan, element: int, out: torch.Tensor) -> torch.Tensor:
    """``out`` filled from the file, from element ``element`` of the tensor of ``span`` on."""
    nbytes = out.numel() * span.dtype.itemsize
    if not nbytes:
        return out
    if element < 0 or element * span.dtype.itemsize + nbytes > math.prod(span.shape) * span.dtype.itemsize:
        raise CheckpointError(f"{path}: elements {element}..{element + out.numel()} are past a tensor of shape "
                              f"{list(span.shape)}")
    buffer = memoryview(out.reshape(-1).view(torch.uint8).numpy().data)
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < nbytes:
            got = os.preadv(fd, [buffer[done:]], span.start + element * span.dtype.itemsize + done)
            if got <= 0:
                raise CheckpointError(f"{path}: ends inside tensor data (truncated?)")
            done += got
    finally:
        os.close(fd)
    return out


def write_at(fd: int, data: Any, offset: int, path: Path) -> None:
    """All of ``data`` at ``offset`` of ``path`` (pwrite may write less than asked)."""
    try:
        serialization.pwrite_all(fd, data, offset)
    except OSError as exc:
        raise write_error(path, exc) from exc


def write_error(path: Path, exc: OSError) -> CheckpointError:
    return CheckpointError(f"{path}: cannot write: {exc.strerror or exc} (disk full or file size limit?)")
