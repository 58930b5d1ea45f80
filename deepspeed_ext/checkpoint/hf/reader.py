"""The HF source: a safetensors checkpoint read lazily (memory-mapped), under the model's names, with release
layouts (multimodal naming, multi-token-prediction layers, block-FP8 / MXFP4 weights) undone."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from deepspeed_ext.checkpoint import output
from deepspeed_ext.checkpoint.families import hf_expert_splits, hf_release_naming
from deepspeed_ext.checkpoint.fingerprint import Fingerprints
from deepspeed_ext.checkpoint.hf.files import (
    CONFIG_FILE,
    INDEX_FILE,
    METADATA_FINGERPRINTS,
    MTP_CHOICES,
    RENAMED,
    SINGLE_FILE,
    TIED_PAIR,
    StoredSpan,
    group_file_names,
    read_stored_part,
    read_stored_range,
    stored_spans,
    release_renames,
)
from deepspeed_ext.checkpoint.model_config import output_dtype, safetensors_dtype_code, torch_dtype
from deepspeed_ext.checkpoint.quantization import MX_BLOCK, MXFP4, STORAGE_CODES
from deepspeed_ext.checkpoint.adapters import adapters_beside
from deepspeed_ext.checkpoint.source import (
    CheckpointSource,
    OpenOptions,
    SourceInfo,
)
from deepspeed_ext.checkpoint.tensor import MASTER_WEIGHTS, LogicalTensor
from deepspeed_ext.errors import CheckpointError, MissingConfigError
from deepspeed_ext.module_inject.layout import TPLayout


# --------------------------------------------------------------------------- source
def parameter_problem(source: CheckpointSource) -> str | None:
    """``verify``'s model check (the format hook): how the parameters fail to fit transformers' model for the
    checkpoint's config, or None."""
    from deepspeed_ext.checkpoint.adapters import find_adapters
    from deepspeed_ext.checkpoint.model_config import config_facts
    if find_adapters(source.info.layouts, with_base=False) is not None:
        return None  # a peft model's (or a PEFT adapter's) names: no transformers model of its own to fit
    assert source.info.model_config is not None
    shapes = {name: layout.shape for name, layout in source.info.layouts.items()}
    return config_facts(source.info.model_config, None, str(source.info.path)).mismatch(shapes)


def open_source(path: Path, options: OpenOptions) -> CheckpointSource:
    """The format registry's reader (:mod:`deepspeed_ext.checkpoint.formats`). A PEFT adapter directory is read on
    its base model (``options.base``), as the ``PeftModel`` they make."""
    from deepspeed_ext.checkpoint.hf.peft_adapter import PeftAdapterSource, adapter_base, is_peft_adapter
    if is_peft_adapter(path):
        base = adapter_base(path, options.base)
        return PeftAdapterSource(path, None if base is None else HFCheckpoint(
            base, dtype=options.dtype, model_config=options.model_config, mtp=options.mtp))
    return HFCheckpoint(path, dtype=options.dtype, model_config=options.model_config, mtp=options.mtp)


def _layer_index(name: str) -> int | None:
    """The decoder layer a tensor belongs to (``model.layers.<i>.*``), or None."""
    match = _LAYER_NAME.match(name)
    return int(match.group(1)) if match else None


_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")


def _layer_order(layer: str) -> tuple[str, int]:
    """``model.layers.10`` after ``model.layers.9``."""
    prefix, _, index = layer.rpartition(".")
    return prefix, int(index) if index.isdigit() else -1


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
        self._file_spans: dict[Path, dict[str, StoredSpan]] = {}
        found = ({} if self.quantization is None else quantization.pair_tensors(
            self.quantization, self._raw_headers, lambda name: str(self._stored_file[name])))
        #: Quantized tensors by the stored name of their packed data.
        self.quantized_tensors: dict[str, quantization.QuantizedTensor] = {t.data: t for t in found.values()}
        scales = {t.scales for t in found.values()}
        # Logical name (dequantized, text-model naming) -> stored name of the tensor or of its packed data.
        stored = {name: name for name in self._stored_file
                  if name not in scales and name not in self.quantized_tensors
                  and not (found and name.endswith(quantization.ACTIVATION_SCALE_SUFFIXES))}
        stored.update((tensor.name, tensor.data) for tensor in found.values())
        # A release that names its files otherwise than save_pretrained (DeepSeek-V4's) is read under
        # save_pretrained's names, which the family's hf_expert_splits map to the model's.
        prefixes, self._mtp_prefix = hf_release_naming(self.model_config.get("model_type"))
        renames = release_renames(stored, prefixes, str(self.path))
        #: save_pretrained's name -> the release's, for the tensors the release names otherwise (to-hf --like).
        self.release_names = {saved: release for release, saved in renames.items()}
        stored = {renames.get(name, name): at for name, at in stored.items()}
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
        for name in [n for n in stored if self._mtp_layer(n) is not None]:
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

    def whole_name(self, param: str) -> str | None:
        """The name the files store model parameter ``param`` under, as they spell it, where they store it whole
        (None: in expert pieces, or not at all)."""
        if param not in self._pieces:
            return None
        pieces = self._pieces[param]
        name = param if pieces is None else pieces.get(RENAMED)
        return None if name is None else self.release_names.get(name, name)

    @property
    def kept(self) -> bool:
        """Whether the tensors set aside go back into an HF output (``mtp="keep"``)."""
        return self.mtp == "keep" and bool(self.set_aside)

    def _mtp_layer(self, name: str) -> str | None:
        """The multi-token-prediction layer ``name`` belongs to, as the files prefix it: a decoder layer past
        ``num_hidden_layers`` (``model.layers.61``, DeepSeek-V3's releases) or one under the family's own prefix
        (``mtp.0``, DeepSeek-V4's); None for the model's tensors."""
        if self._mtp_prefix and name.startswith(self._mtp_prefix):
            return self._mtp_prefix + name[len(self._mtp_prefix):].split(".", 1)[0]
        index, count = _layer_index(name), self.model_config.get("num_hidden_layers")
        return f"model.layers.{index}" if index is not None and isinstance(count, int) and index >= count else None

    def _layers_past_decoder(self, names: Mapping[str, str], mtp: str | None, source: str) -> set[str]:
        """The multi-token-prediction layers (:meth:`_mtp_layer`: DeepSeek-V3's past ``num_hidden_layers``,
        DeepSeek-V4's ``mtp.<i>``); refused unless ``mtp`` says what to do with them."""
        count = self.model_config.get("num_hidden_layers")
        past = {layer for name in names if (layer := self._mtp_layer(name)) is not None}
        if past and mtp is None:
            listed = ", ".join(f"{layer}.*" for layer in sorted(past, key=_layer_order))
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
    def stored_headers(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """(shape, dtype code) of every tensor of the model as read: a quantized one dequantized."""
        headers = {}
        for name, stored in {**self._stored, **self.set_aside}.items():
            tensor = self.quantized_tensors.get(stored)
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
        span = self._spans(file).get(stored)
        try:
            part = None if span is None else read_stored_part(file, span, index)
            if part is not None:
                return part
            with self._open(file) as handle:  # a fresh handle: the pages it touched leave RSS with it
                tensor: torch.Tensor = handle.get_slice(stored)[index] if index else handle.get_tensor(stored)
                return tensor
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"{file}: cannot read tensor {stored!r}: {exc}") from exc

    def _spans(self, file: Path) -> dict[str, StoredSpan]:
        """Where each tensor of ``file`` lies (read once a file, after safetensors has checked its header)."""
        spans = self._file_spans.get(file)
        if spans is None:
            self._raw_headers  # noqa: B018 (safetensors checks every file's header first)
            spans = self._file_spans[file] = stored_spans(file)
        return spans

    def file_header(self, stored: str) -> tuple[tuple[int, ...], str]:
        """(shape, safetensors dtype code) of a tensor as the files store it (a quantized weight's packed values or
        its scales), by its name in the files."""
        return self._raw_headers[stored]

    def read_file_rows(self, stored: str, first: int, last: int) -> torch.Tensor:
        """Rows ``[first, last)`` of a tensor as the files store it, in its file dtype."""
        return self._read_stored(stored, (slice(first, last), ))

    def _stored_name(self, name: str) -> str:
        """The stored tensor (or packed data) a logical name reads."""
        return self._stored[name] if name in self._stored else self.set_aside[name]

    def read_stored_tensor(self, name: str) -> torch.Tensor:
        """A whole tensor by its logical name (dequantized where the files hold it quantized)."""
        from deepspeed_ext.checkpoint.quantization import dequantize_rows
        tensor = self.quantized_tensors.get(self._stored_name(name))
        if tensor is None:
            return self._read_stored(self._stored_name(name))
        return dequantize_rows(tensor, self._read_stored, 0, tensor.rows, tensor.dtype).reshape(tensor.shape)

    @cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Full shape of every model parameter (fused experts assembled), from the headers alone."""
        shapes = {}
        for param, pieces in self._pieces.items():
            if pieces is None or RENAMED in pieces:
                shapes[param] = self.stored_headers[param if pieces is None else pieces[RENAMED]][0]
                continue
            piece_shapes = {self.stored_headers[name][0] for name in pieces.values()}
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
        return torch_dtype(self.stored_headers[param if pieces is None else next(iter(pieces.values()))][1])

    def load(self, param: str) -> torch.Tensor:
        """The full parameter in its file dtype (or the ``dtype`` asked for)."""
        pieces = self._pieces[param]
        if pieces is None or RENAMED in pieces:
            tensor = self.read_stored_tensor(param if pieces is None else pieces[RENAMED])
        else:
            tensor = torch.empty(self.shapes[param], dtype=self.file_dtype(param))
            count = len(pieces) // tensor.shape[0]
            rows = tensor.shape[1] // count
            for (expert, piece), name in pieces.items():
                tensor[expert].narrow(0, piece * rows, rows).copy_(self.read_stored_tensor(name))
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
                          fingerprints=self._fingerprints(),
                          # a peft model's whole state dict saved as a model: its adapters' configs beside it
                          adapters=adapters_beside(self.path))

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
            head, embedding = self.read_stored_tensor(TIED_PAIR[0]), self.load(TIED_PAIR[1])
            if not torch.equal(head.to(embedding.dtype), embedding):
                raise CheckpointError(f"{self._file_of[TIED_PAIR[0]]}: the config ties {TIED_PAIR[0]} to "
                                      f"{TIED_PAIR[1]}, but the files hold different values")
        for name, layout in self.layouts.items():
            yield LogicalTensor(name=name, shape=layout.shape, layout=layout, states=(MASTER_WEIGHTS, ),
                                loader=self._loader(name),
                                dtype=output_dtype(self.dtype_choice, self.file_dtype(name)),
                                range_loader=self._range_loader(name),
                                range_row=self._range_row(name, layout.shape))

    def _range_row(self, param: str, shape: tuple[int, ...]) -> int | None:
        """The elements a block of ``param`` is cut at a multiple of: its rows, and for MXFP4 weights its 32-row
        groups, which share scales along the rows: a block cut inside a group dequantized the group twice (a
        block of gpt-oss's 5760-wide rows was 182 rows, 7 groups dequantized for 5.7 of them)."""
        if not shape:
            return None
        pieces = self._pieces[param]
        stored = param if pieces is None else pieces.get(RENAMED, next(iter(pieces.values()), param))
        quantized = self.quantized_tensors.get(self._stored_name(stored))
        return shape[-1] * (MX_BLOCK if quantized is not None and quantized.method == MXFP4 else 1)

    def _loader(self, name: str) -> Callable[[str], torch.Tensor]:
        return lambda state: self.load(name)  # weights only: the one state

    def _range_loader(self, param: str) -> Callable[[str, int, int], torch.Tensor] | None:
        """Elements ``[low, high)`` of a parameter, read as the rows that hold them: of the tensor stored whole, or
        of the expert pieces a fused parameter is assembled from (a 384-expert stack is read a block at a time like
        any tensor, never whole). A quantized tensor reads the packed rows and scales that hold them."""
        pieces = self._pieces[param]
        shape = self.shapes[param]
        dtype = output_dtype(self.dtype_choice, self.file_dtype(param))
        if pieces is None or RENAMED in pieces:
            name = param if pieces is None else pieces[RENAMED]
            return lambda state, low, high: self._name_range(name, shape, low, high, dtype)
        # [experts, rows, ...]: each expert's rows in equal pieces (gate, up), laid out expert by expert
        count = len(pieces) // shape[0]
        piece_shape = (shape[1] // count, *shape[2:])
        piece_elements = math.prod(piece_shape)

        def read(state: str, low: int, high: int) -> torch.Tensor:
            parts, at = [], low
            while at < high:
                index, offset = divmod(at, piece_elements)
                stop = min(high, (index + 1) * piece_elements)
                parts.append(self._name_range(pieces[divmod(index, count)], piece_shape, offset, offset + stop - at,
                                              dtype))
                at = stop
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        return read

    def _name_range(self, name: str, shape: tuple[int, ...], low: int, high: int, dtype: torch.dtype
                    ) -> torch.Tensor:
        """Elements ``[low, high)`` of the tensor of logical name ``name`` (of ``shape``), flattened, in ``dtype``."""
        from deepspeed_ext.checkpoint.quantization import dequantize_rows
        stored = self._stored_name(name)
        quantized = self.quantized_tensors.get(stored)
        row = shape[-1] if quantized is not None else math.prod(shape[1:])
        if not shape or not row:
            return self.read_stored_tensor(name).reshape(-1)[low:high].to(dtype)
        if quantized is None and (span := self._spans(self._stored_file[stored]).get(stored)) is not None:
            # Any range of the elements, whatever the rows: one read of what holds them
            return read_stored_range(self._stored_file[stored], span, low, high).to(dtype)
        first, last = low // row, -(-high // row)
        rows = (dequantize_rows(quantized, self._read_stored, first, last, dtype) if quantized is not None
                else self._read_stored(stored, (slice(first, last), )))
        return rows.reshape(-1)[low - first * row:high - first * row].to(dtype)

    def raise_if_damaged(self) -> None:
        """Nothing to check as it streams: this format's files are checked by ``verify`` (a manifest, where
        deepspeed-ext wrote them)."""

    def summary(self) -> dict[str, Any]:
        return {"kind": "huggingface", "path": str(self.path), "model_type": self.model_config.get("model_type"),
                "files": len(set(self._file_of.values())),
                "tensor_dtypes": sorted({str(self.file_dtype(n)).replace("torch.", "") for n in self.shapes}),
                "num_parameters": sum(int(torch.Size(s).numel()) for s in self.shapes.values()),
                **({"quantization": f"{self.quantization.describe()}: {len(self.quantized_tensors)} tensors, "
                    "dequantized on read"} if self.quantization is not None else {}),
                **({"set_aside": self.notes} if self.set_aside else {})}

    @property
    def notes(self) -> list[str]:
        """What was read differently from the files as they are, one line each (the CLI prints them)."""
        notes = []
        if self.multimodal is not None:
            kinds = sorted({name.split(".")[1] if name.startswith("model.") else name.split(".")[0]
                            for name in self.set_aside if self._mtp_layer(name) is None})
            count = sum(1 for name in self.set_aside if self._mtp_layer(name) is None)
            notes.append(f"read the text model ({self.multimodal.prefix}*); ignored {count} tensors of "
                         f"{', '.join(kinds)} (to-hf --like {self.path} puts them back)")
        if self.mtp_layers:
            count = sum(1 for name in self.set_aside if self._mtp_layer(name) is not None)
            what = "kept for the HF output" if self.mtp == "keep" else "dropped"
            notes.append(f"{what}: {count} tensors of the multi-token-prediction layer(s) "
                         f"{', '.join(sorted(self.mtp_layers, key=_layer_order))}")
        return notes
