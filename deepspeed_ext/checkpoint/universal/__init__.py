"""DeepSpeed's universal checkpoint layout: sink (write) and source (read).

Layout (the one upstream's ``ds_to_universal`` writes, see docs/universal-checkpoints.md)::

    <save dir>/latest_universal            the name of the universal directory (<tag>_universal)
    <save dir>/<tag>_universal/
        zero/<param>/fp32.pt               {'param': full fp32 tensor[, 'cat_dim': d]}; from ZeRO-3 at TP=1 the
                                           bare flat tensor, as upstream writes that case (:class:`FileForm`)
        zero/<param>/exp_avg.pt            same, Adam first moment
        zero/<param>/exp_avg_sq.pt         same, Adam second moment
        zero/<param>/step.pt               the bare optimizer step (none from ZeRO-3: optimizer_state.pt has it)
        zero/optimizer_state.pt            DP0/TP0 optimizer state minus flat tensors, plus param_groups
        mp_rank_XX_model_states.pt         copied unchanged (steps, lr scheduler, client state)
        deepspeed_ext.json                 our UC info (layouts of the source, model config)
        deepspeed_ext.manifest.json        size and CRC-32C of every file above

Without ``-o`` the save directory is the source's (the universal directory goes beside the tag); with
``-o OUT`` it is ``OUT``. The output is built aside and published whole (:mod:`.output`).

One module each: :mod:`.files` (what a per-parameter file holds, shared by both), :mod:`.writer` (the sink,
through :mod:`~deepspeed_ext.checkpoint.writing`'s flow), :mod:`.reader` (the source).
"""

from __future__ import annotations

from deepspeed_ext.checkpoint.universal.files import (
                                                       KNOWN_TENSOR_STATES,
                                                       OPTIMIZER_STATE_FILE,
                                                       FileForm,
                                                       state_file_stem,
)
from deepspeed_ext.checkpoint.universal.reader import UniversalCheckpoint, open_source
from deepspeed_ext.checkpoint.universal.writer import (
                                                       UniversalOptions,
                                                       shares_by_size,
                                                       universal_name,
                                                       write,
                                                       write_fresh_model_states,
)

__all__ = ["KNOWN_TENSOR_STATES", "OPTIMIZER_STATE_FILE", "FileForm", "UniversalCheckpoint", "UniversalOptions",
           "open_source", "shares_by_size", "state_file_stem", "universal_name", "write", "write_fresh_model_states"]
