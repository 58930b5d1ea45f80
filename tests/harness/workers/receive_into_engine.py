"""A DeepSpeed engine of another job as the receiver of weight updates (``receive_weights(group, engine)``): each of
its ranks is a receiver and keeps its own part; after each update it saves a checkpoint tagged ``v<version>``.
Run under torchrun.

    --group HOST:PORT --senders N --updates U --save-dir DIR  + the demo's --family / --tp / --zero / --dtype
"""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--group", required=True)
    parser.add_argument("--senders", type=int, required=True)
    parser.add_argument("--updates", type=int, required=True)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--family", default="llama")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--dtype", default="bf16")
    args = parser.parse_args()

    import os

    import torch.distributed as dist

    import deepspeed_ext
    from deepspeed_ext.demo.models import build_model, client_optimizer, ds_config, finish_distributed
    world = int(os.environ["WORLD_SIZE"])
    model = build_model(args.family, seed=7)  # other weights than the trainer's: the updates replace them
    engine, *_ = deepspeed_ext.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(tp=args.tp, dp=world // args.tp, zero=args.zero,
                                                           dtype=args.dtype, family=args.family),
                                          optimizer=client_optimizer("adam", model.parameters()))
    host, port = args.group.rsplit(":", 1)
    group = deepspeed_ext.weight_group(host, int(port), senders=args.senders, receivers=world,
                                       receiver=dist.get_rank(), timeout=120)
    for _ in range(args.updates):
        version = deepspeed_ext.receive_weights(group, engine)
        engine.save_checkpoint(args.save_dir, tag=f"v{version}")
    finish_distributed()


if __name__ == "__main__":
    main()
