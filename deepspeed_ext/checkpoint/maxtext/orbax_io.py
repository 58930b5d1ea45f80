"""Orbax PyTrees the way MaxText writes and reads them: lazy leaves (data produced only when Orbax writes the
leaf), the save as step 0 of a checkpoint manager with item ``items`` (OCDBT + zarr3), and one leaf read back
through a partial restore. Orbax's internals (the handler that writes lazy leaves) are in
:mod:`deepspeed_ext.checkpoint.orbax_private`."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Generator, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from deepspeed_ext.checkpoint.maxtext.names import ITEM, STEP_DIR
from deepspeed_ext.errors import CheckpointError, first_line


#: ``write(index, array)``: writes one slab (as :attr:`LazyLeaf.slabs` yields them); returns the bytes written.
SlabWriter = Callable[[tuple[int | slice, ...], np.ndarray], int]


def _write_each(slabs: Callable[[], Iterator[tuple[tuple[int | slice, ...], np.ndarray]]],
                write: SlabWriter) -> Generator[int, None, None]:
    for index, piece in slabs():
        yield write(index, piece)


class LazyLeaf:
    """A numpy-like stand-in Orbax accepts as a leaf; the data is produced only when written.

    ``write_shape`` is the storage chunk (zarr3 chunk). The data comes whole from ``produce``, or from
    ``slabs``: an iterator of ``(index, array)`` pieces that together cover the leaf, each covering whole
    storage chunks, so the writer writes them one by one (no chunk is read back or rewritten) and never holds
    the leaf: a scanned stack a layer at a time, a large tensor a block of rows at a time.
    """

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, produce: Callable[[], np.ndarray] | None,
                 write_shape: tuple[int, ...] | None = None,
                 slabs: Callable[[], Iterator[tuple[tuple[int | slice, ...], np.ndarray]]] | None = None,
                 write_slabs: Callable[[SlabWriter], Generator[int, None, None]] | None = None):
        if (produce is None) == (slabs is None):
            raise CheckpointError("internal: a lazy leaf needs exactly one of `produce` and `slabs`")
        self.shape = tuple(shape)
        self.write_shape = tuple(write_shape) if write_shape else None
        self.slabs = slabs
        #: The same slabs, each handed to ``write`` (on the thread that produced it, where the leaf's producer says
        #: so: a writer that needs no order and no thread of its own, the chunk files deepspeed-ext writes itself);
        #: yields what each write returns, in order.
        self.write_slabs: Callable[[SlabWriter], Generator[int, None, None]] | None = write_slabs or (
            None if slabs is None else functools.partial(_write_each, slabs))
        self.dtype = np.dtype(dtype)
        self.ndim = len(self.shape)
        self.size = math.prod(self.shape)
        self.nbytes = self.size * self.dtype.itemsize
        self._produce = produce

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if self._produce is not None:
            array = self._produce()
        else:  # asked for whole (the writer normally takes it slab by slab)
            assert self.slabs is not None
            array = np.empty(self.shape, dtype=self.dtype)
            for index, piece in self.slabs():
                array[index] = piece
        if array.shape != self.shape or array.dtype != self.dtype:
            raise CheckpointError(f"internal: produced {array.shape} {array.dtype}, planned {self.shape} {self.dtype}")
        return array if dtype is None else array.astype(dtype)


_registered = False


def _register_lazy_leaf() -> None:
    global _registered
    if not _registered:
        from orbax.checkpoint import type_handlers

        from deepspeed_ext.checkpoint.orbax_private import lazy_leaf_handler
        type_handlers.register_type_handler(LazyLeaf, lazy_leaf_handler(), override=True)
        _registered = True


def import_orbax() -> None:
    """Import Orbax (and with it jax and tensorstore) on the calling thread, before a thread of our own starts
    importing transformers (:class:`~deepspeed_ext.checkpoint.model_config.ConfigFit`): CPython 3.11 before
    3.11.9 can fail two imports that parse source at once (``SystemError: AST constructor recursion depth
    mismatch``, python/cpython#106905), as 1 in about 7 to-maxtext runs did."""
    import orbax.checkpoint  # noqa: F401


def save_items(out: Path, tree: dict[str, Any], custom_metadata: Mapping[str, Any],
               finish: Callable[[], None] | None = None, compression: bool = True, ocdbt: bool = True) -> None:
    """Save ``tree`` (lazy leaves allowed) into the staging directory ``out`` as step 0, item ``items``, the
    way MaxText's own writers do, then its manifest; ``finish`` runs after the save (it may refuse it).
    ``compression``: zstd on each storage chunk (Orbax's default), or none. ``ocdbt``: every array in one OCDBT
    store (MaxText's default, ``checkpoint_storage_use_ocdbt``), or each array a directory of chunk files."""
    import orbax.checkpoint as ocp

    from deepspeed_ext.checkpoint.orbax_private import chunk_files_reported
    _register_lazy_leaf()
    chunk_files: list[tuple[str, str, int, str]] = []  # the chunk files written by us, with their CRC-32C
    try:
        # MaxText's own storage choice: OCDBT + zarr3 (unless asked otherwise). Orbax writes the step into a
        # temporary directory and renames it when complete, so an interrupted run leaves no "0/" that looks finished.
        manager = ocp.CheckpointManager(
            out,
            item_names=(ITEM, ),
            item_handlers={ITEM: ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=True,
                                                             use_compression=compression)},
            options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False))
        with chunk_files_reported(out, lambda *chunk_file: chunk_files.append(chunk_file)):
            manager.save(int(STEP_DIR), args=ocp.args.Composite(**{ITEM: ocp.args.PyTreeSave(tree)}),
                         custom_metadata=dict(custom_metadata))
            manager.wait_until_finished()
        manager.close()
        if finish is not None:
            finish()
        from deepspeed_ext.checkpoint.manifest import ManifestRecorder
        manifest = ManifestRecorder(out)
        # Orbax renames the step's and the item's directories once written; each array's keeps its name. A file
        # not found where that puts it, or of another size, is summed from the disk like every other file.
        for array, relative, size, checksum in chunk_files:
            path = out / STEP_DIR / ITEM / array / relative
            if path.is_file() and path.stat().st_size == size:
                manifest.add(path, checksum)
        manifest.write()
    except (ValueError, OSError) as exc:  # tensorstore reports failed writes (disk full) as ValueError
        raise CheckpointError(f"{out}: cannot write the Orbax checkpoint: {first_line(exc)}") from exc


def restore_leaf(checkpointer: Any, items: Path, tree: Any, path: tuple[str, ...], restore_type: type,
                 dtype: Any = None) -> Any:
    """One leaf of a saved Orbax PyTree (``tree``: its metadata tree), through a partial restore."""
    return restore_leaves(checkpointer, items, tree, [path], restore_type, dtype)[path]


def restore_leaves(checkpointer: Any, items: Path, tree: Any, paths: list[tuple[str, ...]], restore_type: type,
                   dtype: Any = None) -> dict[tuple[str, ...], Any]:
    """Some leaves of a saved Orbax PyTree (``tree``: its metadata tree), through one partial restore: each restore
    costs milliseconds of its own, whatever it reads, so small leaves are best asked for together.

    The request holds only ``paths``, shaped like the saved tree: a saved list must be asked for at full
    length, with None for the entries not wanted.
    """
    import orbax.checkpoint as ocp

    def request(value: Any) -> Any:
        root: Any = None
        for path in paths:
            root = place(root, tree, path, value)
        return root

    def place(into: Any, node: Any, path: tuple[str, ...], value: Any) -> Any:
        if not path:
            return value
        key, rest = path[0], path[1:]
        if isinstance(node, (list, tuple)):
            out = into if into is not None else [None] * len(node)
            out[int(key)] = place(out[int(key)], node[int(key)], rest, value)
            return out
        out = into if into is not None else {}
        out[key] = place(out.get(key), node[key], rest, value)
        return out

    item = request(np.empty(0) if restore_type is np.ndarray else 0)
    args = request(ocp.RestoreArgs(restore_type=restore_type, dtype=dtype))
    try:
        restored = checkpointer.restore(items, args=ocp.args.PyTreeRestore(item=item, restore_args=args,
                                                                            partial_restore=True))
    except (ValueError, OSError) as exc:  # tensorstore reports corrupt or truncated data files as ValueError
        if restore_type is not np.ndarray:
            raise
        if len(paths) > 1:  # one at a time, so the error names the array that cannot be read
            return {path: value for one in paths
                    for path, value in restore_leaves(checkpointer, items, tree, [one], restore_type, dtype).items()}
        raise CheckpointError(f"{items}: cannot read array {'/'.join(paths[0])}: {first_line(exc)}") from exc
    found = {}
    for path in paths:
        value = restored
        for key in path:
            value = value[int(key)] if isinstance(value, (list, tuple)) else value[key]
        found[path] = value
    return found
