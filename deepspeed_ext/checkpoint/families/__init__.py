"""Model families: how a model's (= universal) parameter names map to MaxText paths and HF file names.

The registry: one module per family in :data:`FAMILY_MODULES`, each exporting ``FAMILIES`` (its
:class:`Family` objects). A module holds data only: everything about its families — the HF ``model_type``
(and RoPE type) that identifies them, one :class:`Rule` per parameter, and where transformers' files name
parameters differently from the model, :class:`ExpertSplit` entries. Adding a family is one new module plus
its name in :data:`FAMILY_MODULES`. The
transforms the rules name (transpose, per-head reshape, query scaling, RoPE interleave, expert split)
are part of the MaxText format and live in :mod:`deepspeed_ext.checkpoint.maxtext`; the HF file layout
lives in :mod:`deepspeed_ext.checkpoint.hf`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deepspeed_ext.errors import CheckpointError

LAYER = "{layer}"  # in Rule.hf: the decoder layer index
LAYERS = "{layers}"  # in Rule.path: "layers" when scanned, "layers_<i>" when not
EXPERT = "{expert}"  # in ExpertSplit.pieces: the expert index


@dataclass(frozen=True)
class Rule:
    """One HF parameter ⇄ one MaxText leaf (an HF tensor may feed several rules, e.g. fused experts)."""

    hf: str  # HF name, with "{layer}" for per-layer parameters
    path: str  # MaxText path under params/params, "/"-separated, with "{layers}" for per-layer leaves
    kind: str  # the transform (see maxtext.TRANSFORMS)

    @property
    def per_layer(self) -> bool:
        return LAYER in self.hf


@dataclass(frozen=True)
class ExpertSplit:
    """A fused expert parameter that HF checkpoint files store one tensor per expert.

    transformers 5.x models hold a layer's experts as one 3-D parameter ``[E, ...]`` but read and write
    the per-expert tensors of older checkpoints. Expert ``e``'s slice ``param[e]`` is cut into
    ``len(pieces)`` equal parts along its first axis, in the order of ``pieces`` (gate rows before up rows).
    """

    param: str  # the model's name, with "{layer}"
    pieces: tuple[str, ...]  # the file's names, with "{layer}" and "{expert}"


@dataclass(frozen=True)
class Family:
    """A model family's MaxText conventions."""

    name: str
    rules: tuple[Rule, ...]
    #: MaxText bakes 1/sqrt(head_dim) into the query kernel for this family (llama2/3.1, mistral, mixtral).
    query_scaled: bool
    #: MaxText uses adjacent-pair (Meta/GPT-J) RoPE for this family (llama3.1): q/k heads are interleaved.
    rope_interleaved: bool
    #: The MaxText settings a user loads the checkpoint with (for docs and `inspect`).
    maxtext_settings: Mapping[str, Any]
    #: The HF ``model_type`` the family reads (``config.json``).
    model_type: str = ""
    #: Among families of one model_type, the HF RoPE type that picks this one (None: the default).
    rope_type: str | None = None
    #: Rules for the untied output projection; dropped when the model ties it to the embedding.
    untied_rules: tuple[Rule, ...] = ()
    #: How transformers' files split the model's fused expert parameters (none: the files use the model's names).
    hf_expert_splits: tuple[ExpertSplit, ...] = ()

    def rules_for(self, tied: bool) -> tuple[Rule, ...]:
        return self.rules if tied else self.rules + self.untied_rules


#: The family modules (under this package), each exporting ``FAMILIES``.
FAMILY_MODULES = ("llama", "qwen3", "qwen3_moe")


def _families() -> dict[str, Family]:
    import importlib
    found = [family for module in FAMILY_MODULES
             for family in importlib.import_module(f"{__name__}.{module}").FAMILIES]
    return {family.name: family for family in found}


def family_names() -> list[str]:
    return list(_families())


def get_family(name: str) -> Family:
    """The family called ``name`` (``qwen3_moe``, the HF spelling, is read as ``qwen3-moe``)."""
    families = _families()
    family = families.get(name) or families.get(name.replace("_", "-"))
    if family is None:
        raise CheckpointError(f"unknown model family {name!r}; known: {', '.join(families)}")
    return family


def hf_expert_splits(model_type: str | None) -> tuple[ExpertSplit, ...]:
    """How ``model_type``'s HF files split its fused expert parameters (none: the files use the model's names)."""
    return next((f.hf_expert_splits for f in _families().values() if f.model_type == model_type), ())


def infer_family(model_config: Mapping[str, Any], source: str = "model config") -> Family:
    """The family of an HF config: its ``model_type``, and among families of one type the RoPE type (Llama with
    llama3 RoPE scaling is llama3.1)."""
    model_type = model_config.get("model_type")
    rope = model_config.get("rope_scaling") or model_config.get("rope_parameters") or {}
    rope_type = rope.get("rope_type") or rope.get("type") if isinstance(rope, Mapping) else None
    candidates = [f for f in _families().values() if f.model_type == model_type]
    if not candidates:
        raise CheckpointError(f"{source}: model_type {model_type!r} has no MaxText mapping; pass --family "
                              f"({', '.join(family_names())})")
    return next((f for f in candidates if f.rope_type == rope_type),
                next((f for f in candidates if f.rope_type is None), candidates[0]))
