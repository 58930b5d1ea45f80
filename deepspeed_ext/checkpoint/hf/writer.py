"""The HF sink: a source's parameters as sharded safetensors, each tensor written once at its offset, through the
write flow (:mod:`~deepspeed_ext.checkpoint.writing`)."""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from deepspeed_ext.checkpoint import durable, serialization
from deepspeed_ext.checkpoint.families import hf_expert_splits
from deepspeed_ext.checkpoint.fingerprint import Fingerprint, Fingerprints
from deepspeed_ext.checkpoint.hf.files import (
    CONFIG_FILE,
    FILENAME_PATTERN,
    GENERATION_CONFIG,
    INDEX_FILE,
    METADATA_FINGERPRINTS,
    TIED_PAIR,
    FileTensor,
    companion_files,
    file_tensors,
    fingerprints_room,
    fingerprints_text,
    safetensors_header,
    tokenizer_files,
    write_at,
    write_error,
)
from deepspeed_ext.checkpoint.hf.options import HFOptions
from deepspeed_ext.checkpoint.hf.quantized import (
    QuantizedPiece,
    quantize_plan,
    quantized_blocks,
    release_quantize_plan,
    stored_entries,
    write_quantized,
)
from deepspeed_ext.checkpoint.hf.release import like_layout, like_source
from deepspeed_ext.checkpoint.model_config import ConfigFit, output_dtype
from deepspeed_ext.checkpoint.source import (
    CheckpointSource,
    required_model_config,
)
from deepspeed_ext.checkpoint.tensor import MASTER_WEIGHTS, LogicalTensor
from deepspeed_ext.checkpoint.writing import Write
from deepspeed_ext.errors import CheckpointError


def write(source: CheckpointSource, out: str | Path, options: HFOptions = HFOptions()) -> Path:
    """Write ``source``'s parameters (full tensors, HF/universal names) as an HF checkpoint at ``out``.

    Each tensor's master weights (``fp32`` state) are cast to ``options.dtype`` and written once, straight
    into its shard. The parameter names and shapes are checked against transformers' model for the source's
    model config before anything is written, so the output loads with no missing or unexpected keys.
    """
    from huggingface_hub import split_state_dict_into_shards_factory

    model_config = required_model_config(source.info)
    label, dtype = str(source.info.given), options.dtype
    like = like_source(source, options)
    companions = {path.name: path for path in companion_files(source.info)}
    if like is not None:
        companions.update((path.name, path) for path in companion_files(like.info))
    if options.tokenizer is not None:  # files given explicitly win over the source folder's
        companions.update((path.name, path) for path in tokenizer_files(Path(options.tokenizer)))
    write_ = Write.of(source, out, options)
    verdicts = write_.verdicts
    tensors = {tensor.name: tensor for tensor in verdicts.stream(source.tensors(), with_fit=False)}
    tied = bool(model_config.get("tie_word_embeddings", False))
    dropped_tied = tied and all(name in tensors for name in TIED_PAIR)
    params = [tensor for name, tensor in tensors.items() if not (dropped_tied and name == TIED_PAIR[0])]
    if not params:
        raise CheckpointError(f"{label}: no parameters to write")
    out_dtypes = {t.name: output_dtype(dtype, t.dtype) for t in params}
    weights_dtype = max(out_dtypes.values(), key=list(out_dtypes.values()).count)
    fit = verdicts.fit = ConfigFit(model_config, {t.name: tuple(t.shape) for t in params}, label, weights_dtype)
    params = list(verdicts.fitted(params))
    tensors = {**tensors, **{t.name: t for t in params}}
    with fit.first():
        splits = hf_expert_splits(model_config.get("model_type"))
        pieces: dict[str, list[FileTensor | QuantizedPiece]] = {
            t.name: list(file_tensors(t.name, tuple(t.shape), out_dtypes[t.name], splits)) for t in params}
        if like is not None:
            params += like_layout(like, params, pieces, dtype, label)
        quantized = None
        if options.quantize is not None:
            # Into a release with power-of-two scales (DeepSeek-V4's): its own format, tensor by tensor.
            quantized = release_quantize_plan(like, options, pieces)
        if options.quantize is not None and quantized is None:
            # The release's own tensors the model lacks (its MTP layer) are written quantized where it had them so.
            stored_quantized = set() if like is None else {
                name for name, stored in like.set_aside.items() if stored in like.quantized_tensors}
            quantized = quantize_plan(options, model_config, pieces, {t.name: tuple(t.shape) for t in params},
                                      label, fit, stored_quantized)
        plan = {entry.name: entry for entries in pieces.values() for piece in entries
                for entry in stored_entries(piece)}
        split = split_state_dict_into_shards_factory(plan, get_storage_size=lambda entry: entry.nbytes,
                                                     filename_pattern=FILENAME_PATTERN,
                                                     max_shard_size=options.max_shard_size)
        if dropped_tied:
            _check_tied(tensors, label)

        def finish(partial: Path) -> None:  # once the weights are known good: the config, companions, index
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

        write_.publish(lambda partial: _write_shards(partial, split.filename_to_tensors, plan, params, pieces,
                                                     options.progress), finish=finish)
    return Path(out)


def _write_config(path: Path, config: Mapping[str, Any], quantized: Mapping[str, Any] | None) -> None:
    """``config`` (the release's own, or what ``save_pretrained`` wrote) with the ``quantization_config`` of the
    weights as written, or none."""
    values = {key: value for key, value in config.items() if key != "quantization_config"}
    if quantized is not None:
        values["quantization_config"] = dict(quantized)
    durable.replace_file(path, json.dumps(values, indent=2, sort_keys=True) + "\n")


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
    home = {stored_entries(pieces[t.name][0])[0].name: t.name for t in params}
    recorded: dict[str, list[str]] = {filename: [home[name] for name in names if name in home]
                                      for filename, names in shards.items()}
    headers: dict[str, int] = {}
    # Appended by the writer threads, in the order they finish: added up in file order below, so the fingerprint
    # (float sums) and with it the header's bytes are the same on every run.
    sums: list[tuple[str, str, int, tuple[int, float, float]]] = []
    try:
        for filename, names in shards.items():
            entries = [plan[name] for name in names]
            header = safetensors_header(entries, {"format": "pt"}, reserve=fingerprints_room(recorded[filename]))
            headers[filename] = len(header) - 8
            files[filename] = fd = os.open(directory / filename, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            write_at(fd, header, 0, directory / filename)
            offset = len(header)
            for stored in entries:
                where[stored.name] = (filename, offset)
                offset += stored.nbytes
            try:
                os.ftruncate(fd, offset)  # the file's final size, so the tensors can be written in any order
            except OSError as exc:
                raise write_error(directory / filename, exc) from exc
        with serialization.BackgroundWriter() as writer:
            for tensor in params:
                # A source that reads ranges streams each piece in blocks (read, merged, cast here, written on a
                # writer thread); the others load the whole tensor once.
                full = None if tensor.range_loader is not None else tensor.load_tensor(MASTER_WEIGHTS).reshape(-1)
                for entry in pieces[tensor.name]:
                    if isinstance(entry, QuantizedPiece):
                        start, stop = entry.piece.span(tuple(tensor.shape))
                        # Read block by block on the writer threads, as they quantize: a queued block holds
                        # nothing yet, so memory follows the blocks being written, not the weight.
                        read = functools.partial(_master_range, tensor, start) if full is None else \
                            functools.partial(_slice, full[start:stop])
                        at = {stored.name: (files[where[stored.name][0]], where[stored.name][1],
                                            directory / where[stored.name][0]) for stored in stored_entries(entry)}
                        parts, size = quantized_blocks(entry), entry.data.nbytes + entry.scales.nbytes
                        for first, last in parts:
                            writer.submit(write_quantized, entry, read, first, last, at, tensor.name, sums)
                            bar.update(size * last // parts[-1][1] - size * first // parts[-1][1])
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
            metadata = {"format": "pt", METADATA_FINGERPRINTS: fingerprints_text(fingerprints)}
            header = safetensors_header([plan[name] for name in names], metadata, length=headers[filename])
            write_at(files[filename], header, 0, directory / filename)
    finally:
        for fd in files.values():
            os.close(fd)
        bar.close()


def _write_piece(fd: int, data: torch.Tensor, offset: int, path: Path, name: str,
                 sums: list[tuple[str, str, int, tuple[int, float, float]]]) -> None:
    """One piece of a weight at its offset, and its share of the weight's fingerprint (on a writer thread)."""
    from deepspeed_ext.checkpoint.fingerprint import partial_sums
    sums.append((name, path.name, offset, partial_sums(data)))
    write_at(fd, data.reshape(-1).view(torch.uint8).numpy().data, offset, path)


def _master_range(tensor: LogicalTensor, start: int, low: int, high: int) -> torch.Tensor:
    """Elements ``[start + low, start + high)`` of ``tensor``'s master weights flattened, in one tensor (on a writer
    thread): the source's block where one holds them, else its blocks copied in as they come (the next read may
    release the pages of a mapped one)."""
    out: torch.Tensor | None = None
    at = 0
    for block in tensor.blocks(MASTER_WEIGHTS, start + low, start + high):
        if out is None and block.numel() == high - low:
            out, at = block, high - low
            continue
        if out is None:
            out = torch.empty(high - low, dtype=block.dtype)
        out[at:at + block.numel()].copy_(block)
        at += block.numel()
    assert out is not None and at == high - low, (tensor.name, start + low, start + high)
    return out


def _slice(values: torch.Tensor, low: int, high: int) -> torch.Tensor:
    return values[low:high]


def _check_tied(tensors: Mapping[str, LogicalTensor], source: str) -> None:
    head, embedding = (tensors[name] for name in TIED_PAIR)
    same = head.shape == embedding.shape and all(
        torch.equal(a, b) for a, b in zip(head.blocks(MASTER_WEIGHTS), embedding.blocks(MASTER_WEIGHTS)))
    if not same:
        raise CheckpointError(f"{source}: the config ties {TIED_PAIR[0]} to {TIED_PAIR[1]}, but they differ; "
                              "fix tie_word_embeddings in the config")
