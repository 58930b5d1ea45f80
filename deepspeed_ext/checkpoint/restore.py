"""Sink: load a universal checkpoint, or a regular DeepSpeed checkpoint, into a live engine at any TP/DP degree.

Each rank asks the checkpoint for its TP slice under the *target* model's :class:`TPLayout` (computed by
the live AutoTP layers). A universal checkpoint cuts it from the full tensor; a DeepSpeed checkpoint
assembles it from the overlapping pieces of the saved TP slices and ZeRO partitions (load-time resharding, no
conversion step). DeepSpeed's fragment API then keeps only this DP rank's part; a ZeRO-3 rank asks for its DP
partition of the slice only. Both sources read those ranges with ``pread``, readahead off (:mod:`.ranges`), so
a rank reads the pages of its own ranges, not whole tensors and not its neighbours' pages.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, cast

import torch

from deepspeed_ext.checkpoint import engine_private
from deepspeed_ext.checkpoint.deepspeed import keys
from deepspeed_ext.checkpoint.device_staging import staging_for
from deepspeed_ext.checkpoint.expert_names import autoep_named
from deepspeed_ext.checkpoint.locate import DEEPSPEED, UNIVERSAL
from deepspeed_ext.checkpoint.model_config import persistent_buffers
from deepspeed_ext.checkpoint.states import MASTER_WEIGHTS, USE_MUON
from deepspeed_ext.checkpoint.source import OpenOptions, Reshards
from deepspeed_ext.errors import CheckpointError
from deepspeed_ext.module_inject.autotp import LAYOUT_ATTR, shard_rank, tag_autotp_model
from deepspeed_ext.module_inject.layout import TPLayout


def _fill(targets: list[tuple[torch.Tensor, int]], ckpt: Reshards, name: str, state: str, layout: TPLayout,
          tp_rank: int) -> None:
    """Copy into each ``(tensor, start)`` of ``targets`` its elements of the TP-local tensor, reading the range
    they span once, block by block: memory stays at a block whatever the tensor's size, and a DP rank reads
    only the part of its TP slice it keeps."""
    from deepspeed_ext.checkpoint.tensor import BLOCK_ELEMENTS
    spans = [(tensor.view(-1), start, start + tensor.numel()) for tensor, start in targets if tensor.numel()]
    if not spans:
        return
    low, high = min(start for _, start, _ in spans), max(stop for _, _, stop in spans)
    row = math.prod(layout.local_shape(tp_rank)[1:]) or 1
    step = max(1, BLOCK_ELEMENTS // row) * row
    # Targets on an accelerator get each block from pinned memory, without blocking (see device_staging).
    staging = staging_for([flat for flat, _, _ in spans])
    position = low
    while position < high:
        stop = min(high, (position // step + 1) * step)  # block boundaries on whole rows
        block = ckpt.resharded_range(name, state, layout, tp_rank, position, stop)
        if staging is not None:
            block = staging.stage(block)
        for flat, first, last in spans:
            a, b = max(position, first), min(stop, last)
            if a < b:
                flat[a - first:b - first].copy_(block[a - position:b - position], non_blocking=staging is not None)
        if staging is not None:
            staging.copies_issued()
        position = stop


def _set_zero3_partition(param: Any, ckpt: Reshards, name: str, state: str, layout: TPLayout,
                         tp_rank: int) -> None:
    """Restore ``state`` of a ZeRO-3 parameter from the elements of its TP slice that this DP rank keeps:
    the rank reads its own partition, not the slice."""
    local_numel = math.prod(layout.local_shape(tp_rank))
    if engine_private.zero3_numel(param) != local_numel:
        raise CheckpointError(f"{ckpt.path}: {name!r} holds {engine_private.zero3_numel(param)} elements on TP rank "
                              f"{tp_rank}, its TP layout {local_numel}")
    start, stop, size = engine_private.zero3_partition(param)
    partition = engine_private.zero3_partition_in_place(param, state, size)
    if partition is not None:  # written block by block: no copy of the partition, whatever its size
        _fill([(partition[:stop - start], start)], ckpt, name, state, layout, tp_rank)
        partition[stop - start:].zero_()  # the padding past the parameter's end, as DeepSpeed keeps it
        return
    value = torch.zeros(size, dtype=torch.float32)  # the padding past the parameter's end stays 0
    value[:stop - start].copy_(ckpt.resharded_range(name, state, layout, tp_rank, start, stop))
    engine_private.set_zero3_partition(param, state, value)


def load_universal_checkpoint(engine: Any,
                              load_dir: str | Path,
                              tag: str | None = None,
                              **options: bool) -> tuple[str, dict[str, Any]]:
    """Restore ``engine`` from a universal checkpoint; returns ``(load_path, client_state)`` like DeepSpeed.

    Options: ``load_optimizer_states``, ``load_lr_scheduler_states``, ``load_module_only`` (as DeepSpeed's).
    """
    return load_resharded(engine, _opened(UNIVERSAL, load_dir, tag), **options)


def load_deepspeed_checkpoint(engine: Any,
                              load_dir: str | Path,
                              tag: str | None = None,
                              **options: bool) -> tuple[str, dict[str, Any]]:
    """Restore ``engine`` directly from a regular DeepSpeed checkpoint saved at another TP/DP degree (or
    ZeRO stage), with no conversion step: each rank reads only the byte ranges of its own shards."""
    return load_resharded(engine, _opened(DEEPSPEED, load_dir, tag), **options)


def _opened(format_name: str, load_dir: str | Path, tag: str | None) -> Reshards:
    """The checkpoint at ``load_dir`` opened through the registry, as the format whose entry says it restores
    engines (:attr:`~deepspeed_ext.checkpoint.formats.Format.restores_engines`)."""
    from deepspeed_ext.checkpoint.formats import FORMATS
    entry = FORMATS[format_name]
    if not entry.restores_engines:
        raise CheckpointError(f"{load_dir}: a {entry.title} checkpoint does not restore a live engine")
    # The entry vouches for the capability (an isinstance check would evaluate the source's lazy properties).
    return cast(Reshards, entry.open(load_dir, OpenOptions(tag=tag)))


def load_resharded(engine: Any,
                   ckpt: Reshards,
                   *,
                   load_optimizer_states: bool = True,
                   load_lr_scheduler_states: bool = True,
                   load_module_only: bool = False) -> tuple[str, dict[str, Any]]:
    """Restore ``engine`` from ``ckpt`` at the engine's own TP/DP degrees."""
    tp_size, tp_rank = engine_private.model_parallel_info(engine)
    module = engine.module
    params = list(module.named_parameters())
    if any(getattr(p, LAYOUT_ATTR, None) is None for _, p in params):
        tag_autotp_model(module, tp_size=tp_size, tp_rank=tp_rank)

    # A checkpoint under the model's own names (from-hf, from-maxtext) read by an AutoEP engine under AutoEP's.
    ckpt = autoep_named(ckpt, [name for name, _ in params])
    available = set(ckpt.names)
    missing = [name for name, p in params if p.requires_grad and name not in available]
    if missing:
        raise CheckpointError(f"{ckpt.path}: no saved tensors for {len(missing)} model parameters, e.g. "
                              f"{missing[:3]}")
    _warn_of_frozen_left_out(ckpt, [name for name, p in params if not p.requires_grad and name not in available])
    # A universal checkpoint made from weights alone (HF, params-only MaxText) has no optimizer state: the
    # optimizer keeps its fresh state, as when training starts from pretrained weights.
    with_optimizer = load_optimizer_states and not load_module_only and ckpt.has_optimizer_states

    # ZeRO-3 holds each rank's part of the low-precision weights in flat partitions, not in ``param.data``.
    zero3 = engine_private.partitions_weights(engine)
    with torch.no_grad():
        stage0 = engine_private.stage0_slots(engine)
        whole = engine_private.muon_whole_offsets(engine)
        entries = engine_private.StateEntries(engine, stage0) if with_optimizer else None
        # Every parameter the checkpoint holds, frozen ones too (their weights: no optimizer keeps them).
        saved_params = [(name, param) for name, param in params if name in available]
        # A rank beyond the KV-head count holds none of the tensor: nothing of it to restore. DeepSpeed keeps such
        # empty parameters out of the optimizer; an optimizer that keeps state for them anyway (torch's Adagrad
        # creates it at construction) gets the saved step, so every rank counts alike.
        restored = [(name, param) for name, param in saved_params
                    if math.prod(getattr(param, LAYOUT_ATTR).local_shape(shard_rank(param, tp_rank))) != 0]
        # Frozen ones get their weights alone; one a stage-0 wrapper holds is restored as the others are, or the
        # master left as built would undo the restore a step later.
        frozen = {param for _, param in saved_params if engine_private.no_optimizer_holds(param, stage0)}
        saved = {param: _saved_states(ckpt, name, None if param in frozen else entries, param)
                 for name, param in saved_params}
        scalars = {param: {state: ckpt.scalar(name, state) for state in saved[param][1]}
                   for name, param in saved_params}
        if entries is not None:
            engine_private.ensure_optimizer_states(engine, {param: saved[param][0][1:] for _, param in restored},
                                                   entries, whole)
        for name, param in restored:
            layout = getattr(param, LAYOUT_ATTR)
            rank = shard_rank(param, tp_rank)  # AutoEP experts: the EP rank
            if param in frozen:  # its weights where this rank keeps them (ZeRO-3: its partition)
                _fill(engine_private.frozen_weight_targets(param), ckpt, name, MASTER_WEIGHTS, layout, rank)
                continue
            for state in saved[param][0]:
                if engine_private.is_zero3_param(param):  # ZeRO-3: read only this DP rank's partition of the TP slice
                    _set_zero3_partition(param, ckpt, name, state, layout, rank)
                    continue
                master = state == MASTER_WEIGHTS
                targets = engine_private.state_targets(param, None if master else state, engine, stage0, whole)
                if targets is None and not master:
                    raise CheckpointError(f"parameter {name!r} is not managed by a ZeRO/BF16 optimizer; cannot "
                                          "restore its optimizer state")
                if master:  # and the low-precision copy the forward pass uses, whole on every DP rank
                    targets = [*(targets or []), (param.data, 0)]
                _fill(targets or [], ckpt, name, state, layout, rank)
        if zero3:
            engine_private.refresh_zero3_partitions(engine)
        _restore_buffers(module, ckpt, available, tp_size, tp_rank)

        if entries is not None:
            engine_private.set_optimizer_scalars(scalars, entries)
            engine_private.set_optimizer_groups(engine, ckpt.optimizer_state_for_universal())

    client_state = _restore_engine_state(engine, ckpt, load_lr_scheduler_states and not load_module_only)
    return str(ckpt.path), client_state


def _warn_of_frozen_left_out(ckpt: Reshards, names: list[str]) -> None:
    """Frozen parameters the checkpoint does not hold keep the values the model was built with: said once, on
    rank 0 (a checkpoint written before deepspeed-ext carried frozen weights, or by a tool that drops them)."""
    if not names or (torch.distributed.is_initialized() and torch.distributed.get_rank() != 0):
        return
    logging.getLogger("deepspeed_ext").warning(
        "%s: %d frozen parameter(s) are not in the checkpoint and keep the values the model was built with, e.g. "
        "%s", ckpt.path, len(names), names[:3])


def _restore_buffers(module: torch.nn.Module, ckpt: Reshards, available: set[str], tp_size: int,
                     tp_rank: int) -> None:
    """The persistent buffers the checkpoint carries (DeepSeek-V3's router bias): whole on every rank."""
    for name, buffer in persistent_buffers(module).items():
        if name in available:
            value = ckpt.resharded(name, MASTER_WEIGHTS, TPLayout.replicated(tuple(buffer.shape), tp_size), tp_rank)
            buffer.copy_(value.to(buffer.dtype))


def _saved_states(ckpt: Reshards, name: str, entries: engine_private.StateEntries | None,
                  param: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The states to restore of ``name``: (tensor states, the master first; scalars). Refused where the live
    optimizer keeps other states for the parameter than the checkpoint holds: a checkpoint of another optimizer, or
    a parameter that changed sides in DeepSpeed's Muon (momentum for the matrices, ``use_muon``; Adam for the rest).
    """
    if entries is None:  # the optimizer's states are not loaded, or it keeps none (a frozen parameter)
        return (MASTER_WEIGHTS, ), ()
    tensors, scalars = ckpt.states_of(name)
    if len(tensors) == 1 and not scalars:
        raise CheckpointError(f"{ckpt.path}: no saved optimizer state for {name!r}, which this run trains (frozen "
                              "when it was saved?); load it without its optimizer state "
                              "(load_optimizer_states=False) to start the optimizer fresh")
    group = entries.group(param)
    if group is None:  # this rank keeps none of its state
        return tensors, scalars
    expected = engine_private.expected_tensor_states(entries.base, group)
    if expected is not None and expected != set(tensors[1:]):
        how = ("Muon's momentum" if group.get(USE_MUON) else
               f"{type(entries.base).__name__}'s {'/'.join(sorted(expected)) or 'no state'}")
        raise CheckpointError(f"{ckpt.path}: {name!r} was saved with optimizer state {'/'.join(tensors[1:])}, but "
                              f"this run steps it with {how}: a checkpoint of another optimizer (or another "
                              "Muon/Adam split of the parameters) cannot continue it; load it without its "
                              "optimizer state (load_optimizer_states=False) to start the optimizer fresh")
    return tensors, scalars


def _restore_engine_state(engine: Any, ckpt: Reshards, load_lr_scheduler: bool) -> dict[str, Any]:
    states = ckpt.model_states
    engine_private.set_engine_counters(engine, states, load_lr_scheduler)
    return {key: value for key, value in states.items() if key not in keys.DEEPSPEED_STATE_KEYS}
