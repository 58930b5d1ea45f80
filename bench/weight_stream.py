"""Weight updates from a live engine to a receiver outside the training job (``send_weights`` /
``receive_weights``), against ``torch.distributed.broadcast`` of the same bytes: the 246M benchmark Llama (hidden
1024, 16 layers, 16 query / 4 KV heads, intermediate 2816, vocab 32000) or a 1B shape (``--hidden 2048 --layers
16 --intermediate 5632``), AutoTP TP=2, ZeRO-1, bf16, two training ranks (torchrun, gloo, CPU) and one receiver
process holding a transformers model of the same config, which each update loads in place.

Paired rounds, in alternating order, each timed on the receiver from a start signal to its last byte in place:

* **update**: ``send_weights`` on both ranks (each sends the pieces it holds), ``receive_weights(group, model)``;
* **floor, one broadcast**: training rank 0 broadcasts one buffer of the update's bytes to the receiver (the
  issue's floor: ``torch.distributed.broadcast`` of the same bytes);
* **floor, per rank**: each training rank broadcasts a buffer of its own share at once, over the same groups as the
  update (the floor of the update's own parallel shape, no packing, naming or loading);
* **floor, same messages**: each training rank sends the update's messages (its large pieces one each, small ones
  packed) and nothing else: what the update costs beyond its messages is what the receiver does with them.

The memory each process gains during an update (peak RSS over the RSS before it: bucket buffers, assembled
tensors) is reported per rank. Medians and spreads (min-max) over the rounds, ratios taken per round.

    python bench/weight_stream.py                                               # 246M, 5 rounds
    python bench/weight_stream.py --hidden 2048 --layers 16 --intermediate 5632   # 1B
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import llama_config  # noqa: E402
from maxtext_rss import model_arguments  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("update", "floor_one", "floor_ranks", "floor_pieces")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return _status_kib("VmRSS")


def _order(round_: int) -> tuple[str, ...]:
    return KINDS if round_ % 2 == 0 else tuple(reversed(KINDS))


def worker(args: argparse.Namespace) -> None:
    """A training rank (under torchrun)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    import deepspeed_ext
    from deepspeed_ext.demo.models import ds_config, finish_distributed
    from deepspeed_ext.weights.engine_side import engine_plan

    values = json.loads(Path(args.config).read_text())
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(values.pop("model_type"), **values))
    engine, *_ = deepspeed_ext.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(tp=args.tp, dp=2 // args.tp, zero=1, dtype="bf16"))
    del model
    rank = dist.get_rank()
    group = deepspeed_ext.weight_group("127.0.0.1", args.port, senders=2, rank=rank, timeout=600)
    plan = engine_plan(engine)
    shares = [sum(p.numel * t.dtype.itemsize for t in plan.tensors for p in t.pieces if p.owner == r) for r in (0, 1)]
    total = sum(shares)
    # The floors send real bytes: memory never written maps to one zero page, which the kernel would read from
    # the cache over and over, a floor no model's weights could reach.
    one = torch.randint(0, 256, (total if rank == 0 else 0, ), dtype=torch.uint8)
    mine = torch.randint(0, 256, (shares[rank], ), dtype=torch.uint8)
    gains: list[int] = []
    # The update's own messages (each large piece from where the rank keeps it, small ones packed), with nothing
    # else (floor_pieces).
    from deepspeed_ext.weights.engine_side import local_tensors, own_values
    from deepspeed_ext.weights.plan import buckets_of, pack
    local = local_tensors(engine)
    messages = [m for bucket in buckets_of(plan.tensors, args.bucket_bytes) for r in (0, 1) for m in bucket.messages(r)]
    mine_pieces = [own_values(local, *m[0]) if len(m) == 1 else pack([own_values(local, t, p) for t, p in m])
                   for m in messages if m[0][1].owner == rank]
    sizes = [torch.tensor([sum(p.numel * t.dtype.itemsize for t, p in m) for m in messages if m[0][1].owner == r],
                          dtype=torch.int64) for r in (0, 1)]
    if rank == 0:
        group.broadcast(0, torch.tensor([len(sizes[0]), len(sizes[1])], dtype=torch.int64)).wait()
        for r in (0, 1):
            group.broadcast(0, sizes[r]).wait()
    for round_ in range(args.rounds):
        for kind in _order(round_):
            dist.barrier()
            if rank == 0:
                # What comes next, and the sizes of the floors' buffers.
                group.broadcast(0, torch.tensor([KINDS.index(kind), *shares], dtype=torch.int64)).wait()
            if kind == "update":
                before = _reset_peak()
                deepspeed_ext.send_weights(engine, group, bucket_bytes=args.bucket_bytes)
                gains.append(_status_kib("VmHWM") - before)
            elif kind == "floor_one":
                if rank == 0:
                    group.broadcast(0, one).wait()
            elif kind == "floor_ranks":
                group.broadcast(rank, mine).wait()
            else:
                works = [group.broadcast(rank, values) for values in mine_pieces]
                for work in works:
                    work.wait()
    gathered: list = [None, None]
    dist.all_gather_object(gathered, max(gains))
    if rank == 0:
        Path(args.out, "senders.json").write_text(json.dumps({"shares": shares, "total": total,
                                                              "peak_gain_kib": gathered}))
    finish_distributed()


def receiver(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import deepspeed_ext
    values = json.loads(Path(args.config).read_text())
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(values.pop("model_type"), **values),
                                             dtype=torch.bfloat16).eval()
    group = deepspeed_ext.weight_group("127.0.0.1", args.port, senders=2, receiver=0, timeout=600)
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    gains: list[int] = []
    buffers: dict[int, torch.Tensor] = {}
    counts = torch.empty(2, dtype=torch.int64)
    group.broadcast(0, counts).wait()
    sizes = [torch.empty(int(counts[r]), dtype=torch.int64) for r in (0, 1)]
    for r in (0, 1):
        group.broadcast(0, sizes[r]).wait()
    # Every floor's buffers written once before the first round, as the model's weights are: memory's first touch
    # (page faults) is no part of a broadcast.
    piece_buffers = {r: [torch.zeros(int(n), dtype=torch.uint8) for n in sizes[r]] for r in (0, 1)}
    for _ in range(args.rounds * len(KINDS)):
        signal = torch.empty(3, dtype=torch.int64)
        group.broadcast(0, signal).wait()
        kind, shares = KINDS[int(signal[0])], [int(signal[1]), int(signal[2])]
        if not buffers:
            buffers = {-1: torch.zeros(sum(shares), dtype=torch.uint8),
                       **{sender: torch.zeros(shares[sender], dtype=torch.uint8) for sender in (0, 1)}}
        start = time.perf_counter()
        if kind == "update":
            before = _reset_peak()
            deepspeed_ext.receive_weights(group, model)
            gains.append(_status_kib("VmHWM") - before)
        elif kind == "floor_one":
            group.broadcast(0, buffers[-1]).wait()
        elif kind == "floor_ranks":
            works = [group.broadcast(sender, buffers[sender]) for sender in (0, 1)]
            for work in works:
                work.wait()
        else:
            works = [group.broadcast(sender, buffer) for sender in (0, 1) for buffer in piece_buffers[sender]]
            for work in works:
                work.wait()
        times[kind].append(time.perf_counter() - start)
    Path(args.out, "receiver.json").write_text(json.dumps({"times": times, "peak_gain_kib": max(gains)}))


def main() -> None:
    p = argparse.ArgumentParser()
    model_arguments(p)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--bucket-bytes", type=int, default=32 << 20)
    p.add_argument("--tp", type=int, default=2, choices=[1, 2], help="AutoTP degree of the two training ranks (1: DP=2, "
                   "each rank sending the half of the replicated tensors its plan gives it)")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--receiver", action="store_true")
    p.add_argument("--config")
    p.add_argument("--out")
    p.add_argument("--port", type=int)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.receiver:
        receiver(args)
        return
    work = Path(args.workdir) / f"weight_stream_h{args.hidden}_l{args.layers}"
    work.mkdir(parents=True, exist_ok=True)
    config = llama_config(args)
    (work / "config.json").write_text(json.dumps(config))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    common = ["--config", str(work / "config.json"), "--out", str(work), "--port", str(port), "--rounds",
              str(args.rounds), "--bucket-bytes", str(args.bucket_bytes), "--tp", str(args.tp)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    receiving = subprocess.Popen([sys.executable, __file__, "--receiver", *common], cwd=ROOT, env=env)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
                    "--worker", *common], check=True, cwd=ROOT, env=env)
    if receiving.wait() != 0:
        raise SystemExit("the receiver failed")
    senders = json.loads((work / "senders.json").read_text())
    received = json.loads((work / "receiver.json").read_text())
    report(args, senders, received)


def report(args: argparse.Namespace, senders: dict, received: dict) -> None:
    times = received["times"]
    total = senders["total"]
    print(f"\nweight_stream: {args.layers}-layer Llama (hidden {args.hidden}, intermediate {args.intermediate}), "
          f"TP={args.tp} DP={2 // args.tp} ZeRO-1 bf16, {total / 2**20:.0f} MiB an update (ranks: {', '.join(f'{s / 2**20:.0f}' for s in senders['shares'])}"
          f" MiB), bucket {args.bucket_bytes / 2**20:.0f} MiB, {args.rounds} rounds, gloo on loopback, CPU")
    for kind in KINDS:
        values = times[kind]
        print(f"  {kind:12s} median {statistics.median(values):.3f} s  ({min(values):.3f}-{max(values):.3f})  "
              f"{total / statistics.median(values) / 2**30:.2f} GiB/s")
    for floor in ("floor_one", "floor_ranks", "floor_pieces"):
        ratios = [f / u for f, u in zip(times[floor], times["update"])]
        print(f"  update vs {floor}: {statistics.median(ratios):.2f}x of the floor's rate "
              f"({min(ratios):.2f}-{max(ratios):.2f})")
    print(f"  peak RSS gained during an update: training ranks "
          f"{', '.join(f'{kib / 1024:.0f}' for kib in senders['peak_gain_kib'])} MiB, receiver "
          f"{received['peak_gain_kib'] / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
