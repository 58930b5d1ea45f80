"""The save hook: ``save_checkpoint`` staged, written durably on every rank, agreed on, fingerprinted and
committed (marker, fsync, rename, ``latest`` last), or handed to the background writer (:mod:`.background_save`)."""

from __future__ import annotations

import inspect
import os
from typing import Any

from deepspeed_ext.checkpoint import engine_private
from deepspeed_ext.checkpoint.metadata import UCInfo
from deepspeed_ext.errors import DeepSpeedExtError
from deepspeed_ext.runtime.background_save import (
    ASYNC_SAVE_ATTR,
    PENDING_ATTR,
    SNAPSHOT_ATTR,
    hook_steps_to_report_background_saves,
    save_in_background,
    settle_background_save,
)
from deepspeed_ext.runtime.fingerprints import SumsThread, local_sums, save_fingerprints
from deepspeed_ext.runtime.save_steps import (
    can_fuse,
    commit_details,
    commit_save,
    guarded_writes,
    is_commit_coordinator,
    prepare_node_local_save,
    raise_if_any_rank_failed,
    write_info,
)


def hook_save(engine: Any, info: UCInfo, fingerprints: str, snapshot: str | None = None) -> None:
    """``save_checkpoint`` that writes our UC info (layouts, model config, fingerprints) into the tag and commits
    the tag with a marker (:mod:`deepspeed_ext.checkpoint.commit`).

    DeepSpeed writes the tag into a staging directory beside it; each rank's files are written to a temporary
    name, fsynced and renamed. When every rank's writes succeeded (the ranks agree on that, so a rank whose disk
    filled up makes every rank raise the one reason instead of leaving the others waiting), one rank writes the
    marker last, moves the tag into place in one rename (an existing tag of the same name is swapped out: it
    stays valid until then) and only then writes ``latest``. A kill at any instant leaves the tag either as it
    was or complete.

    On a CPU engine with DeepSpeed's own torch checkpoint engine, its files are written by
    :mod:`deepspeed_ext.checkpoint.zipsave`: the same bytes, each storage read once, in cached blocks, and the
    fingerprints' sums read each state from those blocks as they are written (see :func:`guarded_writes`).
    Otherwise the sums run on a thread while DeepSpeed writes. Then rank 0 gathers the ranks' sums and adds them up. A
    checkpoint engine that commits later (decoupled, asynchronous) writes ``latest`` at its own commit: there the
    sums run first, the UC info is written before DeepSpeed's files, and the tag gets no marker (it is read as a
    checkpoint not saved by deepspeed-ext: docs/reliability.md).

    With a ``snapshot`` (``"async_save"``: "fork" or "copy") the files, the fingerprints, the marker and ``latest``
    are written by a writer per rank in the background (:func:`save_in_background`)."""
    engine_private.wrap_engine_method(engine, "save_checkpoint",
                                      lambda original: _committing_save(engine, info, fingerprints, original))
    setattr(engine, ASYNC_SAVE_ATTR, snapshot is not None)
    setattr(engine, SNAPSHOT_ATTR, snapshot or "fork")
    if snapshot is not None:
        hook_steps_to_report_background_saves(engine)


def _committing_save(engine: Any, info: UCInfo, fingerprints: str, original: Any) -> Any:
    """The ``save_checkpoint`` :func:`hook_save` installs, around DeepSpeed's own (``original``)."""
    signature = inspect.signature(original)

    def save_checkpoint(save_dir: Any, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        from deepspeed_ext.checkpoint import commit, faults
        if tag is None:
            tag = f"global_step{engine.global_steps}"  # DeepSpeed's own default, made explicit
        tag = str(tag)
        call = signature.bind(save_dir, tag, *args, **kwargs)
        if engine_private.saves_in_background(engine):
            if fingerprints != "off":  # collective: every rank saves
                info.fingerprints = save_fingerprints(engine, local_sums(engine))
            info.commit_marker = False
            write_info(engine, info, os.path.join(save_dir, tag))
            return original(*call.args, **call.kwargs)
        save_latest = bool(call.arguments.get("save_latest", True))
        call.arguments["save_latest"] = False
        prepare_node_local_save(engine)
        coordinator = is_commit_coordinator(engine)
        this_in_background = getattr(engine, ASYNC_SAVE_ATTR, False)  # switchable per save
        if hasattr(engine, PENDING_ATTR):
            settle_background_save(engine, block=True)  # one save at a time: the previous one is committed first
        faults.current_tag = tag
        problem = None
        if coordinator:
            try:
                commit.prepare_staging(save_dir, tag)
            except OSError as exc:
                problem = f"{commit.staging_root(save_dir, tag)}: cannot create the staging directory: {exc}"
        raise_if_any_rank_failed(problem, tag, save_dir)
        call.arguments["save_dir"] = str(commit.staging_root(save_dir, tag))
        if this_in_background:
            return save_in_background(engine, info, fingerprints, original, call, str(save_dir), tag, save_latest,
                                       coordinator)
        fuse = can_fuse(engine)
        plan = sums = None
        if fingerprints != "off":
            if fuse:
                from deepspeed_ext.checkpoint.engine_fingerprints import SumsPlan
                plan = SumsPlan(engine)
            else:
                sums = SumsThread(engine)
        failures: list[str] = []
        try:
            with guarded_writes(engine, plan, failures, zipsave_files=fuse):
                result = original(*call.args, **call.kwargs)
        finally:
            if sums is not None:
                sums.join()
        faults.reached("files-written")
        raise_if_any_rank_failed(failures[0] if failures else None, tag, save_dir, discard=coordinator)
        if fingerprints != "off":
            local = plan.finish() if plan is not None else sums.result()  # type: ignore[union-attr]
            info.fingerprints = save_fingerprints(engine, local)
        problem = None
        if coordinator:
            try:
                commit_save(engine, info, save_dir, tag, commit_details(engine), save_latest)
            except (OSError, DeepSpeedExtError) as exc:
                problem = f"committing {tag}: {exc}"
        raise_if_any_rank_failed(problem, tag, save_dir, discard=coordinator)
        return result

    return save_checkpoint
