"""The DeepSpeed checkpoint reader: TP slices × an optimizer layout → full tensors, or shards at another TP degree.

What differs between DeepSpeed's optimizer layouts (where the fp32 master and moments of a parameter's TP
shard lie) is in :mod:`.layouts`; this module merges over TP ranks and reshards, the same for all of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from deepspeed_ext.checkpoint import ranges, serialization
from deepspeed_ext.checkpoint.adapters import adapters_beside, is_lora_factor
from deepspeed_ext.checkpoint.deepspeed import keys
from deepspeed_ext.checkpoint.deepspeed.layouts import Fragment
from deepspeed_ext.checkpoint.manifest import FilesChecked
from deepspeed_ext.checkpoint.source import (MASTER_WEIGHTS, STEP, CheckpointSource, OpenOptions, SourceInfo,
                                             frozen_summary)
from deepspeed_ext.checkpoint.states import (MODULE_WEIGHTS, is_scalar_state, optimizer_states_summary)
from deepspeed_ext.checkpoint.deepspeed.tag import DeepSpeedTag
from deepspeed_ext.checkpoint.tensor import LogicalTensor
from deepspeed_ext.errors import CheckpointError, LayoutError
from deepspeed_ext.module_inject.upstream import name_patterns, unsharded_weights
from deepspeed_ext.module_inject.layout import TPLayout

if TYPE_CHECKING:
    from deepspeed_ext.checkpoint.commit import ContentCheck

def open_source(path: Path, options: OpenOptions) -> CheckpointSource:
    """The format registry's reader (:mod:`deepspeed_ext.checkpoint.formats`)."""
    config = dict(options.model_config) if options.model_config is not None else None
    return DeepSpeedCheckpoint(path, options.tag, model_config=config)


def check_files(source: CheckpointSource) -> FilesChecked:
    """``verify``'s file check of a DeepSpeed tag (the format hook). DeepSpeed writes no manifest: a tag
    deepspeed-ext saved has its commit marker (every file's size and CRC-32), any other the CRC-32 of each zip
    record; every file must also load with the allow-list. (Merging each tensor, which verify does next, checks
    that the TP shards fit their layouts and that replicas agree.)"""
    assert isinstance(source, DeepSpeedCheckpoint)
    root = source.info.path
    checked, found = source.contents_checked()
    problems = list(found)  # the content check's own list stays as it found it
    files = sorted(root.glob("*.pt"))
    for file in files:
        try:
            serialization.load(file)
        except CheckpointError as exc:
            problems.append(str(exc))
    return FilesChecked(root, f"DeepSpeed checkpoint: {checked}; {len(files)} files load safely", problems)


class DeepSpeedCheckpoint(DeepSpeedTag):
    """A regular DeepSpeed checkpoint tag directory, read lazily and memory-mapped: the source (its metadata is
    :class:`~.tag.DeepSpeedTag`'s)."""

    @cached_property
    def info(self) -> SourceInfo:
        recorded = self.uc_info
        return SourceInfo(format="deepspeed",
                          given=self.given,
                          path=self.tag_dir,
                          layouts=self.layouts,
                          states=self._states,
                          global_step=int(self.model_states.get(keys.GLOBAL_STEPS) or 0),
                          tp_degree=self.tp_degree,
                          dp_degree=self.dp_degree,
                          zero_stage=self.zero_stage,
                          tag=self.tag,
                          model_config=(self._model_config or (recorded.model_config if recorded else None)
                                        or self._trainer_model_config()),
                          model_class=recorded.model_class if recorded else None,
                          versions=dict(recorded.versions) if recorded else {},
                          metadata=self.metadata_source,
                          fingerprints=recorded.fingerprints if recorded else None,
                          optimizer_settings=self._optimizer_settings(),
                          frozen=tuple(name for name in self.layouts if name in self.frozen_names),
                          engine_settings=recorded.engine_settings if recorded else None,
                          adapters=(recorded.adapters if recorded and recorded.adapters else
                                    adapters_beside(self.tag_dir.parent)))

    def tensors(self) -> Iterator[LogicalTensor]:
        """One :class:`LogicalTensor` per optimizer parameter, in checkpoint order; nothing read yet. The files'
        checksums are checked meanwhile, on a thread (:meth:`raise_if_damaged`): of the optimizer files, only the
        records the caller reads."""
        self._start_content_check(lazy=True)
        module = self.model_states.get(keys.MODULE) or {}
        for name, layout in self.layouts.items():

            def loader(state: str, name: str = name) -> torch.Tensor | int:
                with self._damage_first():
                    return self.scalar(name, state) if state in self._scalars else self.full_tensor(name, state)

            def range_loader(state: str, low: int, high: int, name: str = name) -> torch.Tensor:
                with self._damage_first():
                    return self.full_range(name, state, low, high)

            weights = module.get(name)
            yield LogicalTensor(name=name,
                                shape=layout.shape,
                                layout=layout,
                                states=self.param_states[name],
                                scalars=tuple(self._scalars),
                                loader=loader,
                                dtype=(self.frozen.dtypes[name] if name in self.frozen else
                                       weights.dtype if torch.is_tensor(weights) else self._apart_dtype(name)),
                                range_loader=range_loader,
                                module_weights=name in self._module_shards or (
                                    name in self.frozen and self.frozen.dtypes[name] in (torch.bfloat16, torch.float16)),
                                trainable=name not in self.frozen_names)

    def _apart_dtype(self, name: str) -> torch.dtype:
        """The dtype of a parameter the model states' module does not hold: an AutoEP expert stack, kept in the
        expert files in the dtype DeepSpeed cast the whole module to (the module's other weights'); else fp32."""
        if self.experts is None or name not in self.experts.params:
            return torch.float32
        dtypes = [value.dtype for value in (self.model_states.get(keys.MODULE) or {}).values()
                  if torch.is_tensor(value) and value.is_floating_point()]
        return max(set(dtypes), key=dtypes.count) if dtypes else torch.float32

    #: The check of every file's checksums, started by the first :meth:`tensors` (a conversion reads it all).
    _content_check: ContentCheck | None = None

    @contextlib.contextmanager
    def _damage_first(self) -> Iterator[None]:
        """A read that fails (shards that do not fit, replicas that differ, a pickle that does not load) is
        reported as the damaged file behind it, where the checksums find one: that is the cause to fix."""
        try:
            yield
        except CheckpointError as exc:
            if self._content_check is not None:
                self._content_check.raise_if_damaged(cause=exc)
            raise

    def _start_content_check(self, lazy: bool) -> ContentCheck:
        """The check of the tag's files, started once. ``lazy``: the optimizer files' large records are checked
        only as they are read (:meth:`_flat`); a check of everything already started serves as well."""
        if self._content_check is None or (not lazy and self._content_check.lazy):
            from deepspeed_ext.checkpoint.commit import ContentCheck
            if self._content_check is not None:  # a check of everything replaces the one of what was read
                self._content_check.close()
            optimizer_files = {self.optimizer.mapped_file(tp, dp) for tp, dp in self.files.optim_files} \
                if lazy else set()
            # A conversion (lazy) maps every file it reads (torch.load(mmap=True)), so summing its records through a
            # mapping adds no way to fail; the check of everything (verify) reads with preadv and names a bad file.
            self._content_check = ContentCheck(self.tag_dir, lazy={path for path in optimizer_files if path},
                                               mapped=lazy)
        return self._content_check

    def contents_checked(self) -> tuple[str, list[str]]:
        """Every byte of every file of the tag against its checksums
        (:func:`~deepspeed_ext.checkpoint.commit.check_contents`): (what was checked, in words; one line per
        problem), run once per opened checkpoint: ``verify``'s check."""
        return self._start_content_check(lazy=False).result()

    def _flat(self, tp: int, dp: int, group: int, state: str) -> torch.Tensor:
        """The optimizer's flat tensor (:meth:`OptimizerLayout.flat`) a read takes its elements from; the content
        check is told which record of the file it is, once, before its elements are used."""
        flat = self.optimizer.flat(tp, dp, group, state)
        check, key = self._content_check, (tp, dp, group, state)
        if check is not None and check.lazy and key not in self._noted_reads:
            self._noted_reads.add(key)
            path = self.optimizer.mapped_file(tp, dp)
            if path is not None:
                location = serialization.mapped_location(flat)
                check.note_read(path, location[1] if location is not None and location[0] == path.resolve()
                                else None)
        return flat

    def raise_if_damaged(self) -> None:
        """Raise :class:`CheckpointError` when a file of the tag fails its checksums (the commit marker's, or its
        zip records' CRC-32s): writers call it before publishing. Nothing to check if nothing was streamed."""
        if self._content_check is not None:
            self._content_check.raise_if_damaged()

    # ------------------------------------------------------------------ reading tensors
    @cached_property
    def _module_shards(self) -> dict[str, list[torch.Tensor]]:
        """Per parameter, each TP rank's slice of the module's own bf16/fp16 weights (``MODULE_WEIGHTS``), flat and
        memory-mapped, where the model-states files hold them whole: ZeRO-0/1/2 without pipeline stages or AutoEP
        experts, every TP rank's slice of the layout's shape, all in one lower precision."""
        if self.files.partitioned_weights or self.pp_degree != 1 or self.experts is not None:
            return {}
        modules = [self.rank_model_states(tp).get(keys.MODULE) or {} for tp in range(self.tp_degree)]
        found = {}
        for name, layout in self.layouts.items():
            if name in self.buffers or layout.tp_size > len(modules):
                continue
            shards = [modules[tp].get(name) for tp in range(layout.tp_size)]
            tensors = [shard for shard in shards if torch.is_tensor(shard)]
            if len(tensors) == len(shards) and all(
                    shard.dtype == tensors[0].dtype and shard.dtype in (torch.bfloat16, torch.float16)
                    and tuple(shard.shape) == tuple(layout.local_shape(tp)) for tp, shard in enumerate(tensors)):
                found[name] = [shard.reshape(-1) for shard in tensors]
        return found

    def _module_range(self, name: str, tp: int, low: int, high: int) -> torch.Tensor:
        """Elements ``[low, high)`` of TP rank ``tp``'s flattened slice of the module's weights of ``name``: a view
        into the memory-mapped model-states file, whose pages are released once it is consumed."""
        piece = self._module_shards[name][tp][low:high]
        self._in_flight.append((self.files.model_files[tp], piece))
        return piece

    def _state_fragments(self, name: str, tp: int, state: str) -> list[Fragment]:
        """The fragments of TP rank ``tp``'s shard of ``name`` in the tensors of ``state``: the master's, except
        where the state holds whole parameters (Muon's momentum under ZeRO-1/2), where each fragment lies at the
        parameter's place in that tensor plus the fragment's place in the parameter."""
        fragments = self._fragments.get((name, tp), [])
        if state == MASTER_WEIGHTS or not fragments:
            return fragments
        key = (name, tp, state)
        found = self._remapped.get(key)
        if found is None:
            found, position = [], 0
            for f in fragments:
                entry = (tp if f.tp_rank is None else f.tp_rank, f.dp_rank, f.group, state)
                if entry not in self._whole_offsets:
                    self._whole_offsets[entry] = self.optimizer.whole_param_offsets(*entry)
                offsets = self._whole_offsets[entry]
                found.append(f if offsets is None else dataclasses.replace(f, start=offsets[name] + position))
                position += f.numel
            self._remapped[key] = found
        return found

    def _flat_pieces(self, name: str, tp: int, low: int, high: int,
                     state: str = MASTER_WEIGHTS) -> list[tuple[int, int, int, int, int]]:
        """Where elements ``[low, high)`` of TP rank ``tp``'s flattened shard of ``name`` lie, in order:
        ``(tp, dp, group, start, count)``, elements ``[start, start + count)`` of that flat tensor (the DP
        fragments that hold them)."""
        pieces, offset = [], 0
        for f in self._state_fragments(name, tp, state):
            first, last = max(low, offset), min(high, offset + f.numel)
            if first < last:
                held_by = tp if f.tp_rank is None else f.tp_rank
                pieces.append((held_by, f.dp_rank, f.group, f.start + first - offset, last - first))
            offset += f.numel
        if sum(count for *_, count in pieces) != high - low:
            raise CheckpointError(f"{self.tag_dir}: parameter {name!r} on TP rank {tp}: DP fragments cover "
                                  f"{sum(count for *_, count in pieces)} of elements [{low}, {high})")
        return pieces

    def _flat_range(self, name: str, tp: int, state: str, low: int, high: int) -> torch.Tensor:
        """Elements ``[low, high)`` of TP rank ``tp``'s flattened shard of ``name``, read from the DP
        fragments that hold them (a view into the memory-mapped file when one fragment does)."""
        pieces = []
        for held_by, dp, group, start, count in self._flat_pieces(name, tp, low, high, state):
            piece = self._flat(held_by, dp, group, state).narrow(0, start, count)
            pieces.append(piece)
            mapped = self.optimizer.mapped_file(held_by, dp)
            if mapped is not None:
                self._in_flight.append((mapped, piece))
        if not pieces:
            return torch.empty(0, dtype=torch.float32)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _stored_pieces(self, name: str, tp: int, state: str, low: int, high: int) -> list[ranges.Piece]:
        """:meth:`_flat_pieces` with the file and offset each flat tensor's bytes are at, to read them with
        ``pread`` (:mod:`..ranges`)."""
        found: list[ranges.Piece] = []
        for held_by, dp, group, start, count in self._flat_pieces(name, tp, low, high, state):
            key = (held_by, dp, group, state)
            stored = self._stored.get(key)
            if stored is None:  # once per flat tensor: the optimizer files stay mapped while the reader lives
                stored = self._stored[key] = ranges.stored(self._flat(held_by, dp, group, state),
                                                           self._readers)
            found.append((stored, start, count))
        return found

    def local_tensor(self, name: str, tp: int, state: str) -> torch.Tensor:
        """TP rank ``tp``'s shard of ``name`` for ``state``, reassembled from its DP fragments."""
        shape = self.layouts[name].local_shape(tp)
        return self._flat_range(name, tp, state, 0, int(torch.Size(shape).numel())).view(shape)

    def resharded(self, name: str, state: str, target: TPLayout, rank: int) -> torch.Tensor:
        """Rank ``rank``'s shard of ``name`` under the *target* layout (another TP degree), read directly
        from this checkpoint's TP slices and ZeRO partitions: only the overlapping byte ranges.

        May be a view into a memory-mapped file; the caller copies what it keeps.
        """
        shape = target.local_shape(rank)
        return self.resharded_range(name, state, target, rank, 0, math.prod(shape)).reshape(shape)

    def resharded_range(self, name: str, state: str, target: TPLayout, rank: int, low: int,
                        high: int) -> torch.Tensor:
        """Elements ``[low, high)`` of :meth:`resharded`, flattened, in a new tensor, reading only the byte ranges
        that hold them (a ZeRO-3 rank's partition of its TP slice), with ``pread`` (:mod:`..ranges`)."""
        self._release_in_flight()
        if name in self.buffers:
            return target.slice(self.full_tensor(name, state), rank).reshape(-1)[low:high]
        try:
            if name in self.frozen:
                return self._frozen_as(name, self.frozen.resharded_range(name, target, rank, low, high), state,
                                       copy=True)
            return ranges.resharded_range(self.layouts[name], target, rank, low, high,
                                          lambda src, start, stop: self._stored_pieces(name, src, state, start, stop))
        except LayoutError as exc:
            raise CheckpointError(f"{self.tag_dir}: parameter {name!r}: {exc}") from exc

    def full_tensor(self, name: str, state: str = MASTER_WEIGHTS) -> torch.Tensor:
        """The full fp32 tensor of ``name`` (master weights or an Adam moment), or the module's own weights
        (``MODULE_WEIGHTS``, in their bf16/fp16), merged over TP ranks.

        May be a view into the memory-mapped optimizer file; sinks copy what they keep.
        """
        self._release_in_flight()
        if name in self.buffers:  # fp32, as the masters are; an integer buffer (indices) in its own dtype
            buffer = self.buffers[name]
            buffer = buffer.float() if buffer.is_floating_point() else buffer
            return buffer if state == MASTER_WEIGHTS else torch.zeros_like(buffer)
        layout = self.layouts[name]
        if name in self.frozen:
            return self.full_range(name, state, 0, layout.numel).view(layout.shape)
        # Replicated tensors are merged too: merge() refuses replicas that differ between TP ranks.
        shards = ([self._module_shards[name][tp].view(layout.local_shape(tp)) for tp in range(layout.tp_size)]
                  if state == MODULE_WEIGHTS else [self.local_tensor(name, tp, state) for tp in range(layout.tp_size)])
        try:
            full = layout.merge(shards)
        except Exception as exc:
            raise CheckpointError(f"{self.tag_dir}: cannot merge {name!r}: {exc}") from exc
        return full

    def full_range(self, name: str, state: str, low: int, high: int) -> torch.Tensor:
        """Elements ``[low, high)`` of :meth:`full_tensor`, flattened, read from the pieces of the TP slices that
        hold them (a view into the memory-mapped file where one piece does): a tensor streamed in blocks.
        Replicated tensors are checked block by block to be the same on every TP rank."""
        self._release_in_flight()
        if name in self.buffers:
            return self.full_tensor(name, state).reshape(-1)[low:high]
        layout = self.layouts[name]
        if name in self.frozen:
            try:
                return self._frozen_as(name, self.frozen.full_range(name, low, high), state)
            except LayoutError as exc:
                raise CheckpointError(f"{self.tag_dir}: cannot merge frozen parameter {name!r}: {exc}") from exc

        def read(tp: int, start: int, stop: int) -> torch.Tensor:
            if state == MODULE_WEIGHTS:
                return self._module_range(name, tp, start, stop)
            return self._flat_range(name, tp, state, start, stop)

        if layout.is_replicated:
            block = read(0, low, high)
            for tp in range(1, layout.tp_size):
                if not torch.equal(read(tp, low, high), block):
                    raise CheckpointError(self._copies_differ(name, tp))
            return block
        try:
            return layout.reshard_range(TPLayout.replicated(layout.shape, 1), 0, low, high, read)
        except LayoutError as exc:
            raise CheckpointError(f"{self.tag_dir}: cannot merge {name!r}: {exc}") from exc

    def _frozen_as(self, name: str, weights: torch.Tensor, state: str, copy: bool = False) -> torch.Tensor:
        """A frozen parameter's saved weights as ``state`` asks: in their own dtype (``MODULE_WEIGHTS``), or widened
        to fp32 (its master: no optimizer keeps another copy); ``copy``: in a tensor of its own, not a view of the
        mapped file."""
        if state not in (MASTER_WEIGHTS, MODULE_WEIGHTS):
            raise CheckpointError(f"{self.tag_dir}: parameter {name!r} is frozen: no optimizer state {state!r}")
        return weights.to(weights.dtype if state == MODULE_WEIGHTS else torch.float32, copy=copy)

    @property
    def _in_flight(self) -> list[tuple[Path, torch.Tensor]]:
        if not hasattr(self._reads, "pieces"):
            self._reads.pieces = []
        pieces: list[tuple[Path, torch.Tensor]] = self._reads.pieces
        return pieces

    def _release_in_flight(self) -> None:
        """Drop the optimizer-file pages the previous tensor read from RSS (it has been consumed by now).

        Releasing is safe even if a caller still holds a view: the pages are read back from the file."""
        for path, piece in self._in_flight:
            if path not in self._mappings:
                self._mappings[path] = serialization.file_mappings(path)
            serialization.release_pages(piece, self._mappings[path])
        self._in_flight.clear()

    def step(self, name: str) -> torch.Tensor | int:
        return self.scalar(name, STEP)

    def scalar(self, name: str, state: str) -> torch.Tensor | int:
        """A scalar state (the step) of the param group ``name`` is in; a buffer's: the first group's that has it."""
        if state not in self.param_states.get(name, ()):
            raise CheckpointError(f"{self.tag_dir}: parameter {name!r} has no optimizer state {state!r} (its "
                                  f"optimizer keeps {', '.join(self.param_states.get(name, ())[1:]) or 'none'})")
        holders = ([self._first_entry(name)] if name not in self.buffers else
                   [self._first_entry(other) for other in self.layouts if other not in self.buffers])
        for mp, dp, group in holders:
            value = self.optimizer.group_state(mp, dp, group).get(state)
            if value is not None and is_scalar_state(value):
                found: torch.Tensor | int = value
                return found
        mp, dp, group = holders[0]
        raise CheckpointError(f"{self.optimizer.state_file(mp, dp)}: no optimizer {state} for param group {group}")

    # ------------------------------------------------------------------ summary
    def _commit_summary(self) -> str:
        """Whether the save of this tag is known to have finished (an unfinished one was refused at opening)."""
        from deepspeed_ext.checkpoint import commit
        marker = commit.read_marker(self.tag_dir)
        if marker is None:
            return "no commit marker (not saved by deepspeed-ext): verify checks its zip records' CRC-32s"
        return (f"committed ({commit.COMMIT_FILE}: {len(marker.files)} files, "
                f"{marker.details.get('committed_at', 'time not recorded')})")

    def summary(self) -> dict[str, Any]:
        first = self.model_states
        module = first.get(keys.MODULE) or {}
        lp_dtypes = sorted({str(t.dtype).replace("torch.", "") for t in module.values() if torch.is_tensor(t)})
        return {
            "kind": "deepspeed",
            "path": str(self.tag_dir),
            "tag": self.tag,
            "tp_degree": self.tp_degree,
            "dp_degree": self.dp_degree,
            **({"pp_degree": self.pp_degree} if self.pp_degree > 1 else {}),
            "zero_stage": self.zero_stage,
            "optimizer": self.optimizer_kind,
            **({"optimizer_states": optimizer_states_summary(self.param_states)} if self.has_optimizer_states
               else {}),
            "model_dtypes": lp_dtypes,
            "optimizer_dtype": str(self.optimizer.flat(0, 0, 0, MASTER_WEIGHTS).dtype).replace("torch.", ""),
            "global_steps": first.get(keys.GLOBAL_STEPS),
            **({} if self.has_optimizer_states else
               {"optimizer_state": "fp32 masters only (saved before the first optimizer step: no moments, no step; "
                                   "a resume starts the optimizer fresh)"}),
            "deepspeed_version": str(first.get(keys.DS_VERSION)),
            "metadata": self.metadata_source,
            "commit": self._commit_summary(),
            "num_parameters": sum(layout.numel for layout in self.layouts.values()),
            **frozen_summary(self.layouts, self.frozen_names),
            **({"expert_parallel": self.experts.summary()} if self.experts is not None else {}),
            # Weight matrices AutoTP kept whole on every TP rank (e.g. fused MoE experts it cannot shard); not the
            # LoRA factors kept whole by design.
            "unsharded_weights": name_patterns(name for name in unsharded_weights(self.layouts)
                                               if not is_lora_factor(name)),
            # What a user resuming elsewhere needs (DeepSpeed's own loader fails at other degrees with an
            # assertion about a missing key).
            "resume": (f"DeepSpeed alone resumes it only at {self._degrees_text}; at other "
                       "degrees, call deepspeed_ext.enable() (or use deepspeed_ext.initialize) with the "
                       "\"deepspeed_ext\" config section in the resuming run (load-time resharding), or convert it "
                       "with to-universal (docs/trainers.md)"),
        }

