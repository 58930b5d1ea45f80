"""Source: a regular DeepSpeed checkpoint (TP slices × ZeRO partitions) as a stream of full tensors.

Files (see docs/universal-checkpoints.md):

* ``<tag>/mp_rank_{tp:02d}_model_states.pt`` — one per TP rank (ZeRO-3: ``zero_pp_rank_{dp}_mp_rank_{tp:02d}
  _model_states.pt`` per rank): ``param_shapes`` (TP-local shapes in flat-buffer order), degrees, steps,
  ``universal_checkpoint_info`` (upstream's tags), client state; without ZeRO the whole optimizer.
* ``<tag>/[bf16_]zero_pp_rank_{dp}_mp_rank_{tp:02d}_optim_states.pt`` — with ZeRO, one per (dp, tp): flat fp32
  master partitions and flat Adam moments per param group.

The package, one concern per module:

* :mod:`.keys` — every file name and key DeepSpeed writes (a renamed key in a new release changes here);
* :mod:`.files` — finding the tag directory and its files, loading each once, memory-mapped;
* :mod:`.zero0` — the three stage-0 optimizer wrappers, decoded live (restore, demo) and saved (reader);
* :mod:`.layouts` — DeepSpeed's optimizer layouts (no ZeRO, ZeRO-1/2, BF16_Optimizer, ZeRO-3), one
  class each, chosen once per checkpoint: where each parameter's fragments lie;
* :mod:`.reader` — :class:`DeepSpeedCheckpoint`: merging TP slices, resharding, the source interface.

Everything is opened memory-mapped; a parameter's fragments are narrowed out of the flat buffers,
concatenated over DP ranks, and merged over TP ranks with the parameter's :class:`TPLayout`. No
temporary files, and only the bytes of the parameter being merged are read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deepspeed_ext.checkpoint.deepspeed.keys import MODEL_STATES_RE, OPTIM_STATES_RE, ZERO3_MODEL_STATES_RE

if TYPE_CHECKING:
    from deepspeed_ext.checkpoint.deepspeed.files import resolve_tag_dir
    from deepspeed_ext.checkpoint.deepspeed.reader import DeepSpeedCheckpoint, check_files, open_source
    from deepspeed_ext.checkpoint.deepspeed.tag import HOW_TO_GET_METADATA

__all__ = ["DeepSpeedCheckpoint", "HOW_TO_GET_METADATA", "MODEL_STATES_RE", "OPTIM_STATES_RE", "ZERO3_MODEL_STATES_RE",
           "check_files", "open_source", "resolve_tag_dir"]

_LAZY = {"resolve_tag_dir": "files", "HOW_TO_GET_METADATA": "tag", "DeepSpeedCheckpoint": "reader",
         "open_source": "reader", "check_files": "reader"}


def __getattr__(name: str) -> Any:
    # The key names (``.keys``) are importable without torch; the reader is loaded on first use.
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
