"""MaxText's own model on a checkpoint: build the model from MaxText's config code, restore the parameters
through MaxText's own loader (``load_parameters_path``), run its forward on fixed tokens, save the logits.

Runs in .venv-maxtext (scripts/setup-maxtext.sh), on CPU:

    .venv-maxtext/bin/python maxtext_forward.py --items OUT/0/items --tokens tokens.npy --logits logits.npy \
        --setting model_name=llama2-7b --setting base_emb_dim=64 ... [--setting scan_layers=false]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

#: Settings every run takes: CPU, fp32, exact matmuls, plain dot-product attention, no checkpointing of its own.
CPU_SETTINGS = {
    "per_device_batch_size": 1, "enable_checkpointing": False, "override_model_config": True,
    "attention": "dot_product", "skip_jax_distributed_system": True, "run_name": "deepspeed_ext_test",
    "dtype": "float32", "weight_dtype": "float32", "matmul_precision": "highest", "sparse_matmul": False,
    "megablox": False, "enable_dropout": False, "float32_qk_product": True, "float32_logits": True,
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--items", required=True, help="load_parameters_path: the checkpoint's <root>/<step>/items")
    p.add_argument("--tokens", required=True, help="int32 [batch, length] .npy")
    p.add_argument("--logits", required=True, help="where to save the float32 logits (.npy)")
    p.add_argument("--setting", action="append", default=[], help="a MaxText config KEY=VALUE (repeatable)")
    p.add_argument("--output-dir", required=True, help="MaxText's base_output_directory (it writes nothing there)")
    p.add_argument("--sharded", action="store_true",
                   help="restore onto MaxText's own sharding of a 4-device CPU mesh (fsdp=2 x tensor=2), as a "
                        "MaxText run on that mesh does, instead of whole arrays on one device")
    args = p.parse_args()
    if args.sharded:
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

    import jax
    import numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    import maxtext
    from maxtext.common import checkpointing
    from maxtext.common.common_types import MODEL_MODE_TRAIN
    from maxtext.configs import pyconfig
    from maxtext.models import models
    from maxtext.utils import max_utils, maxtext_utils

    tokens = np.load(args.tokens).astype(np.int32)
    settings = {**CPU_SETTINGS, "max_target_length": tokens.shape[1], "max_prefill_predict_length": tokens.shape[1],
                "base_output_directory": args.output_dir, "load_parameters_path": args.items}
    if args.sharded:
        settings.update(ici_fsdp_parallelism=2, ici_tensor_parallelism=2, per_device_batch_size=0.25)
    base = Path(maxtext.__file__).parent / "configs" / "base.yml"
    argv = ["maxtext", str(base), *(f"{k}={v}" for k, v in settings.items()), *args.setting]
    config = pyconfig.initialize(argv)
    mesh = jax.sharding.Mesh(maxtext_utils.create_device_mesh(config), config.mesh_axes)
    model = models.transformer_as_linen(config, mesh, quant=None, model_mode=MODEL_MODE_TRAIN)
    boxed = maxtext_utils.get_abstract_param(model, config)
    abstract = max_utils.unbox_logicallypartioned(boxed)
    if args.sharded:  # MaxText's own logical-axis rules place every array on the mesh
        import flax.linen as nn
        from maxtext.utils import sharding
        shardings = sharding.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, config.logical_axis_rules)
    else:  # each array whole on the one-device CPU mesh, as MaxText's loader requires a sharding
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        shardings = jax.tree_util.tree_map(lambda leaf: replicated, abstract)
    abstract = jax.tree_util.tree_map(lambda leaf, where: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=where),
                                      abstract, shardings)
    params = checkpointing.load_params_from_path(config.load_parameters_path, abstract,
                                                 config.checkpoint_storage_concurrent_gb,
                                                 use_ocdbt=config.checkpoint_storage_use_ocdbt,
                                                 use_zarr3=config.checkpoint_storage_use_zarr3)
    if args.sharded:  # how many arrays MaxText actually split over the mesh (the caller checks it)
        placed = jax.tree_util.tree_leaves(params)
        split = sum(any(axis is not None for axis in leaf.sharding.spec) for leaf in placed)
        print(f"MAXTEXT_SPLIT_ARRAYS {split} {len(placed)}")
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    with mesh:
        logits = model.apply(params, tokens, positions, decoder_segment_ids=np.ones_like(tokens),
                             enable_dropout=False, model_mode=MODEL_MODE_TRAIN)
    if isinstance(logits, tuple):
        logits = logits[0]
    np.save(args.logits, np.asarray(logits, np.float32))


if __name__ == "__main__":
    main()
