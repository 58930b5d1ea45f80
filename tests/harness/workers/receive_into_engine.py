"""A DeepSpeed engine of another job as the receiver of weight updates (``receive_weights(group, engine)``): each of
its ranks is a receiver and keeps its own part; after each update it saves a checkpoint tagged ``v<version>``.
Run under torchrun.

    --group HOST:PORT --senders N --updates U --save-dir DIR  + the demo's --family / --tp / --zero / --dtype
    [--receivers R --first-receiver I]   the group's receivers, of which this job's ranks are I, I+1, ...

An update refused is written to DIR/refused.rank<r>.txt and the next awaited; once the group is given up (an update
cut short), the job ends.
"""

from __future__ import annotations

import argparse
from pathlib import Path


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
    parser.add_argument("--receivers", type=int)
    parser.add_argument("--first-receiver", type=int, default=0)
    args = parser.parse_args()

    import os

    import torch.distributed as dist

    import deepspeed_ext
    from deepspeed_ext.demo.models import build_model, client_optimizer, ds_config
    from deepspeed_ext.errors import CheckpointError
    world = int(os.environ["WORLD_SIZE"])
    model = build_model(args.family, seed=7)  # other weights than the trainer's: the updates replace them
    engine, *_ = deepspeed_ext.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(tp=args.tp, dp=world // args.tp, zero=args.zero,
                                                           dtype=args.dtype, family=args.family),
                                          optimizer=client_optimizer("adam", model.parameters()))
    host, port = args.group.rsplit(":", 1)
    group = deepspeed_ext.weight_group(host, int(port), senders=args.senders, receivers=args.receivers or world,
                                       receiver=args.first_receiver + dist.get_rank(), timeout=120)
    Path(args.save_dir).mkdir(parents=True, exist_ok=True)
    for _ in range(args.updates):
        try:
            version = deepspeed_ext.receive_weights(group, engine)
        except CheckpointError as exc:
            with open(f"{args.save_dir}/refused.rank{dist.get_rank()}.txt", "a") as handle:
                handle.write(f"{exc}\n")
            if group.broken is not None:
                break
            continue
        engine.save_checkpoint(args.save_dir, tag=f"v{version}")
    import sys
    sys.stdout.flush()
    os._exit(0)  # the senders may be gone: no barrier at the end (finish_distributed would wait on one)


if __name__ == "__main__":
    main()
