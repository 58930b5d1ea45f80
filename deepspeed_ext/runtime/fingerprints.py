"""Resume fingerprints in the runtime: this rank's sums taken while a save writes (on a thread, or from
zipsave's blocks), added up over the ranks for the record, and checked against the live engine after a load."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from deepspeed_ext.runtime.log import logger


class SumsThread:
    """This rank's fingerprint sums, computed on a thread (torch's kernels release the GIL)."""

    def __init__(self, engine: Any):
        import threading
        self._local: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(engine, ), name="deepspeed-ext-fingerprints",
                                        daemon=True)
        self._thread.start()

    def _run(self, engine: Any) -> None:
        try:
            self._local = local_sums(engine)
        except BaseException as exc:  # handed to the caller, which re-raises it on its own thread
            self._error = exc

    def join(self) -> None:
        self._thread.join()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._local


def local_sums(engine: Any) -> Any:
    from deepspeed_ext.checkpoint.engine_fingerprints import local_engine_sums
    return local_engine_sums(engine)


def save_fingerprints(engine: Any, local: Any) -> Any:
    """The fingerprints from this rank's sums (collective: every rank saves)."""
    from deepspeed_ext.checkpoint.engine_fingerprints import reduce_engine_sums
    return recorded_fingerprints(engine, *reduce_engine_sums(local))


def recorded_fingerprints(engine: Any, found: Any, problems: list[str]) -> Any:
    """``found``, with a warning where the ranks disagree (``problems``)."""
    if problems and engine.global_rank == 0:
        logger.warning("saving a training state that is not consistent across ranks: %s", "; ".join(problems))
    return found


def check_resume_fingerprints(engine: Any, load_path: str | os.PathLike[str] | None, *, with_optimizer: bool = True,
                              on_mismatch: str = "error") -> bool | None:
    """Compare the live engine's training state with the fingerprints recorded in the checkpoint it loaded from
    (``load_path``: the tag directory or a file in it, as ``load_checkpoint`` returns it).

    Collective: every rank calls it, and every rank reaches the same verdict. Returns True on a match, False
    on a mismatch logged as a warning (``on_mismatch="warn"``), None when nothing could be checked; raises
    :class:`~deepspeed_ext.errors.CheckpointError` naming the parameters and states on a mismatch otherwise.
    """
    from deepspeed_ext.checkpoint.engine_fingerprints import engine_fingerprints
    from deepspeed_ext.checkpoint.expert_names import has_autoep_names, model_named_fingerprints
    from deepspeed_ext.checkpoint.fingerprint import compare, mismatch_message
    from deepspeed_ext.checkpoint.metadata import read_uc_info
    from deepspeed_ext.checkpoint.states import MODULE_WEIGHTS
    from deepspeed_ext.errors import CheckpointError
    if load_path is None:
        return None
    directory = Path(load_path)
    directory = directory if directory.is_dir() else directory.parent
    info = read_uc_info(directory)
    recorded = info.fingerprints if info is not None else None
    rank0 = engine.global_rank == 0
    if recorded is None:
        if rank0:
            logger.info("%s records no resume fingerprints; the restored state is not checked", directory)
        return None
    if not with_optimizer:
        # Without the optimizer's states DeepSpeed rebuilds the fp32 masters from the low-precision weights:
        # nothing saved is there to compare.
        if rank0:
            logger.info("optimizer states not loaded from %s; resume fingerprints not checked", directory)
        return None
    started = time.perf_counter()
    recorded_states = {state for states in recorded.tensors.values() for state in states} - {MODULE_WEIGHTS}
    found, problems = engine_fingerprints(engine, with_moments=len(recorded_states) > 1)
    if has_autoep_names(found.tensors) and not has_autoep_names(recorded.tensors):
        # An AutoEP engine resumed from the model's names (from-hf).
        config = getattr(getattr(engine, "module", None), "config", None)
        found = model_named_fingerprints(found, getattr(config, "model_type", None))
    checked, mismatches = compare(recorded, found)
    elapsed = time.perf_counter() - started
    if not mismatches and not problems:
        if rank0:
            logger.info("resume fingerprints match: %d states of %d parameters and the steps, from %s (%.2f s)",
                        checked, len(recorded.tensors), directory, elapsed)
        return True
    message = mismatch_message(str(directory), mismatches, checked)
    if problems:
        message = f"{message}; {'; '.join(problems)}" if mismatches else f"{directory}: {'; '.join(problems)}"
    if on_mismatch == "error":
        raise CheckpointError(message)
    if rank0:
        logger.warning("%s", message)
    return False
