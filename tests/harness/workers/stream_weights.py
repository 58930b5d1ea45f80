"""The demo's training run (``deepspeed_ext.demo.train``) with a weight update after each save: every rank sends
the engine's weights to the receivers of a weight group (``deepspeed_ext.send_weights``), and iterates
``deepspeed_ext.hf_weights``, whose tensors rank 0 writes out. Run under torchrun.

    --group HOST:PORT   the weight group (training rank 0 hosts its store); --receivers N of them
    --hf-weights DIR    after each save, rank 0 writes hf_weights(engine) to DIR/step<S>.pt (every rank iterates)
    --hf-names NAMES    hf_weights' names (hf, files)
    --hf-adapters DIR   after each save, rank 0 writes hf_weights(engine, adapters="only") to DIR/step<S>.pt
    --adapters-only     send a peft model's adapters alone
    --adapters-group HOST:PORT   also send the adapters alone to the receivers of this second group
    --versions V,V,...  the version of each update in turn (default: deepspeed_ext's count)
    --bucket-bytes N    the buckets of both
    --die-at STEP       the last rank leaves abruptly (os._exit) in the middle of the update after that step's save
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--group", required=True)
    parser.add_argument("--receivers", type=int, default=1)
    parser.add_argument("--hf-weights")
    parser.add_argument("--hf-names", default="hf")
    parser.add_argument("--hf-adapters")
    parser.add_argument("--adapters-only", action="store_true")
    parser.add_argument("--adapters-group")
    parser.add_argument("--versions", default="")
    parser.add_argument("--bucket-bytes", type=int, default=32 << 20)
    parser.add_argument("--die-at", type=int)
    probes, rest = parser.parse_known_args()

    import torch.distributed as dist

    import deepspeed_ext
    from deepspeed_ext.demo.train import Hooks, main as train_main
    from deepspeed_ext.weights import engine_side
    host, port = probes.group.rsplit(":", 1)
    groups: dict[str, Any] = {}
    versions = [int(v) for v in probes.versions.split(",") if v]

    def after_save(engine: Any, step: int) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        if "group" not in groups:
            groups["group"] = deepspeed_ext.weight_group(host, int(port), senders=world, receivers=probes.receivers,
                                                         rank=rank, timeout=120)
        if probes.die_at == step and rank == world - 1:
            packed = engine_side.pack

            def pack_then_die(bucket: Any, rank: int, local: Any) -> Any:
                if getattr(pack_then_die, "calls", 0) >= 1:
                    sys.stdout.flush()
                    os._exit(17)  # mid-update, after one bucket is out
                pack_then_die.calls = 1  # type: ignore[attr-defined]
                return packed(bucket, rank, local)
            engine_side.pack = pack_then_die  # type: ignore[assignment]
        deepspeed_ext.send_weights(engine, groups["group"], adapters_only=probes.adapters_only,
                                   bucket_bytes=probes.bucket_bytes, version=versions.pop(0) if versions else None)
        if probes.adapters_group:
            if "adapters" not in groups:
                adapters_host, adapters_port = probes.adapters_group.rsplit(":", 1)
                groups["adapters"] = deepspeed_ext.weight_group(adapters_host, int(adapters_port), senders=world,
                                                                rank=rank, timeout=120)
            deepspeed_ext.send_weights(engine, groups["adapters"], adapters_only=True, bucket_bytes=probes.bucket_bytes)
        for directory, adapters in ((probes.hf_weights, "merge"), (probes.hf_adapters, "only")):
            if not directory:
                continue
            weights = {name: tensor.clone() for name, tensor in deepspeed_ext.hf_weights(
                engine, names=probes.hf_names, adapters=adapters, bucket_bytes=probes.bucket_bytes)}
            if rank == 0:
                Path(directory).mkdir(parents=True, exist_ok=True)
                torch.save(weights, Path(directory) / f"step{step}.pt")

    train_main(rest, Hooks(after_save=after_save))


if __name__ == "__main__":
    main()
