"""The steps every save shares, synchronous or in the background: DeepSpeed's files written durably and never
raising (so every rank reaches the point where the ranks agree), the agreement itself (one rank's failure
raised on every rank, in one line), and the coordinator's commit (UC info, marker, rename, ``latest``)."""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any

import torch

from deepspeed_ext.checkpoint import engine_private
from deepspeed_ext.checkpoint.metadata import UCInfo, write_uc_info
from deepspeed_ext.version import __version__


def versions() -> dict[str, str]:
    import deepspeed
    return {"deepspeed_ext": __version__, "deepspeed": deepspeed.__version__, "torch": torch.__version__}


def commit_save(engine: Any, info: UCInfo, save_dir: str, tag: str, details: dict[str, Any],
                 save_latest: bool) -> None:
    """The coordinator's part of a save whose files every rank wrote: the UC info, then the commit. On node-local
    storage, first the check that this node holds every model-states file its ranks read to resume."""
    from deepspeed_ext.checkpoint import commit
    from deepspeed_ext.errors import CheckpointError
    staged = commit.staging_root(save_dir, tag) / tag
    needed: dict[str, int] = getattr(engine, NODE_FILES_ATTR, {}).get(_node_of(engine), {})
    for name, rank in sorted(needed.items()):
        if not (staged / name).is_file():
            raise CheckpointError(f"{save_dir}/{tag}/{name}: not written on this node, yet rank {rank} reads it to "
                                  f"resume (node-local storage: each node must hold its ranks' files)")
    info.commit_marker = True
    write_info(engine, info, str(staged), always=True)
    commit.commit(save_dir, tag, details, save_latest=save_latest)


#: On node-local storage: {first global rank of a node: {model-states file its ranks read: the first such rank}}.
NODE_FILES_ATTR = "_deepspeed_ext_node_files"


def _node_of(engine: Any) -> int:
    """This rank's node, as its first global rank (torchrun numbers each node's ranks consecutively)."""
    return int(engine.global_rank) - int(engine.local_rank)


def prepare_node_local_save(engine: Any) -> None:
    """Collective, once per engine, where DeepSpeed keeps checkpoints on node-local storage. DeepSpeed picks the
    ranks that write model-states files there by local rank alone (each node's local rank 0 writes), so with
    tensor or pipeline parallelism inside a node the other model-parallel ranks' files land on no node, and no node
    can resume. Here the first rank on each node that reads a file writes it, and the table of what each node
    needs is kept for its coordinator's check (:func:`commit_save`). MoE engines save through DeepSpeed's own MoE
    path, left as it is: the check still refuses a node that misses a file."""
    from deepspeed_ext.checkpoint import collective
    if not engine_private.node_local_storage(engine):
        return
    if not hasattr(engine, NODE_FILES_ATTR):
        name = engine_private.model_states_file(engine)
        table: dict[int, dict[str, int]] = {}
        for rank, (_, (node, needed)) in enumerate(collective.gather(None, (_node_of(engine), name))):
            table.setdefault(node, {}).setdefault(needed, rank)
        setattr(engine, NODE_FILES_ATTR, table)
    table = getattr(engine, NODE_FILES_ATTR)
    if engine_private.writes_model_states(engine) is not None and not engine_private.has_moe_layers(engine):
        first = table[_node_of(engine)][engine_private.model_states_file(engine)]
        engine_private.set_writes_model_states(engine, first == engine.global_rank)


def is_commit_coordinator(engine: Any) -> bool:
    """The rank that prepares and commits a save: global rank 0, or each node's first rank where DeepSpeed keeps
    checkpoints on node-local storage (each node then commits the files it holds)."""
    node_local = engine_private.node_local_storage(engine)
    return bool((engine.local_rank if node_local else engine.global_rank) == 0)


def commit_details(engine: Any) -> dict[str, Any]:
    """What the commit marker records beside the files: who wrote it and at which degrees."""
    tp_size, _ = engine_private.model_parallel_info(engine)
    world = world_size()
    return {"global_steps": int(engine.global_steps), "world_size": world, "tp_degree": tp_size,
            "zero_stage": engine_private.zero_stage(engine), "written_by": versions()}


def world_size() -> int:
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def raise_if_any_rank_failed(problem: str | None, tag: str, save_dir: str, discard: bool = False) -> None:
    """Collective: every rank says whether its part of the save failed; if any did, every rank raises the first
    failure (one line, naming the rank and the file), and the coordinator removes the unfinished save. Doubles
    as the barrier between the save's steps."""
    from deepspeed_ext.checkpoint import collective, commit
    from deepspeed_ext.errors import CheckpointError
    failed = [(rank, text) for rank, (text, _) in enumerate(collective.gather(problem)) if text is not None]
    if not failed:
        return
    if discard:
        commit.discard_staging(save_dir, tag)
    raise CheckpointError(save_failure(failed, tag, save_dir))


def save_failure(failed: list[tuple[int, str]], tag: str, save_dir: str, how: str = "",
                  published: bool = False) -> str:
    """One line: the save of ``tag`` failed, on which rank(s) and why, and what ``latest`` still names
    (``published``: the tag itself was committed in place before the failure, only ``latest`` not moved)."""
    rank, text = failed[0]
    others = f" (and on {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
    latest = os.path.join(save_dir, "latest")
    kept = f"; {latest} still names {read_text(latest)!r}" if os.path.isfile(latest) else ""
    what = (f"{os.path.join(save_dir, tag)} was committed (complete; load it by its tag) but latest was not moved"
            if published else "nothing of it was committed")
    return f"saving checkpoint {tag!r} into {save_dir} {how}failed on rank {rank}{others}: {text}; {what}{kept}"


def read_text(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return "?"


def write_info(engine: Any, info: UCInfo, tag_dir: str, always: bool = False) -> None:
    if always or engine.global_rank == 0:
        info.optimizer_param_names = engine_private.stage0_param_names(engine)
        write_uc_info(tag_dir, info)


def _barrier() -> None:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def can_fuse(engine: Any) -> bool:
    """Whether DeepSpeed's files can be written by :mod:`~deepspeed_ext.checkpoint.zipsave` (the sums read
    from its blocks): its own torch checkpoint engine (the zip format) on a CPU engine. On an accelerator the
    sums run there and torch.save copies each storage to the host anyway."""
    from deepspeed_ext.checkpoint import zipsave
    return (engine_private.writes_torch_zip_files(engine) and device_type(getattr(engine, "device", None)) == "cpu"
            and zipsave.supported())


def device_type(device: Any) -> str:
    """``device``'s type ("cpu", "cuda", ...), whether it is a torch.device, a string or an index."""
    try:
        return torch.device(device).type
    except (TypeError, RuntimeError):
        return "cpu" if device is None else "other"


#: A file system with less room than this after a failed write was full (torch's writer reports ENOSPC as an
#: iostream error without the cause).
_NEARLY_FULL_BYTES = 64 << 20


def _write_failure(path: str, exc: BaseException) -> str:
    """Why writing ``path`` failed, in one line, with the cause where torch's message hides it (a full disk)."""
    from deepspeed_ext.errors import first_line
    message = first_line(exc)
    try:
        stats = os.statvfs(os.path.dirname(os.path.abspath(path)))
    except OSError:
        return message
    free = stats.f_bavail * stats.f_frsize
    if free < _NEARLY_FULL_BYTES and "No space left" not in message:
        message = f"No space left on device ({free} bytes free): {message}"
    return message


def guarded_writes(engine: Any, plan: Any, failures: list[str], zipsave_files: bool) -> Any:
    """The engine's checkpoint writes (and its copy of the recovery scripts) replaced, for one ``save_checkpoint``,
    by :func:`guarded_save` and :func:`guarded_copy`: a save that is durable (fsynced) when it returns and
    never raises, so that every rank reaches DeepSpeed's own barrier and the ranks can then agree that the save
    failed (:func:`raise_if_any_rank_failed`)."""
    stack = contextlib.ExitStack()
    stack.enter_context(engine_private.checkpoint_files_written_by(
        engine, lambda own: functools.partial(guarded_save, own, plan, failures, zipsave_files)))
    stack.enter_context(engine_private.recovery_scripts_copied_by(
        engine, lambda own: functools.partial(guarded_copy, own, failures)))
    return stack


def guarded_save(own: Any, plan: Any, failures: list[str], zipsave_files: bool, state_dict: Any, path: str,
                  written: Any = None) -> None:
    """Write one of DeepSpeed's files durably, never raising: a failed write (a full disk) is recorded in
    ``failures``, its file removed, and the rest of this rank's files skipped. With ``zipsave_files`` the file is
    written by zipsave, which shows ``plan`` (the fingerprints' sums, when not None) each storage's blocks as they
    are written; where zipsave cannot (another torch), ``own`` (the checkpoint engine's save) writes it and what
    ``plan`` summed from it is forgotten. ``written``: zipsave's, told each block once it is in the file."""
    from deepspeed_ext.checkpoint import durable, zipsave
    if failures:
        return  # this rank's save has failed already: it will not be committed
    try:
        if zipsave_files:
            mark = plan.mark() if plan is not None else None
            zipsave.save(state_dict, path, plan,
                         on_fallback=(lambda: plan.rollback(mark)) if plan is not None else None, written=written)
        else:
            own(state_dict, path)
            if os.path.isfile(path):
                durable.fsync_file(path)
    except Exception as exc:  # a failed write: reported by every rank after DeepSpeed's barrier
        failures.append(f"{path}: {_write_failure(path, exc)}")
        with contextlib.suppress(OSError):
            os.unlink(path)


def guarded_copy(own: Any, failures: list[str], save_path: str) -> None:
    """DeepSpeed's copy of its recovery scripts (``zero_to_fp32.py``), a write past its checkpoint engine, by
    ``own``; a failure recorded in ``failures`` as :func:`guarded_save` does."""
    from deepspeed_ext.checkpoint import faults
    if failures:
        return
    try:
        faults.reached("recovery-scripts")
        own(save_path)
    except OSError as exc:
        path = str(exc.filename2 or exc.filename or save_path)
        failures.append(f"{path}: {_write_failure(path, exc)}")
