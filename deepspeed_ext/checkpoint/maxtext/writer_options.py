"""What ``to-maxtext`` may be told (:class:`MaxTextOptions`) and how :func:`~.writer.write_maxtext` writes
(:class:`WriterOptions`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from deepspeed_ext.checkpoint.source import (WriteOptions)
from deepspeed_ext.checkpoint.writing import Verdicts

if TYPE_CHECKING:  # torch only where tensors are handed over

    pass


#: ``load(name, state)``: one full HF tensor's state as numpy; ``load_rows(name, state, first, last)``: rows of it.
Load = Callable[..., np.ndarray]
LoadRows = Callable[[str, str, int, int], Any]

DTYPES = ("bfloat16", "float32")


#: Each storage chunk's codec: zstd (level 3, Orbax's default and MaxText's own) or none.
COMPRESSIONS = ("zstd", "none")


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
