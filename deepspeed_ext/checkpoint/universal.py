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
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import re
import threading
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Iterator

import torch
from tqdm import tqdm

from deepspeed_ext.checkpoint import collective, output, ranges, serialization
from deepspeed_ext.checkpoint.deepspeed import keys
from deepspeed_ext.checkpoint.deepspeed.experts import EP_NUM_EXPERTS, IS_EXPERT_PARAM, is_expert_layout
from deepspeed_ext.checkpoint.deepspeed.files import resolve_tag_dir
from deepspeed_ext.checkpoint.fingerprint import Fingerprint, Fingerprints, partial_sums
from deepspeed_ext.checkpoint.locate import ALREADY_UNIVERSAL, LATEST_UNIVERSAL, ZERO_DIR
from deepspeed_ext.checkpoint.manifest import ManifestRecorder
from deepspeed_ext.checkpoint.metadata import METADATA_FILE as UC_INFO_FILE
from deepspeed_ext.checkpoint.metadata import UCInfo, read_uc_info, write_uc_info
from deepspeed_ext.checkpoint.source import (CarriesDeepSpeedStates, CheckpointSource, OpenOptions, SourceInfo,
                                             WriteOptions, check_against_record, finite_check, frozen_summary,
                                             protected_paths, required_model_config)
from deepspeed_ext.checkpoint.states import (ADAM_STATES, KNOWN_SCALARS, MASTER_WEIGHTS, MODULE_WEIGHTS,
                                             MUON_MOMENTUM, STEP, has_optimizer, optimizer_settings,
                                             optimizer_states_summary, ordered_states)
from deepspeed_ext.checkpoint.tensor import FiniteCheck, LogicalTensor
from deepspeed_ext.errors import CheckpointError
from deepspeed_ext.module_inject.layout import TPLayout

if TYPE_CHECKING:
    from deepspeed_ext.checkpoint.model_config import ConfigFit

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


@dataclass(frozen=True)
class UniversalOptions(WriteOptions):
    """``distributed``: every rank of the initialized ``torch.distributed`` group calls :func:`write`; each
    converts its share of the parameters (balanced by size) and rank 0 writes the rest and publishes the
    result, byte-identical to a single-process run."""

    distributed: bool = False
    #: ``out`` is the universal tag directory itself, with ``latest_universal`` naming it in its parent (as
    #: upstream ``ds_to_universal --output_folder`` writes), rather than a save directory to write one into.
    tag_directory: bool = False
    #: Check that the parameters fit transformers' model for the source's model config (from-maxtext, where the
    #: config may come from --config), on a thread while the tensors stream; nothing is published if not.
    check_config_fit: bool = False


def universal_name(info: SourceInfo) -> str:
    """``<tag>_universal``, the directory name upstream's converter uses; sources without a DeepSpeed tag
    (HF, MaxText) are named after the training step they hold."""
    return f"{info.tag or f'global_step{info.global_step}'}{keys.UNIVERSAL_TAG_SUFFIX}"


def write(source: CheckpointSource, out: str | Path | None = None,
          options: UniversalOptions = UniversalOptions()) -> Path:
    """Convert ``source`` into DeepSpeed's universal layout; returns the universal checkpoint directory.

    ``out`` None (DeepSpeed sources): ``<tag>_universal/`` beside the source tag, then the ``latest_universal``
    pointer in the save directory, as upstream's ``ds_to_universal`` lays them out. ``out`` given: a save
    directory of its own, ``out/<tag>_universal/`` + ``out/latest_universal``, which
    ``engine.load_checkpoint(out)`` loads; nothing is written outside it. Either way the output is built aside
    and published whole, and may not touch the source (:mod:`deepspeed_ext.checkpoint.output`).

    Streams one parameter and one state at a time: memory stays at about one full tensor.

    ``options.distributed``: a refusal on any rank is raised on every rank, the same one line
    (:mod:`.collective`), at the first agreement point after it: no rank is left waiting for one that gave up.
    """
    if not options.distributed:
        return _write(source, out, options, rank=0)
    # The last agreement point doubles as the barrier: nobody returns before the output and its pointer are in
    # place, and a failure of rank 0's publishing reaches the ranks that finished their share.
    return collective.on_every_rank(lambda: _write(source, out, options, rank=_rank()))


def _write(source: CheckpointSource, out: str | Path | None, options: UniversalOptions, rank: int) -> Path:
    info = source.info
    with contextlib.ExitStack() as stack:
        refusal: Exception | None = None
        try:
            publish, inner = _prepare(source, out, options)
            # Beside the tag (or as a tag directory of its own), the pointer goes into the directory above once
            # the output is published.
            pointer = (publish.parent / LATEST_UNIVERSAL, publish.name) if inner is None else None
            partial = stack.enter_context(output.staged(publish, pointer) if rank == 0 else
                                          contextlib.nullcontext(output.staging_path(publish)))
            universal = partial / inner if inner else partial
            if rank == 0:
                (universal / ZERO_DIR).mkdir(parents=True)
                if inner:
                    (partial / LATEST_UNIVERSAL).write_text(inner)
        except Exception as exc:  # under --distributed every rank must hear of it (below)
            refusal = exc
        if options.distributed:
            collective.agree(refusal)
        elif refusal is not None:
            raise refusal
        finite = finite_check(source, options)
        bar = (options.progress_label or "to-universal") if options.progress else None
        if options.distributed:
            _write_distributed(source, universal, bar, finite)
        else:
            fit = None
            if options.check_config_fit:
                from deepspeed_ext.checkpoint.model_config import ConfigFit
                fit = ConfigFit(required_model_config(info), {name: layout.shape for name, layout in
                                                              info.layouts.items()}, str(info.given))
            with fit.first() if fit is not None else contextlib.nullcontext():
                manifest = ManifestRecorder(universal)
                written = _write_tensors(source, list(info.layouts), universal, bar, manifest,
                                         first=lambda: _write_summary(source, universal), finite=finite, fit=fit)
                if fit is not None:
                    fit.result()
                _write_uc_info(source, universal, written)
                manifest.write()
    return publish / inner if inner else publish


def _prepare(source: CheckpointSource, out: str | Path | None, options: UniversalOptions) -> tuple[Path, str | None]:
    """The directory to publish and, for a save directory of its own, the universal directory's name in it."""
    info = source.info
    if info.format == "universal":
        raise CheckpointError(f"{info.given}: {ALREADY_UNIVERSAL}")
    name = universal_name(info)
    if out is None:  # beside the tag: adds a directory and the pointer, replaces no file of the checkpoint
        if info.tag is None:
            raise CheckpointError(f"{info.given}: a {info.format} checkpoint has no save directory to write "
                                  "beside: give an output")
        return output.prepare(info.path.parent / name, source.read_paths, overwrite=options.overwrite), None
    if options.tag_directory:
        return output.prepare(out, protected_paths(source, options), overwrite=options.overwrite), None
    return output.prepare(out, protected_paths(source, options), overwrite=options.overwrite), name


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank()


def shares_by_size(layouts: dict[str, TPLayout], world: int) -> list[list[str]]:
    """Parameter names per rank: largest first, each to the rank with the fewest elements so far."""
    loads = [0] * world
    shares: list[list[str]] = [[] for _ in range(world)]
    for name in sorted(layouts, key=lambda n: (-layouts[n].numel, n)):
        rank = loads.index(min(loads))
        shares[rank].append(name)
        loads[rank] += layouts[name].numel
    order = {name: i for i, name in enumerate(layouts)}
    return [sorted(share, key=order.__getitem__) for share in shares]


def _write_distributed(source: CheckpointSource, universal: Path, progress: str | None,
                       finite: FiniteCheck | None) -> None:
    """This rank's share of the parameters into ``universal`` (inside rank 0's staging directory); rank 0 shows
    the progress bar."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()

    def attempt(work: Any) -> BaseException | None:
        try:
            work()
        except Exception as exc:  # re-raised below, once every rank knows the run failed
            return exc
        return None

    mine = shares_by_size(dict(source.info.layouts), world)[rank]
    summary = (lambda: _write_summary(source, universal)) if rank == 0 else None
    manifest = ManifestRecorder(universal)
    written = Fingerprints()

    def write_share() -> None:
        written.merge(_write_tensors(source, mine, universal, progress if rank == 0 else None, manifest,
                                     first=summary, finite=finite))

    error = attempt(write_share)
    if error is None and rank != 0:
        error = attempt(lambda: manifest.write_rank_part(rank))
    shares = collective.agree(error, written.to_json() if error is None else None)
    if rank == 0:  # every rank's files are in place: the manifest is the output's last file
        for share in shares:
            written.merge(Fingerprints.from_json(share))
        _write_uc_info(source, universal, written)
        manifest.merge_rank_parts(world)
        manifest.write()


def _write_tensors(source: CheckpointSource, names: list[str], partial: Path, progress: str | None,
                   manifest: ManifestRecorder, first: Callable[[], None] | None = None,
                   finite: FiniteCheck | None = None, fit: ConfigFit | None = None) -> Fingerprints:
    """The per-parameter files of ``names``, each recorded in ``manifest`` by the thread that wrote it;
    ``first`` (the summary files) runs on a writer thread meanwhile. ``progress``: the progress bar's label, or
    None for no bar. Returns the fingerprints of what was written, checked against the source's record.

    Each state is streamed in blocks by a writer thread (:meth:`LogicalTensor.blocks`), so memory stays at a few
    blocks whatever the tensor's size, where the source reads ranges (DeepSpeed checkpoints); other sources
    hand over whole tensors."""
    written = Fingerprints(global_steps=source.info.global_step)
    form = FileForm.of(source.info)

    def save(value: Any, path: Path) -> None:
        serialization.save(value, path)
        manifest.add(path)  # hashed while its pages are still in the page cache

    def stream_state(tensor: LogicalTensor, state: str, path: Path, blocks: Iterator[torch.Tensor]) -> None:
        """Read, fingerprint, checksum and write one state block by block on a writer thread: each block is
        read from the source (the TP merge) and passed over while it is in the CPU's cache."""
        first = next(blocks, None)
        if first is None:  # an empty tensor: its dtype
            first = tensor.load_tensor(state).reshape(-1)
        sums = [0, 0.0, 0.0]

        def summed(block: torch.Tensor) -> torch.Tensor:
            for i, value in enumerate(partial_sums(block)):
                sums[i] += value
            return block

        placeholder = torch.empty(tensor.shape, dtype=first.dtype)  # never touched: no memory
        content = form.content(placeholder, tensor.layout)
        placeholder = content if torch.is_tensor(content) else placeholder  # the flat form: the tensor itself
        checksum = serialization.save_streamed(content, placeholder,
                                               map(summed, itertools.chain([first], blocks)), path)
        written.add(tensor.name, state, Fingerprint(int(sums[0]), sums[1], sums[2]))
        manifest.add(path, checksum)

    zero = partial / ZERO_DIR
    wanted = set(names)
    # Each state is read (merged) and written on a writer thread; this thread only walks the parameters.
    with serialization.BackgroundWriter() as writer:
        if first is not None:
            writer.submit(first)
        stream: Iterator[LogicalTensor] = (t for t in source.tensors() if t.name in wanted)
        for check in (finite, fit):
            stream = check.stream(stream) if check is not None else stream
        for tensor in tqdm(stream, total=len(names), desc=progress,
                           unit="param", disable=progress is None):
            param_dir = zero / tensor.name
            param_dir.mkdir()
            # A source without optimizer state (HF weights, a params-only MaxText checkpoint) has only fp32:
            # no moment files, and the resuming optimizer starts fresh. Each state is a file named by the
            # optimizer's key (Adam's exp_avg.pt, SGD's momentum_buffer.pt, ...); the scalars come last.
            for state in tensor.states:
                path = param_dir / f"{state_file_stem(tensor.name, state)}.pt"
                if state in tensor.scalars:
                    value = tensor.load(state)
                    if state == STEP:
                        written.step = _as_int(value) if written.step is None else written.step
                        if not form.step_files:
                            continue
                    writer.submit(save, value, path)
                    continue
                # A source that reads ranges is read on the writer thread, block by block; others (HF,
                # MaxText: whole arrays) here, as before.
                blocks = (tensor.blocks(state) if tensor.range_loader is not None else
                          iter([tensor.load_tensor(state).reshape(-1)]))
                writer.submit(stream_state, tensor, state, path, blocks)
    if finite is not None:
        finite.raise_if_any()
    source.raise_if_damaged()
    check_against_record(source.info, written, names)
    return written


def state_file_stem(name: str, state: str) -> str:
    """The file name (less ``.pt``) of a state: the optimizer's own key, refused where it cannot be one."""
    if not re.fullmatch(r"[A-Za-z0-9_]+", state):
        raise CheckpointError(f"{name}: optimizer state {state!r} has a name that cannot be a file name")
    return state


def _write_summary(source: CheckpointSource, partial: Path) -> None:
    """Everything but the per-parameter files and our UC info: optimizer summary, model states.

    A DeepSpeed source has its own (copied); a source that never ran in DeepSpeed gets a fresh optimizer
    summary and a model-states file at TP=1, DP=1 that records its step."""
    info = source.info
    if isinstance(source, CarriesDeepSpeedStates):
        serialization.save(source.optimizer_state_for_universal(), partial / ZERO_DIR / OPTIMIZER_STATE_FILE)
        source.copy_model_states(partial)
    else:
        serialization.save({keys.PARAM_GROUPS: []}, partial / ZERO_DIR / OPTIMIZER_STATE_FILE)
        write_fresh_model_states(partial, info.global_step)


def _write_uc_info(source: CheckpointSource, partial: Path, written: Fingerprints) -> None:
    """Our UC info, with the fingerprints of the tensors written (the step: the source's record, else the
    optimizer step of the files)."""
    info = source.info
    if info.fingerprints is not None and info.fingerprints.step is not None:
        written.step = info.fingerprints.step
    write_uc_info(
        partial,
        UCInfo(tp_size=info.tp_degree,
               layouts=dict(info.layouts),
               model_config=dict(info.model_config) if info.model_config is not None else None,
               model_class=info.model_class,
               versions=dict(info.versions),
               kind="universal",
               fingerprints=written,
               frozen=list(info.frozen),
               engine_settings=dict(info.engine_settings) if info.engine_settings else None))


def write_fresh_model_states(directory: Path, global_steps: int) -> None:
    """The model-states file of a universal checkpoint from a source that never ran in DeepSpeed:
    TP=1, DP=1, the training step it records, no module copy, no scheduler."""
    from importlib.metadata import version
    # DeepSpeed's loader refuses a checkpoint without ds_version; the files follow the installed release's layout.
    states: dict[str, Any] = {
        keys.MODULE: None, keys.BUFFER_NAMES: [], keys.OPTIMIZER: None, keys.PARAM_SHAPES: None,
        keys.LR_SCHEDULER: None, keys.GLOBAL_STEPS: int(global_steps), keys.SKIPPED_STEPS: 0,
        keys.MP_WORLD_SIZE: 1, keys.DP_WORLD_SIZE: 1, keys.DS_VERSION: version("deepspeed")}
    serialization.save(states, directory / "mp_rank_00_model_states.pt")


def open_source(path: Path, options: OpenOptions) -> CheckpointSource:
    """The format registry's reader (:mod:`deepspeed_ext.checkpoint.formats`)."""
    config = dict(options.model_config) if options.model_config is not None else None
    return UniversalCheckpoint(path, options.tag, model_config=config)


class UniversalCheckpoint:
    """A universal checkpoint directory (ours or upstream's), read lazily and memory-mapped."""

    def __init__(self, path: str | Path, tag: str | None = None, model_config: dict[str, Any] | None = None):
        """``model_config``: the HF config to report instead of the one recorded with it (``--config``)."""
        path = Path(path)
        self.given = path
        self._model_config = model_config
        if (path / ZERO_DIR).is_dir() and tag is None:
            self.path = path
        else:
            self.path = resolve_tag_dir(path, tag, latest_file=LATEST_UNIVERSAL)
        self.zero = self.path / ZERO_DIR
        if not self.zero.is_dir():
            raise CheckpointError(f"{self.path}: not a universal checkpoint (no {ZERO_DIR}/ directory)")
        # Per thread: the tensor file it reads in blocks (kept mapped between blocks) and its last block.
        self._reads = threading.local()
        self._refuse_missing_parameters()

    @property
    def read_paths(self) -> list[Path]:
        return output.read_paths(self.path)

    @cached_property
    def names(self) -> list[str]:
        """The parameters under ``zero/``. A directory the checkpoint does not list that holds master weights alone
        is a second name of a listed tensor, not a parameter: upstream writes one for each tensor the module state
        dict holds twice (AutoEP's router, also reachable as ``<block>.gate``)."""
        found = sorted(p.name for p in self.zero.iterdir() if p.is_dir())
        listed, _ = self._listed_names()
        if not listed:
            return found
        listed_set = set(listed)
        return [name for name in found if name in listed_set or has_optimizer(self._state_files(name))]

    def _state_files(self, name: str) -> list[str]:
        """The states ``zero/<name>/`` holds a file of, by name."""
        try:
            return [entry[:-3] for entry in os.listdir(self.zero / name) if entry.endswith(".pt")]
        except OSError:
            return []

    @cached_property
    def param_states(self) -> dict[str, tuple[str, ...]]:
        """Each parameter's states, from the files it has: the master, its optimizer's tensor states, its scalars.
        Upstream's ZeRO-3 output keeps the step only in ``zero/optimizer_state.pt`` (no ``step.pt`` at all): there
        a parameter with optimizer states has that step."""
        files = {name: self._state_files(name) for name in self.names}
        step_elsewhere = not any(STEP in states for states in files.values())
        found = {}
        for name, states in files.items():
            scalars = [state for state in states if self._is_scalar(name, state)]
            if step_elsewhere and has_optimizer(states) and self.step(name) is not None:
                scalars.append(STEP)
            found[name] = ordered_states([state for state in states if state not in scalars], scalars)
        return found

    @cached_property
    def _scalar_names(self) -> dict[str, bool]:
        return {}

    def _is_scalar(self, name: str, state: str) -> bool:
        """Whether ``state`` is a scalar (a bare value in its file) rather than a tensor (``{'param': ...}``): known
        for the usual names, else told by the first file of that name (the same for every parameter)."""
        if state in KNOWN_SCALARS or state in KNOWN_TENSOR_STATES:
            return state in KNOWN_SCALARS
        if state not in self._scalar_names:
            data = serialization.load(self.file(name, state))
            self._scalar_names[state] = not (torch.is_tensor(data) and data.dim() > 0
                                             or isinstance(data, dict) and keys.PARAM in data)
        return self._scalar_names[state]

    def _refuse_missing_parameters(self) -> None:
        """At opening: refuse a parameter the checkpoint lists but does not hold under ``zero/`` (a conversion
        killed midway, a directory deleted); the list is our UC info's, else the copied model states'."""
        found = set(self.names)
        expected, listed_by = self._listed_names()
        missing = [name for name in expected if name not in found]
        if missing:
            raise CheckpointError(f"{self.zero / missing[0]}: missing ({listed_by} lists {len(missing)} parameter(s) "
                                  f"with no directory under {ZERO_DIR}/, e.g. {missing[:3]})")

    def _listed_names(self) -> tuple[list[str], str]:
        """The parameters the checkpoint says it holds, and the file that says so."""
        if self.uc_info is not None:
            return list(self._recorded_shapes), str(self.path / UC_INFO_FILE)
        if self.model_state_files:
            return list(self._recorded_shapes), str(self.model_state_files[0])
        return [], ""

    @cached_property
    def uc_info(self) -> UCInfo | None:
        return read_uc_info(self.path)

    @cached_property
    def frozen(self) -> frozenset[str]:
        """The frozen parameters our UC info lists: weights only (no moments, no step), as saved."""
        return frozenset(self.uc_info.frozen or ()) if self.uc_info is not None else frozenset()

    def file(self, name: str, state: str) -> Path:
        return self.zero / name / f"{state}.pt"

    def has(self, name: str, state: str = MASTER_WEIGHTS) -> bool:
        return self.file(name, state).is_file()

    def states_of(self, name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """``name``'s tensor states (the master first) and its scalar states."""
        states, scalars = self.param_states[name], self._scalars
        return tuple(s for s in states if s not in scalars), tuple(s for s in states if s in scalars)

    def load(self, name: str, state: str = MASTER_WEIGHTS) -> torch.Tensor:
        """The full tensor of ``name``/``state``, memory-mapped: only pages that are touched get read."""
        path = self.file(name, state)
        data = serialization.load(path)
        tensor = data.get(keys.PARAM) if isinstance(data, dict) else data
        if not torch.is_tensor(tensor):
            raise CheckpointError(f"{path}: no tensor under 'param'")
        shape = self._recorded_shapes.get(name)
        if not isinstance(data, dict) and shape is not None and tuple(tensor.shape) != shape:
            # Upstream's form from ZeRO-3 at TP=1: the bare flat tensor, shaped by what the checkpoint records.
            if tensor.dim() != 1 or tensor.numel() != math.prod(shape):
                raise CheckpointError(f"{path}: {tensor.numel()} elements, but {name!r} is {shape}")
            tensor = tensor.view(shape)
        return tensor

    @cached_property
    def _recorded_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each parameter's full shape as the checkpoint records it: our UC info's, else the copied model
        states' ``param_shapes`` (ZeRO-3 records full shapes there)."""
        if self.uc_info is not None:
            return {name: layout.shape for name, layout in self.uc_info.layouts.items()}
        if not self.model_state_files:
            return {}
        groups = self.model_states.get(keys.PARAM_SHAPES) or []
        return {name: tuple(int(d) for d in shape)
                for group in (groups if isinstance(groups, list) else [groups]) if isinstance(group, dict)
                for name, shape in group.items()}

    def _mapped(self, name: str, state: str) -> torch.Tensor:
        """The memory-mapped full tensor of ``name``/``state``, kept mapped for the blocks that follow (one per
        thread); the pages of this thread's previous block are released from RSS first."""
        reads = self._reads
        previous = getattr(reads, "block", None)
        if previous is not None:
            serialization.release_pages(previous, reads.mappings)
            reads.block = None
        if getattr(reads, "key", None) != (name, state):
            reads.key, reads.tensor, reads.stored = None, None, None  # unmaps (and closes) the previous file
            reads.tensor = self.load(name, state)
            reads.mappings = serialization.file_mappings(self.file(name, state))
            reads.key = (name, state)
        tensor: torch.Tensor = reads.tensor
        return tensor

    def _block(self, block: torch.Tensor) -> torch.Tensor:
        self._reads.block = block  # released at this thread's next read
        return block

    def full_range(self, name: str, state: str, low: int, high: int) -> torch.Tensor:
        """Elements ``[low, high)`` of the full tensor, flattened: a view of the mapped file."""
        return self._block(self._mapped(name, state).reshape(-1)[low:high])

    def _full_for(self, name: str, state: str, target: TPLayout) -> torch.Tensor:
        """The memory-mapped full tensor, checked against the model's shape."""
        full = self._mapped(name, state)
        if tuple(full.shape) != target.shape:
            raise CheckpointError(f"{self.file(name, state)}: shape {tuple(full.shape)} does not match the model's "
                                  f"{name!r} {target.shape}")
        return full

    def resharded(self, name: str, state: str, target: TPLayout, rank: int) -> torch.Tensor:
        """Rank ``rank``'s shard of ``name`` under ``target``: a view of the memory-mapped full tensor
        where the layout allows, so only the shard's pages are read."""
        return target.slice(self._full_for(name, state, target), rank)

    def resharded_range(self, name: str, state: str, target: TPLayout, rank: int, low: int,
                        high: int) -> torch.Tensor:
        """Elements ``[low, high)`` of :meth:`resharded`, flattened, in a new tensor: only the pages that hold
        them are read, with ``pread`` (:mod:`.ranges`: a ZeRO-3 rank's partition of its TP slice, and of a
        row-parallel weight only its part of each row)."""
        full = self._full_for(name, state, target)
        reads = self._reads
        if reads.stored is None:  # once per mapped tensor: where its bytes are, and a descriptor to read them
            reads.stored = ranges.stored(full.reshape(-1))
        here: ranges.Stored = reads.stored
        whole = TPLayout.replicated(target.shape, 1)  # the full tensor: a replicated source of one rank
        return ranges.resharded_range(whole, target, rank, low, high,
                                      lambda _, start, stop: [(here, start, stop - start)])

    def scalar(self, name: str, state: str) -> torch.Tensor | int:
        """A scalar state of ``name`` (the step), from its file."""
        value = self.step(name) if state == STEP else (serialization.load(self.file(name, state))
                                                        if self.has(name, state) else None)
        if value is None:
            raise CheckpointError(f"{self.file(name, state)}: no optimizer {state}")
        found: torch.Tensor | int = value
        return found

    def step(self, name: str) -> torch.Tensor | int | None:
        path = self.file(name, STEP)
        step: torch.Tensor | int | None
        if path.is_file():
            step = serialization.load(path)
            return step
        state = self.optimizer_state
        try:  # ZeRO-3 universal output keeps the step only in optimizer_state.pt
            step = state[keys.OPTIMIZER_STATE_DICT][keys.STATE][0][STEP]
        except (KeyError, TypeError, IndexError):
            return None
        return step

    @cached_property
    def optimizer_state(self) -> dict[str, Any]:
        path = self.zero / OPTIMIZER_STATE_FILE
        state: dict[str, Any] = serialization.load(path) if path.is_file() else {}
        return state

    def optimizer_state_for_universal(self) -> dict[str, Any]:
        return self.optimizer_state

    @cached_property
    def model_state_files(self) -> list[Path]:
        return sorted(p for p in self.path.iterdir()
                      if keys.MODEL_STATES_RE.match(p.name) or keys.ZERO3_MODEL_STATES_RE.match(p.name))

    @cached_property
    def model_states(self) -> dict[str, Any]:
        if not self.model_state_files:
            raise CheckpointError(f"{self.path}: no mp_rank_*_model_states.pt files")
        states: dict[str, Any] = serialization.load(self.model_state_files[0])
        return states

    @cached_property
    def has_optimizer_states(self) -> bool:
        """Whether the checkpoint holds an optimizer's states (a universal checkpoint from HF weights does not)."""
        return any(has_optimizer(states) for states in self.param_states.values())

    def model_dtype(self, name: str) -> torch.dtype:
        """The dtype the source model held ``name`` in: its copied module weights', else the stored tensor's."""
        module = self.model_states.get(keys.MODULE) if self.model_state_files else None
        value = module.get(name) if isinstance(module, dict) else None
        return value.dtype if torch.is_tensor(value) else self.load(name).dtype

    @cached_property
    def layouts(self) -> dict[str, TPLayout]:
        """The source's TP layouts as recorded; a parameter without one (upstream's output) as one tensor."""
        recorded = self.uc_info.layouts if self.uc_info else {}
        return {name: recorded[name] if name in recorded else TPLayout.replicated(tuple(self.load(name).shape), 1)
                for name in self.names}

    @cached_property
    def info(self) -> SourceInfo:
        recorded = self.uc_info
        states = self.model_states if self.model_state_files else {}
        every = {state for states in self.param_states.values() for state in states}
        return SourceInfo(format="universal",
                          given=self.given,
                          path=self.path,
                          layouts=self.layouts,
                          states=ordered_states(every - set(self._scalars), every & set(self._scalars)),
                          global_step=int(states.get(keys.GLOBAL_STEPS) or 0),
                          tp_degree=int(states.get(keys.MP_WORLD_SIZE) or 1),
                          dp_degree=int(states.get(keys.DP_WORLD_SIZE) or 1),
                          tag=self.path.name,
                          model_config=self._model_config or (recorded.model_config if recorded else None),
                          model_class=recorded.model_class if recorded else None,
                          versions=dict(recorded.versions) if recorded else {},
                          metadata="deepspeed_ext" if recorded else "none",
                          fingerprints=recorded.fingerprints if recorded else None,
                          optimizer_settings=optimizer_settings(
                              self.optimizer_state.get(keys.PARAM_GROUPS), states.get(keys.DS_CONFIG),
                              recorded.engine_settings if recorded else None, self.optimizer_state.get(keys.CLIP_GRAD),
                              states.get(keys.DS_VERSION), int(states.get(keys.DP_WORLD_SIZE) or 1)),
                          engine_settings=recorded.engine_settings if recorded else None,
                          frozen=tuple(name for name in self.names if name in self.frozen))

    @cached_property
    def _scalars(self) -> tuple[str, ...]:
        every = {state for states in self.param_states.values() for state in states}
        return tuple(sorted(state for state in every if state in KNOWN_SCALARS or self._scalar_names.get(state)))

    def _expected_states(self, name: str, states: tuple[str, ...]) -> tuple[str, ...]:
        """The states ``name`` must have: those the checkpoint's record lists for it, and the states that come
        together (Adam's two moments: one without the other is a file lost)."""
        recorded = self.uc_info.fingerprints if self.uc_info is not None else None
        expected = [state for state in recorded.tensors[name] if state != MODULE_WEIGHTS] \
            if recorded is not None and name in recorded.tensors else []  # no file holds the module's own copy
        if any(state in states for state in ADAM_STATES):
            expected += ADAM_STATES
        return tuple(dict.fromkeys(expected))

    def tensors(self) -> Iterator[LogicalTensor]:
        any_optimizer = self.has_optimizer_states
        scalars = self._scalars
        for name, layout in self.layouts.items():
            states = self.param_states[name]
            # A torn conversion may lack one file of one parameter.
            missing = [state for state in self._expected_states(name, states) if state not in states]
            if any_optimizer and not has_optimizer(states) and name not in self.frozen:  # frozen: weights alone
                missing.append(next(s for s in self.param_states.values() if has_optimizer(s))[1])
            if missing:
                raise CheckpointError(f"{self.file(name, missing[0])}: missing ({name} has "
                                      f"{'/'.join(states) or 'nothing'})")

            def loader(state: str, name: str = name) -> torch.Tensor | int:
                if state not in scalars:
                    return self.load(name, state)
                return self.scalar(name, state)

            def range_loader(state: str, low: int, high: int, name: str = name) -> torch.Tensor:
                return self.full_range(name, state, low, high)

            yield LogicalTensor(name=name, shape=layout.shape, layout=layout, states=states, loader=loader,
                                dtype=self.model_dtype(name), range_loader=range_loader,
                                scalars=tuple(s for s in states if s in scalars), trainable=name not in self.frozen)

    def raise_if_damaged(self) -> None:
        """Nothing to check as it streams: this format's files are checked by ``verify`` (a manifest, where
        deepspeed-ext wrote them)."""

    def summary(self) -> dict[str, Any]:
        states = self.model_states
        opt = self.optimizer_state
        first = self.names[0] if self.names else None
        stepped = next((name for name, states in self.param_states.items() if STEP in states), None)
        master = [self.load(n) for n in self.names]  # memory-mapped: only headers are read
        return {
            "kind": "universal",
            "path": str(self.path),
            "tag": self.path.name,
            "source_tp_degree": states.get(keys.MP_WORLD_SIZE),
            "source_dp_degree": states.get(keys.DP_WORLD_SIZE),
            "zero_stage": int(opt.get(keys.ZERO_STAGE, 1)) if opt else None,
            "tensor_dtypes": sorted({str(t.dtype).replace("torch.", "") for t in master}),
            "global_steps": states.get(keys.GLOBAL_STEPS),
            "optimizer_step": None if first is None else _as_int(self.step(stepped or first)),
            "optimizer_states": optimizer_states_summary(self.param_states),
            "deepspeed_version": str(states.get(keys.DS_VERSION)),
            "metadata": "deepspeed_ext" if self.uc_info else "none",
            "num_parameters": sum(t.numel() for t in master),
            **frozen_summary(self.layouts, self.frozen),
        }


def _as_int(value: Any) -> int | None:
    if value is None:
        return None
    return int(value.item()) if torch.is_tensor(value) else int(value)
