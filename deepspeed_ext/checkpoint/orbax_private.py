"""The one place deepspeed-ext touches Orbax internals (written against orbax-checkpoint 0.12.8).

Orbax's public API writes a numpy leaf as one storage chunk (or sub-chunks it by byte size along axes
of its own choosing). MaxText restores fastest when each chunk is exactly one device's shard of the
target mesh. Only Orbax's internal write-spec builder takes that shard ("write") shape. This module
wraps it, plus the numpy handler hooks that write lazy leaves one at a time.

Orbax takes a step's custom metadata before it writes the arrays and has no public API to add to it
afterwards; what is known only once every array is written (the fingerprints of lazily read tensors) is added
by rewriting the step's metadata file, whose name and layout are Orbax's own (:func:`add_step_custom_metadata`).

Reading, Orbax parses an item's whole tree metadata for every partial restore; :func:`leaf_checkpointer` hooks
the handler's metadata read so that readers restoring a leaf at a time parse it once. It only saves time, so
where Orbax lacks the hook it is left out (:func:`metadata_reuse_problems` says what is missing; the unit test
fails on it) rather than refused.

``check_orbax_internals()`` verifies every internal the writes use. The writer calls it before it
relies on them, and ``tests/unit/test_orbax_private.py`` runs it too (and, in CI,
``tests/e2e/test_orbax_guard_e2e.py`` in MaxText's own environment), so an Orbax upgrade that moves them
fails loudly instead of writing silently different chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
import threading
from collections.abc import Callable, Generator, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from deepspeed_ext.checkpoint import durable
from deepspeed_ext.errors import CheckpointError

TESTED_ORBAX = "0.12.8"
#: Slab writes a lazy leaf keeps in flight (each holds its block until tensorstore has written it).
WRITES_IN_FLIGHT = 2
#: Orbax's step metadata file (``<step>/_CHECKPOINT_METADATA``, JSON) and its entry holding the custom metadata
#: given to ``CheckpointManager.save``.
STEP_METADATA = "_CHECKPOINT_METADATA"
CUSTOM_METADATA = "custom_metadata"


def _internals() -> dict[str, Any]:
    from orbax.checkpoint import type_handlers
    from orbax.checkpoint._src.metadata import checkpoint as step_metadata
    from orbax.checkpoint._src.metadata import step_metadata_serialization
    from orbax.checkpoint._src.serialization import ocdbt_utils
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
    return {"NumpyHandler": type_handlers.NumpyHandler, "ts_utils": ts_utils, "ocdbt_utils": ocdbt_utils,
            "step_metadata": step_metadata,
            "InternalCheckpointMetadata": step_metadata_serialization.InternalCheckpointMetadata}


def _write_problems(parts: dict[str, Any]) -> list[str]:
    """What the shard-aligned writes of lazy leaves need and the installed Orbax lacks."""
    spec_params = inspect.signature(parts["ts_utils"].build_array_write_spec).parameters
    handler = parts["NumpyHandler"]
    problems = [name for name in ("global_shape", "local_shape", "dtype", "use_ocdbt", "process_index",
                                  "metadata_key") if name not in spec_params]
    problems += [f"NumpyHandler.{name}" for name in ("_background_serialize", "_open_and_write")
                 if not inspect.iscoroutinefunction(getattr(handler, name, None))]
    if not hasattr(parts["ocdbt_utils"], "get_process_index_for_subdir"):
        problems.append("ocdbt_utils.get_process_index_for_subdir")
    return problems


def _step_metadata_problems(parts: dict[str, Any]) -> list[str]:
    """Where the installed Orbax's step metadata file is not what :func:`add_step_custom_metadata` rewrites."""
    problems = []
    name = getattr(parts["step_metadata"], "_STEP_METADATA_FILENAME", None)
    if name != STEP_METADATA:
        problems.append(f"step metadata file {name!r}, not {STEP_METADATA!r}")
    fields = {field.name for field in dataclasses.fields(parts["InternalCheckpointMetadata"])}
    if CUSTOM_METADATA not in fields:
        problems.append(f"no {CUSTOM_METADATA!r} in the step metadata")
    return problems


def check_orbax_internals() -> None:
    """Raise a clear error if the Orbax internals used here are not what this module expects."""
    import orbax.checkpoint as ocp
    version = getattr(ocp, "__version__", "?")
    try:
        parts = _internals()
        problems = _write_problems(parts) + _step_metadata_problems(parts)
    except (ImportError, AttributeError, TypeError) as exc:  # TypeError: no longer a dataclass
        problems = [str(exc)]
    if problems:
        raise CheckpointError(f"orbax-checkpoint {version} changed internals deepspeed-ext uses for shard-aligned "
                              f"writes and step metadata (tested with {TESTED_ORBAX}): {problems}")


def leaf_checkpointer() -> Any:
    """An Orbax ``Checkpointer`` (OCDBT, zarr3) for partial restores of a leaf at a time that parses each item's
    PyTree metadata once. Orbax reads, parses and nests the whole tree's metadata file on every restore, so reading
    a checkpoint leaf by leaf took time quadratic in its leaves (a tree of a few thousand leaves: minutes). Where
    the installed Orbax lacks the hook (:func:`metadata_reuse_problems`), a plain checkpointer: the same leaves,
    read the slow way."""
    import orbax.checkpoint as ocp
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)
    impl: Any = getattr(handler, "_handler_impl", None)
    if not _reuse_problems(impl):
        read = impl._read_metadata_file
        parsed: dict[str, _ParsedOnce] = {}

        async def read_once(directory: Any) -> Any:
            key = str(directory)
            if key not in parsed:  # two threads may both parse it: either result serves
                parsed[key] = _ParsedOnce(await read(directory))
            return parsed[key]

        impl._read_metadata_file = read_once  # an instance attribute: this handler's restores alone
    return ocp.Checkpointer(handler)


class _ParsedOnce:
    """Orbax's parsed tree metadata (``InternalTreeMetadata``) with its nested tree built once: a restore only
    reads it (it trims a copy to the leaves asked for)."""

    def __init__(self, metadata: Any):
        self._metadata = metadata
        self._nested: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._metadata, name)

    def as_nested_tree(self) -> Any:
        if self._nested is None:
            self._nested = self._metadata.as_nested_tree()
        return self._nested


def metadata_reuse_problems() -> list[str]:
    """What :func:`leaf_checkpointer` needs of the installed Orbax and it lacks (then its restores parse the
    metadata every time: slower, never wrong)."""
    import orbax.checkpoint as ocp
    return _reuse_problems(getattr(ocp.PyTreeCheckpointHandler(), "_handler_impl", None))


def _reuse_problems(impl: Any) -> list[str]:
    """:func:`metadata_reuse_problems` of one handler's implementation (None: the handler has none)."""
    if impl is None:
        return ["PyTreeCheckpointHandler._handler_impl"]
    problems = [] if inspect.iscoroutinefunction(getattr(impl, "_read_metadata_file", None)) else [
        "BasePyTreeCheckpointHandler._read_metadata_file"]
    from orbax.checkpoint._src.metadata import tree as tree_metadata
    if not callable(getattr(tree_metadata.InternalTreeMetadata, "as_nested_tree", None)):
        problems.append("InternalTreeMetadata.as_nested_tree")
    return problems


def add_step_custom_metadata(step_dir: Path, key: str, entries: Mapping[str, Any]) -> None:
    """Add ``entries`` to ``key``'s entry of the custom metadata Orbax recorded for the step saved in ``step_dir``.

    Runs once the step is written (Orbax has renamed it into place): the step's metadata file is read as JSON,
    extended, and replaced whole, so a reader sees it without the entries or with them, never part of it.
    """
    check_orbax_internals()
    path = step_dir / STEP_METADATA
    data = json.loads(path.read_text())
    data.setdefault(CUSTOM_METADATA, {}).setdefault(key, {}).update(entries)
    durable.replace_file(path, json.dumps(data))


#: Saves in progress whose chunk files deepspeed-ext writes: each one's staging directory and what it is told of
#: every chunk file written under it (:func:`chunk_files_reported`).
_CHUNK_FILE_REPORTS: dict[Path, Callable[[str, str, int, str], None]] = {}
_REPORTS_LOCK = threading.Lock()


@contextlib.contextmanager
def chunk_files_reported(root: Path, report: Callable[[str, str, int, str], None]) -> Iterator[None]:
    """While a save into ``root`` runs, ``report(array, relative, size, crc32c)`` is called for each chunk file
    deepspeed-ext writes under it (outside OCDBT, uncompressed): the name of the array's directory, the file's path
    in it, its size, and the CRC-32C of its bytes summed as they were written, so that the output's manifest need
    not read every file back."""
    root = Path(root).absolute()
    with _REPORTS_LOCK:
        _CHUNK_FILE_REPORTS[root] = report
    try:
        yield
    finally:
        with _REPORTS_LOCK:
            _CHUNK_FILE_REPORTS.pop(root, None)


def _chunk_file_report(directory: Path) -> Callable[[str, int, str], None] | None:
    """What the chunk files of the array in ``directory`` report to (None: no save asked for it)."""
    with _REPORTS_LOCK:
        report = next((report for root, report in _CHUNK_FILE_REPORTS.items() if directory.is_relative_to(root)),
                      None)
    if report is None:
        return None
    return lambda relative, size, checksum: report(directory.name, relative, size, checksum)


async def write_on_a_thread(writes: Generator[Any, None, None]) -> None:
    """Run ``writes`` (each item a slab written) to its end on a thread. Cancelled, it lets the thread stop after
    the write in hand, closes ``writes`` there (which ends the writes in flight) and only then lets the
    cancellation through: no thread still writes into the staging directory when it is removed."""
    stop = threading.Event()

    def drain() -> None:
        try:
            for _ in writes:
                if stop.is_set():
                    break
        finally:
            writes.close()

    done = asyncio.get_running_loop().run_in_executor(None, drain)
    try:
        await asyncio.shield(done)
    except asyncio.CancelledError:
        stop.set()
        await asyncio.wait([done])
        raise


def lazy_leaf_handler() -> Any:
    """A numpy handler that materialises each lazy leaf only when writing it, one leaf at a time, slab by slab
    where the leaf has ``slabs`` (a scanned stack a layer at a time, a large tensor a block of rows at a time),
    with the storage chunk (zarr3 chunk) set to the leaf's ``write_shape``."""
    import tensorstore as ts

    from deepspeed_ext.checkpoint.zarr3_shards import ChunkFiles
    check_orbax_internals()
    parts = _internals()
    ts_utils, ocdbt_utils = parts["ts_utils"], parts["ocdbt_utils"]

    numpy_handler: Any = parts["NumpyHandler"]  # Orbax has no type information

    class LazyLeafHandler(numpy_handler):  # type: ignore[misc]  # subclassing Any: Orbax's untyped handler

        def __init__(self) -> None:
            # No defensive deep copy: a lazy leaf owns no data until it is written.
            super().__init__(deepcopy_host_arrays=False)

        async def _background_serialize(self, values: Any, infos: Any, args: Any = None) -> None:
            args = args or [None] * len(values)
            for value, info, arg in zip(values, infos, args, strict=True):  # sequential: one array in memory
                await info.await_path_creation()
                spec = ts_utils.build_array_write_spec(
                    info=info,
                    arg=arg,
                    global_shape=value.shape,
                    local_shape=getattr(value, "write_shape", None) or value.shape,
                    dtype=value.dtype,
                    use_ocdbt=info.is_ocdbt_checkpoint,
                    process_index=ocdbt_utils.get_process_index_for_subdir(
                        use_ocdbt=info.is_ocdbt_checkpoint,
                        override_ocdbt_process_id=self._override_ocdbt_process_id),
                    metadata_key=self._metadata_key)
                slabs = getattr(value, "slabs", None)
                if slabs is None:
                    await self._open_and_write(np.asarray(value), spec.json, info.ts_context)
                    continue
                # Slab by slab, each covering whole chunks (no read-modify-write of a chunk): only a block or
                # two are ever in memory. Up to WRITES_IN_FLIGHT slabs are compressed and written by
                # tensorstore's threads while the next is produced.
                store = await ts.open(ts.Spec(spec.json), create=True, open=True, context=info.ts_context)
                files = None if info.is_ocdbt_checkpoint else ChunkFiles.of(store.spec().to_json(),
                                                                            store.dtype.numpy_dtype)
                if files is not None:  # outside OCDBT, uncompressed: each chunk's file written by us
                    files = dataclasses.replace(files, written=_chunk_file_report(files.directory))
                    # Each slab written by the thread that produced it: the files need no order, and a thread of
                    # their own only added hand-offs (a third fewer context switches without it).
                    await write_on_a_thread(value.write_slabs(files.write_slab))
                    continue
                pending: list[Any] = []
                for index, piece in slabs():
                    pending.append(store[index].write(piece, can_reference_source_data_indefinitely=True))
                    if len(pending) >= WRITES_IN_FLIGHT:
                        await pending.pop(0)
                for write in pending:
                    await write

    return LazyLeafHandler()
