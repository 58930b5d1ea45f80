"""MaxText's own model on a checkpoint: build the model from MaxText's config code, restore the parameters
through MaxText's own loader (``load_parameters_path``), run its forward on fixed tokens, save the logits.

Runs in .venv-maxtext (scripts/setup-maxtext.sh), on CPU, one process for many forwards (starting JAX and
importing MaxText take most of one; the tests ask for dozens):

    echo '{"items": "OUT/0/items", "tokens": "tokens.npy", "logits": "logits.npy", "output_dir": "DIR",
           "settings": ["model_name=llama2-7b", "base_emb_dim=64", ...]}' |
        .venv-maxtext/bin/python maxtext_forward.py [--sharded]

Each line on stdin is a request (``tokens``: int32 [batch, length] .npy; ``settings``: MaxText config KEY=VALUE
entries); each answer is one JSON line on stdout: ``{"ok": true}``, with ``split`` and ``arrays`` when sharded, or
``{"ok": false, "error": TRACEBACK}``.
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


def forward(items: str, tokens_file: str, logits_file: str, output_dir: str, settings_given: list[str],
            sharded: bool) -> dict:
    """MaxText's forward on the checkpoint at ``items``; the logits saved to ``logits_file``. With ``sharded``,
    how many of the restored arrays MaxText split over the mesh (``split`` of ``arrays``)."""
    import jax
    import numpy as np
    import maxtext
    from maxtext.common import checkpointing
    from maxtext.common.common_types import MODEL_MODE_TRAIN
    from maxtext.configs import pyconfig
    from maxtext.models import models
    from maxtext.utils import max_utils, maxtext_utils

    tokens = np.load(tokens_file).astype(np.int32)
    settings = {**CPU_SETTINGS, "max_target_length": tokens.shape[1], "max_prefill_predict_length": tokens.shape[1],
                "base_output_directory": output_dir, "load_parameters_path": items}
    if sharded:
        settings.update(ici_fsdp_parallelism=2, ici_tensor_parallelism=2, per_device_batch_size=0.25)
    base = Path(maxtext.__file__).parent / "configs" / "base.yml"
    argv = ["maxtext", str(base), *(f"{k}={v}" for k, v in settings.items()), *settings_given]
    config = pyconfig.initialize(argv)
    mesh = jax.sharding.Mesh(maxtext_utils.create_device_mesh(config), config.mesh_axes)
    model = models.transformer_as_linen(config, mesh, quant=None, model_mode=MODEL_MODE_TRAIN)
    boxed = maxtext_utils.get_abstract_param(model, config)
    abstract = max_utils.unbox_logicallypartioned(boxed)
    if sharded:  # MaxText's own logical-axis rules place every array on the mesh
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
    answer: dict = {"ok": True}
    if sharded:  # how many arrays MaxText actually split over the mesh (the caller checks it)
        placed = jax.tree_util.tree_leaves(params)
        answer.update(split=sum(any(axis is not None for axis in leaf.sharding.spec) for leaf in placed),
                      arrays=len(placed))
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    def apply(params, tokens, positions, segments):
        return model.apply(params, tokens, positions, decoder_segment_ids=segments, enable_dropout=False,
                           model_mode=MODEL_MODE_TRAIN)

    with mesh:  # compiled whole, as MaxText's own steps are: op by op, an unscanned hybrid model took 2-8x as long
        logits = jax.jit(apply)(params, tokens, positions, np.ones_like(tokens))
    if isinstance(logits, tuple):
        logits = logits[0]
    np.save(logits_file, np.asarray(logits, np.float32))
    return answer


def serve(sharded: bool) -> None:
    """Answer requests from stdin until it closes (``line_server``)."""
    from line_server import answer_lines  # this script's directory
    answer_lines(lambda request: forward(request["items"], request["tokens"], request["logits"],
                                         request["output_dir"], request["settings"], sharded))


def main() -> None:
    p = argparse.ArgumentParser(description="answer JSON requests from stdin (see the module's doc)")
    p.add_argument("--sharded", action="store_true",
                   help="restore onto MaxText's own sharding of a 4-device CPU mesh (fsdp=2 x tensor=2), as a "
                        "MaxText run on that mesh does, instead of whole arrays on one device")
    args = p.parse_args()
    if args.sharded:  # before JAX starts
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    serve(args.sharded)


if __name__ == "__main__":
    main()
