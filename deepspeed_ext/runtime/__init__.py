"""Engine integration: ``deepspeed_ext.initialize`` = ``deepspeed.initialize`` + UC tagging and hooks.

After DeepSpeed builds the engine (and AutoTP has sharded the model), every parameter is tagged with
its :class:`~deepspeed_ext.module_inject.layout.TPLayout`. The engine's ``save_checkpoint`` then also
writes ``deepspeed_ext.json`` (layouts + model config) into the tag directory, and, when the config
sets ``"checkpoint": {"load_universal": true}``, ``load_checkpoint`` restores universal checkpoints
through :mod:`deepspeed_ext.checkpoint.restore`. The training script changes in one line.

One module per part of an engine's life: :mod:`.init` (``initialize``, ``enable``, ``attach``),
:mod:`.integrations` (the Trainer's and Accelerate's functions we replace, fenced), :mod:`.save` and
:mod:`.save_steps` (the save hook and the commit), :mod:`.background_save` (``async_save``), :mod:`.load` (the
load hook and route), :mod:`.fingerprints` (resume fingerprints).
"""

from __future__ import annotations

from deepspeed_ext.runtime.background_save import (
                                                   ASYNC_SAVE_ATTR,
                                                   PENDING_ATTR,
                                                   finish_background_saves,
                                                   settle_background_save,
                                                   wait_for_saves,
)
from deepspeed_ext.runtime.fingerprints import check_resume_fingerprints
from deepspeed_ext.runtime.init import (
                                                   ENGINE_ATTR,
                                                   attach,
                                                   disable,
                                                   enable,
                                                   enabled,
                                                   initialize,
                                                   refuse_autoep_with_incompatible_transformers,
                                                   refuse_empty_shards_under_zero3,
)
from deepspeed_ext.runtime.load import refuse_incomplete
from deepspeed_ext.runtime.log import logger

__all__ = ["ASYNC_SAVE_ATTR", "ENGINE_ATTR", "PENDING_ATTR", "attach", "check_resume_fingerprints", "disable",
           "enable", "enabled", "finish_background_saves", "initialize", "logger",
           "refuse_autoep_with_incompatible_transformers", "refuse_empty_shards_under_zero3", "refuse_incomplete",
           "settle_background_save", "wait_for_saves"]
