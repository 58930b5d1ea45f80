"""Saves in the background (``"async_save": true``): DeepSpeed's files handed over instead of written, a forked
writer per rank that writes them from the state as it was and commits, and how the ranks learn how it went (at
the next step, at ``destroy``, at ``load_checkpoint``, at the process's exit)."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
import weakref
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch

from deepspeed_ext.checkpoint import engine_private
from deepspeed_ext.checkpoint.metadata import UCInfo
from deepspeed_ext.errors import CheckpointError, DeepSpeedExtError, first_line
from deepspeed_ext.runtime.fingerprints import local_sums, recorded_fingerprints, save_fingerprints
from deepspeed_ext.runtime.log import logger
from deepspeed_ext.runtime.save_steps import (
    can_fuse,
    commit_details,
    commit_save,
    device_type,
    guarded_copy,
    guarded_save,
    raise_if_any_rank_failed,
    read_text,
    save_failure,
    world_size,
)

#: Whether the engine's next ``save_checkpoint`` is written in the background: ``async_save`` from the config,
#: switchable per save (False: this save is written before it returns, as without ``async_save``).
ASYNC_SAVE_ATTR = "deepspeed_ext_async_save"


#: The engine's save being written in the background (a :class:`~.background.BackgroundSave`), until reported.
PENDING_ATTR = "deepspeed_ext_background_save"


#: Every save of this process still being written, for the exit (:func:`wait_at_exit`).
PENDING_SAVES: list[Any] = []


#: The engines that save in the background (for Accelerate's ``save_state``, which waits for them).
BACKGROUND_ENGINES: weakref.WeakSet[Any] = weakref.WeakSet()


#: How the engine's saves in the background take their snapshot: "fork" or "copy" (:func:`background_snapshot`).
SNAPSHOT_ATTR = "deepspeed_ext_async_snapshot"

#: The host buffers of the engine's copy snapshots (:class:`~deepspeed_ext.checkpoint.snapshot.HostPool`), kept from
#: one save to the next.
POOL_ATTR = "deepspeed_ext_snapshot_pool"


def background_snapshot(engine: Any, asked: str | None) -> str | None:
    """How ``async_save`` snapshots this engine's state: ``asked`` ("fork" or "copy", from the config) or, left
    out, host copies: the only way on an accelerator, and on the CPU the faster of the two (a shorter stall, and
    training slowed less while the writer writes, for a copy of the state kept in host memory: docs/performance.md).
    None where the save stays synchronous (with a warning): DeepSpeed's decoupled checkpoint engine (it writes in
    the background already), a fork asked for on an accelerator or where the platform cannot fork."""
    on_cpu = device_type(getattr(engine, "device", None)) == "cpu"
    snapshot = asked or "copy"
    reason = None
    if engine_private.saves_in_background(engine):
        reason = "DeepSpeed's decoupled checkpoint engine writes in the background already"
    elif snapshot == "fork" and not hasattr(os, "fork"):
        reason = 'this platform cannot fork (use "async_save": {"snapshot": "copy"})'
    elif snapshot == "fork" and not on_cpu:
        reason = ('a fork cannot snapshot an accelerator\'s memory (the engine runs on '
                  f'{device_type(engine.device)}: use "async_save": {{"snapshot": "copy"}})')
    if reason is not None:
        if engine.global_rank == 0:
            logger.warning("async_save: saving synchronously: %s", reason)
        return None
    return snapshot


def save_in_background(engine: Any, info: UCInfo, fingerprints: str, original: Any, call: Any, save_dir: str,
                        tag: str, save_latest: bool, coordinator: bool) -> Any:
    """DeepSpeed's ``save_checkpoint`` with each file it writes (and its copy of the recovery scripts) handed
    over instead of written; then a writer per rank (:mod:`~deepspeed_ext.checkpoint.background`) writes them from
    the state as it was (a fork of the rank, or host copies written by a thread), and the coordinator's writer
    commits once every rank's files are durable. Returns as soon as every rank's writer has started."""
    from deepspeed_ext.checkpoint import background, commit
    files: list[tuple[Any, Any, str]] = []
    copies: list[tuple[Any, str]] = []

    def hand_over(own: Any) -> Any:
        def save(state_dict: Any, path: str) -> None:
            files.append((own, state_dict, path))
        return save

    def hand_over_copy(own: Any) -> Any:
        def copy(save_path: str) -> None:
            copies.append((own, save_path))
        return copy

    with engine_private.checkpoint_files_written_by(engine, hand_over), \
            engine_private.recovery_scripts_copied_by(engine, hand_over_copy):
        result = original(*call.args, **call.kwargs)
    staging = commit.staging_root(save_dir, tag)
    # On node-local storage a node's coordinator hears only its own node's writers: the sums are added up over
    # every rank here, in a collective, before the snapshot is written (the stall pays for them).
    sums_in_writer = fingerprints != "off" and not engine_private.node_local_storage(engine)
    if fingerprints != "off" and not sums_in_writer:
        info.fingerprints = save_fingerprints(engine, local_sums(engine))
    job = _WriteJob(engine, info, sums_in_writer, copies, staging, engine.global_rank, coordinator,
                    _ranks_committed_together(engine), save_dir, tag, commit_details(engine), save_latest)
    problem, pending, start_copies = None, None, None
    if getattr(engine, SNAPSHOT_ATTR, "fork") == "copy":
        try:
            start_copies = _copy_writer(engine, job, files)
        except Exception as exc:  # no host memory for the copies, a state that cannot be copied
            problem = f"cannot snapshot the state for the background writer: {first_line(exc)}"
    else:
        fuse = can_fuse(engine)

        def write_and_commit() -> None:  # in the forked writer: the state as it was at the fork
            torch.set_num_threads(1)  # the parent's OpenMP threads do not exist here
            plan = None
            if sums_in_writer and fuse:
                from deepspeed_ext.checkpoint.engine_fingerprints import SumsPlan
                plan = SumsPlan(engine)
            releases = _released_once_written(files, plan) if fuse else [None] * len(files)
            job.run(files, plan, fuse, releases, lambda: False)

        try:
            pending = background.start(write_and_commit, tag=tag, save_dir=save_dir, staging=staging,
                                       rank=engine.global_rank, coordinator=coordinator)
        except OSError as exc:  # no memory or no process left to fork
            problem = f"cannot start the background writer: {exc}"
    files.clear()  # the writer holds them now; the parent lets go of DeepSpeed's temporaries
    try:
        raise_if_any_rank_failed(problem, tag, save_dir, discard=coordinator)
    except CheckpointError:
        if pending is not None:
            pending.kill()
        if start_copies is not None:
            start_copies(False)
        raise
    if start_copies is not None:
        # Only now, the ranks agreed: the host copies, on a thread, would slow every rank's way to the agreement.
        pending = start_copies(True)
    setattr(engine, PENDING_ATTR, pending)
    PENDING_SAVES.append(pending)
    return result


def _copy_writer(engine: Any, job: _WriteJob, files: list[tuple[Any, Any, str]]) -> Callable[[bool], Any]:
    """The copy snapshot (:mod:`~deepspeed_ext.checkpoint.snapshot`) of ``files``, its device copies issued, and
    what starts its host copies and a thread that writes and commits it (``start(True)``: the writer's handle), or
    lets it go (``start(False)``). The fingerprints' plan is made from the live engine first, then pointed at the
    copies."""
    from deepspeed_ext.checkpoint import background, snapshot, zipsave
    pool = getattr(engine, POOL_ATTR, None)
    if pool is None:
        pool = snapshot.HostPool()
        setattr(engine, POOL_ATTR, pool)
    plan = None
    if job.sums_in_writer:
        from deepspeed_ext.checkpoint.engine_fingerprints import SumsPlan
        plan = SumsPlan(engine)
    taken = snapshot.take([state for _, state, _ in files], pool,
                          also=(lambda copied: plan.point_at(copied.view_of)) if plan is not None else None)
    copied = [(own, state, path) for (own, _, path), state in zip(files, taken.states, strict=True)]
    # The copies are host tensors: zipsave writes them wherever DeepSpeed's own engine writes torch's zip files.
    fuse = engine_private.writes_torch_zip_files(engine) and zipsave.supported()

    def write_and_commit(stopped: Callable[[], bool]) -> None:
        try:
            taken.wait()
            job.run(copied, plan, fuse, [_StopBetweenBlocks(stopped)] * len(copied), stopped)
        finally:
            copied.clear()
            taken.release()

    def start(go: bool) -> Any:
        if not go:
            copied.clear()
            taken.release()
            return None
        taken.start_host_copies()
        return background.WriterThread(write_and_commit, tag=job.tag, save_dir=job.save_dir, staging=job.staging,
                                       rank=job.rank, coordinator=job.coordinator, order_next_step=taken.order_after)

    return start


class _StopBetweenBlocks:
    """zipsave's ``written``: raises once the writer was asked to stop (the file is then removed)."""

    def __init__(self, stopped: Callable[[], bool]):
        self._stopped = stopped

    def __call__(self, address: int, nbytes: int) -> None:
        from deepspeed_ext.checkpoint import background
        if self._stopped():
            raise background.BackgroundFailure("stopped")


@dataclasses.dataclass
class _WriteJob:
    """What a rank's background writer writes and commits, whichever the snapshot."""

    engine: Any
    info: UCInfo
    #: Whether each writer takes its rank's fingerprint sums and the coordinator adds them up (else they were
    #: recorded in ``info`` before the snapshot, or not at all).
    sums_in_writer: bool
    copies: list[tuple[Any, str]]
    staging: Path
    rank: int
    coordinator: bool
    together: int
    save_dir: str
    tag: str
    details: dict[str, Any]
    save_latest: bool

    def run(self, files: list[tuple[Any, Any, str]], plan: Any, fuse: bool, releases: list[Any],
            stopped: Callable[[], bool]) -> None:
        """Write this rank's files (``plan``: the fingerprints' sums, from zipsave's blocks where ``fuse``), say
        how it went, and, on the coordinator, wait for every rank's word and commit; raises the failure."""
        from deepspeed_ext.checkpoint import background, faults
        from deepspeed_ext.checkpoint.engine_fingerprints import LocalSums
        background.note_writer(self.staging, self.rank)
        failures: list[str] = []
        local = None
        try:
            for (own, state, path), written in zip(files, releases, strict=True):
                if stopped():
                    raise background.BackgroundFailure("stopped")
                guarded_save(own, plan, failures, fuse, state, path, written=written)
            for own, path in self.copies:
                guarded_copy(own, failures, path)
            faults.reached("files-written")
            if not failures and self.sums_in_writer:
                local = plan.finish() if plan is not None else local_sums(self.engine)
        except Exception as exc:
            failures.append(first_line(exc))
        background.report_rank(self.staging, self.rank, failures[0] if failures else None,
                               {"sums": None if local is None else local.to_json()})
        if failures:
            raise background.BackgroundFailure(failures[0])
        if not self.coordinator:
            return
        words = background.wait_for_ranks(self.staging, self.together,
                                          stop=lambda: "stopped" if stopped() else None)
        if self.sums_in_writer:
            from deepspeed_ext.checkpoint.engine_fingerprints import combine_local_sums
            self.info.fingerprints = recorded_fingerprints(self.engine, *combine_local_sums(
                [LocalSums.from_json(words[each]["sums"]) for each in sorted(words)]))
        if stopped():
            raise background.BackgroundFailure("stopped")
        try:
            commit_save(self.engine, self.info, self.save_dir, self.tag, self.details, self.save_latest)
        except (OSError, DeepSpeedExtError) as exc:
            raise background.BackgroundFailure(f"committing {self.tag}: {first_line(exc)}") from exc


def _released_once_written(files: list[tuple[Any, Any, str]], plan: Any) -> list[Any]:
    """For a forked writer's zipsave, one per file: what gives each block of the file back to the kernel once it is
    written, but for what a later file or the sums still to be done (``plan``) read. Nothing is given back where
    a file's storages cannot be found (a file torch cannot pickle fails in its own write)."""
    from deepspeed_ext.checkpoint import background, zipsave
    try:
        spans = [zipsave.storage_ranges(state) for _, state, _ in files]
    except Exception:  # noqa: BLE001
        return [None] * len(files)
    later: list[list[tuple[int, int]]] = [[] for _ in files]
    for index in range(len(files) - 2, -1, -1):
        later[index] = later[index + 1] + spans[index + 1]

    def kept_for(kept: list[tuple[int, int]]) -> Callable[[], list[tuple[int, int]]]:
        return lambda: kept + (plan.unread_ranges() if plan is not None else [])

    return [background.ReleasedPages(kept_for(kept)) for kept in later]


def _ranks_committed_together(engine: Any) -> int:
    """How many ranks' writers the coordinator waits for: every rank, or the node's where each node commits its
    own files (node-local storage)."""
    if engine_private.node_local_storage(engine):
        return int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))
    return world_size()


def settle_background_save(engine: Any, block: bool) -> None:
    """Collective: where the engine has a save in the background, find out how it went (waiting for it with
    ``block``) and agree on it. Committed: forgotten, and what waited for the commit (a trainer's rotation of its
    old checkpoints) runs. Failed on any rank: every rank stops its writer, the coordinator removes the
    unfinished save, and every rank raises the failure in one line (naming the rank whose write failed first;
    ``latest`` never moved). Still running (not ``block``): kept, asked again at the next step."""
    from deepspeed_ext.checkpoint import collective, commit
    pending = getattr(engine, PENDING_ATTR, None)
    if pending is None:
        return
    outcome = pending.wait() if block else pending.poll()
    published = False
    if outcome is not None and not outcome.ok and pending.coordinator:
        published = _published_before_it_died(pending)
        if published and read_text(os.path.join(pending.save_dir, "latest")) == pending.tag:
            logger.warning("the writer of %s died after committing it (%s); its leftovers are removed", pending.tag,
                           outcome.message)
            commit.discard_staging(pending.save_dir, pending.tag)
            outcome, published = type(outcome)(True), False
    problem = None if outcome is None or outcome.ok else outcome.message or "failed"
    gathered = collective.gather(problem, (outcome is not None, bool(outcome and outcome.relayed), published))
    failed = [(rank, text, relayed) for rank, (text, (_, relayed, _)) in enumerate(gathered) if text is not None]
    if not failed and not all(done for _, (done, _, _) in gathered):
        return
    delattr(engine, PENDING_ATTR)
    PENDING_SAVES.remove(pending)
    if failed:
        pending.kill()  # a writer still at work on a save that cannot be committed
        if pending.coordinator:
            commit.discard_staging(pending.save_dir, pending.tag)
        # A coordinator that gave up because another rank failed names that rank, whose own line says why.
        first_hand = [(rank, text) for rank, text, relayed in failed if not relayed]
        raise CheckpointError(save_failure(first_hand or [(rank, text) for rank, text, _ in failed], pending.tag,
                                            pending.save_dir, "in the background ",
                                            published=any(flag for _, (_, _, flag) in gathered)))
    if pending.coordinator:
        logger.info("committed %s in the background, %.1f s after save_checkpoint returned", pending.tag,
                    time.monotonic() - pending.started)
    for action in pending.after_commit:
        action()


def _published_before_it_died(pending: Any) -> bool:
    """Whether the coordinator's writer had moved the tag into place (committed) before it failed or died: its
    staging directory no longer holds the tag, and the tag in the save directory is complete."""
    from deepspeed_ext.checkpoint import commit
    staging = commit.staging_root(pending.save_dir, pending.tag)
    final = Path(pending.save_dir) / pending.tag
    if not (staging.is_dir() and not (staging / pending.tag).exists() and final.is_dir()):
        return False
    status = commit.tag_status(final)
    return status.state is commit.TagState.COMMITTED and status.complete


def wait_for_saves(engine: Any) -> None:
    """Collective: wait until the engine's save in the background is committed; raises its failure (one line)."""
    settle_background_save(engine, block=True)


def hook_steps_to_report_background_saves(engine: Any) -> None:
    """Each training step (``train_batch`` of a pipeline engine) first asks how a save in the background went
    (:func:`settle_background_save`, without waiting), so that a failure stops training at the next step;
    ``destroy`` waits for it (and ``load_checkpoint``: :func:`hook_load`); the process's exit waits for every
    one (:func:`wait_at_exit`)."""
    BACKGROUND_ENGINES.add(engine)
    name = "train_batch" if engine_private.engine_is_pipeline(engine) else "step"
    for method in (name, "destroy"):
        engine_private.wrap_engine_method(engine, method, functools.partial(_reporting, engine, method != name))
    wait_at_exit()


def _reporting(engine: Any, block: bool, own: Any) -> Any:
    """``own`` (an engine's step or destroy), after asking how its save in the background went."""
    def reporting(*args: Any, **kwargs: Any) -> Any:
        settle_background_save(engine, block=block)
        pending = getattr(engine, PENDING_ATTR, None)
        if pending is not None:
            pending.order_next_step()  # the step's kernels after the snapshot's device copies
        return own(*args, **kwargs)
    return reporting


def wait_at_exit() -> None:
    """:func:`_at_exit` at the process's exit (registered once)."""
    global _EXIT_WAIT_INSTALLED
    if not _EXIT_WAIT_INSTALLED:
        import atexit
        atexit.register(_at_exit)
        _EXIT_WAIT_INSTALLED = True


def _at_exit() -> None:
    """What a training process leaves running is ended before the interpreter tears itself down: the saves still
    being written in the background are waited for, then the default process group, if the script left it up, is
    destroyed. Left to the interpreter's teardown, a process group's C++ threads can be destroyed while still
    joinable, and the process aborts (SIGABRT, "terminate called without an active exception") after its work was
    done and committed: a job script would see a failed run. (atexit runs this before the interpreter finalizes;
    a script that destroys its process group itself is left as it is.)"""
    finish_background_saves()
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # at exit: say it, never raise
            logger.warning("could not destroy the process group at exit: %s", exc)


_EXIT_WAIT_INSTALLED = False


def finish_background_saves() -> None:
    """Wait for every save of this process still being written in the background, and say what became of each:
    committed, or not and why (a log line; no collective: each rank waits for its own writer). Runs at exit; a
    script that leaves by ``os._exit`` calls it first."""
    for pending in list(PENDING_SAVES):
        if pending.poll() is None:
            logger.info("waiting for the save of %s in the background to finish before exiting", pending.tag)
        outcome = pending.wait()
        PENDING_SAVES.remove(pending)
        if not outcome.ok:
            logger.error("the save of %s into %s in the background was not committed: %s", pending.tag,
                         pending.save_dir, outcome.message)
        elif pending.coordinator:
            logger.info("committed %s in the background", pending.tag)
            for action in pending.after_commit:
                action()
