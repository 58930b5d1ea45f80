"""The lazy leaves of a MaxText write: each produces its HF tensors' blocks in the leaf's layout and dtype when
Orbax writes it (:data:`PRODUCERS` threads, in order), and records the fingerprints of what a read returns."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from deepspeed_ext.checkpoint.families import LAYER, Family, Rule
from deepspeed_ext.checkpoint.fingerprint import Fingerprint, Fingerprints
from deepspeed_ext.checkpoint.maxtext.names import (PARAMS_COLLECTION)
from deepspeed_ext.checkpoint.maxtext.orbax_io import LazyLeaf, SlabWriter
from deepspeed_ext.checkpoint.maxtext.plan import Leaf, stacked_shape
from deepspeed_ext.checkpoint.maxtext.sharding import shard_shape, storage_chunk
from deepspeed_ext.checkpoint.maxtext.transforms import (BLOCK_BYTES, TRANSFORMS, ModelDims, RowBlocks,
                                                         exact_bf16_scale, from_maxtext, row_blocks, to_maxtext)
from deepspeed_ext.checkpoint.serialization import one_torch_thread, worker_threads
from deepspeed_ext.checkpoint.states import MASTER_WEIGHTS, MODULE_WEIGHTS
from deepspeed_ext.errors import CheckpointError

if TYPE_CHECKING:  # torch only where tensors are handed over
    from tqdm import tqdm


from deepspeed_ext.checkpoint.maxtext.writer_options import Load, LoadRows, WriterOptions

#: Slabs produced at once (read, checked, laid out and cast, each on a thread of its own) while the writers write
#: the ones before: one a core, at least two (:func:`~deepspeed_ext.checkpoint.serialization.worker_threads`): one
#: producer kept one core busy while the other waited on the writes. On a 2-core VM two took to-maxtext's time at the
#: margin (16 -> 48 layers of the 246M shape, warm, in process) from 1.2-1.6 s to 1.0-1.2 s.
PRODUCERS = worker_threads()


_Item = TypeVar("_Item")


_Produced = TypeVar("_Produced")


class LeafArrays:
    """The lazy leaves of one write: each produces its HF tensors' blocks in the leaf's layout and dtype when Orbax
    writes it, recording the fingerprints of what a read of them returns (``read_back``)."""

    def __init__(self, load: Load, load_rows: LoadRows, hf_shapes: Mapping[str, tuple[int, ...]], family: Family,
                 dims: ModelDims, options: WriterOptions, np_dtype: np.dtype, bar: tqdm):
        self.load, self.load_rows, self.hf_shapes = load, load_rows, hf_shapes
        self.family, self.dims, self.mesh, self.bar = family, dims, options.mesh, bar
        self.block_bytes = BLOCK_BYTES if options.block_bytes is None else options.block_bytes
        self.np_dtype = np_dtype
        self.module_weights, self.source, self.recorded = options.module_weights, options.source, (
            options.verdicts.recorded if options.verdicts is not None else None)
        # Fingerprints of what a read of this checkpoint returns (each array as stored, undone from MaxText's layout
        # in fp32, as from-maxtext does), so a reader can check the arrays exactly: per HF tensor and state, one
        # fingerprint per part (a fused tensor's halves sit in two leaves), added up once every array is written.
        self.read_back = ReadBackFingerprints()
        #: The threads that produce a leaf's slabs, :data:`PRODUCERS` blocks at a time (:func:`_in_order`).
        self.producers = ThreadPoolExecutor(PRODUCERS, thread_name_prefix="deepspeed-ext-maxtext-blocks",
                                            initializer=one_torch_thread)

    def tree(self, leaves: list[Leaf], state: str) -> dict[str, Any]:
        """``{collection: tree}``; the moments only of the ``params`` collection (the optimizer's)."""
        # Moments stay fp32 (optax's mu_dtype defaults to MaxText's fp32 weight_dtype).
        moment = np.dtype(np.float32)
        return _nested(((leaf.collection, *leaf.path),
                        self.lazy_leaf(leaf, state, self._dtype(leaf) if state == MASTER_WEIGHTS else moment))
                       for leaf in leaves if state == MASTER_WEIGHTS or leaf.collection == PARAMS_COLLECTION)

    def _dtype(self, leaf: Leaf) -> np.dtype:
        """The dtype ``leaf``'s weights are stored in: the checkpoint's, or fp32 for indices (exact in fp32 only)."""
        return np.dtype(np.float32) if leaf.rule is not None and TRANSFORMS[leaf.rule.kind].integer else self.np_dtype

    def model_variables(self, leaves: list[Leaf]) -> dict[str, Any]:
        """The variables outside ``params`` (DeepSeek's router bias) by their path alone: where MaxText's full train
        state keeps them (``nnx_aux/model/<path>``, with every persistent variable that is not a parameter)."""
        return _nested((leaf.path, self.lazy_leaf(leaf, MASTER_WEIGHTS, self._dtype(leaf))) for leaf in leaves
                       if leaf.collection != PARAMS_COLLECTION)

    def lazy_leaf(self, leaf: Leaf, state: str, leaf_dtype: np.dtype) -> LazyLeaf:
        rule = leaf.rule
        assert rule is not None  # plan_leaves gives every leaf its rule
        layers = leaf.layers or ()
        # Per layer, the HF tensors the leaf holds (more than one where the rule fuses several).
        groups = [rule.sources] if leaf.layers is None else [
            tuple(hf.replace(LAYER, str(layer)) for hf in rule.sources) for layer in layers]
        if leaf.stacked and leaf.scan_axis != 1:  # small non-parameter variables stacked on axis 0: whole
            return self._whole_stack(leaf, rule, groups, state, leaf_dtype)
        if not leaf.stacked:
            groups = groups[:1]  # an unscanned layer's leaf holds its one layer
        plan, write_shape = self._row_plan(leaf, rule, state, self._hf_shape(groups[0]))
        per_layer_ndim = len(leaf.shape) - len(leaf.stack_axes)

        def blocks() -> Iterator[tuple[tuple[int | slice, ...], tuple[str, ...], int, int]]:
            for position, group in enumerate(groups):
                for first, last in plan.ranges() if plan.axis is not None else [(0, 1)]:
                    index: list[int | slice] = [slice(None)] * per_layer_ndim
                    if plan.axis is not None:
                        index[plan.axis] = slice(first, last)
                    if leaf.stacked:
                        index[leaf.scan_axis:leaf.scan_axis] = leaf.stack_index(position)
                    yield tuple(index), group, first, last

        def slab(block: tuple[tuple[int | slice, ...], tuple[str, ...], int, int]
                 ) -> tuple[tuple[int | slice, ...], np.ndarray]:
            index, group, first, last = block
            return index, self.stored_block(rule, group, state, leaf_dtype, plan, first, last)

        def produced(produce: Callable[[tuple[tuple[int | slice, ...], tuple[str, ...], int, int]], _Produced]
                     ) -> Generator[_Produced, None, None]:
            yield from _in_order(self.producers, blocks(), produce)
            self.bar.update(1)

        def write_slabs(write: SlabWriter) -> Generator[int, None, None]:
            return produced(lambda block: write(*slab(block)))  # written on the producer's thread

        return LazyLeaf(leaf.shape, leaf_dtype, None, write_shape, slabs=lambda: produced(slab),
                        write_slabs=write_slabs)

    def _hf_shape(self, group: tuple[str, ...]) -> tuple[int, ...]:
        """The shape of a leaf's HF tensors of one layer, stacked on axis 0 (one tensor: its shape)."""
        return stacked_shape([tuple(self.hf_shapes[name]) for name in group], self.source)

    def _whole_stack(self, leaf: Leaf, rule: Rule, groups: list[tuple[str, ...]], state: str,
                     leaf_dtype: np.dtype) -> LazyLeaf:
        """A stack on an axis other than 1 (small non-parameter variables, on axis 0), produced whole."""

        def produce_stack() -> np.ndarray:
            plan = RowBlocks(None)
            array = np.stack([self.stored_block(rule, group, state, leaf_dtype, plan, 0, 1) for group in groups],
                             leaf.scan_axis).reshape(leaf.shape)
            self.bar.update(1)
            return array

        return LazyLeaf(leaf.shape, leaf_dtype, produce_stack, shard_shape(leaf, self.mesh) if self.mesh else None)

    def _row_plan(self, leaf: Leaf, rule: Rule, state: str,
                  hf_shape: tuple[int, ...]) -> tuple[RowBlocks, tuple[int, ...]]:
        """How a tensor of ``leaf`` is streamed, and the leaf's storage chunk (one layer thick for a stack)."""
        # The leaf of one tensor (one layer's, for a stack): its storage chunk without the stack's axes.
        stack = leaf.stack_axes
        chunk = [c for axis, c in enumerate(storage_chunk(leaf, self.mesh) or leaf.shape) if axis not in stack]
        per_mesh = shard_shape(leaf, self.mesh) if self.mesh else None
        if per_mesh is not None:
            per_mesh = tuple(c for axis, c in enumerate(per_mesh) if axis not in stack)
        plan = row_blocks(rule.kind, state, hf_shape, self.dims, per_mesh, self.block_bytes)
        if plan.axis is not None:
            chunk[plan.axis] = plan.chunk
        chunk[leaf.scan_axis:leaf.scan_axis] = [1] * len(stack)
        return plan, tuple(chunk)

    def _module_scale(self, rule: Rule, name: str) -> float | None:
        """The factor ``name``'s bf16 leaf of ``rule`` takes from the module's weights with the masters' very bits
        (:func:`exact_bf16_scale`), or None where it is read from the masters."""
        if self.module_weights is None or name not in self.module_weights.names:
            return None
        return exact_bf16_scale(rule.kind, self.dims, self.family)

    def _module_rows(self, name: str, scale: float, low: int, high: int, hf_shape: tuple[int, ...]
                     ) -> tuple[np.ndarray, Fingerprint | None]:
        """Rows ``[low, high)`` of ``name`` from the module's bf16 weights (checked as they are read), as bf16 where
        ``scale`` is 1 and as fp32 where it is another power of two (the product is then exact, and exact again once
        rounded to bf16), except in a block where some weight would scale below the smallest normal: that block is
        made from the fp32 masters, which must round to the module's weights. With them, the fingerprint of the
        rows as the source check summed them (what a read of the leaf returns, undone from its layout) or None."""
        import ml_dtypes
        import torch
        assert self.module_weights is not None
        rows = self.load_rows(name, MODULE_WEIGHTS, low, high)
        row = math.prod(hf_shape[1:])
        sums = self.recorded.range_sums(name, MODULE_WEIGHTS, low * row, high * row) if self.recorded else None
        read = Fingerprint(*sums) if sums is not None else None
        shape = (high - low, *hf_shape[1:])
        array: np.ndarray = rows.view(torch.int16).numpy().view(ml_dtypes.bfloat16).reshape(shape)
        if scale == 1.0:
            return array, read
        if scale > 1.0 or not _below(rows, 2.0 ** -126 / scale):
            return array.astype(np.float32), read
        masters = self.module_weights.master_rows(name, low, high)
        if not torch.equal(masters.to(torch.bfloat16).view(torch.int16), rows.view(torch.int16)):
            raise CheckpointError(f"{self.source}: {name!r}: the module's bf16 weights are not its fp32 masters "
                                  f"rounded (rows {low}-{high}); convert from the masters (module_weights=False)")
        return masters.numpy().reshape(shape), None

    def stored_block(self, rule: Rule, group: tuple[str, ...], state: str, leaf_dtype: np.dtype, plan: RowBlocks,
                     first: int, last: int) -> np.ndarray:
        """Units ``[first, last)`` of the HF tensor ``group`` names (one, or those a rule fuses) in the leaf's
        layout and dtype (all of it where the plan streams nothing); its read-back fingerprint is recorded as it
        goes."""
        if len(group) > 1:
            return self._fused_block(rule, group, state, leaf_dtype)
        (name, ) = group
        hf_shape = tuple(self.hf_shapes[name])
        dims = self.dims
        transform = TRANSFORMS[rule.kind]
        if plan.axis is None:
            low, high, block_dims = 0, (hf_shape[0] if hf_shape else 0), dims
        else:
            low, high = first * plan.unit, last * plan.unit
            # A per-head reshape that takes the head count from dims sees only this block's heads.
            block_dims = dataclasses.replace(dims, num_heads=last - first) if transform.heads_in_rows else dims
        module_scale = self._module_scale(rule, name) if state == MASTER_WEIGHTS and leaf_dtype.name == "bfloat16" \
            and hf_shape else None
        read: Fingerprint | None = None
        if module_scale is not None:  # the bits the masters' cast gives, read from half the bytes, no cast
            array, read = self._module_rows(name, module_scale, low, high, hf_shape)
        elif plan.axis is None:
            array = np.asarray(self.load(name, state), dtype=np.float32)
        else:
            rows = self.load_rows(name, state, low, high)
            rows = rows.detach().numpy() if hasattr(rows, "detach") else rows  # a torch tensor
            array = np.asarray(rows, dtype=np.float32).reshape(high - low, *hf_shape[1:])
        stored = _contiguous_as(to_maxtext(rule.kind, array, block_dims, self.family, state), leaf_dtype)
        if read is not None and stored.size == array.size:
            # The leaf holds every one of the module weights read (scaled by a power of two, which a read undoes
            # exactly): their sums, taken as they were checked, are the read-back's. Sums do not see order.
            self.read_back.add_sums(name, state, rule, low, read)
            return stored
        del array
        # Sums do not see order: where the transform only moves elements, the stored block itself is what a read
        # returns (its dtype widened as it is summed); otherwise the read is undone in fp32, as from-maxtext does.
        self.read_back.add(name, state, rule, low, stored if transform.rearranges else
                           from_maxtext(rule.kind, stored.astype(np.float32), block_dims, self.family, state))
        return stored

    def _fused_block(self, rule: Rule, group: tuple[str, ...], state: str, leaf_dtype: np.dtype) -> np.ndarray:
        """The leaf (one layer's) of the HF tensors a rule fuses, made whole from their fp32 values (they are
        interleaved in it: no block of it is a block of one tensor's rows); each tensor's read-back fingerprint
        is that of its rows of the leaf undone."""
        arrays = [np.asarray(self.load(name, state), dtype=np.float32) for name in group]
        stored = _contiguous_as(to_maxtext(rule.kind, np.concatenate(arrays), self.dims, self.family, state),
                                leaf_dtype)
        rows = np.cumsum([array.shape[0] for array in arrays])[:-1]
        del arrays
        read = from_maxtext(rule.kind, stored.astype(np.float32), self.dims, self.family, state)
        for name, part in zip(group, np.split(read, rows), strict=True):
            self.read_back.add(name, state, rule, 0, part)
        return stored


def _in_order(pool: ThreadPoolExecutor, items: Iterable[_Item], produce: Callable[[_Item], _Produced]
              ) -> Iterator[_Produced]:
    """``map(produce, items)`` run on ``pool``, in order, with :data:`PRODUCERS` items still queued or running
    while the consumer holds the one yielded (one more is submitted before an item is yielded: with only
    PRODUCERS in flight, a producer idled each time the consumer was busy). Left early (a failed write), it
    cancels what has not started and waits for what has, so nothing still reads the source after."""
    pending: list[Future[_Produced]] = []
    try:
        for item in items:
            pending.append(pool.submit(produce, item))
            if len(pending) > PRODUCERS:
                yield pending.pop(0).result()
        while pending:
            yield pending.pop(0).result()
    finally:
        for future in pending:
            future.cancel()
        wait(pending)


def _below(values: Any, limit: float) -> bool:
    """Whether any nonzero element of the bf16 torch tensor ``values`` is smaller in magnitude than ``limit`` (a
    power of two at or above bf16's smallest normal), from the bits: one pass, no cast."""
    import torch
    magnitudes = values.view(torch.int16) & 0x7FFF  # bf16 is sign and magnitude: the magnitude's bits order it
    limit_bits = (math.frexp(limit)[1] - 1 + 127) << 7  # 2**e has exponent field e + 127, mantissa 0
    if not magnitudes.numel():
        return False
    # 0 < m < limit as one comparison of the minimum: m - 1 taken modulo 2**15 puts zero (-1) at the top. Two
    # in-place passes and a reduction: 0.14 ms per million elements against 1.6 ms for the masks and any().
    magnitudes.sub_(1).bitwise_and_(0x7FFF)
    return bool(magnitudes.min() < limit_bits - 1)


def _contiguous_as(view: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``np.ascontiguousarray(view, dtype=dtype)``, the copy (and cast) done by torch where it can: most leaves
    are transposed views of HF rows, and numpy copies a transposed fp32 view into ``ml_dtypes.bfloat16`` element
    by element (0.37 GB/s of fp32 on one core of a 2-core EPYC VM: most of to-maxtext's CPU time); torch, which
    also rounds to nearest even, cast and transposed at 1.4-1.6 GB/s. A bf16 result is torch's bits seen as
    ``ml_dtypes.bfloat16``."""
    import torch

    bf16 = dtype.name == "bfloat16"
    if bf16 and view.dtype == dtype and view.size and all(stride > 0 and stride % view.itemsize == 0
                                                          for stride in view.strides):
        # Already bf16 (the module's weights): one transposing copy of 2-byte elements, into memory of its own
        # (the view may be of the source's mapped file).
        copied = torch.from_numpy(_coalesced(view).view(np.int16)).clone(memory_format=torch.contiguous_format)
        return copied.numpy().view(dtype).reshape(view.shape)
    if (view.dtype != np.float32 or not (bf16 or dtype == np.float32) or view.size == 0 or not view.flags.writeable
            or any(stride < 0 or stride % view.itemsize for stride in view.strides)):
        return np.ascontiguousarray(view, dtype=dtype)  # what torch.from_numpy cannot take (or warns about)
    # Cast first, keeping the view's strides where it is dense (a transposed block: one pass in memory order),
    # then lay the narrower elements out: a transposing copy of bf16 ran 2.6x as fast as one that also casts.
    stored = torch.from_numpy(_coalesced(view)).to(torch.bfloat16 if bf16 else torch.float32).contiguous()
    return (stored.view(torch.int16).numpy().view(dtype) if bf16 else stored.numpy()).reshape(view.shape)


def _coalesced(view: np.ndarray) -> np.ndarray:
    """The same elements in the same order as ``view``, with every run of dimensions that lie in memory as one
    merged into one (and dimensions of size 1 dropped): a per-head view of a transposed matrix (``[embed, heads,
    head_dim]`` of ``[heads * head_dim, embed]``) becomes the 2-D transpose it is. torch copies a 2-D transpose
    in cache-sized tiles; the same copy seen in 3-D went element by element, 6x slower (0.6 against 3.8 GB/s of
    bf16 on one core of a 2-core EPYC VM) and most of to-maxtext's attention weights' time."""
    dims = [(size, stride) for size, stride in zip(view.shape, view.strides) if size != 1]
    if not dims:
        return view.reshape(view.size)
    shape, strides = [dims[0][0]], [dims[0][1]]
    for size, stride in dims[1:]:
        if strides[-1] == stride * size:  # the previous dimension steps over whole runs of this one
            shape[-1] *= size
            strides[-1] = stride
        else:
            shape.append(size)
            strides.append(stride)
    return np.lib.stride_tricks.as_strided(view, tuple(shape), tuple(strides))


def _nested(items: Iterable[tuple[Sequence[str], Any]]) -> dict[str, Any]:
    """``{a: {b: value}}`` from ``((a, b), value)`` pairs."""
    tree: dict[str, Any] = {}
    for path, value in items:
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


class ReadBackFingerprints:
    """Per HF tensor and state, the fingerprints of its parts as a read returns them, block by block (:meth:`add`
    runs on Orbax's writer threads: one dict store each, under the GIL); a block produced twice is counted once."""

    def __init__(self) -> None:
        self._parts: dict[tuple[str, str], dict[tuple[str, str, int], Fingerprint]] = {}

    def add(self, name: str, state: str, rule: Rule, first_row: int, read: np.ndarray) -> None:
        """``read``: the HF rows from ``first_row`` on of this rule's part (a block, or all of it), or the stored
        elements that hold them (fp32 or bf16)."""
        import torch

        # Sums do not see order: the elements as laid out in memory, with no copy for a transposed view.
        flat = np.ravel(read, order="K")
        values = torch.from_numpy(flat.view(np.int16)).view(torch.bfloat16) if flat.dtype.name == "bfloat16" \
            else torch.from_numpy(flat)
        self.add_sums(name, state, rule, first_row, Fingerprint.of(values))

    def add_sums(self, name: str, state: str, rule: Rule, first_row: int, sums: Fingerprint) -> None:
        """:meth:`add` of a part whose sums are known already."""
        self._parts.setdefault((name, state), {})[(rule.collection, rule.path, first_row)] = sums

    def total(self, step: int | None, global_steps: int) -> Fingerprints:
        """The fingerprints of the whole tensors: a joined tensor's sums are its parts' sums added up."""
        found = Fingerprints(step=step, global_steps=global_steps)
        for (name, state), parts in sorted(self._parts.items()):
            found.add(name, state, Fingerprint(sum(p.numel for p in parts.values()),
                                               math.fsum(p.total for p in parts.values()),
                                               math.fsum(p.total_sq for p in parts.values())))
        return found
