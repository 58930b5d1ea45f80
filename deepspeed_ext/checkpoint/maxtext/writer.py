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
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from deepspeed_ext.checkpoint import orbax_private
from deepspeed_ext.checkpoint.families import Family
from deepspeed_ext.checkpoint.maxtext.names import (COUNT_KEY, FAMILY_KEY, FINGERPRINTS_KEY, ITEM, METADATA_KEY,
                                                    MODEL_AUX_KEY, MODEL_AUX_MODEL, MODEL_CONFIG_KEY, MU_KEY, NU_KEY,
                                                    OPT_STATE_KEY, PARAMS_KEY, SCAN_LAYERS_KEY,
                                                    STEP_DIR, STEP_KEY)
from deepspeed_ext.checkpoint.maxtext.orbax_io import import_orbax, save_items
from deepspeed_ext.checkpoint.maxtext.plan import Leaf, plan_leaves
from deepspeed_ext.checkpoint.maxtext.sharding import parse_mesh
from deepspeed_ext.checkpoint.maxtext.transforms import (STATES, ModelDims)
from deepspeed_ext.checkpoint.source import (CheckpointSource, SourceInfo, protected_paths, required_model_config)
from deepspeed_ext.checkpoint.states import ADAM_STATES, MASTER_WEIGHTS, MODULE_WEIGHTS, MUON_MOMENTUM, STEP
from deepspeed_ext.checkpoint.writing import Verdicts, Write
from deepspeed_ext.errors import CheckpointError

if TYPE_CHECKING:  # torch only where tensors are handed over

    from deepspeed_ext.checkpoint.tensor import LogicalTensor, StreamCheck

from deepspeed_ext.checkpoint.maxtext.leaves import LeafArrays, ReadBackFingerprints
from deepspeed_ext.checkpoint.maxtext.writer_options import (COMPRESSIONS, DTYPES, Load, LoadRows, MaxTextOptions,
                                                             ModuleWeights, WriterOptions)

def write(source: CheckpointSource, out: str | Path, options: MaxTextOptions = MaxTextOptions()) -> Path:
    """Write ``source`` as a MaxText Orbax checkpoint at ``out``; returns ``out/0/items`` (MaxText's
    ``load_parameters_path``). One tensor is read when Orbax writes the leaf that needs it."""
    from deepspeed_ext.checkpoint.families import get_family, infer_family, require_maxtext
    from deepspeed_ext.checkpoint.model_config import ConfigFit
    info = source.info
    label = str(info.given)
    config = required_model_config(info)
    family = require_maxtext(get_family(options.family) if options.family else infer_family(config, label), label)
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
    arrays = LeafArrays(load, _rows_loader(load, options.load_rows, checks, hf_shapes), hf_shapes, family, dims,
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


def _train_state(arrays: LeafArrays, leaves: list[Leaf], options: WriterOptions) -> dict[str, Any]:
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


def _finish(partial: Path, options: WriterOptions, verdicts: Verdicts, read_back: ReadBackFingerprints) -> None:
    """Once every array is written, before anything is published: the checks' verdicts, then the fingerprints of
    what a read returns, added to our entry of the step's custom metadata (which Orbax took before it wrote the
    arrays, whose tensors are read lazily)."""
    verdicts.give()
    written = read_back.total(step=options.optimizer_step if options.with_optimizer else None,
                              global_steps=int(options.step))
    orbax_private.add_step_custom_metadata(partial / STEP_DIR, METADATA_KEY, {FINGERPRINTS_KEY: written.to_json()})
