"""A training script as a user writes one, ending as such scripts end: it returns, with the process group still up
(no destroy_process_group, no os._exit). ZeRO-3 with a secondary partition (``zero_hpz_partition_size``), trained
3 steps and saved through deepspeed_ext.initialize; run under torchrun.

    save_and_exit.py SAVE_DIR MARKER_DIR

An exit handler registered before anything else (so it runs after every other, atexit being last-in first-out)
writes ``MARKER_DIR/rank<R>`` saying whether the process group was still up by then.
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path


def _say_how_it_ends(marker_dir: Path) -> None:
    import torch.distributed as dist
    rank = os.environ.get("RANK", "0")
    (marker_dir / f"rank{rank}").write_text("process group up" if dist.is_initialized() else "process group ended")


def main() -> None:
    save_dir, marker_dir = Path(sys.argv[1]), Path(sys.argv[2])
    marker_dir.mkdir(parents=True, exist_ok=True)
    atexit.register(_say_how_it_ends, marker_dir)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch.distributed as dist

    import deepspeed_ext
    from deepspeed_ext.demo.models import batch, build_model, ds_config
    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    model = build_model("llama")
    config = ds_config(tp=1, dp=world, zero=3, dtype="bf16")
    config["zero_optimization"]["zero_hpz_partition_size"] = 2
    engine, *_ = deepspeed_ext.initialize(model=model, model_parameters=model.parameters(), config=config)
    for step in range(1, 4):
        tokens = batch(step, dist.get_rank(), world)
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        engine.step()
    engine.save_checkpoint(str(save_dir))


if __name__ == "__main__":
    main()
