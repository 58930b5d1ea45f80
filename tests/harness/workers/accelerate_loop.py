"""An Accelerate training loop (no Trainer) with DeepSpeed AutoTP and deepspeed-ext enabled from the config.

Run under torchrun (``DS_ACCELERATOR=cpu``), one process per TP rank (DP=1), so the global batch is the same
at every TP degree. Saves with ``accelerator.save_state`` and resumes with ``accelerator.load_state``.

    torchrun --nproc_per_node 2 accelerate_loop.py --tp 2 --steps 6 --save-at 3 --save-dir STATE --result r.json
    torchrun --nproc_per_node 1 accelerate_loop.py --tp 1 --steps 6 --load-dir STATE --result r1.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--zero", type=int, default=1)
    p.add_argument("--family", default="llama")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-at", type=int)
    p.add_argument("--save-dir")
    p.add_argument("--load-dir")
    p.add_argument("--async-save", action="store_true", help='"async_save": true in the deepspeed_ext section')
    p.add_argument("--result", required=True)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    import deepspeed_ext
    deepspeed_ext.enable()  # the one added line

    import torch
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    from deepspeed_ext.demo.models import GLOBAL_BATCH, batch, build_model, finish_distributed, tensor_parallel_section

    ds_config = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH,  # DP=1: the global batch
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": args.zero},
        "tensor_parallel": tensor_parallel_section(args.family, args.tp),
        "steps_per_print": 1000,
        "deepspeed_ext": {"universal_checkpoint": {"enabled": True}, "async_save": args.async_save},
    }
    accelerator = Accelerator(mixed_precision="bf16", deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config))
    model = build_model(args.family)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    if args.load_dir:
        accelerator.load_state(args.load_dir)
    losses: dict[int, float] = {}
    while model.global_steps < args.steps:
        step = model.global_steps + 1
        tokens = batch(step, 0, 1)
        loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = loss.item()
        if args.save_dir and step == args.save_at:
            accelerator.save_state(args.save_dir)
    if accelerator.is_main_process:
        Path(args.result).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result).write_text(json.dumps({"tp": args.tp, "losses": losses}))
    finish_distributed()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
