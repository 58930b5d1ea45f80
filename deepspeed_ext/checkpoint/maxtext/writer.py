"""The sink behind ``to-maxtext``: a checkpoint source written as a MaxText Orbax checkpoint (the layout is in
:mod:`deepspeed_ext.checkpoint.maxtext.names`, the conventions in docs/maxtext.md).

Streaming: each leaf is a lazy proxy that Orbax materialises just before writing it, one leaf at a
time, and writes slab by slab: a block of an HF tensor's rows (about :data:`BLOCK_BYTES` of fp32) is read,
transformed and cast, and becomes one slab of the leaf, written as whole storage chunks (a scanned stack is
stored one layer thick). :data:`PRODUCERS` threads produce a leaf's slabs, in order, while the writers write the
ones before. Peak memory is a few blocks, whatever the size of the largest tensor. bf16 is written as
``ml_dtypes.bfloat16``, cast from the fp32 rows by torch (:func:`_contiguous_as`).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from deepspeed_ext.checkpoint import orbax_private
from deepspeed_ext.checkpoint.families import LAYER, Family, Rule
from deepspeed_ext.checkpoint.fingerprint import Fingerprint, Fingerprints
from deepspeed_ext.checkpoint.maxtext.names import (COUNT_KEY, FAMILY_KEY, FINGERPRINTS_KEY, ITEM, METADATA_KEY,
                                                    MODEL_AUX_KEY, MODEL_AUX_MODEL, MODEL_CONFIG_KEY, MU_KEY, NU_KEY,
                                                    OPT_STATE_KEY, PARAMS_COLLECTION, PARAMS_KEY, SCAN_LAYERS_KEY,
                                                    STEP_DIR, STEP_KEY)
from deepspeed_ext.checkpoint.maxtext.orbax_io import LazyLeaf, SlabWriter, import_orbax, save_items
from deepspeed_ext.checkpoint.maxtext.plan import Leaf, plan_leaves
from deepspeed_ext.checkpoint.maxtext.sharding import parse_mesh, shard_shape, storage_chunk
from deepspeed_ext.checkpoint.maxtext.transforms import (BLOCK_BYTES, STATES, TRANSFORMS, ModelDims, RowBlocks,
                                                         exact_bf16_scale, from_maxtext, row_blocks, to_maxtext)
from deepspeed_ext.checkpoint.source import (CheckpointSource, SourceInfo, WriteOptions, protected_paths, required_model_config)
from deepspeed_ext.checkpoint.states import ADAM_STATES, MASTER_WEIGHTS, MODULE_WEIGHTS, MUON_MOMENTUM, STEP
from deepspeed_ext.checkpoint.writing import Verdicts, Write
from deepspeed_ext.errors import CheckpointError

if TYPE_CHECKING:  # torch only where tensors are handed over
    from tqdm import tqdm

    from deepspeed_ext.checkpoint.tensor import LogicalTensor, StreamCheck

DTYPES = ("bfloat16", "float32")
#: Slabs produced at once (read, checked, laid out and cast, each on a thread of its own) while the writers write
#: the ones before: one producer kept one core busy while the other waited on the writes. On a 2-core VM two took
#: to-maxtext's time at the margin (16 -> 48 layers of the 246M shape, warm, in process) from 1.2-1.6 s to 1.0-1.2 s.
PRODUCERS = 2
_Item = TypeVar("_Item")
_Produced = TypeVar("_Produced")
#: Each storage chunk's codec: zstd (level 3, Orbax's default and MaxText's own) or none.
COMPRESSIONS = ("zstd", "none")
#: ``load(name, state)``: one full fp32 tensor as numpy; ``load_rows(name, state, first, last)``: rows
#: ``[first, last)`` of it (along axis 0), flattened, as numpy or a torch tensor.
Load = Callable[..., np.ndarray]
LoadRows = Callable[[str, str, int, int], Any]


@dataclass(frozen=True)
class MaxTextOptions(WriteOptions):
    """``family``: the MaxText model family (None: inferred from the model config); ``scan_layers``: stack the
    decoder layers as MaxText's ``scan_layers=true`` expects; ``dtype`` of the weights; ``mesh``: the target
    mesh the storage chunks are cut for (``{"fsdp": 16}`` or ``"fsdp=16"``); ``with_optimizer``: also write
    the Adam moments as optax adamw's state; ``compression``: ``zstd`` (Orbax's default, as MaxText writes) or
    ``none`` (each chunk's bytes as they are: larger, written and read without (de)compressing); ``ocdbt``: all
    arrays in one OCDBT store, as MaxText writes (default), or each array a directory of chunk files (which
    deepspeed-ext writes itself when uncompressed);
    ``module_weights``: for bf16 weights, read a DeepSpeed checkpoint's own bf16 module weights where it recorded
    their fingerprints (the same bits as the masters' cast, from half the bytes); False reads the fp32 masters."""

    family: str | None = None
    scan_layers: bool = True
    dtype: str = "bfloat16"
    mesh: Mapping[str, int] | str | None = None
    with_optimizer: bool = False
    compression: str = "zstd"
    ocdbt: bool = True
    module_weights: bool = True


@dataclass(frozen=True)
class WriterOptions:
    """How :func:`write_maxtext` writes, beside the tensors, the family and the model's dimensions.

    ``model_config`` (the HF config) is stored in the step's custom metadata beside ``scan_layers``, so
    ``from-maxtext`` needs no ``--config`` for checkpoints written here. ``step`` (the training step the
    weights are from) goes into the tree's ``step`` leaf, which MaxText ignores for a parameter load and
    ``from-maxtext`` hands back to DeepSpeed so a resumed run continues its step count and data order.

    ``mesh`` (e.g. ``{"fsdp": 16}``): each array's storage chunks are one device's shard under MaxText's
    sharding rules for that mesh (one layer thick for scanned stacks, see :func:`storage_chunk`), so a
    restore into that mesh reads each shard's bytes once, with no separate reshard pass.

    ``with_optimizer``: ``opt_state`` also holds the Adam moments in the layout of MaxText's default
    optimizer (optax ``adamw``: ``[ScaleByAdamState(count, mu, nu), EmptyState, ScaleByScheduleState(count)]``,
    ``mu``/``nu`` mirroring ``params`` and kept in fp32), with ``count`` = ``optimizer_step``. The query
    moments are rescaled for MaxText's pre-scaled query kernel (see :class:`~.transforms.Transform`).

    ``load_rows(name, state, first, last)``: rows ``[first, last)`` of a tensor (along axis 0), flattened, as
    numpy or a torch tensor (default: cut from ``load``, which then loads the whole tensor for each block: for
    sources held in memory). Tensors are streamed into their leaves in blocks of about ``block_bytes`` (default
    :data:`BLOCK_BYTES`) of fp32 rows (:func:`row_blocks`). ``verdicts``: the checks of what ``load`` returns
    (``--check-finite``, the source's recorded fingerprints, the fit to transformers' model for the config, on a
    thread) and, last, the source's own checksums (:class:`~deepspeed_ext.checkpoint.writing.Verdicts`): any
    failure and the written checkpoint is removed and nothing is left.
    ``protect``: the source's paths, which the output may not touch; the output is built aside and published
    whole (:mod:`deepspeed_ext.checkpoint.output`). ``source``: the source's name in errors. ``compression``:
    each storage chunk's codec, one of :data:`COMPRESSIONS`. ``ocdbt``: every array in one OCDBT store (MaxText's
    own choice), or each array a directory of chunk files (written by :mod:`~deepspeed_ext.checkpoint.zarr3_shards`
    where uncompressed).
    """

    scan_layers: bool = True
    dtype: str = "bfloat16"
    overwrite: bool = False
    progress: bool = True
    source: str = "source"
    model_config: Mapping[str, Any] | None = None
    step: int = 0
    mesh: Mapping[str, int] | None = None
    with_optimizer: bool = False
    optimizer_step: int | None = None
    verdicts: Verdicts | None = None
    protect: Iterable[str | Path] = ()
    load_rows: LoadRows | None = None
    block_bytes: int | None = None
    compression: str = "zstd"
    ocdbt: bool = True
    #: What a bf16 leaf may read in place of the fp32 masters (:class:`ModuleWeights`; None: the masters).
    module_weights: ModuleWeights | None = None


@dataclass(frozen=True)
class ModuleWeights:
    """The HF tensors whose module weights ``load_rows`` returns in bf16 (state ``MODULE_WEIGHTS``, checked against
    the fingerprints the source recorded of them). DeepSpeed rounds its fp32 masters to them after every step, so a
    bf16 leaf whose transform moves them or scales them by a power of two (:func:`~.transforms.exact_bf16_scale`)
    is the very bits it would be from the masters, read from half the bytes with no cast. ``master_rows``:
    ``load_rows`` of the masters unchecked, for the rare block whose weights a factor below 1 would take under
    the smallest normal (there the two roundings may differ): the block is made from the masters, which must
    round to the checked module weights."""

    names: frozenset[str]
    master_rows: Callable[[str, int, int], Any]


def write(source: CheckpointSource, out: str | Path, options: MaxTextOptions = MaxTextOptions()) -> Path:
    """Write ``source`` as a MaxText Orbax checkpoint at ``out``; returns ``out/0/items`` (MaxText's
    ``load_parameters_path``). One tensor is read when Orbax writes the leaf that needs it."""
    from deepspeed_ext.checkpoint.families import get_family, infer_family
    from deepspeed_ext.checkpoint.model_config import ConfigFit
    info = source.info
    label = str(info.given)
    config = required_model_config(info)
    family = get_family(options.family) if options.family else infer_family(config)
    tensors = {tensor.name: tensor for tensor in source.tensors()}
    import_orbax()  # before the config check's thread imports transformers (see import_orbax)
    fit = ConfigFit(config, {name: tuple(t.shape) for name, t in tensors.items()}, label)
    load, load_rows = _source_loaders(tensors)
    module_weights = _module_weights(tensors, info, load_rows) \
        if options.dtype == "bfloat16" and options.module_weights else None
    with fit.first():  # a config that does not fit is named before what follows from it
        optimizer_step = _optimizer_step(tensors, label) if options.with_optimizer else None
        mesh = parse_mesh(options.mesh) if isinstance(options.mesh, str) else options.mesh
        return write_maxtext(load, {name: t.shape for name, t in tensors.items()}, family,
                             ModelDims.from_config(config), out,
                             WriterOptions(scan_layers=options.scan_layers, dtype=options.dtype,
                                           overwrite=options.overwrite, progress=options.progress, source=label,
                                           model_config=config, step=info.global_step, mesh=mesh,
                                           with_optimizer=options.with_optimizer, optimizer_step=optimizer_step,
                                           verdicts=Verdicts.of(source, options, fit=fit),
                                           protect=protected_paths(source, options), load_rows=load_rows,
                                           compression=options.compression, ocdbt=options.ocdbt,
                                           module_weights=module_weights))


def _module_weights(tensors: Mapping[str, LogicalTensor], info: SourceInfo, load_rows: LoadRows
                    ) -> ModuleWeights | None:
    """The tensors whose bf16 module weights the source holds with a recorded fingerprint (a save by
    deepspeed-ext): a bf16 export may read them instead of the masters and still check what it read."""
    import torch
    recorded = info.fingerprints
    if recorded is None:
        return None
    names = frozenset(name for name, tensor in tensors.items() if tensor.module_weights
                      and tensor.dtype == torch.bfloat16 and recorded.get(name, MODULE_WEIGHTS) is not None)
    return ModuleWeights(names, lambda name, first, last: load_rows(name, MASTER_WEIGHTS, first, last)) \
        if names else None


def _refuse_other_optimizers(tensors: Mapping[str, LogicalTensor], label: str) -> None:
    """``--with-optimizer`` writes MaxText's ``opt_type=adamw`` state (optax's Adam moments): the source must have
    been stepped by Adam/AdamW throughout. Other optimizers are refused in one line: MaxText's ``sgd`` is optax's
    SGD without momentum (nothing to put SGD's momentum in), and its ``muon`` keeps optax's own Muon state (a
    momentum for the matrices its own rule picks, Adam's moments for the rest), which this writer does not lay out."""
    if not any(s not in t.scalars and s != MASTER_WEIGHTS for t in tensors.values() for s in t.states):
        raise CheckpointError(f"{label}: parameters only (no optimizer state: a Hugging Face checkpoint, or one saved "
                              "without its optimizer); --with-optimizer writes MaxText's full train state "
                              "(load_full_state_path) and needs the run's Adam moments: drop it to write the "
                              "parameters alone (load_parameters_path)")
    frozen = [tensor.name for tensor in tensors.values() if not tensor.trainable]
    if frozen:
        raise CheckpointError(f"{label}: {len(frozen)} parameter(s) are frozen (e.g. {frozen[0]}): no optimizer "
                              "steps them, and MaxText's optimizer steps every parameter, so a continuation from "
                              "--with-optimizer would train them; write the weights alone (without "
                              "--with-optimizer): the MaxText run then starts its optimizer fresh")
    other: dict[str, list[str]] = {}
    for tensor in tensors.values():
        kept = tuple(s for s in tensor.states if s not in tensor.scalars and s != MASTER_WEIGHTS)
        if kept != ADAM_STATES:
            other.setdefault("/".join(kept) or "no state", []).append(tensor.name)
    if not other:
        return
    states, names = next(iter(other.items()))
    hint = ("DeepSpeed's Muon or SGD with momentum; MaxText's opt_type=sgd keeps no momentum and its opt_type=muon "
            "a state of optax's own" if MUON_MOMENTUM in states else "not Adam/AdamW")
    raise CheckpointError(f"{label}: --with-optimizer carries Adam/AdamW moments into MaxText's opt_type=adamw, but "
                          f"{len(names)} parameter(s) hold optimizer state {states} (e.g. {names[0]}: {hint}); "
                          "write the weights alone (without --with-optimizer): the MaxText run then starts its "
                          "optimizer fresh")


def _optimizer_step(tensors: Mapping[str, LogicalTensor], label: str) -> int:
    """The optimizer step the source's tensors carry (``--with-optimizer``)."""
    _refuse_other_optimizers(tensors, label)
    first = next(iter(tensors.values()))
    if STEP not in first.states:
        raise CheckpointError(f"{label}: no optimizer step to carry (--with-optimizer)")
    value = first.load(STEP)
    return int(value.item() if hasattr(value, "item") else value)


def _source_loaders(tensors: Mapping[str, LogicalTensor]) -> tuple[Load, LoadRows]:
    """``load`` and ``load_rows`` (:class:`WriterOptions`) reading the source's tensors."""
    #: Tensors loaded whole (sources that cannot read ranges), each kept while some thread still reads its rows:
    #: the tensor each thread asked for last. A producer that moves on to its next tensor never drops the one
    #: another producer is still reading (dropping the oldest did, and that tensor was loaded again), and two
    #: producers reading one tensor's blocks load it once.
    whole: dict[tuple[str, str], Future[Any]] = {}
    reading: dict[int, tuple[str, str]] = {}
    whole_lock = threading.Lock()

    def load_whole(name: str, state: str) -> Any:
        key = (name, state)
        with whole_lock:
            reading[threading.get_ident()] = key
            loaded = whole.get(key)
            loads = loaded is None
            if loaded is None:
                loaded = whole[key] = Future()
            kept = set(reading.values())
            for other in [other for other in whole if other not in kept]:
                del whole[other]
        if loads:
            try:
                loaded.set_result(tensors[name].load_tensor(state).detach().float().reshape(-1))
            except BaseException as exc:
                with whole_lock:
                    whole.pop(key, None)
                loaded.set_exception(exc)
        return loaded.result()

    def load(name: str, state: str = MASTER_WEIGHTS) -> np.ndarray:
        return tensors[name].load_tensor(state).detach().float().numpy()

    def load_rows(name: str, state: str, first: int, last: int) -> Any:
        """Rows ``[first, last)`` as a flat fp32 tensor; a source that cannot read ranges loads the tensor once for
        its blocks."""
        import torch
        tensor = tensors[name]
        row = math.prod(tensor.shape[1:])
        if tensor.range_loader is None:
            return load_whole(name, state)[first * row:last * row]
        # One read for the writer's whole block (its size bounds the memory): the source merges the TP shards of
        # the rows into a tensor of their own, with no second copy into this one's. A view of a mapped file
        # (a replicated tensor's rows) is consumed before this thread reads again; its pages are released then,
        # which only drops them from memory.
        # (Blocks are cut on multiples of their size: one as large as the range's end is the whole range.)
        if first * row == last * row:  # no elements (a dimension of size 0): no block to read
            return torch.empty(0, dtype=tensor.dtype if state == MODULE_WEIGHTS else torch.float32)
        (rows,) = tensor.blocks(state, first * row, last * row, block_elements=last * row)
        rows = rows.detach().reshape(-1)
        return rows if state == MODULE_WEIGHTS else rows.float()  # the module's weights stay in their bf16

    return load, load_rows


def write_maxtext(load: Load,
                  hf_shapes: Mapping[str, tuple[int, ...]],
                  family: Family,
                  dims: ModelDims,
                  out: str | Path,
                  options: WriterOptions = WriterOptions(),
                  **fields: Any) -> Path:
    """Write a MaxText Orbax checkpoint at ``out`` from HF-named fp32 tensors; returns ``out/0/items``.

    ``load(name, state)`` returns one full fp32 tensor (``state``: ``fp32``, ``exp_avg`` or ``exp_avg_sq``) as
    numpy, read when Orbax writes the leaf that needs it. ``options``: how (:class:`WriterOptions`); ``fields``,
    any of its fields given by name instead (``write_maxtext(..., dtype="float32", mesh={"fsdp": 4})``).
    """
    import ml_dtypes
    from tqdm import tqdm

    options = dataclasses.replace(options, **fields) if fields else options
    if options.dtype not in DTYPES:
        raise CheckpointError(f"--dtype must be one of {', '.join(DTYPES)}, not {options.dtype!r}")
    if options.compression not in COMPRESSIONS:
        raise CheckpointError(f"--compression must be one of {', '.join(COMPRESSIONS)}, not {options.compression!r}")
    np_dtype = np.dtype(ml_dtypes.bfloat16) if options.dtype == "bfloat16" else np.dtype(np.float32)
    write = Write(out, protect=list(options.protect), overwrite=options.overwrite, verdicts=options.verdicts)
    out = write.out  # absolute: OCDBT refuses relative paths
    leaves = plan_leaves(family, dims, hf_shapes, options.scan_layers, options.source)  # validated before writing
    states = STATES if options.with_optimizer else STATES[:1]
    checks = write.verdicts.checks
    load = write.verdicts.loader(load)
    bar = tqdm(total=len(leaves) * len(states), desc="to-maxtext", unit="array", disable=not options.progress)
    arrays = _LeafArrays(load, _rows_loader(load, options.load_rows, checks, hf_shapes), hf_shapes, family, dims,
                         options, np_dtype, bar)
    tree = _train_state(arrays, leaves, options)
    custom = {SCAN_LAYERS_KEY: options.scan_layers,
              METADATA_KEY: {FAMILY_KEY: family.name, MODEL_CONFIG_KEY: dict(options.model_config or {})}}

    def write_items(partial: Path) -> None:  # Orbax records the manifest as it writes; the verdicts come first
        with arrays.producers:
            save_items(partial, tree, custom, finish=lambda: _finish(partial, options, write.verdicts, arrays.read_back),
                       compression=options.compression != "none", ocdbt=options.ocdbt)

    try:
        write.publish(write_items, manifest=False)
    finally:
        bar.close()
    return out / STEP_DIR / ITEM


def _rows_loader(load: Load, load_rows: LoadRows | None, checks: Sequence[StreamCheck],
                 hf_shapes: Mapping[str, tuple[int, ...]]) -> LoadRows:
    """``load_rows`` with every block seen by ``checks``, or rows cut from ``load`` (already checked)."""
    if load_rows is None:

        def whole_rows(name: str, state: str, first: int, last: int) -> np.ndarray:
            return np.asarray(load(name, state))[first:last].reshape(-1)

        return whole_rows
    return _checked_rows(load_rows, checks, hf_shapes)


def _checked_rows(load_rows: LoadRows, checks: Sequence[StreamCheck],
                  hf_shapes: Mapping[str, tuple[int, ...]]) -> LoadRows:
    """``load_rows`` with every block it returns seen by ``checks`` as the flat element range it is."""
    import torch

    def load(name: str, state: str, first: int, last: int) -> Any:
        rows = load_rows(name, state, first, last)
        value = rows if isinstance(rows, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(rows))
        row = math.prod(hf_shapes[name][1:])
        for check in checks:
            value = check.check_range(name, state, first * row, last * row, value)
        return value

    return load


def _train_state(arrays: _LeafArrays, leaves: list[Leaf], options: WriterOptions) -> dict[str, Any]:
    """MaxText's train state of lazy leaves: the step, the parameters, and optax adamw's state or nothing.

    A full state (``with_optimizer``) also has the variables outside ``params`` where MaxText's full-state restore
    reads them (``nnx_aux/model``), beside their place in the parameter tree, which a parameter load reads: a full
    restore ignores the second and keeps its freshly initialized value (a zero router bias: other experts)."""
    opt_state: Any = {}
    state = {STEP_KEY: int(options.step), PARAMS_KEY: arrays.tree(leaves, MASTER_WEIGHTS)}
    if options.with_optimizer:
        count = np.int32(options.step if options.optimizer_step is None else options.optimizer_step)
        adam = {COUNT_KEY: count, MU_KEY: arrays.tree(leaves, "exp_avg"), NU_KEY: arrays.tree(leaves, "exp_avg_sq")}
        opt_state = [adam, None, {COUNT_KEY: count}]
        variables = arrays.model_variables(leaves)
        if variables:
            state[MODEL_AUX_KEY] = {MODEL_AUX_MODEL: variables}
    return {**state, OPT_STATE_KEY: opt_state}


def _finish(partial: Path, options: WriterOptions, verdicts: Verdicts, read_back: _ReadBackFingerprints) -> None:
    """Once every array is written, before anything is published: the checks' verdicts, then the fingerprints of
    what a read returns, added to our entry of the step's custom metadata (which Orbax took before it wrote the
    arrays, whose tensors are read lazily)."""
    verdicts.give()
    written = read_back.total(step=options.optimizer_step if options.with_optimizer else None,
                              global_steps=int(options.step))
    orbax_private.add_step_custom_metadata(partial / STEP_DIR, METADATA_KEY, {FINGERPRINTS_KEY: written.to_json()})


class _LeafArrays:
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
        self.read_back = _ReadBackFingerprints()
        #: The threads that produce a leaf's slabs, :data:`PRODUCERS` blocks at a time (:func:`_in_order`).
        self.producers = ThreadPoolExecutor(PRODUCERS, thread_name_prefix="deepspeed-ext-maxtext-blocks",
                                            initializer=_one_torch_thread)

    def tree(self, leaves: list[Leaf], state: str) -> dict[str, Any]:
        """``{collection: tree}``; the moments only of the ``params`` collection (the optimizer's)."""
        # Moments stay fp32 (optax's mu_dtype defaults to MaxText's fp32 weight_dtype).
        leaf_dtype = self.np_dtype if state == MASTER_WEIGHTS else np.dtype(np.float32)
        return _nested(((leaf.collection, *leaf.path), self.lazy_leaf(leaf, state, leaf_dtype)) for leaf in leaves
                       if state == MASTER_WEIGHTS or leaf.collection == PARAMS_COLLECTION)

    def model_variables(self, leaves: list[Leaf]) -> dict[str, Any]:
        """The variables outside ``params`` (DeepSeek's router bias) by their path alone: where MaxText's full train
        state keeps them (``nnx_aux/model/<path>``, with every persistent variable that is not a parameter)."""
        return _nested((leaf.path, self.lazy_leaf(leaf, MASTER_WEIGHTS, self.np_dtype)) for leaf in leaves
                       if leaf.collection != PARAMS_COLLECTION)

    def lazy_leaf(self, leaf: Leaf, state: str, leaf_dtype: np.dtype) -> LazyLeaf:
        rule = leaf.rule
        assert rule is not None  # plan_leaves gives every leaf its rule
        layers = leaf.layers or ()
        names = [rule.hf] if leaf.layers is None else [rule.hf.replace(LAYER, str(layer)) for layer in layers]
        if leaf.stacked and leaf.scan_axis != 1:  # small non-parameter variables stacked on axis 0: whole
            return self._whole_stack(leaf, rule, names, state, leaf_dtype)
        if not leaf.stacked:
            names = names[:1]  # an unscanned layer's leaf holds its one layer
        plan, write_shape = self._row_plan(leaf, rule, state, tuple(self.hf_shapes[names[0]]))
        stack_axis = 1 if leaf.stacked else None

        def blocks() -> Iterator[tuple[tuple[int | slice, ...], str, int, int]]:
            for position, name in enumerate(names):
                for first, last in plan.ranges() if plan.axis is not None else [(0, 1)]:
                    index: list[int | slice] = [slice(None)] * (len(leaf.shape) - (stack_axis is not None))
                    if plan.axis is not None:
                        index[plan.axis] = slice(first, last)
                    if stack_axis is not None:
                        index.insert(stack_axis, position)
                    yield tuple(index), name, first, last

        def slab(block: tuple[tuple[int | slice, ...], str, int, int]) -> tuple[tuple[int | slice, ...], np.ndarray]:
            index, name, first, last = block
            return index, self.stored_block(rule, name, state, leaf_dtype, plan, first, last)

        def produced(produce: Callable[[tuple[tuple[int | slice, ...], str, int, int]], _Produced]
                     ) -> Generator[_Produced, None, None]:
            yield from _in_order(self.producers, blocks(), produce)
            self.bar.update(1)

        def write_slabs(write: SlabWriter) -> Generator[int, None, None]:
            return produced(lambda block: write(*slab(block)))  # written on the producer's thread

        return LazyLeaf(leaf.shape, leaf_dtype, None, write_shape, slabs=lambda: produced(slab),
                        write_slabs=write_slabs)

    def _whole_stack(self, leaf: Leaf, rule: Rule, names: list[str], state: str, leaf_dtype: np.dtype) -> LazyLeaf:
        """A stack on an axis other than 1 (small non-parameter variables, on axis 0), produced whole."""

        def produce_stack() -> np.ndarray:
            plan = RowBlocks(None)
            array = np.stack([self.stored_block(rule, name, state, leaf_dtype, plan, 0, 1) for name in names],
                             leaf.scan_axis)
            self.bar.update(1)
            return array

        return LazyLeaf(leaf.shape, leaf_dtype, produce_stack, shard_shape(leaf, self.mesh) if self.mesh else None)

    def _row_plan(self, leaf: Leaf, rule: Rule, state: str,
                  hf_shape: tuple[int, ...]) -> tuple[RowBlocks, tuple[int, ...]]:
        """How a tensor of ``leaf`` is streamed, and the leaf's storage chunk (one layer thick for a stack)."""
        # The leaf of one tensor (one layer's, for a stack on axis 1): its storage chunk without the layer axis.
        chunk = list(storage_chunk(leaf, self.mesh) or leaf.shape)
        if leaf.stacked:
            del chunk[1]
        per_mesh = shard_shape(leaf, self.mesh) if self.mesh else None
        if per_mesh is not None and leaf.stacked:
            per_mesh = per_mesh[:1] + per_mesh[2:]
        plan = row_blocks(rule.kind, state, hf_shape, self.dims, per_mesh, self.block_bytes)
        if plan.axis is not None:
            chunk[plan.axis] = plan.chunk
        return plan, (tuple(chunk[:1] + [1] + chunk[1:]) if leaf.stacked else tuple(chunk))

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

    def stored_block(self, rule: Rule, name: str, state: str, leaf_dtype: np.dtype, plan: RowBlocks, first: int,
                     last: int) -> np.ndarray:
        """Units ``[first, last)`` of HF tensor ``name`` in the leaf's layout and dtype (all of it where the plan
        streams nothing); its read-back fingerprint is recorded as it goes."""
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


def _one_torch_thread() -> None:
    """A producer's torch operations on its own thread alone: with :data:`PRODUCERS` of them and the writers on a
    few cores, torch's intra-op threads (OpenMP's, set per calling thread) only contended: on a 2-core VM,
    to-maxtext's time at the margin (16 -> 48 layers) fell from 1.2-1.4 s to 1.1 s with them off (two producers)."""
    import torch
    torch.set_num_threads(1)


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


class _ReadBackFingerprints:
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
