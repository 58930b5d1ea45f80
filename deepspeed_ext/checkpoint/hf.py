"""Hugging Face checkpoints (sharded safetensors): the sink behind ``to-hf``, the source behind ``from-hf``.

Layout written (what ``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads)::

    OUT/config.json                          the model's HF config (dtype = the weights' dtype)
    OUT/model-0000K-of-0000N.safetensors     the weights, cut at --max-shard-size (one file: model.safetensors)
    OUT/model.safetensors.index.json         {"metadata": {total_parameters, total_size}, "weight_map": ...}

Names: HF names are the model's parameter names, which are the universal names, except where a family
says transformers' files store a fused parameter in pieces (:class:`~deepspeed_ext.checkpoint.families.
ExpertSplit`: Qwen3-MoE's experts one by one). A tied output projection is left out, as
``save_pretrained`` does.

Streaming: the shard plan (names, shapes, dtypes, offsets) is known before any data is read, so every
shard file gets its safetensors header up front and each tensor is written at its offset as the source
produces it, once. The safetensors library serialises only whole in-memory dictionaries, which would hold
a shard (5 GB by default) in memory; the format itself is a length-prefixed JSON header followed by raw
little-endian bytes (https://github.com/huggingface/safetensors#format), and every file written here is
read back by ``safetensors.safe_open`` in the tests. Reading uses ``safe_open`` (memory-mapped, lazy).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, TypeVar

import torch

from deepspeed_ext.checkpoint import durable, output, serialization
from deepspeed_ext.checkpoint.fingerprint import FINGERPRINTS_KEY, Fingerprint, Fingerprints
from deepspeed_ext.checkpoint.manifest import ManifestRecorder
from deepspeed_ext.checkpoint.families import EXPERT, LAYER, ExpertSplit, hf_expert_splits
from deepspeed_ext.checkpoint.source import (CheckpointSource, OpenOptions, SourceInfo, WriteOptions, finite_check,
                                             protected_paths, record_check, required_model_config)
from deepspeed_ext.checkpoint.model_config import (ConfigFit, output_dtype, safetensors_dtype_code,
                                                   torch_dtype)
from deepspeed_ext.checkpoint.quantization import STORAGE_CODES
from deepspeed_ext.checkpoint.tensor import BLOCK_ELEMENTS, MASTER_WEIGHTS, LogicalTensor
from deepspeed_ext.errors import CheckpointError, MissingConfigError
from deepspeed_ext.module_inject.layout import TPLayout

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
            return split, match.group("layer")
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
                param = split.param.replace(LAYER, match.group("layer"))
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


# --------------------------------------------------------------------------- sink
def _header(entries: list[FileTensor], metadata: Mapping[str, str], reserve: int = 0, length: int | None = None
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


def _fingerprints_text(fingerprints: Fingerprints) -> str:
    return json.dumps(fingerprints.to_json(), separators=(",", ":"))


def _fingerprints_room(names: Iterable[str]) -> int:
    """The most bytes the fingerprints of ``names`` can take in a header (JSON-escaped inside a string): every
    number at its longest repr."""
    widest = Fingerprints()
    for name in names:
        widest.add(name, MASTER_WEIGHTS, Fingerprint(-(10**19), -1.2345678901234567e-308, -1.2345678901234567e-308))
    return len(json.dumps(METADATA_FINGERPRINTS)) + len(json.dumps(_fingerprints_text(widest))) + 2


@dataclass(frozen=True)
class HFOptions(WriteOptions):
    """``dtype``: of the weights written (``source``: the dtype the source model had); ``max_shard_size``: the
    largest safetensors file (bytes, or "5GB"); ``tokenizer``: a directory whose tokenizer files (and generation
    config) to add, for a source folder that has none."""

    dtype: str = "source"
    max_shard_size: int | str = "5GB"
    tokenizer: str | Path | None = None
    #: ``fp8`` (block FP8, tiles of ``fp8_block``) or ``mxfp4`` (gpt-oss's experts): write quantized weights.
    quantize: str | None = None
    fp8_block: tuple[int, int] = (128, 128)
    #: ``fp8``: also quantize weights that are not whole tiles, with partial tiles at the edges (DeepSeek-V3's
    #: release does; transformers 5.22 does not read those right, so by default they stay unquantized).
    fp8_edge_tiles: bool = False
    #: An HF directory (a multimodal or DeepSeek-V3 release) whose layout to write into: its naming, its config,
    #: and the tensors the source model lacks (a vision tower, a multi-token-prediction layer), copied.
    like: str | Path | None = None


def write(source: CheckpointSource, out: str | Path, options: HFOptions = HFOptions()) -> Path:
    """Write ``source``'s parameters (full tensors, HF/universal names) as an HF checkpoint at ``out``.

    Each tensor's master weights (``fp32`` state) are cast to ``options.dtype`` and written once, straight
    into its shard. The parameter names and shapes are checked against transformers' model for the source's
    model config before anything is written, so the output loads with no missing or unexpected keys.
    """
    from huggingface_hub import split_state_dict_into_shards_factory

    model_config = required_model_config(source.info)
    label, dtype = str(source.info.given), options.dtype
    like = _like_source(source, options)
    companions = {path.name: path for path in companion_files(source.info)}
    if like is not None:
        companions.update((path.name, path) for path in companion_files(like.info))
    if options.tokenizer is not None:  # files given explicitly win over the source folder's
        companions.update((path.name, path) for path in tokenizer_files(Path(options.tokenizer)))
    given = out
    out = output.prepare(out, protected_paths(source, options), overwrite=options.overwrite)
    finite = finite_check(source, options)
    recorded = record_check(source.info)
    stream = source.tensors()
    for check in (finite, recorded):
        stream = check.stream(stream) if check is not None else stream
    tensors = {tensor.name: tensor for tensor in stream}
    tied = bool(model_config.get("tie_word_embeddings", False))
    dropped_tied = tied and all(name in tensors for name in TIED_PAIR)
    params = [tensor for name, tensor in tensors.items() if not (dropped_tied and name == TIED_PAIR[0])]
    if not params:
        raise CheckpointError(f"{label}: no parameters to write")
    out_dtypes = {t.name: output_dtype(dtype, t.dtype) for t in params}
    weights_dtype = max(out_dtypes.values(), key=list(out_dtypes.values()).count)
    fit = ConfigFit(model_config, {t.name: tuple(t.shape) for t in params}, label, weights_dtype)
    params = list(fit.stream(params))
    tensors = {**tensors, **{t.name: t for t in params}}
    with fit.first():
        splits = hf_expert_splits(model_config.get("model_type"))
        pieces: dict[str, list[FileTensor | QuantizedPiece]] = {
            t.name: list(file_tensors(t.name, tuple(t.shape), out_dtypes[t.name], splits)) for t in params}
        if like is not None:
            params += _like_layout(like, params, pieces, dtype, label)
        quantized = None
        if options.quantize is not None:
            # The release's own tensors the model lacks (its MTP layer) are written quantized where it had them so.
            stored_quantized = set() if like is None else {
                name for name, stored in like.set_aside.items() if stored in like._quantized}
            quantized = _quantize_plan(options, model_config, pieces, {t.name: tuple(t.shape) for t in params},
                                       label, fit, stored_quantized)
        plan = {entry.name: entry for entries in pieces.values() for piece in entries
                for entry in _stored_entries(piece)}
        split = split_state_dict_into_shards_factory(plan, get_storage_size=lambda entry: entry.nbytes,
                                                     filename_pattern=FILENAME_PATTERN,
                                                     max_shard_size=options.max_shard_size)
        if dropped_tied:
            _check_tied(tensors, label)
        with output.staged(out) as partial:
            _write_shards(partial, split.filename_to_tensors, plan, params, pieces, options.progress)
            if finite is not None:
                finite.raise_if_any()
            if recorded is not None:
                recorded.raise_if_wrong()
            source.raise_if_damaged()
            facts = fit.result()
            if like is not None:
                _write_config(partial / CONFIG_FILE, like.raw_config, quantized)
            elif quantized is not None:
                _write_config(partial / CONFIG_FILE, json.loads(facts.config_json), quantized)
            else:
                durable.replace_file(partial / CONFIG_FILE, facts.config_json)
            for name, companion in companions.items():
                shutil.copyfile(companion, partial / name)
            if GENERATION_CONFIG not in companions and facts.generation_config_json is not None:
                durable.replace_file(partial / GENERATION_CONFIG, facts.generation_config_json)
            # The index comes after every shard: without it a multi-shard output does not load.
            if split.is_sharded:
                index = {"metadata": {"total_parameters": sum(t.layout.numel for t in params),
                                      "total_size": split.metadata["total_size"]},
                         "weight_map": dict(sorted(split.tensor_to_filename.items()))}
                durable.replace_file(partial / INDEX_FILE, json.dumps(index, indent=2) + "\n")
            ManifestRecorder(partial).write()
    return Path(given)


# --------------------------------------------------------------------------- quantized and release layouts
@dataclass(frozen=True)
class QuantizedPiece:
    """A weight written quantized: the values it is cut from (``piece``) and the two tensors stored for them."""

    piece: FileTensor  # the values (their span in the parameter; name: the dequantized tensor's)
    data: FileTensor  # packed values
    scales: FileTensor
    method: str
    block: tuple[int, int]


def _stored_entries(piece: FileTensor | QuantizedPiece) -> tuple[FileTensor, ...]:
    return (piece.data, piece.scales) if isinstance(piece, QuantizedPiece) else (piece, )


def _quantize_plan(options: HFOptions, model_config: Mapping[str, Any],
                   pieces: dict[str, list[FileTensor | QuantizedPiece]], shapes: Mapping[str, tuple[int, ...]],
                   label: str, fit: ConfigFit, stored_quantized: set[str]) -> dict[str, Any]:
    """Replace the pieces written quantized by :class:`QuantizedPiece`; the ``quantization_config`` to write.
    ``stored_quantized``: tensors outside the model (copied from a release) to quantize as it had them."""
    from deepspeed_ext.checkpoint import quantization as q
    if options.quantize == q.FP8:
        block = tuple(options.fp8_block)
        if len(block) != 2 or not all(isinstance(v, int) and v > 0 for v in block):
            raise CheckpointError(f"--fp8-block must be two positive integers ROWSxCOLS, not {options.fp8_block!r}")
        bm, bn = int(block[0]), int(block[1])
        from deepspeed_ext.checkpoint.model_config import linear_weights
        linear = linear_weights(fit.config())
        skipped: set[str] = set()
        for param, entries in pieces.items():
            for i, entry in enumerate(entries):
                if not isinstance(entry, FileTensor):
                    continue
                is_linear = (param in linear or param in stored_quantized
                             or (entry.expert is not None and entry.name.endswith(".weight")))
                if not is_linear or param == TIED_PAIR[0]:
                    continue
                if len(entry.shape) != 2 or not (options.fp8_edge_tiles or q.fp8_quantizable(entry.shape, (bm, bn))):
                    skipped.add(entry.name.rsplit(".", 1)[0])
                    continue
                grid = (-(-entry.shape[0] // bm), -(-entry.shape[1] // bn))
                entries[i] = QuantizedPiece(entry, FileTensor(entry.name, param, entry.shape, q.FP8_DTYPE),
                                            FileTensor(entry.name + q.FP8_SCALE_SUFFIX, param, grid, torch.float32),
                                            q.FP8, (bm, bn))
        not_converted = sorted({"lm_head", *skipped})
        return {"quant_method": q.FP8, "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [bm, bn], "modules_to_not_convert": not_converted}
    if options.quantize == q.MXFP4:
        if model_config.get("model_type") != "gpt_oss":
            raise CheckpointError(f"{label}: --quantize mxfp4 writes gpt-oss's experts as its release does; this is a "
                                  f"{model_config.get('model_type')!r} model (use --quantize fp8)")
        for param, entries in pieces.items():
            if not re.fullmatch(r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)", param):
                continue
            (entry, ) = entries
            assert isinstance(entry, FileTensor)
            *lead, k, n = shapes[param]
            if k % q.MX_BLOCK:
                raise CheckpointError(f"{param}: {k} input features are not whole MXFP4 blocks of {q.MX_BLOCK}")
            stem = entry.name
            entries[0] = QuantizedPiece(
                entry, FileTensor(stem + q.MX_BLOCKS_SUFFIX, param, (*lead, n, k // q.MX_BLOCK, q.MX_BLOCK // 2),
                                  torch.uint8),
                FileTensor(stem + q.MX_SCALES_SUFFIX, param, (*lead, n, k // q.MX_BLOCK), torch.uint8),
                q.MXFP4, (1, q.MX_BLOCK))
        return {"quant_method": q.MXFP4, "modules_to_not_convert": list(q.GPT_OSS_NOT_CONVERTED)}
    raise CheckpointError(f"--quantize must be one of {', '.join(q.METHODS)}, not {options.quantize!r}")


def _like_source(source: CheckpointSource, options: HFOptions) -> HFCheckpoint | None:
    """The release whose layout to write into: ``like``, or an HF source that keeps its set-aside tensors."""
    if options.like is not None:
        like = Path(options.like)
        if not (like / CONFIG_FILE).is_file():
            raise CheckpointError(f"{like}: no {CONFIG_FILE} (--like expects the HF directory of the original "
                                  "release)")
        return HFCheckpoint(like, mtp="keep")
    if isinstance(source, HFCheckpoint) and source.kept:
        return source
    return None


def _like_layout(like: HFCheckpoint, params: list[LogicalTensor],
                 pieces: dict[str, list[FileTensor | QuantizedPiece]], dtype: str, label: str) -> list[LogicalTensor]:
    """Name the pieces as ``like`` stores its text model, check they are the tensors it has, and add its tensors
    the model lacks (read from it, in their own dtype unless ``dtype`` says otherwise)."""
    from deepspeed_ext.checkpoint.model_config import shapes_mismatch
    detail = shapes_mismatch(like.shapes, {t.name: tuple(t.shape) for t in params}, "the release has")
    if detail is not None:
        raise CheckpointError(f"{like.path}: not the model of {label} (--like): the source's parameters against "
                              f"the release's: {detail}")
    if like.multimodal is not None:
        for entries in pieces.values():
            for i, entry in enumerate(entries):
                assert isinstance(entry, FileTensor)
                entries[i] = FileTensor(like.multimodal.stored_name(entry.name), entry.param, entry.shape, entry.dtype,
                                        entry.expert, entry.piece, entry.pieces)
    extra_tensors = []
    for name in like.set_aside:
        shape, code = like._headers[name]
        tensor_dtype = output_dtype(dtype, torch_dtype(code))
        extra_tensors.append(LogicalTensor(name=name, shape=shape, layout=TPLayout.replicated(shape, 1),
                                           states=(MASTER_WEIGHTS, ), loader=_set_aside_loader(like, name),
                                           dtype=tensor_dtype))
        pieces[name] = [FileTensor(name, name, shape, tensor_dtype)]
    return extra_tensors


def _set_aside_loader(like: HFCheckpoint, name: str) -> Callable[[str], torch.Tensor]:
    return lambda state: like._read(name)


def _write_config(path: Path, config: Mapping[str, Any], quantized: Mapping[str, Any] | None) -> None:
    """``config`` (the release's own, or what ``save_pretrained`` wrote) with the ``quantization_config`` of the
    weights as written, or none."""
    values = {key: value for key, value in config.items() if key != "quantization_config"}
    if quantized is not None:
        values["quantization_config"] = dict(quantized)
    durable.replace_file(path, json.dumps(values, indent=2, sort_keys=True) + "\n")


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


def _write_shards(directory: Path, shards: Mapping[str, list[str]], plan: Mapping[str, FileTensor],
                  params: list[LogicalTensor], pieces: Mapping[str, list[FileTensor | QuantizedPiece]],
                  progress: bool) -> None:
    """Create every shard with its header, then write each parameter's pieces at their offsets, in stream order.

    Positional writes run on writer threads while the next parameter is read and cast. The fingerprints of the
    weights as written go into the ``__metadata__`` of the file holding each one's first piece: the headers are
    written with room for them and rewritten, same length, once the data is in."""
    from tqdm import tqdm
    bar = tqdm(total=sum(entry.nbytes for entry in plan.values()), desc="to-hf", unit="B", unit_scale=True,
               disable=not progress)
    files: dict[str, int] = {}
    where: dict[str, tuple[str, int]] = {}  # file tensor -> (shard, absolute offset)
    # A parameter's fingerprint goes with its first piece (a quantized one's: with its packed data).
    home = {_stored_entries(pieces[t.name][0])[0].name: t.name for t in params}
    recorded: dict[str, list[str]] = {filename: [home[name] for name in names if name in home]
                                      for filename, names in shards.items()}
    headers: dict[str, int] = {}
    # Appended by the writer threads, in the order they finish: added up in file order below, so the fingerprint
    # (float sums) and with it the header's bytes are the same on every run.
    sums: list[tuple[str, str, int, tuple[int, float, float]]] = []
    try:
        for filename, names in shards.items():
            entries = [plan[name] for name in names]
            header = _header(entries, {"format": "pt"}, reserve=_fingerprints_room(recorded[filename]))
            headers[filename] = len(header) - 8
            files[filename] = fd = os.open(directory / filename, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            _write_at(fd, header, 0, directory / filename)
            offset = len(header)
            for stored in entries:
                where[stored.name] = (filename, offset)
                offset += stored.nbytes
            try:
                os.ftruncate(fd, offset)  # the file's final size, so the tensors can be written in any order
            except OSError as exc:
                raise _write_error(directory / filename, exc) from exc
        with serialization.BackgroundWriter() as writer:
            for tensor in params:
                # A source that reads ranges streams each piece in blocks (read, merged, cast here, written on a
                # writer thread); the others load the whole tensor once.
                full = None if tensor.range_loader is not None else tensor.load_tensor(MASTER_WEIGHTS).reshape(-1)
                for entry in pieces[tensor.name]:
                    if isinstance(entry, QuantizedPiece):
                        start, stop = entry.piece.span(tuple(tensor.shape))
                        values = full[start:stop] if full is not None else torch.cat(
                            list(tensor.blocks(MASTER_WEIGHTS, start, stop)))
                        at = {stored.name: (files[where[stored.name][0]], where[stored.name][1],
                                            directory / where[stored.name][0]) for stored in _stored_entries(entry)}
                        writer.submit(_write_quantized, entry, values, at, tensor.name, sums)
                        bar.update(entry.data.nbytes + entry.scales.nbytes)
                        continue
                    start, stop = entry.span(tuple(tensor.shape))
                    filename, offset = where[entry.name]
                    blocks = [full[start:stop]] if full is not None else tensor.blocks(MASTER_WEIGHTS, start, stop)
                    for block in blocks:
                        data = block.to(entry.dtype).contiguous()
                        if full is None and data.data_ptr() == block.data_ptr():
                            # Still the source's mapped pages (no cast was needed): the writer gets a copy, so
                            # the reader can release them from RSS once it reads on.
                            data = data.clone()
                        writer.submit(_write_piece, files[filename], data, offset, directory / filename, tensor.name,
                                      sums)
                        offset += data.numel() * data.element_size()
                        bar.update(data.numel() * data.element_size())
                del full
        totals: dict[str, list[float]] = {}
        for name, _, _, piece in sorted(sums, key=lambda item: item[:3]):
            running = totals.setdefault(name, [0, 0.0, 0.0])
            for i, value in enumerate(piece):
                running[i] += value
        for filename, names in shards.items():
            fingerprints = Fingerprints()
            for name in recorded[filename]:
                numel, total, total_sq = totals[name]
                fingerprints.add(name, MASTER_WEIGHTS, Fingerprint(int(numel), total, total_sq))
            metadata = {"format": "pt", METADATA_FINGERPRINTS: _fingerprints_text(fingerprints)}
            header = _header([plan[name] for name in names], metadata, length=headers[filename])
            _write_at(files[filename], header, 0, directory / filename)
    finally:
        for fd in files.values():
            os.close(fd)
        bar.close()


def _write_piece(fd: int, data: torch.Tensor, offset: int, path: Path, name: str,
                 sums: list[tuple[str, str, int, tuple[int, float, float]]]) -> None:
    """One piece of a weight at its offset, and its share of the weight's fingerprint (on a writer thread)."""
    from deepspeed_ext.checkpoint.fingerprint import partial_sums
    sums.append((name, path.name, offset, partial_sums(data)))
    _write_at(fd, data.reshape(-1).view(torch.uint8).numpy().data, offset, path)


def _write_quantized(entry: QuantizedPiece, values: torch.Tensor, at: Mapping[str, tuple[int, int, Path]], name: str,
                     sums: list[tuple[str, str, int, tuple[int, float, float]]]) -> None:
    """A weight quantized and written (on a writer thread), a block of rows at a time; its fingerprint is of the
    values a reader dequantizes, which is what the file holds."""
    from deepspeed_ext.checkpoint import quantization as q
    from deepspeed_ext.checkpoint.fingerprint import partial_sums
    data_fd, data_offset, data_path = at[entry.data.name]
    scale_fd, scale_offset, scale_path = at[entry.scales.name]
    if entry.method == q.FP8:
        bm, bn = entry.block
        rows, cols = math.prod(entry.piece.shape[:-1]), entry.piece.shape[-1]
        values = values.reshape(rows, cols)
        step = bm * max(1, BLOCK_ELEMENTS // (bm * cols))  # whole tile rows, as many as a streamed block
        for first in range(0, rows, step):
            chunk = values[first:first + step]
            packed, scales = q.quantize_fp8(chunk, (bm, bn))
            sums.append((name, data_path.name, data_offset + first * cols,
                         partial_sums(q.fp8_dequantize(packed, scales, (bm, bn)))))
            _write_at(data_fd, packed.view(torch.uint8).reshape(-1).numpy().data, data_offset + first * cols,
                      data_path)
            _write_at(scale_fd, scales.reshape(-1).view(torch.uint8).numpy().data,
                      scale_offset + (first // bm) * scales.shape[1] * 4, scale_path)
        return
    *lead, k, n = entry.piece.shape
    values = values.reshape(-1, k, n)
    for expert in range(values.shape[0]):
        blocks, scales = q.quantize_mxfp4(values[expert])
        offset = data_offset + expert * blocks.numel()
        sums.append((name, data_path.name, offset, partial_sums(q.mxfp4_dequantize(blocks, scales).contiguous())))
        _write_at(data_fd, blocks.reshape(-1).numpy().data, offset, data_path)
        _write_at(scale_fd, scales.reshape(-1).numpy().data, scale_offset + expert * scales.numel(), scale_path)


def _write_at(fd: int, data: Any, offset: int, path: Path) -> None:
    """All of ``data`` at ``offset`` of ``path`` (pwrite may write less than asked)."""
    try:
        serialization.pwrite_all(fd, data, offset)
    except OSError as exc:
        raise _write_error(path, exc) from exc


def _write_error(path: Path, exc: OSError) -> CheckpointError:
    return CheckpointError(f"{path}: cannot write: {exc.strerror or exc} (disk full or file size limit?)")


def _check_tied(tensors: Mapping[str, LogicalTensor], source: str) -> None:
    head, embedding = (tensors[name] for name in TIED_PAIR)
    same = head.shape == embedding.shape and all(
        torch.equal(a, b) for a, b in zip(head.blocks(MASTER_WEIGHTS), embedding.blocks(MASTER_WEIGHTS)))
    if not same:
        raise CheckpointError(f"{source}: the config ties {TIED_PAIR[0]} to {TIED_PAIR[1]}, but they differ; "
                              "fix tie_word_embeddings in the config")


# --------------------------------------------------------------------------- source
def parameter_problem(source: CheckpointSource) -> str | None:
    """``verify``'s model check (the format hook): how the parameters fail to fit transformers' model for the
    checkpoint's config, or None."""
    from deepspeed_ext.checkpoint.model_config import config_facts
    assert source.info.model_config is not None
    shapes = {name: layout.shape for name, layout in source.info.layouts.items()}
    return config_facts(source.info.model_config, None, str(source.info.path)).mismatch(shapes)


def open_source(path: Path, options: OpenOptions) -> CheckpointSource:
    """The format registry's reader (:mod:`deepspeed_ext.checkpoint.formats`)."""
    return HFCheckpoint(path, dtype=options.dtype, model_config=options.model_config, mtp=options.mtp)


def _layer_index(name: str) -> int | None:
    """The decoder layer a tensor belongs to (``model.layers.<i>.*``), or None."""
    match = _LAYER_NAME.match(name)
    return int(match.group(1)) if match else None


_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")


class HFCheckpoint:
    """An HF model directory (``config.json`` + safetensors) as a stream of full parameters.

    Files are opened with ``safe_open`` (memory-mapped); a tensor is read when a sink asks for it, in
    the file's dtype unless ``dtype`` says otherwise. No transformers model is built. There is no
    optimizer state: a universal checkpoint written from here starts a fresh optimizer at step 0.

    Releases are read as transformers reads them: block-FP8 and MXFP4 weights are dequantized
    (:mod:`~deepspeed_ext.checkpoint.quantization`; ``source`` dtype: what transformers dequantizes them to) and
    the config loses its ``quantization_config``; a multimodal checkpoint is its text model
    (:mod:`~deepspeed_ext.checkpoint.multimodal`). Tensors that are not the model's (a vision tower, DeepSeek-V3's
    multi-token-prediction layer with ``mtp="drop"`` or ``"keep"``) are set aside (:attr:`set_aside`).
    """

    def __init__(self, path: str | Path, dtype: str = "source", model_config: Mapping[str, Any] | None = None,
                 mtp: str | None = None):
        """``model_config``: the HF config to use instead of the directory's ``config.json`` (``--config``).
        ``mtp``: what to do with decoder layers past ``num_hidden_layers`` (DeepSeek-V3's multi-token
        prediction): None refuses them, ``drop`` sets them aside, ``keep`` sets them aside for an HF output
        to write back (:attr:`kept`)."""
        from deepspeed_ext.checkpoint import multimodal, quantization
        self.path = Path(path)
        self.tag_dir = self.path
        self.dtype_choice = dtype
        output_dtype(dtype, torch.float32)  # validates the choice
        if mtp not in MTP_CHOICES:
            raise CheckpointError(f"mtp must be one of {', '.join(map(str, MTP_CHOICES))}, not {mtp!r}")
        config_path = self.path / CONFIG_FILE
        if model_config is not None:
            raw_config: dict[str, Any] = dict(model_config)
        elif not config_path.is_file():
            raise MissingConfigError(f"{config_path}: missing; a Hugging Face checkpoint needs its model config: add "
                                  "config.json to the directory or pass --config CONFIG.json")
        else:
            try:
                raw_config = json.loads(config_path.read_text())
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"{config_path}: cannot read JSON: {exc}") from exc
        #: The config as the directory has it (multimodal, quantized); ``model_config`` is the model read.
        self.raw_config = raw_config
        self.quantization = quantization.scheme_of(raw_config, str(config_path))
        self.model_config: dict[str, Any] = {k: v for k, v in raw_config.items() if k != quantization.CONFIG_KEY}
        self._stored_file = self._weight_files()
        found = ({} if self.quantization is None else quantization.pair_tensors(
            self.quantization, self._raw_headers, lambda name: str(self._stored_file[name])))
        #: Quantized tensors by the stored name of their packed data.
        self._quantized: dict[str, quantization.QuantizedTensor] = {t.data: t for t in found.values()}
        scales = {t.scales for t in found.values()}
        # Logical name (dequantized, text-model naming) -> stored name of the tensor or of its packed data.
        stored = {name: name for name in self._stored_file
                  if name not in scales and name not in self._quantized
                  and not (found and name.endswith(quantization.ACTIVATION_SCALE_SUFFIXES))}
        stored.update((tensor.name, tensor.data) for tensor in found.values())
        #: Tensors that are not the model's: logical name -> stored name.
        self.set_aside: dict[str, str] = {}
        self.multimodal: Any = None
        if multimodal.is_multimodal(raw_config):
            self.multimodal = multimodal.naming_of(stored, str(self.path))
            self.model_config = multimodal.text_model_config(self.model_config, str(config_path))
            text = {}
            for name, at in stored.items():
                model_name = self.multimodal.model_name(name)
                if model_name is None:
                    self.set_aside[name] = at
                else:
                    text[model_name] = at
            stored = text
        self.mtp, self.mtp_layers = mtp, self._layers_past_decoder(stored, mtp, str(self.path))
        for name in [n for n in stored if _layer_index(n) in self.mtp_layers]:
            self.set_aside[name] = stored.pop(name)
        self._stored = stored
        self._file_of = {name: self._stored_file[at] for name, at in stored.items()}
        self.splits = hf_expert_splits(self.model_config.get("model_type"))
        self._pieces = group_file_names(self._file_of, self.splits, str(self.path))
        if self.model_config.get("tie_word_embeddings") and all(name in self._pieces for name in TIED_PAIR):
            self._tied_head = True  # transformers ties it on load; the model has one parameter
            del self._pieces[TIED_PAIR[0]]
        else:
            self._tied_head = False

    @property
    def kept(self) -> bool:
        """Whether the tensors set aside go back into an HF output (``mtp="keep"``)."""
        return self.mtp == "keep" and bool(self.set_aside)

    def _layers_past_decoder(self, names: Mapping[str, str], mtp: str | None, source: str) -> set[int]:
        """The decoder layer indices past ``num_hidden_layers`` (DeepSeek-V3 releases keep their multi-token-
        prediction layer there); refused unless ``mtp`` says what to do with them."""
        count = self.model_config.get("num_hidden_layers")
        if not isinstance(count, int):
            return set()
        past = {index for name in names if (index := _layer_index(name)) is not None and index >= count}
        if past and mtp is None:
            listed = ", ".join(f"model.layers.{i}.*" for i in sorted(past))
            predicted = self.model_config.get("num_nextn_predict_layers")
            what = (f"the multi-token-prediction layer{'s' if len(past) > 1 else ''} (num_nextn_predict_layers="
                    f"{predicted})" if predicted else f"{len(past)} layer(s)")
            raise CheckpointError(f"{source}: holds {what} {listed} past num_hidden_layers={count}, which the "
                                  "model does not have; choose: --mtp drop (convert without it) or, for an HF "
                                  "output, --mtp keep (write it back untouched)")
        return past

    @property
    def read_paths(self) -> list[Path]:
        """The directory and, for a Hugging Face cache snapshot, the blobs its symlinks point at."""
        from deepspeed_ext.checkpoint import output
        return output.read_paths(self.path)

    def _weight_files(self) -> dict[str, Path]:
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: not a safetensors index ({exc})") from exc
            files = {name: self.path / filename for name, filename in weight_map.items()}
            for file in sorted(set(files.values())):
                if not file.is_file():
                    raise CheckpointError(f"{file}: file not found (listed in {INDEX_FILE})")
            return files
        paths = [self.path / SINGLE_FILE] if (self.path / SINGLE_FILE).is_file() else sorted(
            self.path.glob("*.safetensors"))
        if not paths:
            raise CheckpointError(f"{self.path}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors files")
        files = {}
        for file in paths:
            with self._open(file) as handle:
                names = list(handle.keys())
            for name in names:
                if name in files:
                    raise CheckpointError(f"{file}: tensor {name!r} is also in {files[name]}")
                files[name] = file
        return files

    @staticmethod
    def _open(file: Path) -> Any:
        """A fresh ``safe_open`` handle. Handles are not kept: a file's touched pages stay mapped (and count
        in RSS) while its handle lives, which with 5 GB shards would be far more than one tensor."""
        from safetensors import SafetensorError, safe_open
        try:
            return safe_open(str(file), framework="pt")
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{file}: cannot read safetensors: {exc}") from exc

    @cached_property
    def _raw_headers(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """(shape, safetensors dtype code) of every stored tensor, from the files' headers."""
        headers = {}
        for file in sorted(set(self._stored_file.values())):
            with self._open(file) as handle:
                for name in handle.keys():
                    if self._stored_file.get(name) == file:
                        info = handle.get_slice(name)
                        headers[name] = (tuple(info.get_shape()), info.get_dtype())
        missing = sorted(set(self._stored_file) - set(headers))
        if missing:
            raise CheckpointError(f"{self._stored_file[missing[0]]}: no tensor {missing[0]!r} (listed in "
                                  f"{INDEX_FILE})")
        return headers

    @cached_property
    def _headers(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """(shape, dtype code) of every tensor of the model as read: a quantized one dequantized."""
        headers = {}
        for name, stored in {**self._stored, **self.set_aside}.items():
            tensor = self._quantized.get(stored)
            if tensor is not None:
                headers[name] = (tensor.shape, safetensors_dtype_code(tensor.dtype))
            else:
                headers[name] = self._raw_headers[stored]
                if headers[name][1] in STORAGE_CODES.values():
                    raise CheckpointError(f"{self._stored_file[stored]}: tensor {stored!r} is {headers[name][1]}, "
                                          "a quantized weight, but config.json has no quantization_config saying how "
                                          "to dequantize it (casting it without its scales gives wrong weights)")
        return headers

    def _read_stored(self, stored: str, index: tuple[Any, ...] = ()) -> torch.Tensor:
        """A stored tensor, or the part ``index`` selects, in its file dtype."""
        file = self._stored_file[stored]
        try:
            with self._open(file) as handle:  # a fresh handle: the pages it touched leave RSS with it
                tensor: torch.Tensor = handle.get_slice(stored)[index] if index else handle.get_tensor(stored)
                return tensor
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"{file}: cannot read tensor {stored!r}: {exc}") from exc

    def _stored_name(self, name: str) -> str:
        """The stored tensor (or packed data) a logical name reads."""
        return self._stored[name] if name in self._stored else self.set_aside[name]

    def _read(self, name: str) -> torch.Tensor:
        """A whole tensor by its logical name (dequantized where the files hold it quantized)."""
        from deepspeed_ext.checkpoint.quantization import dequantize_rows
        tensor = self._quantized.get(self._stored_name(name))
        if tensor is None:
            return self._read_stored(self._stored_name(name))
        return dequantize_rows(tensor, self._read_stored, 0, tensor.rows, tensor.dtype).reshape(tensor.shape)

    @cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Full shape of every model parameter (fused experts assembled), from the headers alone."""
        shapes = {}
        for param, pieces in self._pieces.items():
            if pieces is None or RENAMED in pieces:
                shapes[param] = self._headers[param if pieces is None else pieces[RENAMED]][0]
                continue
            piece_shapes = {self._headers[name][0] for name in pieces.values()}
            if len(piece_shapes) != 1:
                raise CheckpointError(f"{self.path}: the expert tensors of {param} differ in shape: "
                                      f"{sorted(piece_shapes)}")
            (shape, ) = piece_shapes
            experts = 1 + max(expert for expert, _ in pieces)
            count = len(pieces) // experts
            shapes[param] = (experts, shape[0] * count, *shape[1:])
        return shapes

    def file_dtype(self, param: str) -> torch.dtype:
        pieces = self._pieces[param]
        return torch_dtype(self._headers[param if pieces is None else next(iter(pieces.values()))][1])

    def load(self, param: str) -> torch.Tensor:
        """The full parameter in its file dtype (or the ``dtype`` asked for)."""
        pieces = self._pieces[param]
        if pieces is None or RENAMED in pieces:
            tensor = self._read(param if pieces is None else pieces[RENAMED])
        else:
            tensor = torch.empty(self.shapes[param], dtype=self.file_dtype(param))
            count = len(pieces) // tensor.shape[0]
            rows = tensor.shape[1] // count
            for (expert, piece), name in pieces.items():
                tensor[expert].narrow(0, piece * rows, rows).copy_(self._read(name))
        return tensor.to(output_dtype(self.dtype_choice, tensor.dtype))

    @cached_property
    def layouts(self) -> dict[str, TPLayout]:
        return {name: TPLayout.replicated(shape, 1) for name, shape in self.shapes.items()}

    @cached_property
    def info(self) -> SourceInfo:
        return SourceInfo(format="huggingface", given=self.path, path=self.path, layouts=self.layouts,
                          states=(MASTER_WEIGHTS, ), model_config=self.model_config,
                          model_class=(self.model_config.get("architectures") or [None])[0],
                          versions={"source": "huggingface safetensors"},
                          fingerprints=self._fingerprints())

    def _fingerprints(self) -> Fingerprints | None:
        """The fingerprints deepspeed-ext wrote into the files' metadata, where every parameter has one and the
        tensors are read in their file dtype or a wider one (a narrower ``dtype`` changes the values)."""
        found = Fingerprints()
        for file in sorted(set(self._file_of.values())):
            with self._open(file) as handle:
                text = (handle.metadata() or {}).get(METADATA_FINGERPRINTS)
            if text is not None:
                try:
                    found.merge(Fingerprints.from_json(json.loads(text), f"{file} (__metadata__)"))
                except ValueError as exc:
                    raise CheckpointError(f"{file}: unreadable fingerprints in __metadata__: {exc}") from exc
        if not found.tensors or set(found.tensors) != set(self.shapes):
            return None
        for name in self.shapes:
            stored = self.file_dtype(name)
            read = output_dtype(self.dtype_choice, stored)
            if read.is_floating_point and torch.finfo(read).eps > torch.finfo(stored).eps:
                return None
        return found

    def tensors(self) -> Iterator[LogicalTensor]:
        if self._tied_head:
            head, embedding = self._read(TIED_PAIR[0]), self.load(TIED_PAIR[1])
            if not torch.equal(head.to(embedding.dtype), embedding):
                raise CheckpointError(f"{self._file_of[TIED_PAIR[0]]}: the config ties {TIED_PAIR[0]} to "
                                      f"{TIED_PAIR[1]}, but the files hold different values")
        for name, layout in self.layouts.items():
            yield LogicalTensor(name=name, shape=layout.shape, layout=layout, states=(MASTER_WEIGHTS, ),
                                loader=self._loader(name),
                                dtype=output_dtype(self.dtype_choice, self.file_dtype(name)),
                                range_loader=self._range_loader(name))

    def _loader(self, name: str) -> Callable[[str], torch.Tensor]:
        return lambda state: self.load(name)  # weights only: the one state

    def _range_loader(self, param: str) -> Callable[[str, int, int], torch.Tensor] | None:
        """Elements ``[low, high)`` of a parameter stored whole, read as the rows that hold them (None for one
        assembled from expert pieces, which is read whole). A quantized one reads the packed rows and scales
        that hold them."""
        from deepspeed_ext.checkpoint.quantization import dequantize_rows
        pieces = self._pieces[param]
        if pieces is not None and RENAMED not in pieces:
            return None
        name, shape = (param if pieces is None else pieces[RENAMED]), self.shapes[param]
        stored = self._stored_name(name)
        quantized = self._quantized.get(stored)
        dtype = output_dtype(self.dtype_choice, self.file_dtype(param))
        row = shape[-1] if quantized is not None else math.prod(shape[1:])

        def read(state: str, low: int, high: int) -> torch.Tensor:
            if not shape or not row:
                return self.load(param).reshape(-1)[low:high]
            first, last = low // row, -(-high // row)
            if quantized is not None:
                rows = dequantize_rows(quantized, self._read_stored, first, last, dtype)
            else:
                rows = self._read_stored(stored, (slice(first, last), ))
            return rows.reshape(-1)[low - first * row:high - first * row].to(dtype)

        return read

    def raise_if_damaged(self) -> None:
        """Nothing to check as it streams: this format's files are checked by ``verify`` (a manifest, where
        deepspeed-ext wrote them)."""

    def summary(self) -> dict[str, Any]:
        return {"kind": "huggingface", "path": str(self.path), "model_type": self.model_config.get("model_type"),
                "files": len(set(self._file_of.values())),
                "tensor_dtypes": sorted({str(self.file_dtype(n)).replace("torch.", "") for n in self.shapes}),
                "num_parameters": sum(int(torch.Size(s).numel()) for s in self.shapes.values()),
                **({"quantization": f"{self.quantization.describe()}: {len(self._quantized)} tensors, "
                    "dequantized on read"} if self.quantization is not None else {}),
                **({"set_aside": self.notes} if self.set_aside else {})}

    @property
    def notes(self) -> list[str]:
        """What was read differently from the files as they are, one line each (the CLI prints them)."""
        notes = []
        if self.multimodal is not None:
            kinds = sorted({name.split(".")[1] if name.startswith("model.") else name.split(".")[0]
                            for name in self.set_aside if _layer_index(name) not in self.mtp_layers})
            count = sum(1 for name in self.set_aside if _layer_index(name) not in self.mtp_layers)
            notes.append(f"read the text model ({self.multimodal.prefix}*); ignored {count} tensors of "
                         f"{', '.join(kinds)} (to-hf --like {self.path} puts them back)")
        if self.mtp_layers:
            count = sum(1 for name in self.set_aside if _layer_index(name) in self.mtp_layers)
            what = "kept for the HF output" if self.mtp == "keep" else "dropped"
            notes.append(f"{what}: {count} tensors of the multi-token-prediction layer(s) "
                         f"{', '.join(f'model.layers.{i}' for i in sorted(self.mtp_layers))}")
        return notes
