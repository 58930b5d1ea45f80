"""Multimodal releases whose text model is a supported family (Gemma 3): where its tensors sit in the files.

A released ``Gemma3ForConditionalGeneration`` checkpoint holds the language model beside a vision tower and a
projector, and its ``config.json`` nests the text model's config under ``text_config``. Two namings are in use:

* ``model.language_model.<name>`` (transformers 5's own, and what ``save_pretrained`` writes), the output
  projection as ``lm_head.weight`` (usually left out: tied to the embedding);
* ``language_model.model.<name>`` (older files), the projection as ``language_model.lm_head.weight``.

The text model read from either is the causal LM of ``text_config`` with the usual names (``model.<name>``); the
other tensors (``vision_tower``, ``multi_modal_projector``) are set aside, and ``to-hf --like DIR`` puts them back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from deepspeed_ext.errors import CheckpointError

TEXT_CONFIG = "text_config"
HEAD = "lm_head.weight"


@dataclass(frozen=True)
class TextNaming:
    """How a multimodal file names its text model's tensors."""

    prefix: str  # the stored prefix that stands for the text model's "model."
    head: str  # the stored name of the output projection

    def model_name(self, stored: str) -> str | None:
        """The causal LM's name of a stored tensor (None: not the text model's)."""
        if stored.startswith(self.prefix):
            return "model." + stored[len(self.prefix):]
        return HEAD if stored == self.head else None

    def stored_name(self, name: str) -> str:
        """The stored name of a causal LM tensor."""
        if name == HEAD:
            return self.head
        if not name.startswith("model."):
            raise CheckpointError(f"{name}: not a text model tensor (expected model.* or {HEAD})")
        return self.prefix + name[len("model."):]


NAMINGS = (TextNaming("model.language_model.", HEAD), TextNaming("language_model.model.", "language_model." + HEAD))


def is_multimodal(config: Mapping[str, Any]) -> bool:
    """A config that nests its language model's config (``text_config``)."""
    return isinstance(config.get(TEXT_CONFIG), Mapping)


def naming_of(names: Iterable[str], source: str) -> TextNaming:
    """Which naming the files use; one line when they use none or both."""
    names = list(names)
    used = [naming for naming in NAMINGS if any(name.startswith(naming.prefix) for name in names)]
    if len(used) != 1:
        found = "none" if not used else " and ".join(f"{n.prefix}*" for n in used)
        raise CheckpointError(f"{source}: a multimodal checkpoint whose text model is under "
                              f"{' or '.join(n.prefix + '*' for n in NAMINGS)}; found {found}")
    return used[0]


def text_model_config(config: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The causal LM config of a multimodal config: its ``text_config``, with what the outer config holds for it
    (the dtype, tied embeddings) and the causal LM's architecture."""
    from deepspeed_ext.checkpoint.model_config import causal_lm_class
    text = dict(config[TEXT_CONFIG])
    model_type = text.get("model_type")
    if not model_type:
        raise CheckpointError(f"{source}: text_config has no model_type")
    for key in ("dtype", "torch_dtype", "tie_word_embeddings"):
        if key not in text and key in config:
            text[key] = config[key]
    architecture = causal_lm_class(str(model_type))
    if architecture is None:
        raise CheckpointError(f"{source}: the text model's model_type {model_type!r} has no causal LM in "
                              "transformers")
    text["architectures"] = [architecture]
    return text
