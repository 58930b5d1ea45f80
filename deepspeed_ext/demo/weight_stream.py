"""The weight-streaming demo: the tiny model trains on two ranks (AutoTP TP=2 by default) and after each step sends
its weights to a receiver process outside the training job, which loads them into a transformers model of the same
config and checks them against what ``hf_weights`` gave the training ranks. No downloads.

    python -m deepspeed_ext.demo.weight_stream                      # TP=2, ZeRO-1, bf16, 3 updates
    python -m deepspeed_ext.demo.weight_stream --zero 3 --tp 1      # ZeRO-3 over two ranks
    python -m deepspeed_ext.demo.weight_stream --family mixtral --tp 1 --ep 2

See docs/weight-streaming.md.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def _trainer(args: argparse.Namespace, rest: list[str]) -> None:
    """A training rank (under torchrun): the demo's training run, an update after each step."""
    import torch.distributed as dist

    import deepspeed_ext
    from deepspeed_ext.demo.train import Hooks, main

    groups: dict[str, Any] = {}

    def after_step(engine: Any, step: int) -> None:
        if "group" not in groups:  # every training rank joins; rank 0 hosts the store
            groups["group"] = deepspeed_ext.weight_group("127.0.0.1", args.port, senders=dist.get_world_size(),
                                                         rank=dist.get_rank())
        version = deepspeed_ext.send_weights(engine, groups["group"])
        # The same weights on every training rank, as an evaluation loop would take them.
        sums = {name: float(tensor.float().sum()) for name, tensor in deepspeed_ext.hf_weights(engine)}
        if dist.get_rank() == 0:
            Path(args.work, f"sent_v{version}.json").write_text(json.dumps(sums))

    main(rest, Hooks(after_step=after_step))


def _receiver(args: argparse.Namespace) -> None:
    """The inference side: a transformers model loaded in place by each update."""
    import torch
    from transformers import AutoModelForCausalLM

    import deepspeed_ext
    from deepspeed_ext.demo.models import tiny_config
    model = AutoModelForCausalLM.from_config(tiny_config(args.family), dtype=torch.bfloat16).eval()
    group = deepspeed_ext.weight_group("127.0.0.1", args.port, senders=2, receiver=0)
    for _ in range(args.steps):
        version = deepspeed_ext.receive_weights(group, model)
        sums = {name: float(tensor.float().sum()) for name, tensor in model.state_dict().items()}
        Path(args.work, f"received_v{version}.json").write_text(json.dumps(sums))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="llama")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--role", choices=["trainer", "receiver"], help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args, rest = p.parse_known_args(argv)
    if args.role == "trainer":
        _trainer(args, ["--family", args.family, "--steps", str(args.steps), *rest])
        return
    if args.role == "receiver":
        _receiver(args)
        return
    from deepspeed_ext.demo.runner import child_env, run_logged
    rest = rest or ["--tp", "2", "--zero", "1"]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="deepspeed_ext_weights_") as work:
        common = ["--family", args.family, "--steps", str(args.steps), "--port", str(port), "--work", work]
        print(f"1/2 training {args.family} on 2 ranks ({' '.join(rest)}), an update after each of {args.steps} steps",
              flush=True)
        receiver = subprocess.Popen([sys.executable, "-m", "deepspeed_ext.demo.weight_stream", "--role",
                                     "receiver", *common], env=child_env())
        run_logged([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                    "deepspeed_ext.demo.weight_stream", "--role", "trainer", *common, *rest], Path(work) / "train.log")
        if receiver.wait(timeout=300) != 0:
            raise SystemExit("deepspeed-ext weight-stream demo: the receiver failed")
        print("2/2 the receiver's model against hf_weights on the training ranks", flush=True)
        for version in range(1, args.steps + 1):
            sent = json.loads(Path(work, f"sent_v{version}.json").read_text())
            received = json.loads(Path(work, f"received_v{version}.json").read_text())
            same = all(received[name] == value for name, value in sent.items())
            print(f"      update {version}: {len(sent)} tensors, {'equal' if same else 'DIFFERENT'}", flush=True)
            if not same:
                raise SystemExit(f"deepspeed-ext weight-stream demo: update {version} differs from hf_weights")


if __name__ == "__main__":
    main()
