"""Where a receiver puts an update: a transformers model (in place), a vLLM model (its ``load_weights``), or a
callback. Each says which names it loads (:data:`~deepspeed_ext.weights.naming.NAMINGS`) and checks the shapes
of an update against its own before anything of it is loaded."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from deepspeed_ext.errors import CheckpointError


class Sink:
    """What :func:`~deepspeed_ext.receive_weights` loads into."""

    #: The names this sink loads (``hf``, ``files``, ``module``).
    names = "hf"

    def check(self, shapes: Mapping[str, tuple[int, ...]], label: str) -> None:
        """Refuse, in one line naming the first tensor, an update that does not fit (before any of it is loaded)."""

    def load(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError


class ModuleSink(Sink):
    """A torch module (a transformers model, a ``PeftModel``): each tensor copied into the parameter or persistent
    buffer of its name, in place (a tied weight once, both names then hold it)."""

    def __init__(self, module: torch.nn.Module, names: str = "hf"):
        self.module, self.names = module, names
        self.targets: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
        persistent = set(module.state_dict(keep_vars=True))
        self.targets.update((name, buffer) for name, buffer in module.named_buffers() if name in persistent)
        #: Every tensor the module holds once: what a whole update must carry.
        self.required = {name for name, _ in module.named_parameters(remove_duplicate=True)}

    def check(self, shapes: Mapping[str, tuple[int, ...]], label: str) -> None:
        for name, shape in shapes.items():
            target = self.targets.get(name)
            if target is None:
                raise CheckpointError(f"{label}: {name} {list(shape)} has no place in the receiving "
                                      f"{type(self.module).__name__} (another model?)")
            if tuple(target.shape) != tuple(shape):
                raise CheckpointError(f"{label}: {name} is {list(shape)} in the update, {list(target.shape)} in the "
                                      f"receiving {type(self.module).__name__} (another model, or a model sharded "
                                      "another way?)")
        whole = self.required - set(shapes)
        tied = {name for name in whole if any(self.targets[name] is self.targets[other] for other in shapes)}
        missing = sorted(whole - tied)
        if missing and not all("lora_" in name for name in shapes):  # an update of the adapters alone
            raise CheckpointError(f"{label}: the update carries no {missing[0]} (and {len(missing) - 1} more), which "
                                  f"the receiving {type(self.module).__name__} holds")

    def load(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, value in tensors:
                target = self.targets[name]
                if value.data_ptr() != target.data_ptr():  # else it was received in place
                    target.copy_(value)


class LoadWeightsSink(Sink):
    """A model with vLLM's ``load_weights(weights: Iterable[tuple[str, torch.Tensor]])``: the HF files' names,
    handed over as they arrive (vLLM shards them onto its own TP ranks)."""

    names = "files"

    def __init__(self, model: Any):
        self.model = model

    def load(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.model.load_weights(iter(tensors))


class CallbackSink(Sink):
    """``callback(name, tensor)`` for each tensor."""

    def __init__(self, callback: Callable[[str, torch.Tensor], Any], names: str = "hf"):
        self.callback, self.names = callback, names

    def load(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, value in tensors:
            self.callback(name, value)


def sink_for(sink: Any, names: str | None = None, adapters_only: bool = False) -> Sink:
    """The :class:`Sink` for what was given: a Sink, a model with ``load_weights`` (vLLM), a module, a callable."""
    if isinstance(sink, Sink):
        return sink
    if callable(getattr(sink, "load_weights", None)) and names in (None, "files"):
        return LoadWeightsSink(sink)
    if isinstance(sink, torch.nn.Module):
        return ModuleSink(sink, names or ("module" if adapters_only else "hf"))
    if callable(sink):
        return CallbackSink(sink, names or "hf")
    raise TypeError(f"a weight sink is a torch module, a model with load_weights(iterable), or a callable "
                    f"(name, tensor); not {type(sink).__name__}")
