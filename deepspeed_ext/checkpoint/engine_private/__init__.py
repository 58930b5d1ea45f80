"""DeepSpeed's live engine, fenced: the one package that reads or writes a running engine's and optimizer's
internals (flat groups, ``_hp_mapping`` fragments, ZeRO-3 partitions, the loss scaler, swapped states, the
checkpoint engine, tensor-parallel groups).

DeepSpeed changes these between releases without notice; everything deepspeed-ext does to a live engine (the
restore, the save's fingerprints, the save hooks, the tests' state dumps) goes through the functions here, so a
new release is adapted in this package alone. :func:`check_installed_deepspeed` runs at ``initialize`` and names, in one
line, any part of the installed DeepSpeed that is not what these functions expect, instead of failing deep inside
a save or a load. What a *saved* checkpoint holds is the readers' business (``checkpoint/deepspeed/``): nothing
here touches files.

Without ZeRO (stage 0) DeepSpeed runs the optimizer through one of three wrappers, and each keeps its state
differently (the saved form of each is decoded by :mod:`~deepspeed_ext.checkpoint.deepspeed.zero0`, under the
same names):

* ``FP16_Optimizer`` (fp16/bf16 with a fused Adam): one flat fp32 master per param group, the group's parameters
  concatenated without padding; the torch optimizer's state is keyed by that flat master;
* ``FP16_UnfusedOptimizer`` (fp16/bf16 with any other optimizer): one fp32 master per parameter, and the torch
  state keyed by it;
* no wrapper (fp32): the torch optimizer steps the parameters themselves.

One module per concern: :mod:`.check` (the up-front check), :mod:`.engine` (shape, groups, checkpoint engine,
hooked methods), :mod:`.optimizer` (where state lives), :mod:`.restore_state` (writing restored state),
:mod:`.autotp_layers` (AutoTP layer classes, imported by the tagging alone, where it needs them). Callers use
the package: ``engine_private.<function>``.
"""

from __future__ import annotations

from deepspeed_ext.checkpoint.engine_private.check import check_installed_deepspeed, missing_deepspeed_parts
from deepspeed_ext.checkpoint.engine_private.engine import (
    LOW_PRECISION,
    LiveExperts,
    autoep_layers,
    checkpoint_engine,
    checkpoint_files_written_by,
    data_parallel_group,
    data_parallel_size,
    engine_is_pipeline,
    has_moe_layers,
    is_zero3_param,
    loads_universal,
    model_parallel_info,
    model_states_file,
    module_weights_apart,
    node_local_storage,
    partitions_weights,
    pipeline_stage,
    recovery_scripts_copied_by,
    saves_in_background,
    set_writes_model_states,
    step_settings,
    stored_shape,
    tp_group_info,
    uses_zero,
    wrap_engine_method,
    writes_model_states,
    writes_torch_zip_files,
    zero3_numel,
    zero3_partition,
    zero3_process_group,
    zero_stage,
)
from deepspeed_ext.checkpoint.engine_private.optimizer import (
    LiveSlot,
    base_optimizer,
    live_kind,
    live_param_groups,
    live_slots,
    live_steps,
    muon_whole_offsets,
    owned_state,
    stage0_param_names,
    stage0_slots,
    state_targets,
    wrapped_optimizer,
)
from deepspeed_ext.checkpoint.engine_private.restore_state import (
    StateEntries,
    ensure_optimizer_states,
    expected_tensor_states,
    frozen_weight_targets,
    held_weights,
    live_tensor_states,
    no_optimizer_holds,
    owned_frozen_weights,
    refresh_zero3_partitions,
    set_engine_counters,
    set_optimizer_groups,
    set_optimizer_scalars,
    set_zero3_partition,
    zero3_partition_in_place,
)

__all__ = ["LOW_PRECISION", "LiveExperts", "LiveSlot", "StateEntries", "autoep_layers", "base_optimizer", "check_installed_deepspeed", "checkpoint_engine", "checkpoint_files_written_by", "data_parallel_group", "data_parallel_size", "engine_is_pipeline", "ensure_optimizer_states", "expected_tensor_states", "frozen_weight_targets", "has_moe_layers", "held_weights", "is_zero3_param", "live_kind", "live_param_groups", "live_slots", "live_steps", "live_tensor_states", "loads_universal", "missing_deepspeed_parts", "model_parallel_info", "model_states_file", "module_weights_apart", "muon_whole_offsets", "no_optimizer_holds", "node_local_storage", "owned_frozen_weights", "owned_state", "partitions_weights", "pipeline_stage", "recovery_scripts_copied_by", "refresh_zero3_partitions", "saves_in_background", "set_engine_counters", "set_optimizer_groups", "set_optimizer_scalars", "set_writes_model_states", "set_zero3_partition", "stage0_param_names", "stage0_slots", "state_targets", "step_settings", "stored_shape", "tp_group_info", "uses_zero", "wrap_engine_method", "wrapped_optimizer", "writes_model_states", "writes_torch_zip_files", "zero3_numel", "zero3_partition", "zero3_partition_in_place", "zero3_process_group", "zero_stage"]
