"""peft's LoRA layers on a live model, fenced: the one module that reads a ``LoraLayer``'s parts (its base layer, its
``lora_A`` / ``lora_B`` / ``lora_dropout`` dicts, its variants such as DoRA) or puts it back in its parent.

peft renames these between releases; :func:`check_lora_layer` names, in one line, a part a layer lacks instead of
an AttributeError while a model is being sharded. peft itself is never imported here unless the process already
imported it (a model with peft layers cannot exist otherwise).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from deepspeed_ext.errors import DeepSpeedExtError

#: What every LoRA layer the tensor-parallel code touches must have.
_LAYER_PARTS = ("base_layer", "lora_A", "lora_B", "lora_dropout")


@dataclass
class LoraLinear:
    """A peft LoRA layer over a linear base: where it sits (``parent.<attribute>``) and the layer itself."""

    name: str
    layer: Any  # peft's LoraLayer (untyped)
    parent: torch.nn.Module
    attribute: str

    @property
    def base(self) -> Any:
        return self.layer.base_layer

    def adapter_names(self) -> list[str]:
        return [str(name) for name in self.layer.lora_A.keys()]

    def pair(self, adapter: str) -> tuple[Any, Any]:
        """``(lora_A, lora_B)`` of ``adapter``: two ``nn.Linear`` (in -> r, r -> out)."""
        return self.layer.lora_A[adapter], self.layer.lora_B[adapter]

    def dropout(self, adapter: str) -> Any:
        return self.layer.lora_dropout[adapter]

    def dropout_p(self, adapter: str) -> float:
        """The adapter's dropout probability (0 for peft's ``nn.Identity``)."""
        module = self.dropout(adapter)
        return float(module.p) if isinstance(module, torch.nn.Dropout) else 0.0

    def variants(self) -> list[str]:
        """Adapters of this layer that are not plain LoRA (DoRA, aLoRA, ...): their forward is peft's own math over
        the whole weight, which a tensor-parallel shard cannot run as is."""
        variant = getattr(self.layer, "lora_variant", None) or {}
        dora = getattr(self.layer, "use_dora", None) or {}
        return sorted({str(name) for name in variant} | {str(name) for name, on in dora.items() if on})

    def refuse_mixed_batches(self, why: Exception) -> None:
        """Make peft's forward for a batch that mixes adapters (``adapter_names=``, which peft's forward hooks hand to
        each layer) raise ``why`` in this layer instead of running."""
        if not hasattr(self.layer, "_mixed_batch_forward"):
            return  # this peft has no mixed batches

        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise why
        self.layer._mixed_batch_forward = refuse

    def detach(self) -> None:
        """Put the base layer where the LoRA layer was (AutoTP then shards it as it shards a plain model)."""
        setattr(self.parent, self.attribute, self.base)

    def reattach(self) -> None:
        """Put the LoRA layer back over whatever now sits in its place (the base, or the AutoTP layer cut from it)."""
        current = getattr(self.parent, self.attribute)
        if current is not self.layer:
            self.layer.base_layer = current
            setattr(self.parent, self.attribute, self.layer)


def _lora_layer_class() -> type | None:
    if "peft" not in sys.modules:
        return None
    from peft.tuners.lora import LoraLayer
    found: type = LoraLayer
    return found


def lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """``(name, layer)`` of every peft LoRA layer of ``model`` (any base: linear, embedding, conv, parameter)."""
    cls = _lora_layer_class()
    if cls is None:
        return
    for name, module in model.named_modules():
        if isinstance(module, cls):
            yield name, module


def check_lora_layer(name: str, layer: Any) -> None:
    """One line naming the parts of ``layer`` this module reads that the installed peft does not give it."""
    missing = [part for part in _LAYER_PARTS if not hasattr(layer, part)]
    if missing:
        import peft
        raise DeepSpeedExtError(f"peft {peft.__version__}'s LoRA layer {name!r} ({type(layer).__name__}) has no "
                                f"{', '.join(missing)}, which deepspeed-ext reads to shard adapters under AutoTP")


def lora_linears(model: torch.nn.Module, base_is: Callable[[torch.nn.Module], bool]) -> list[LoraLinear]:
    """The LoRA layers of ``model`` whose base layer ``base_is`` accepts (an ``nn.Linear``, which AutoTP shards, or
    the AutoTP layer cut from one), with their places."""
    modules = dict(model.named_modules())
    found = []
    for name, layer in lora_layers(model):
        check_lora_layer(name, layer)
        if not base_is(layer.base_layer):
            continue
        parent_name, _, attribute = name.rpartition(".")
        found.append(LoraLinear(name, layer, modules[parent_name], attribute))
    return found
