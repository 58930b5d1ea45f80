"""``reshard-orbax``: a MaxText Orbax checkpoint re-chunked for a target mesh, one array at a time."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from deepspeed_ext.checkpoint import orbax_private, output
from deepspeed_ext.checkpoint.maxtext.names import (ITEM, METADATA, NESTED_STACKS, PARAM_ROOTS, SCANNED_STACKS,
                                                    STEP_DIR)
from deepspeed_ext.checkpoint.maxtext.orbax_io import LazyLeaf, restore_leaf, save_items
from deepspeed_ext.checkpoint.maxtext.plan import Leaf
from deepspeed_ext.checkpoint.maxtext.sharding import shard_shape
from deepspeed_ext.errors import CheckpointError

if TYPE_CHECKING:
    from tqdm import tqdm


def reshard_orbax(items: str | Path,
                  out: str | Path,
                  mesh: Mapping[str, int],
                  *,
                  overwrite: bool = False,
                  progress: bool = True,
                  protect: Iterable[str | Path] = ()) -> tuple[Path, list[str]]:
    """Re-chunk a MaxText Orbax checkpoint for a target mesh, holding one array at a time.

    Every array is read whole (one partial restore), and rewritten with its storage chunk set to one
    device's shard on ``mesh``, under MaxText's logical-axis rules. Params and optax adamw moments are
    both handled; scalars (step, counts) and the step's custom metadata are copied as they are. Returns
    the output item directory and the arrays whose logical axes are unknown, which are written whole.
    """
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    items = Path(items).absolute()
    if not (items / METADATA).is_file():
        raise CheckpointError(f"{items}: not an Orbax checkpoint item directory (no {METADATA})")
    step = items.parent
    out = output.prepare(out, [*protect, *output.read_paths(step.parent if step.name.isdigit() else step)],
                         overwrite=overwrite)
    checkpointer = orbax_private.leaf_checkpointer()
    tree = ocp.PyTreeCheckpointer().metadata(items).item_metadata.tree
    try:
        custom = ocp.StandardCheckpointer().metadata(items.parent).custom_metadata or {}
    except (FileNotFoundError, ValueError, KeyError):
        custom = {}
    arrays = [name for name, m in ocp.tree.to_flat_dict(tree, sep="/").items() if len(getattr(m, "shape", ())) > 0]
    bar = tqdm(total=len(arrays), desc="reshard-orbax", unit="array", disable=not progress)
    rechunk = _Rechunk(checkpointer, items, tree, mesh, bar)
    new_tree = rechunk.rebuild(tree, ())
    try:
        with output.staged(out) as partial:
            save_items(partial, new_tree, custom)
    finally:
        bar.close()
    return out / STEP_DIR / ITEM, rechunk.whole


class _Rechunk:
    """The saved tree rebuilt of lazy leaves, each read whole when written and stored in one device's shard of
    ``mesh`` (``whole``: the arrays whose logical axes are unknown, written in one chunk)."""

    def __init__(self, checkpointer: Any, items: Path, tree: Any, mesh: Mapping[str, int], bar: tqdm):
        self.checkpointer, self.items, self.tree, self.mesh, self.bar = checkpointer, items, tree, mesh, bar
        self.whole: list[str] = []

    def read(self, path: tuple[str, ...], dtype: np.dtype) -> Callable[[], np.ndarray]:

        def produce() -> np.ndarray:
            array = np.asarray(restore_leaf(self.checkpointer, self.items, self.tree, path, np.ndarray), dtype=dtype)
            self.bar.update(1)
            return np.ascontiguousarray(array)

        return produce

    def rebuild(self, node: Any, path: tuple[str, ...]) -> Any:
        if isinstance(node, Mapping):
            return {key: self.rebuild(value, (*path, key)) for key, value in node.items()}
        if isinstance(node, (list, tuple)):
            return [self.rebuild(value, (*path, str(i))) for i, value in enumerate(node)]
        if node is None:
            return None
        shape, dtype, name = tuple(node.shape), np.dtype(node.dtype), "/".join(path)
        if not shape:  # a scalar (step, an optimizer count): copied with its dtype
            value = restore_leaf(self.checkpointer, self.items, self.tree, path, int if dtype.kind in "iu" else float)
            return int(value) if dtype == np.int64 else dtype.type(value)
        write_shape = self.write_shape(name, shape)
        if write_shape is None:
            self.whole.append(name)
        return LazyLeaf(shape, dtype, self.read(path, dtype), write_shape)

    def write_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        """One device's shard of the parameter (or moment) ``name``; None where its logical axes are unknown."""
        root = next((r for r in PARAM_ROOTS if name.startswith(r)), None)
        if root is None:
            return None
        parts = tuple(name[len(root):].split("/"))
        rank = (len(parts) > 2 and parts[1] in SCANNED_STACKS) + sum(part in NESTED_STACKS for part in parts[:-1])
        leaf = Leaf(parts, shape, None, None, stacked=rank > 0, stack_rank=max(rank, 1))
        try:
            return shard_shape(leaf, self.mesh)
        except CheckpointError:
            return None
