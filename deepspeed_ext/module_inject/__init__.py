"""Tensor-parallel layout metadata for AutoTP-sharded parameters."""

from deepspeed_ext.module_inject.layout import (LAYOUT_SCHEMA_VERSION, TPLayout, num_kv_heads_of, shard_size,
                                                shard_sizes)
from deepspeed_ext.module_inject.autotp import (LAYOUT_ATTR, layout_from_upstream_meta,
                                                layouts_from_universal_checkpoint_info, tag_autotp_model,
                                                upstream_layouts)

__all__ = [
    "LAYOUT_ATTR", "LAYOUT_SCHEMA_VERSION", "TPLayout", "layout_from_upstream_meta",
    "layouts_from_universal_checkpoint_info", "num_kv_heads_of", "shard_size", "shard_sizes", "tag_autotp_model",
    "upstream_layouts"
]
