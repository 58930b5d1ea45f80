"""The other way: a live DeepSpeed engine as a receiver's sink (an RL job's reference policy, an evaluation engine
of another job), loaded from a stream under the model's HF names. Each of its ranks is a receiver of the whole
stream and keeps its own part of each tensor: its TP or EP shard, under ZeRO-3 its partition; AutoEP's stacks are
cut from the fused tensors. The module's weights are written where the forward pass reads them, and the
optimizer's fp32 masters where it keeps them (so a later step does not undo the load). Nothing else changes: the
step counters, the optimizer's moments and the scheduler stay as they were."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from deepspeed_ext.checkpoint import engine_private
from deepspeed_ext.checkpoint.expert_names import autoep_name_map, has_autoep_names
from deepspeed_ext.checkpoint.model_config import persistent_buffers
from deepspeed_ext.errors import CheckpointError
from deepspeed_ext.module_inject.autotp import LAYOUT_ATTR, shard_rank, tag_autotp_model
from deepspeed_ext.module_inject.layout import TPLayout
from deepspeed_ext.checkpoint.states import MASTER_WEIGHTS
from deepspeed_ext.weights.sinks import Sink


def is_engine(sink: Any) -> bool:
    """Whether ``sink`` is a DeepSpeed engine (it wraps its model as ``module`` and steps it)."""
    return isinstance(getattr(sink, "module", None), torch.nn.Module) and callable(getattr(sink, "step", None)) \
        and hasattr(sink, "save_checkpoint")


class EngineSink(Sink):
    """A DeepSpeed engine (see the module docstring)."""

    names = "hf"

    def __init__(self, engine: Any):
        if engine_private.engine_is_pipeline(engine):
            raise CheckpointError("a PipelineModule engine cannot take HF-named weights (its layers have no HF names)")
        self.engine = engine
        tp_size, self.tp_rank = engine_private.model_parallel_info(engine)
        params = list(engine.module.named_parameters(remove_duplicate=True))
        if any(getattr(p, LAYOUT_ATTR, None) is None for _, p in params):
            tag_autotp_model(engine.module, tp_size=tp_size, tp_rank=self.tp_rank)
        self.params = dict(params)
        self.buffers = {name: b for name, b in persistent_buffers(engine.module).items() if name not in self.params}
        #: stream name -> [(engine parameter, which half of the stream tensor's dim 1: None for all of it)]
        self.feeds: dict[str, list[tuple[str, int | None]]] = {}

    def check(self, shapes: Mapping[str, tuple[int, ...]], label: str) -> None:
        names = list(self.params)
        mapped = autoep_name_map(list(shapes)) if has_autoep_names(names) else {name: (name, None) for name in shapes}
        self.feeds = {}
        for name, param in self.params.items():
            source, half = mapped.get(name, (name, None))
            if source not in shapes:
                raise CheckpointError(f"{label}: the update carries no {source}, which the receiving engine's {name} "
                                      "is loaded from")
            expected = tuple(getattr(param, LAYOUT_ATTR).shape)
            given = tuple(shapes[source])
            if half is not None:
                given = (given[0], given[1] // 2, *given[2:])
            if given != expected:
                raise CheckpointError(f"{label}: {source} is {list(shapes[source])} in the update; the receiving "
                                      f"engine's {name} needs {list(expected)} (another model?)")
            self.feeds.setdefault(source, []).append((name, half))
        for name, buffer in self.buffers.items():
            if name in shapes and tuple(shapes[name]) == tuple(buffer.shape):
                self.feeds.setdefault(name, []).append((name, None))

    def load(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        stage0 = engine_private.stage0_slots(self.engine)
        with torch.no_grad():
            for name, full in tensors:
                for target, half in self.feeds.get(name, ()):
                    if target in self.buffers:
                        self.buffers[target].copy_(full)
                        continue
                    if half is not None:
                        rows = full.shape[1] // 2
                        full = full.narrow(1, half * rows, rows)
                    self._write(self.params[target], full, stage0)

    def _write(self, param: Any, full: torch.Tensor, stage0: Any) -> None:
        layout: TPLayout = getattr(param, LAYOUT_ATTR)
        shard = 0 if layout.is_replicated else shard_rank(param, self.tp_rank)
        flat = layout.slice(full, shard).reshape(-1)
        if not flat.numel():
            return
        values, start = engine_private.held_weights(param)  # what the forward pass reads
        values.copy_(flat[start:start + values.numel()])
        if engine_private.is_zero3_param(param):
            first, stop, size = engine_private.zero3_partition(param)
            master = engine_private.zero3_partition_in_place(param, MASTER_WEIGHTS, size)
            if master is not None:
                master[:stop - first].copy_(flat[first:stop])
            return
        for target, offset in engine_private.state_targets(param, None, self.engine, stage0) or []:
            target.view(-1).copy_(flat[offset:offset + target.numel()])
