"""A stream of full tensors under the names an inference engine loads: the model's own (transformers 5's, as
``model.state_dict()`` has them: fused experts, a tied weight once), or the HF files' (what ``to-hf`` writes and
vLLM's ``load_weights`` reads: experts one by one where the family stores them so), in the dtype asked, block-FP8
as a release writes it, adapters merged or alone.

The tensors come from a :class:`StreamedSource`: the weights of a live engine (or of an update received from
one) described by a :class:`~deepspeed_ext.weights.plan.WeightPlan` and fetched a bucket at a time. The names and
merges are the converters' own (:mod:`~deepspeed_ext.checkpoint.expert_names`,
:mod:`~deepspeed_ext.checkpoint.adapter_merge`, :mod:`~deepspeed_ext.checkpoint.hf.files`), so a stream holds
exactly what ``to-hf`` of a checkpoint saved at the same step holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepspeed_ext.checkpoint.adapter_export import adapter_model
from deepspeed_ext.checkpoint.adapter_merge import MergedSource
from deepspeed_ext.checkpoint.adapters import peft_key
from deepspeed_ext.checkpoint.expert_names import model_named
from deepspeed_ext.checkpoint.families import hf_expert_splits
from deepspeed_ext.checkpoint.hf.files import TIED_PAIR, file_tensors
from deepspeed_ext.checkpoint.model_config import output_dtype
from deepspeed_ext.checkpoint.source import CheckpointSource, SourceInfo
from deepspeed_ext.checkpoint.states import MASTER_WEIGHTS
from deepspeed_ext.checkpoint.tensor import LogicalTensor
from deepspeed_ext.errors import CheckpointError
from deepspeed_ext.weights.plan import WeightPlan

#: ``names``: the model's parameter names; the HF files' names; the live module's own (a PeftModel's, unmerged).
NAMINGS = ("hf", "files", "module")
#: ``adapters``: a peft model's LoRA adapters merged into the weights, or the adapters alone.
ADAPTER_CHOICES = ("merge", "only")


@dataclass(frozen=True)
class WeightOptions:
    """How the tensors of a stream are named and typed (see the module docstring)."""

    names: str = "hf"
    #: ``source`` (the module's dtype), ``bfloat16``, ``float16``, ``float32``.
    dtype: str = "source"
    #: ``fp8``: linear weights as block FP8 (``weight`` in ``float8_e4m3fn`` + ``weight_scale_inv``), ``names="files"``.
    quantize: str | None = None
    fp8_block: tuple[int, int] = (128, 128)
    adapters: str = "merge"

    def __post_init__(self) -> None:
        if self.names not in NAMINGS:
            raise ValueError(f"names={self.names!r}: choose one of {', '.join(NAMINGS)}")
        if self.adapters not in ADAPTER_CHOICES:
            raise ValueError(f"adapters={self.adapters!r}: choose one of {', '.join(ADAPTER_CHOICES)}")
        if self.quantize not in (None, "fp8"):
            raise ValueError(f"quantize={self.quantize!r}: a stream quantizes to 'fp8' (block FP8) or not at all")
        if self.quantize is not None and self.names != "files":
            raise ValueError("quantize='fp8' streams the HF files' tensors (weight + weight_scale_inv): names='files'")
        output_dtype(self.dtype, torch.float32)  # one line for an unknown dtype, before anything is sent


class StreamedSource:
    """A :class:`~deepspeed_ext.checkpoint.source.CheckpointSource` over a plan whose tensors arrive a bucket at a
    time from ``buckets`` (each a ``{name: full tensor}``). A tensor is handed out once; those of a bucket not yet
    asked for wait in memory (a fused expert's other half, a LoRA factor its base weight is merged with)."""

    def __init__(self, plan: WeightPlan, buckets: Iterator[dict[str, torch.Tensor]], label: str):
        self.plan, self._buckets, self.label = plan, buckets, label
        self._waiting: dict[str, torch.Tensor] = {}
        self._done = False

    @property
    def info(self) -> SourceInfo:
        plan = self.plan
        return SourceInfo(format="live", given=Path(self.label), path=Path(self.label),
                          layouts={t.name: t.layout for t in plan.tensors}, states=(MASTER_WEIGHTS, ),
                          model_config=plan.model_config, model_class=plan.model_class, adapters=plan.adapters,
                          frozen=tuple(t.name for t in plan.tensors if not t.trainable), metadata="deepspeed_ext")

    @property
    def read_paths(self) -> list[Path]:
        return []

    def summary(self) -> dict[str, Any]:
        return {"format": "live", "tensors": len(self.plan.tensors)}

    def raise_if_damaged(self) -> None:
        return None

    def tensors(self) -> Iterator[LogicalTensor]:
        for plan in self.plan.tensors:
            yield LogicalTensor(name=plan.name, shape=tuple(plan.layout.shape), layout=plan.layout,
                                states=(MASTER_WEIGHTS, ), loader=self._loader(plan.name), dtype=plan.dtype,
                                trainable=plan.trainable)

    def _loader(self, name: str) -> Any:
        def load(state: str) -> torch.Tensor:
            while name not in self._waiting:
                bucket = next(self._buckets, None)
                if bucket is None:
                    raise CheckpointError(f"{self.label}: {name} was asked for twice or never sent")
                self._waiting.update(bucket)
            return self._waiting.pop(name)
        return load

    def drain(self) -> None:
        """Fetch the buckets nobody asked for (every rank takes part in every bucket's collectives)."""
        for _ in self._buckets:
            pass
        self._waiting.clear()


def _tied_dropped(source: CheckpointSource) -> bool:
    config = source.info.model_config or {}
    return bool(config.get("tie_word_embeddings", False)) and all(name in source.info.layouts for name in TIED_PAIR)


def named_source(source: CheckpointSource, options: WeightOptions) -> tuple[CheckpointSource, dict[str, str] | None]:
    """``source`` under the model's names (AutoEP's renamed, adapters merged); with ``adapters="only"`` the source
    and ``{tensor name: its name in the stream}`` of the adapters' tensors (None otherwise)."""
    if options.names == "module":
        return source, None
    source = model_named(source)
    adapters = adapter_model(source)
    label = str(source.info.given)
    if options.adapters == "only":
        if adapters is None:
            raise CheckpointError(f"{label}: adapters='only', but the model has no peft LoRA adapters")
        return source, {name: peft_key(name, adapter, adapters.prefix) for adapter in adapters.choose((), label)
                        for name in adapters.parameters_of(adapter)}
    if adapters is None:
        return source, None
    return MergedSource(source, adapters, adapters.choose((), label)), None


def named_shapes(source: CheckpointSource, options: WeightOptions) -> dict[str, tuple[int, ...]]:
    """The names and shapes a stream of ``source`` will hold, before anything is fetched (``quantize`` aside:
    the names of the weights it would quantize are the same, their scales are added)."""
    named, only = named_source(source, options)
    layouts = named.info.layouts
    if only is not None:
        return {only[name]: tuple(layouts[name].shape) for name in layouts if name in only}
    dropped = _tied_dropped(named)
    splits = hf_expert_splits((named.info.model_config or {}).get("model_type")) if options.names == "files" else ()
    shapes: dict[str, tuple[int, ...]] = {}
    for name, layout in layouts.items():
        if dropped and name == TIED_PAIR[0]:
            continue
        for entry in file_tensors(name, tuple(layout.shape), torch.float32, splits):
            shapes[entry.name] = tuple(entry.shape)
    return shapes


def named_tensors(source: CheckpointSource, options: WeightOptions) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of ``source`` as ``options`` name and type them, in the source's order."""
    named, only = named_source(source, options)
    if only is not None:
        for tensor in named.tensors():
            if tensor.name in only:
                yield only[tensor.name], _typed(tensor, options)
        return
    dropped = _tied_dropped(named)
    config = named.info.model_config or {}
    splits = hf_expert_splits(config.get("model_type")) if options.names == "files" else ()
    quantized = _quantized_names(named, options)
    for tensor in named.tensors():
        if dropped and tensor.name == TIED_PAIR[0]:
            continue
        value = _typed(tensor, options)
        if not splits and quantized is None:
            yield tensor.name, value
            continue
        flat = value.reshape(-1)
        for entry in file_tensors(tensor.name, tuple(tensor.shape), value.dtype, splits):
            start, stop = entry.span(tuple(tensor.shape))
            piece = flat[start:stop].view(entry.shape)
            if quantized is not None and len(entry.shape) == 2 and (
                    tensor.name in quantized or (entry.expert is not None and entry.name.endswith(".weight"))):
                yield from _fp8(entry.name, piece, options)
            else:
                yield entry.name, piece


def _typed(tensor: LogicalTensor, options: WeightOptions) -> torch.Tensor:
    value = tensor.load_tensor(MASTER_WEIGHTS)
    wanted = output_dtype(options.dtype, tensor.dtype)
    return value if value.dtype == wanted else value.to(wanted)


def _quantized_names(source: CheckpointSource, options: WeightOptions) -> set[str] | None:
    """The model's linear weights, which ``quantize="fp8"`` streams as block FP8 as ``to-hf --quantize fp8`` writes
    them (the output projection stays; experts stored one by one are quantized too). None: no quantizing."""
    if options.quantize is None:
        return None
    from deepspeed_ext.checkpoint.model_config import hf_config, linear_weights
    config = source.info.model_config
    if config is None:
        raise CheckpointError(f"{source.info.given}: quantize='fp8' needs the model's config, which the module lacks")
    linear = linear_weights(hf_config(config, None, str(source.info.given)))
    return {name for name in source.info.layouts if name != TIED_PAIR[0] and name in linear}


def _fp8(name: str, weight: torch.Tensor, options: WeightOptions) -> Iterator[tuple[str, torch.Tensor]]:
    from deepspeed_ext.checkpoint import quantization as q
    block = (int(options.fp8_block[0]), int(options.fp8_block[1]))
    if not q.fp8_quantizable(tuple(weight.shape), block):
        yield name, weight  # not whole tiles: kept as it is, as to-hf keeps it
        return
    values, scale_inv = q.quantize_fp8(weight.float(), block)
    yield name, values
    yield name + q.FP8_SCALE_SUFFIX, scale_inv
