"""An adapter checkpoint seen as the model its adapters make: each adapted weight merged (``W + scale * B @ A``, DoRA
rescaled), each module saved whole taken from the adapter, peft's names undone. ``to-hf --merge`` and ``to-maxtext``
write it through their usual writers; it is a :class:`~deepspeed_ext.checkpoint.source.CheckpointSource` like any
other, with the fp32 weights alone.

The base weights are the checkpoint's own (frozen, they are in its model states), or a base model's (``--base``),
checked against each other where both are there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from deepspeed_ext.checkpoint.adapters import AdapterModel, LoraModule
from deepspeed_ext.checkpoint.source import CheckpointSource, SourceInfo
from deepspeed_ext.checkpoint.states import MASTER_WEIGHTS
from deepspeed_ext.checkpoint.tensor import LogicalTensor
from deepspeed_ext.errors import CheckpointError


def trained_value(tensor: LogicalTensor) -> torch.Tensor:
    """A tensor's weights as the model ran with them: the master rounded to the module's dtype, in fp32."""
    return tensor.load_tensor(MASTER_WEIGHTS).to(tensor.dtype).float()


def lora_delta(module: LoraModule, adapter: str, tensors: Mapping[str, LogicalTensor], model: AdapterModel,
               shape: tuple[int, ...]) -> torch.Tensor:
    """``scale * B @ A`` of one adapter at one layer, in fp32, in the base weight's shape."""
    a, b = trained_value(tensors[module.a[adapter]]), trained_value(tensors[module.b[adapter]])
    settings = model.adapters[adapter]
    scale = settings.scaling(model.unwrapped(module.module), a.shape[0])
    delta = b @ a
    if module.embedding or settings.fan_in_fan_out:
        delta = delta.T  # an embedding's (vocab x dim), GPT-2's Conv1D (in x out)
    if tuple(delta.shape) != tuple(shape):
        raise CheckpointError(f"{module.a[adapter]}: B @ A is {tuple(delta.shape)}, the base weight "
                              f"{tuple(shape)}; not a LoRA adapter of this layer")
    return scale * delta


class MergedSource:
    """``source`` (an adapter checkpoint) as the merged model of ``adapters``; ``base``: a base model's checkpoint
    whose weights to use, checked against the checkpoint's."""

    def __init__(self, source: CheckpointSource, model: AdapterModel, adapters: list[str],
                 base: CheckpointSource | None = None) -> None:
        self.source, self.model, self.adapters, self.base = source, model, adapters, base
        for adapter in adapters:
            settings = model.adapters[adapter]
            if settings.peft_type != "LORA":
                raise CheckpointError(f"{source.info.given}: adapter {adapter!r} is {settings.peft_type}; only LoRA "
                                      "adapters can be merged")
            if settings.use_dora and any(m.embedding and adapter in m.magnitude for m in model.lora.values()):
                raise CheckpointError(f"{source.info.given}: adapter {adapter!r}: DoRA on an embedding cannot be "
                                      "merged here; write the PEFT adapter instead (to-hf without --merge)")
            settings.scaling("", 1)  # the config is known: else one line on how to give it
            unbiased = [m.module for m in model.lora.values() if adapter in m.b_bias and "bias" not in m.base]
            if unbiased:
                raise CheckpointError(f"{source.info.given}: adapter {adapter!r} trains a bias (lora_bias) on "
                                      f"{unbiased[0]}, whose base layer has none: the merged model has nowhere to put "
                                      "it (peft cannot merge it either); write the PEFT adapter instead (to-hf "
                                      "without --merge)")
        self._names = self._merged_names()

    def _merged_names(self) -> dict[str, str]:
        """Checkpoint name -> merged name, for every tensor the merged model has, in the checkpoint's order."""
        model, chosen = self.model, self.adapters
        merged: dict[str, str] = {}
        for name in self.source.info.layouts:
            if name in model.plain:
                merged[name] = model.plain[name]
        for module in model.lora.values():
            for key, name in module.base.items():
                merged[name] = model.unwrapped(f"{module.module}.{key}")
        for saved in model.saved.values():
            copies = [saved.copies[a] for a in chosen if a in saved.copies]
            keys = copies[0] if copies else saved.original
            for key, name in keys.items():
                merged[name] = model.unwrapped(f"{saved.module}.{key}")
        return {name: merged[name] for name in self.source.info.layouts if name in merged}

    @property
    def info(self) -> SourceInfo:
        info = self.source.info
        layouts = info.layouts
        return dataclasses.replace(
            info, layouts={merged: layouts[name] for name, merged in self._names.items()}, states=(MASTER_WEIGHTS,),
            fingerprints=None, optimizer_settings=None, frozen=(), adapters=None,
            model_class=None if info.model_class and info.model_class.startswith("Peft") else info.model_class)

    @property
    def read_paths(self) -> list[Path]:
        return [*self.source.read_paths, *(self.base.read_paths if self.base is not None else [])]

    def summary(self) -> dict[str, Any]:
        return {**self.source.summary(), "merged_adapters": ", ".join(self.adapters)}

    def raise_if_damaged(self) -> None:
        self.source.raise_if_damaged()
        if self.base is not None:
            self.base.raise_if_damaged()

    def tensors(self) -> Iterator[LogicalTensor]:
        tensors = {tensor.name: tensor for tensor in self.source.tensors()}
        base = {tensor.name: tensor for tensor in self.base.tensors()} if self.base is not None else {}
        by_base = {name: module for module in self.model.lora.values() for name in module.base.values()}
        for name, merged in self._names.items():
            tensor = tensors[name]
            loader = self._base_loader(tensor, merged, base)
            module = by_base.get(name)
            if module is not None and name == module.base["weight"]:
                loader = self._merged_loader(module, loader, tuple(tensor.shape), tensors)
            elif module is not None and name == module.base.get("bias"):
                loader = self._bias_loader(module, loader, tensors)
            yield LogicalTensor(name=merged, shape=tuple(tensor.shape), layout=tensor.layout, states=(MASTER_WEIGHTS,),
                                loader=_only_weights(merged, loader), dtype=tensor.dtype)

    def _base_loader(self, tensor: LogicalTensor, merged: str,
                     base: Mapping[str, LogicalTensor]) -> Callable[[], torch.Tensor]:
        """The weights of ``tensor`` (the checkpoint's), checked against the base model's where one is given."""
        given = base.get(merged)
        if self.base is not None and given is None and not tensor.trainable:
            raise CheckpointError(f"{self.base.info.given}: the base model has no {merged!r}, which the adapter "
                                  "checkpoint's base holds; wrong --base?")
        if given is not None and tuple(given.shape) != tuple(tensor.shape):
            raise CheckpointError(f"{self.base.info.given if self.base else ''}: {merged} is {tuple(given.shape)}, the "
                                  f"adapter checkpoint's base has {tuple(tensor.shape)}; wrong --base?")

        def load() -> torch.Tensor:
            value = tensor.load_tensor(MASTER_WEIGHTS)
            if given is not None and not tensor.trainable:
                theirs = given.load_tensor(MASTER_WEIGHTS)
                if not torch.equal(theirs.to(value.dtype), value):
                    raise CheckpointError(f"{self.base.info.given if self.base else ''}: {merged} differs from the "
                                          "base weights the adapters were trained on (the checkpoint's frozen copy); "
                                          "wrong --base?")
            return value
        return load

    def _merged_loader(self, module: LoraModule, base: Callable[[], torch.Tensor], shape: tuple[int, ...],
                       tensors: Mapping[str, LogicalTensor]) -> Callable[[], torch.Tensor]:
        def load() -> torch.Tensor:
            weight = base().float()
            for adapter in self.adapters:
                if adapter not in module.a:
                    continue
                delta = lora_delta(module, adapter, tensors, self.model, shape)
                if adapter in module.magnitude:  # DoRA: each output row rescaled to the trained magnitude
                    magnitude = trained_value(tensors[module.magnitude[adapter]])
                    combined = weight + delta
                    weight = combined * (magnitude / torch.linalg.norm(combined, dim=1)).view(-1, 1)
                else:
                    weight = weight + delta
            return weight
        return load

    def _bias_loader(self, module: LoraModule, base: Callable[[], torch.Tensor],
                     tensors: Mapping[str, LogicalTensor]) -> Callable[[], torch.Tensor]:
        def load() -> torch.Tensor:
            bias = base().float()
            for adapter in self.adapters:
                if adapter in module.b_bias:  # lora_bias: lora_B's bias, scaled, adds to the layer's
                    rank = tensors[module.a[adapter]].shape[0]
                    scale = self.model.adapters[adapter].scaling(self.model.unwrapped(module.module), rank)
                    bias = bias + scale * trained_value(tensors[module.b_bias[adapter]])
            return bias
        return load


def _only_weights(name: str, load: Callable[[], torch.Tensor]) -> Callable[[str], torch.Tensor]:
    def loader(state: str) -> torch.Tensor:
        if state != MASTER_WEIGHTS:
            raise KeyError(f"{name}: a merged weight has no state {state!r}")
        return load()
    return loader


class AdaptersOnBase:
    """An adapter checkpoint saved without its frozen parameters (the Trainer saves a peft model so) on the base model
    ``base`` (an HF directory): the base's tensors under the adapted model's names, frozen, then the checkpoint's own.
    What :class:`MergedSource` merges when the checkpoint holds no base weights of its own."""

    def __init__(self, source: CheckpointSource, model: AdapterModel, base: CheckpointSource) -> None:
        self.source, self.base = source, base
        held = set(source.info.layouts)
        names = model.base_live_names(base.info.layouts, f"{base.info.given} (--base of {source.info.given})")
        self._base_names = {name: live for name, live in names.items() if live not in held}

    @property
    def info(self) -> SourceInfo:
        info, base = self.source.info, self.base.info
        layouts = {live: base.layouts[name] for name, live in self._base_names.items()}
        layouts.update(info.layouts)
        return dataclasses.replace(info, layouts=layouts, model_config=info.model_config or base.model_config,
                                   frozen=(*info.frozen, *self._base_names.values()))

    @property
    def read_paths(self) -> list[Path]:
        return [*self.source.read_paths, *self.base.read_paths]

    def summary(self) -> dict[str, Any]:
        return {**self.source.summary(), "base": str(self.base.info.given)}

    def raise_if_damaged(self) -> None:
        self.source.raise_if_damaged()
        self.base.raise_if_damaged()

    def tensors(self) -> Iterator[LogicalTensor]:
        for tensor in self.base.tensors():
            live = self._base_names.get(tensor.name)
            if live is not None:
                yield dataclasses.replace(tensor, name=live, trainable=False)
        yield from self.source.tensors()
