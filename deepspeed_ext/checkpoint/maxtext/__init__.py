"""MaxText checkpoints in Orbax: the sink behind ``to-maxtext``, the source behind ``from-maxtext``, and
``reshard-orbax``. The conventions are in docs/maxtext.md.

The modules, each standing only on those before it:

- :mod:`.names`: every on-disk name and key (Orbax's files, MaxText's train state, our custom metadata);
- :mod:`.transforms`: the HF <-> MaxText math (a :class:`Transform` per kind of parameter) and the row blocks
  a tensor is streamed in;
- :mod:`.plan`: the leaf plan, which MaxText leaf each HF parameter goes to;
- :mod:`.sharding`: MaxText's logical axes and mesh rules, the storage chunk of a leaf on a mesh, ``--mesh``;
- :mod:`.settings`: the MaxText settings that build the model of a checkpoint;
- :mod:`.orbax_io`: lazy leaves, the save as MaxText writes it, one leaf read back;
- :mod:`.writer`: :func:`write` / :func:`write_maxtext` (to-maxtext), with :mod:`.writer_options` (their options)
  and :mod:`.leaves` (the lazy leaves Orbax materialises, block by block);
- :mod:`.reader`: :func:`open_source` / :class:`MaxTextCheckpoint` (from-maxtext);
- :mod:`.reshard`: :func:`reshard_orbax`.

Orbax's private API is used only through :mod:`deepspeed_ext.checkpoint.orbax_private`. jax, orbax, tensorstore
and torch are imported only where they are used, so importing this package stays cheap.
"""

from __future__ import annotations

from deepspeed_ext.checkpoint.maxtext.names import (ITEM, METADATA_KEY, MOMENT_PREFIX, PARAMS_PREFIX, SCANNED_STACKS,
                                                    STEP_DIR)
from deepspeed_ext.checkpoint.maxtext.orbax_io import LazyLeaf, restore_leaf
from deepspeed_ext.checkpoint.maxtext.plan import Leaf, layer_blocks, plan_leaves, rule_blocks
from deepspeed_ext.checkpoint.maxtext.reader import MaxTextCheckpoint, open_source, stored_model_info
from deepspeed_ext.checkpoint.maxtext.reshard import reshard_orbax
from deepspeed_ext.checkpoint.maxtext.settings import (adamw_settings, continuation_settings, maxtext_settings,
                                                       settings_text)
from deepspeed_ext.checkpoint.maxtext.sharding import (LOGICAL_AXES, MESH_AXES, MESH_RULES, logical_axes, parse_mesh,
                                                       partition_spec, shard_shape, storage_chunk)
from deepspeed_ext.checkpoint.maxtext.transforms import (BLOCK_BYTES, STATES, TRANSFORMS, ModelDims, RowBlocks,
                                                         Transform, from_maxtext, join_parts, row_blocks, to_maxtext)
from deepspeed_ext.checkpoint.maxtext.writer import write, write_maxtext
from deepspeed_ext.checkpoint.maxtext.writer_options import DTYPES, MaxTextOptions, WriterOptions

__all__ = [
    # names
    "ITEM", "METADATA_KEY", "MOMENT_PREFIX", "PARAMS_PREFIX", "SCANNED_STACKS", "STEP_DIR",
    # transforms
    "BLOCK_BYTES", "STATES", "TRANSFORMS", "ModelDims", "RowBlocks", "Transform", "from_maxtext", "join_parts",
    "row_blocks", "to_maxtext",
    # plan, sharding, settings
    "Leaf", "layer_blocks", "plan_leaves", "rule_blocks",
    "LOGICAL_AXES", "MESH_AXES", "MESH_RULES", "logical_axes", "parse_mesh", "partition_spec", "shard_shape",
    "storage_chunk",
    "adamw_settings", "continuation_settings", "maxtext_settings", "settings_text",
    # Orbax I/O, the writer, the reader, reshard
    "LazyLeaf", "restore_leaf",
    "DTYPES", "MaxTextOptions", "WriterOptions", "write", "write_maxtext",
    "MaxTextCheckpoint", "open_source", "stored_model_info",
    "reshard_orbax",
]
