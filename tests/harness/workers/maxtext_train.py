"""MaxText's own training on a checkpoint: MaxText's train-loop setup (``train_utils.setup_train_loop``: the model,
the optimizer and the restore through MaxText's own checkpoint code, ``load_full_state_path`` or
``load_parameters_path``), its jitted ``train_step`` on given batches, and its own checkpoint manager saving the full
state after every step, as ``train.py``'s loop does with ``checkpoint_period=1``.

Runs in .venv-maxtext, on CPU, one run per line of stdin (importing JAX and MaxText is most of a short run); each
answer is one JSON line on stdout, ``{"ok": true}`` or ``{"ok": false, "error": TRACEBACK}``:

    .venv-maxtext/bin/python maxtext_train.py < REQUESTS

REQUEST: ``{"settings": ["model_name=llama2-7b", ...], "batches": "batches.npz", "output_dir": DIR,
"result": "result.json"}``. ``settings`` are MaxText config KEY=VALUE entries (the model's, the optimizer's, the
load path); ``batches.npz`` holds ``inputs`` and ``targets``, int32 [steps, batch, length]: one MaxText batch per
step, positions 0.. and one segment per row. The checkpoints go to ``DIR/<run_name>/checkpoints/<step>/items``,
labelled as MaxText labels them (the state after training step ``s``, 0-based, is saved as ``s``).
The result: ``{"start_step", "losses": [...], "checkpoints": [dir, ...]}``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

#: Settings every run takes: CPU, fp32, exact matmuls, plain dot-product attention, synchronous checkpoints after
#: every step, and MaxText's synthetic data source (its batches are never used: the request's are).
CPU_SETTINGS = {
    "enable_checkpointing": True, "async_checkpointing": False, "checkpoint_period": 1, "override_model_config": True,
    "attention": "dot_product", "skip_jax_distributed_system": True, "run_name": "deepspeed_ext_test",
    "dtype": "float32", "weight_dtype": "float32", "matmul_precision": "highest", "sparse_matmul": False,
    "megablox": False, "enable_dropout": False, "float32_qk_product": True, "float32_logits": True,
    "dataset_type": "synthetic", "enable_goodput_recording": False, "monitor_goodput": False,
}


def train(request: dict) -> dict:
    import jax
    import numpy as np
    import maxtext
    from flax import nnx
    from maxtext.common import checkpointing
    from maxtext.configs import pyconfig
    from maxtext.trainers.pre_train import train as maxtext_train
    from maxtext.utils import sharding, train_utils
    from flax.core.spmd import logical_axis_rules

    batches = np.load(request["batches"])
    inputs, targets = batches["inputs"].astype(np.int32), batches["targets"].astype(np.int32)
    steps, rows, length = inputs.shape
    settings = {**CPU_SETTINGS, "per_device_batch_size": rows, "max_target_length": length,
                "max_prefill_predict_length": length, "base_output_directory": request["output_dir"]}
    base = Path(maxtext.__file__).parent / "configs" / "base.yml"
    argv = ["maxtext", str(base), *(f"{k}={v}" for k, v in settings.items()), *request["settings"]]
    config = pyconfig.initialize(argv)
    (_, checkpoint_manager, state_mesh_shardings, _, mesh, _, data_iterator, _, _, _,
     state) = train_utils.setup_train_loop(config, None)
    start_step = maxtext_train.get_first_step(None, state)
    model, state = nnx.split(state)
    params_shardings, state_mesh_shardings = sharding.maybe_update_params_sharding_with_opt(config,
                                                                                           state_mesh_shardings)
    p_train_step, _ = train_utils.jit_train_and_eval_step(config, model, mesh, state, state_mesh_shardings,
                                                          maxtext_train.train_step, maxtext_train.eval_step, None,
                                                          params_shardings)
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length))
    segments = np.ones((rows, length), np.int32)
    losses, saved = [], []
    for index in range(steps):
        batch = {"inputs": inputs[index], "inputs_position": positions, "inputs_segmentation": segments,
                 "targets": targets[index], "targets_position": positions, "targets_segmentation": segments}
        with jax.set_mesh(mesh), logical_axis_rules(config.logical_axis_rules):
            state, metrics = p_train_step(state, batch)
        losses.append(float(metrics["scalar"]["learning/loss"]))
        step = start_step + index
        checkpointing.maybe_save_checkpoint(checkpoint_manager, state, config, data_iterator, step)
        saved.append(str(Path(config.checkpoint_dir) / str(step)))
    checkpointing.wait_until_finished(checkpoint_manager)
    checkpoint_manager.close()  # its threads end with the run, which a served process outlives
    return {"start_step": start_step, "losses": losses, "checkpoints": saved}


def main() -> None:
    import jax

    from line_server import answer_lines  # this script's directory
    jax.config.update("jax_default_matmul_precision", "highest")

    def run(request: dict) -> dict:
        Path(request["result"]).write_text(json.dumps(train(request)))
        return {"ok": True}

    answer_lines(run)


if __name__ == "__main__":
    main()
