"""What a universal checkpoint's per-parameter files hold, in the forms upstream's ``ds_to_universal`` writes:
shared by the writer and the reader."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from deepspeed_ext.checkpoint.deepspeed import keys
from deepspeed_ext.checkpoint.deepspeed.experts import EP_NUM_EXPERTS, IS_EXPERT_PARAM, is_expert_layout
from deepspeed_ext.checkpoint.source import SourceInfo
from deepspeed_ext.checkpoint.states import ADAM_STATES, MASTER_WEIGHTS, MUON_MOMENTUM
from deepspeed_ext.errors import CheckpointError
from deepspeed_ext.module_inject.layout import TPLayout

OPTIMIZER_STATE_FILE = keys.UNIVERSAL_OPTIMIZER_STATE_FILE


#: States known to be tensors without opening a file (any other name is told by its file's content).
KNOWN_TENSOR_STATES = frozenset({MASTER_WEIGHTS, *ADAM_STATES, MUON_MOMENTUM, "sum"})


def _standalone(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor that owns exactly its bytes: torch.save of a view would pickle the whole storage."""
    tensor = tensor.detach()
    if (not tensor.is_contiguous() or tensor.storage_offset() != 0
            or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size()):
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor


@dataclass(frozen=True)
class FileForm:
    """How the per-parameter files of one source are written: upstream's ``ds_to_universal`` writes two forms, and
    tools and tests that follow it read the one it writes for that kind of checkpoint.

    ``flat``: ZeRO-3 at TP=1 (AutoEP's dense parameters included): each state the bare flat tensor, no dictionary;
    an expert stack keeps its dictionary (its loader reads the expert count from it). ``step_files``: ZeRO-3's
    step lives in ``zero/optimizer_state.pt`` alone, as upstream's loader reads it."""

    flat: bool = False
    step_files: bool = True

    @classmethod
    def of(cls, info: SourceInfo) -> FileForm:
        zero3 = info.zero_stage == 3
        return cls(flat=zero3 and info.tp_degree == 1, step_files=not zero3)

    def content(self, tensor: torch.Tensor, layout: TPLayout) -> Any:
        """What the file of ``tensor`` (a state of a parameter of ``layout``) holds."""
        if self.flat and not is_expert_layout(layout):
            return _standalone(tensor).reshape(-1)
        return _entry(tensor, layout)


def _entry(tensor: torch.Tensor, layout: TPLayout) -> dict[str, Any]:
    """A per-parameter file's dictionary, with the keys upstream's ``ds_to_universal`` writes for it."""
    entry: dict[str, Any] = {keys.PARAM: _standalone(tensor)}
    if layout.tp_size == 1 or (not layout.is_replicated and layout.view_shape is None
                               and len(layout.sub_param_sizes) == 1):
        # Lets DeepSpeed's legacy (non-AutoTP) restore path chunk the tensor along the right dim. Upstream writes it
        # for every tensor of a TP=1 checkpoint too (0: its loader chunks a whole tensor over a TP degree by dim 0).
        entry[keys.CAT_DIM] = layout.partition_dim or 0
    if is_expert_layout(layout):
        # As upstream marks an AutoEP expert stack: its loader cuts each EP rank's experts along dim 0.
        entry[IS_EXPERT_PARAM] = True
        entry[EP_NUM_EXPERTS] = layout.shape[0]
    if layout.role == "vocab":
        # As upstream marks a vocabulary-parallel table. Its loader pads the table only where the model carries
        # no AutoTP restore metadata; the tensor itself is the unpadded vocabulary either way.
        entry[keys.VOCAB_TENSOR] = True
    return entry


def state_file_stem(name: str, state: str) -> str:
    """The file name (less ``.pt``) of a state: the optimizer's own key, refused where it cannot be one."""
    if not re.fullmatch(r"[A-Za-z0-9_]+", state):
        raise CheckpointError(f"{name}: optimizer state {state!r} has a name that cannot be a file name")
    return state


def as_int(value: Any) -> int | None:
    if value is None:
        return None
    return int(value.item()) if torch.is_tensor(value) else int(value)
