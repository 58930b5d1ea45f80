"""The universal sink: any source into DeepSpeed's universal layout, one parameter and one state at a time, in
blocks where the source reads ranges; on several ranks with ``distributed``."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from deepspeed_ext.checkpoint import collective, output, serialization
from deepspeed_ext.checkpoint.deepspeed import keys
from deepspeed_ext.checkpoint.fingerprint import Fingerprint, Fingerprints, partial_sums
from deepspeed_ext.checkpoint.locate import ALREADY_UNIVERSAL, LATEST_UNIVERSAL, ZERO_DIR
from deepspeed_ext.checkpoint.manifest import ManifestRecorder
from deepspeed_ext.checkpoint.metadata import UCInfo, write_uc_info
from deepspeed_ext.checkpoint.source import (
    CarriesDeepSpeedStates,
    CheckpointSource,
    SourceInfo,
    WriteOptions,
    check_against_record,
    required_model_config,
)
from deepspeed_ext.checkpoint.states import STEP
from deepspeed_ext.checkpoint.tensor import LogicalTensor
from deepspeed_ext.checkpoint.universal.files import OPTIMIZER_STATE_FILE, FileForm, as_int, state_file_stem
from deepspeed_ext.checkpoint.writing import Verdicts, Write
from deepspeed_ext.errors import CheckpointError
from deepspeed_ext.module_inject.layout import TPLayout


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
    """The write flow (:mod:`~deepspeed_ext.checkpoint.writing`): rank 0 prepares and publishes; under
    ``distributed`` every rank writes its share into rank 0's staging directory between two agreement points."""
    info = source.info
    agreed = False

    def write_into(partial: Path) -> None:
        nonlocal agreed
        universal = partial / inner if inner else partial
        if rank == 0:
            (universal / ZERO_DIR).mkdir(parents=True)
            if inner:
                (partial / LATEST_UNIVERSAL).write_text(inner)
        agreed = True
        if options.distributed:
            collective.agree(None)
        bar = (options.progress_label or "to-universal") if options.progress else None
        if options.distributed:
            _write_distributed(source, universal, bar, write.verdicts)
            return
        with write.verdicts.fit.first() if write.verdicts.fit is not None else contextlib.nullcontext():
            manifest = ManifestRecorder(universal)
            written = _write_tensors(source, list(info.layouts), universal, bar, manifest, write.verdicts,
                                     first=lambda: _write_summary(source, universal))
            _write_uc_info(source, universal, written)
            manifest.write()

    try:
        write, inner = _prepare(source, out, options)
        # Beside the tag (or as a tag directory of its own), the pointer goes into the directory above once the
        # output is published.
        pointer = (write.out.parent / LATEST_UNIVERSAL, write.out.name) if inner is None else None
        if rank == 0:
            write.publish(write_into, pointer=pointer, manifest=False)  # the manifest is recorded as files are
        else:
            write_into(output.staging_path(write.out))
    except Exception as exc:
        if agreed or not options.distributed:
            raise
        collective.agree(exc)  # under --distributed every rank hears of a refusal before the first agreement
        raise
    return write.out / inner if inner else write.out


def _prepare(source: CheckpointSource, out: str | Path | None, options: UniversalOptions) -> tuple[Write, str | None]:
    """The write (its output prepared) and, for a save directory of its own, the universal directory's name in
    it."""
    info = source.info
    if info.format == "universal":
        raise CheckpointError(f"{info.given}: {ALREADY_UNIVERSAL}")
    name = universal_name(info)
    if out is None:  # beside the tag: adds a directory and the pointer, replaces no file of the checkpoint
        if info.tag is None:
            raise CheckpointError(f"{info.given}: a {info.format} checkpoint has no save directory to write "
                                  "beside: give an output")
        write = Write.of(source, info.path.parent / name, options, protect=source.read_paths, recorded=False)
        inner = None
    else:
        write = Write.of(source, out, options, recorded=False)
        inner = None if options.tag_directory else name
    if options.check_config_fit and not options.distributed:  # once the output may be written (its thread starts)
        from deepspeed_ext.checkpoint.model_config import ConfigFit
        write.verdicts.fit = ConfigFit(required_model_config(info),
                                       {param: layout.shape for param, layout in info.layouts.items()},
                                       str(info.given))
    return write, inner


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


def _write_distributed(source: CheckpointSource, universal: Path, progress: str | None, verdicts: Verdicts) -> None:
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
        written.merge(_write_tensors(source, mine, universal, progress if rank == 0 else None, manifest, verdicts,
                                     first=summary))

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
                   manifest: ManifestRecorder, verdicts: Verdicts, first: Callable[[], None] | None = None
                   ) -> Fingerprints:
    """The per-parameter files of ``names``, each recorded in ``manifest`` by the thread that wrote it;
    ``first`` (the summary files) runs on a writer thread meanwhile. ``progress``: the progress bar's label, or
    None for no bar. Returns the fingerprints of what was written, checked against the source's record (the last
    of ``verdicts``, given here: each rank of a distributed write gives its own share's).

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
        stream = verdicts.stream(t for t in source.tensors() if t.name in wanted)
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
                        written.step = as_int(value) if written.step is None else written.step
                        if not form.step_files:
                            continue
                    writer.submit(save, value, path)
                    continue
                # A source that reads ranges is read on the writer thread, block by block; others (HF,
                # MaxText: whole arrays) here, as before.
                blocks = (tensor.blocks(state) if tensor.range_loader is not None else
                          iter([tensor.load_tensor(state).reshape(-1)]))
                writer.submit(stream_state, tensor, state, path, blocks)
    verdicts.also.append(lambda: check_against_record(source.info, written, names))
    verdicts.give()
    return written


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
               engine_settings=dict(info.engine_settings) if info.engine_settings else None,
               adapters=dict(info.adapters) if info.adapters else None))


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
