"""A DeepSpeed tag as its files describe it: degrees (TP, PP, DP, AutoEP), the optimizer layout, each parameter's
TP layout checked against the shapes every rank saved, its states, the frozen parameters and buffers, the model
states. Reading tensors out of it is :class:`~.reader.DeepSpeedCheckpoint`'s."""

from __future__ import annotations

import dataclasses
import math
import shutil
import threading
from collections import OrderedDict
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from deepspeed_ext.checkpoint import output, ranges, serialization
from deepspeed_ext.checkpoint.deepspeed import keys, reconcile
from deepspeed_ext.checkpoint.deepspeed.experts import FOLDING, folded_onto_tp, read_expert_parallel
from deepspeed_ext.checkpoint.deepspeed.files import TagFiles, resolve_tag_dir
from deepspeed_ext.checkpoint.deepspeed.frozen import FrozenWeights, find_frozen
from deepspeed_ext.checkpoint.deepspeed.layouts import Fragment, OptimizerLayout, choose_layout
from deepspeed_ext.checkpoint.metadata import UCInfo, read_uc_info
from deepspeed_ext.checkpoint.source import (MASTER_WEIGHTS, STEP)
from deepspeed_ext.checkpoint.states import (has_optimizer, optimizer_settings,
                                             optimizer_state_keys, ordered_states)
from deepspeed_ext.errors import CheckpointError
from deepspeed_ext.module_inject.layout import TPLayout

if TYPE_CHECKING:
    pass

HOW_TO_GET_METADATA = ("save it through deepspeed_ext.initialize with "
                       "\"deepspeed_ext\": {\"universal_checkpoint\": {\"enabled\": true}} in the DeepSpeed config, "
                       "or with DeepSpeed >= 0.18.9, whose AutoTP stores universal_checkpoint_info")


class DeepSpeedTag:
    """A regular DeepSpeed checkpoint tag directory's metadata, read lazily and memory-mapped."""

    def __init__(self, path: str | Path, tag: str | None = None, model_config: dict[str, Any] | None = None):
        """``model_config``: the HF config to report instead of the one recorded at save time (``--config``)."""
        self.given = Path(path)
        self._model_config = model_config
        self.tag_dir = resolve_tag_dir(path, tag)
        self.tag = self.tag_dir.name
        self.files = TagFiles.scan(self.tag_dir)
        if 0 not in self.files.model_files:
            self.files.degrees()  # refuses naming TP rank 0's missing model-states file
        reference = self.files.model_files[0]
        first = self.rank_model_states(0)
        # Files are per model-parallel rank: a pipeline stage's TP ranks, stage-major (mp = stage * TP + tp).
        self.mp_degree, self.dp_degree = reconcile.degrees(self.files, first, reference)
        reconcile.check_model_states_agree(self.files.model_files, self.rank_model_states, self.mp_degree,
                                           self.dp_degree)
        self.pp_degree = reconcile.pipeline_degree(first, reference, self.mp_degree)
        self.tp_degree = self.mp_degree // self.pp_degree
        self.experts = read_expert_parallel(first, reference, self.dp_degree, self.tp_degree)
        if self.experts is not None and self.tp_degree > 1 and self.pp_degree == 1:
            tps = range(self.tp_degree)
            self.experts = dataclasses.replace(self.experts, ep_of_tp=folded_onto_tp(
                [self.rank_model_states(tp).get(FOLDING) for tp in tps], [self.files.model_files[tp] for tp in tps],
                self.experts.ep_size))
        self._check_experts(reference)
        self.optimizer: OptimizerLayout = choose_layout(self.files, self.mp_degree, self.dp_degree,
                                                        self._recorded_optimizer_names, self.experts)
        if self.pp_degree > 1 and self.optimizer.zero_stage == 0:
            raise CheckpointError(f"{reference}: pipeline parallelism without ZeRO; deepspeed-ext reads pipeline "
                                  "checkpoints of ZeRO stage 1")
        # Per thread, the memory-mapped optimizer-file pieces its last read returned, released before its next
        # one (writer threads stream tensors side by side).
        self._reads = threading.local()
        self._mappings: dict[Path, list[tuple[int, int]]] = {}
        # What the restore reads with pread: each flat tensor's file and offset, and one descriptor per file.
        self._stored: dict[tuple[int, int, int, str], ranges.Stored] = {}
        self._readers: dict[Path, ranges.FileReader] = {}
        #: The flat tensors (tp, dp, group, state) whose reads the content check was told of.
        self._noted_reads: set[tuple[int, int, int, str]] = set()
        #: Per (name, TP rank, state): the fragments in that state's tensors; per (tp, dp, group, state): where
        #: whole parameters lie in a state that holds them (None: laid out like the master).
        self._remapped: dict[tuple[str, int, str], list[Fragment]] = {}
        self._whole_offsets: dict[tuple[int, int, int, str], dict[str, int] | None] = {}
        #: The optimizer's scalar states met so far (the step): carried per param group, not resharded.
        self._scalars: set[str] = {STEP}

    @property
    def _degrees_text(self) -> str:
        pipeline = f"PP={self.pp_degree} x " if self.pp_degree > 1 else ""
        return f"{pipeline}TP={self.tp_degree} x DP={self.dp_degree}"

    def _check_experts(self, reference: Path) -> None:
        """What of AutoEP this reader serves: ZeRO-1/2/3 at TP=1, and ZeRO-1/2 folded with TP (one EP rank per TP
        rank); under ZeRO-1/2 every expert's model-states file present (a tag that lacks one lost part of a save)."""
        if self.experts is None:
            if self.files.expert_files:
                name = self.files.expert_files[min(self.files.expert_files)].name
                raise CheckpointError(f"{self.tag_dir / name}: an expert checkpoint file, but {reference.name} records "
                                      "no AutoEP layers (ds_autoep_layers): DeepSpeed's older MoE layer, which "
                                      "deepspeed-ext does not read (it reads AutoEP checkpoints)")
            return
        if self.pp_degree != 1:
            raise CheckpointError(f"{reference}: AutoEP with pipeline parallelism (PP={self.pp_degree}) is not read")
        if self.tp_degree != 1 and self.files.partitioned_weights:
            raise CheckpointError(f"{reference}: AutoEP folded with TP={self.tp_degree} under ZeRO-3 is not read")
        if not self.files.optim_files:
            raise CheckpointError(f"{reference}: AutoEP without ZeRO; deepspeed-ext reads AutoEP checkpoints of "
                                  "ZeRO stages 1-3")
        if self.files.partitioned_weights:
            return
        layers = sorted({(param.layer, param.num_experts) for param in self.experts.params.values()})
        placement = next(iter(self.experts.params.values())).placement
        holder = {expert: self.experts.holder_files(ep_rank)[0][0]  # the TP rank whose files hold it
                  for ep_rank, experts in enumerate(placement) for expert in experts}
        missing = [f"layer_{layer}_expert_{expert}_mp_rank_{holder.get(expert, 0):02d}_model_states.pt"
                   for layer, count in layers for expert in range(count)
                   if (layer, expert, holder.get(expert, 0)) not in self.files.expert_files]
        if missing:
            raise CheckpointError(f"{self.tag_dir}: {missing[0]} is missing ({len(layers)} AutoEP layers record "
                                  f"{sum(count for _, count in layers)} experts; {len(missing)} expert files missing)")

    def _recorded_optimizer_names(self, tp: int) -> list[list[str]] | None:
        """Without ZeRO: the parameter names TP rank ``tp``'s optimizer holds, if deepspeed-ext recorded them."""
        if self.uc_info is None or self.uc_info.optimizer_param_names is None:
            return None
        # Recorded on TP rank 0; a rank that holds an empty shard of a parameter (beyond the KV-head count)
        # has no optimizer entry for it, as DeepSpeed leaves empty parameters out.
        layouts = self.uc_info.layouts
        return [[name for name in group if name not in layouts or math.prod(layouts[name].local_shape(tp)) != 0]
                for group in self.uc_info.optimizer_param_names]

    # ------------------------------------------------------------------ the source interface
    @property
    def path(self) -> Path:
        return self.tag_dir

    def _optimizer_settings(self) -> dict[str, Any] | None:
        """The torch optimizer's param-group settings and DeepSpeed's step settings, as saved."""
        try:
            groups = self.optimizer.base_state(0, 0).get(keys.PARAM_GROUPS)
            clip_grad = self.optimizer.optimizer_state_for_universal().get(keys.CLIP_GRAD)
        except (CheckpointError, KeyError, TypeError, AttributeError, NotImplementedError):
            return None  # no optimizer saved (a weights-only tag)
        states = self.model_states
        return optimizer_settings(groups, states.get(keys.DS_CONFIG),
                                  self.uc_info.engine_settings if self.uc_info is not None else None, clip_grad,
                                  states.get(keys.DS_VERSION), self.dp_degree)

    def _trainer_model_config(self) -> dict[str, Any] | None:
        """The model's ``config.json`` in the Hugging Face Trainer ``checkpoint-N`` folder that holds this tag
        (the Trainer writes it there; a checkpoint saved without deepspeed-ext records no config of its own)."""
        from deepspeed_ext.checkpoint.locate import read_config, trainer_checkpoint_of
        folder = trainer_checkpoint_of(self.tag_dir)
        if folder is None or not (folder / "config.json").is_file():
            return None
        return read_config(folder / "config.json")

    @property
    def read_paths(self) -> list[Path]:
        """What converting this checkpoint reads, which no output may touch."""
        return output.read_paths(self.tag_dir)

    @property
    def names(self) -> list[str]:
        return list(self.layouts)

    @cached_property
    def has_optimizer_states(self) -> bool:
        """Every parameter has master weights, and its optimizer's states once the optimizer has stepped. A save
        before the first step has the masters alone: it converts to what a weights-only source gives (fp32 files,
        no moments, no step), and a resume from it keeps the engine's fresh optimizer, as one from pretrained
        weights does."""
        return self.optimizer.has_stepped()

    @cached_property
    def param_states(self) -> dict[str, tuple[str, ...]]:
        """Each parameter's states: the master, then the tensor states and scalars its param group's optimizer
        keeps, by their keys (Adam's ``exp_avg``/``exp_avg_sq``/``step``, Muon's and SGD's ``momentum_buffer``,
        Adagrad's ``sum``/``step``...). Param groups may differ: DeepSpeed's Muon steps its matrices with momentum
        and the rest with Adam. A persistent buffer, which no optimizer steps, has every tensor state any group
        has (zeros) and the step."""
        if not self.has_optimizer_states:
            return {name: (MASTER_WEIGHTS, ) for name in self.layouts}
        by_entry: dict[tuple[int, int, int], tuple[str, ...]] = {}
        found: dict[str, tuple[str, ...]] = {name: (MASTER_WEIGHTS, ) for name in self.frozen.layouts}
        for name in self.layouts:
            if name in self.buffers or name in self.frozen:
                continue
            entry = self._first_entry(name)
            if entry not in by_entry:
                by_entry[entry] = self._states_of_entry(*entry)
            found[name] = by_entry[entry]
        every = [state for name, states in found.items() if name not in self.frozen for state in states]
        buffer_states = ordered_states([s for s in every if s != STEP], [STEP] if STEP in every else [])
        return {name: found.get(name, buffer_states) for name in self.layouts}

    def _first_entry(self, name: str) -> tuple[int, int, int]:
        """``(tp, dp, group)``: the optimizer state entry holding the first fragment of ``name`` (the files of its
        first TP, or EP, rank that holds any of it)."""
        for tp in range(self.layouts[name].tp_size):
            fragments = self._fragments.get((name, tp))
            if fragments:
                first = fragments[0]
                return (tp if first.tp_rank is None else first.tp_rank), first.dp_rank, first.group
        raise CheckpointError(f"{self.tag_dir}: parameter {name!r} is in no optimizer partition")

    def _states_of_entry(self, tp: int, dp: int, group: int) -> tuple[str, ...]:
        """The states a torch optimizer state entry holds, checked to be of a shape this reader reshards: a tensor
        state must hold the elements of the entry's fp32 master (or, Muon's momentum under ZeRO-1/2, its whole
        parameters); a scalar is carried."""
        entry = self.optimizer.group_state(tp, dp, group)
        tensors, scalars = optimizer_state_keys(entry)
        self._scalars.update(scalars)
        master = self.optimizer.flat(tp, dp, group, MASTER_WEIGHTS).numel()
        padding = self.optimizer.padding(tp, dp, group)
        for state in tensors:
            if self.optimizer.whole_param_offsets(tp, dp, group, state) is not None:
                continue
            value = entry[state]
            if not master <= value.numel() <= master + padding:
                raise CheckpointError(
                    f"{self.optimizer.state_file(tp, dp)}: the optimizer ({self.optimizer_kind} over "
                    f"{self._torch_optimizer_name}) keeps state {state!r} of shape {tuple(value.shape)} for param "
                    f"group {group}, whose fp32 master has {master} elements: a state not laid out like its "
                    "parameters (factored or per-row) cannot be resharded, and is not converted")
        return ordered_states(tensors, scalars)

    @property
    def _torch_optimizer_name(self) -> str:
        """What the checkpoint says of the torch optimizer it wrapped (its param groups' keys name it no better)."""
        groups = self.optimizer.base_state(0, 0).get(keys.PARAM_GROUPS) or []
        settings = sorted({key for group in groups for key in group if key != keys.PARAMS})
        return f"a torch optimizer with settings {', '.join(settings[:8])}"

    @property
    def _states(self) -> tuple[str, ...]:
        """Every state any parameter has (the union, in reading order)."""
        every = {state for states in self.param_states.values() for state in states}
        return ordered_states(every - self._scalars, every & self._scalars)

    def has(self, name: str, state: str = MASTER_WEIGHTS) -> bool:
        return name in self.layouts and state in self.param_states[name]

    def states_of(self, name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """``name``'s tensor states (the master first) and its scalar states."""
        states = self.param_states[name]
        return (tuple(s for s in states if s not in self._scalars), tuple(s for s in states if s in self._scalars))

    # ------------------------------------------------------------------ files
    def rank_model_states(self, tp_rank: int) -> dict[str, Any]:
        """TP rank ``tp_rank``'s model states (memory-mapped, loaded once)."""
        return self.files.model_states(tp_rank)

    @property
    def model_states(self) -> dict[str, Any]:
        return self.rank_model_states(0)

    @property
    def model_state_files(self) -> list[Path]:
        """Every model-states file (under ZeRO-3 one per rank)."""
        return list(self.files.all_model_files)

    def copy_model_states(self, directory: Path) -> None:
        """Copy every model-states file into ``directory`` (a universal checkpoint being built).

        Without ZeRO they also hold the whole optimizer, which the universal form already has per
        parameter, so those copies leave it out instead of doubling the checkpoint.
        """
        for path in self.model_state_files:
            if self.optimizer.optimizer_in_model_states:
                states = dict(serialization.load(path))
                states[keys.OPTIMIZER] = None
                serialization.save(states, directory / path.name)
            else:
                shutil.copy2(path, directory / path.name)

    @property
    def zero_stage(self) -> int:
        return self.optimizer.zero_stage

    @property
    def optimizer_kind(self) -> str:
        """Which DeepSpeed optimizer wrapper wrote the state (decides where its tensors live)."""
        return self.optimizer.kind

    def optimizer_state_for_universal(self) -> dict[str, Any]:
        """What upstream stores as ``zero/optimizer_state.pt``: DP0/TP0 state minus the flat tensors."""
        return self.optimizer.optimizer_state_for_universal()

    def _copies_differ(self, name: str, tp: int) -> str:
        """The refusal of a tensor every TP rank holds whole whose copies differ."""
        if self.pp_degree == 1:
            return f"{self.tag_dir}: cannot merge {name!r}: replicated tensor differs between TP rank 0 and TP rank {tp}"
        # Plain layers in a pipeline with a model-parallel axis: each rank trained its own copy (upstream's own
        # TP x PP test saves such a run), so there is no one tensor to convert.
        return (f"{self.tag_dir}: cannot merge {name!r}: TP rank 0 and TP rank {tp} of pipeline stage "
                f"{self._stage_of[name]} (PP={self.pp_degree} x TP={self.tp_degree}) hold different copies of it: "
                "the layer is not tensor-parallel, so each model-parallel rank trained its own; train the pipeline "
                "at TP=1, or with the same initial weights and data on every model-parallel rank")

    # ------------------------------------------------------------------ TP metadata
    @cached_property
    def _saved_shapes(self) -> OrderedDict[str, list[tuple[int, ...] | None]]:
        """``{name: [shape TP rank 0 saved, rank 1, ...]}`` in flat-buffer order.

        None where a rank saved no such parameter: DeepSpeed leaves empty parameters out of the optimizer
        (and so out of ``param_shapes``), which is what a rank beyond the model's KV-head count holds of
        each attention projection. :attr:`layouts` checks that such a rank's shard is indeed empty.
        """
        per_rank = self._shapes_per_file
        experts = self.experts.params if self.experts is not None else {}
        names = list(dict.fromkeys(name for shapes in per_rank for name in shapes if name not in experts))
        stage_of = self._stage_of
        return OrderedDict((name, [per_rank[stage_of[name] * self.tp_degree + tp].get(name)
                                   for tp in range(self.tp_degree)]) for name in names)

    @cached_property
    def _stage_of(self) -> dict[str, int]:
        """The pipeline stage each parameter is read from: the first that holds it (a layer tied across stages, such
        as an embedding shared by the first and the last, is held whole by each; without pipeline parallelism, 0)."""
        found: dict[str, int] = {}
        for mp, shapes in enumerate(self._shapes_per_file):
            for name in shapes:
                found.setdefault(name, mp // self.tp_degree)
        return found

    @cached_property
    def _shapes_per_file(self) -> list[OrderedDict[str, tuple[int, ...]]]:
        """Per model-parallel rank's files (stage-major), ``{name: local shape}`` of what its optimizer holds."""
        return [self.optimizer.saved_shapes(mp) for mp in range(self.mp_degree)]

    @cached_property
    def uc_info(self) -> UCInfo | None:
        from deepspeed_ext.checkpoint import commit
        from deepspeed_ext.checkpoint.metadata import METADATA_FILE
        commit.require_listed_file_intact(self.tag_dir, METADATA_FILE)
        return read_uc_info(self.tag_dir)

    @cached_property
    def metadata_source(self) -> str:
        if self.uc_info is not None:
            return "deepspeed_ext"
        if self.model_states.get(keys.UNIVERSAL_CHECKPOINT_INFO):
            return "deepspeed"
        return "none (TP=1)" if self.tp_degree == 1 else "none"

    @cached_property
    def layouts(self) -> dict[str, TPLayout]:
        """Every parameter's TP layout: ours if saved, else rebuilt from upstream's UC info; checked against the
        shapes every rank saved (:func:`.reconcile.layouts`)."""
        found = reconcile.layouts(self.uc_info, self.model_states.get(keys.UNIVERSAL_CHECKPOINT_INFO),
                                  self._saved_shapes, self.tp_degree, self.files.model_files, self.tag_dir,
                                  self.buffers, HOW_TO_GET_METADATA, pp_degree=self.pp_degree)
        if self.experts is not None:
            # The stacked experts, split over the EP ranks (their shards are EP ranks', not TP ranks').
            order = list(self._shapes_per_file[0])
            layouts = {**found, **{name: param.layout for name, param in self.experts.params.items()}}
            found = {name: layouts[name] for name in [*order, *(n for n in layouts if n not in order)]}
        return {**found, **self.frozen.layouts}  # the frozen parameters last

    @cached_property
    def frozen(self) -> FrozenWeights:
        """The frozen parameters (no optimizer holds them; the model states do): :mod:`.frozen`."""
        trainable = {*self._saved_shapes, *(self.experts.params if self.experts is not None else {})}
        return find_frozen(self.files.model_states, self.files.grid_model_states, self.files.model_files.__getitem__,
                           self.mp_degree, self.tp_degree, self.dp_degree, self.files.partitioned_weights, trainable,
                           self.uc_info.layouts if self.uc_info is not None else None,
                           self.model_states.get(keys.UNIVERSAL_CHECKPOINT_INFO), self.tag_dir,
                           recorded_frozen=self.uc_info.frozen if self.uc_info is not None else None)

    @cached_property
    def frozen_names(self) -> frozenset[str]:
        """Every parameter no optimizer steps: those only the model states hold (:attr:`frozen`), and those an
        optimizer holds but never stepped while it stepped the others (a stage-0 wrapper of DeepSpeed 0.18.8 keeps
        an fp32 master of every parameter it was handed, frozen ones too: their master is their weights)."""
        stepped = self.has_optimizer_states
        return frozenset([*self.frozen.layouts, *(name for name, states in self.param_states.items() if stepped
                                                  and name not in self.buffers and not has_optimizer(states))])

    @cached_property
    def buffers(self) -> dict[str, torch.Tensor]:
        """The model's persistent buffers (the module state dict's non-parameters, such as DeepSeek-V3's router
        ``e_score_correction_bias`` or DeepSeek-V4's int64 ``tid2eid``): state the optimizer does not step but the
        model needs. They are carried as tensors with zero Adam moments; every TP rank's copy must agree."""
        return reconcile.buffers([self.rank_model_states(tp) for tp in range(self.tp_degree)],
                                 self.files.model_files)

    @cached_property
    def _fragments(self) -> dict[tuple[str, int], list[Fragment]]:
        """``(name, tp) -> fragments`` in DP order."""
        found: dict[tuple[str, int], list[Fragment]] = {}
        for mp in range(self.mp_degree):
            stage, tp = divmod(mp, self.tp_degree)
            for name, fragments in self.optimizer.fragments(mp).items():
                if self._stage_of.get(name, 0) == stage:  # a tied layer: its first stage's copy
                    found[(name, tp)] = fragments if self.pp_degree == 1 else [
                        dataclasses.replace(f, tp_rank=mp if f.tp_rank is None else f.tp_rank) for f in fragments]
        return {**found, **self.optimizer.expert_fragments()}
