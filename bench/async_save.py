"""What a save stalls training with ``"async_save"``, against the synchronous save, with either snapshot (a fork of
the rank; host copies written by a thread), on the 246M benchmark model (hidden 1024, 16 layers, 16 query / 4 KV
heads, intermediate 2816, vocab 32000), TP=2, ZeRO-1, bf16, with the real engine (torchrun, gloo, CPU).

After two warm-up steps, ``--rounds`` rounds (each of the three first in turn), each of:

* a synchronous save (the same engine, ``deepspeed_ext_async_save`` switched off for it): its wall time;
* for each snapshot, a save in the background: the time ``save_checkpoint`` blocks (the stall), then training
  steps until it has committed: the steps taken meanwhile, their times, and the seconds from the save's return to
  its commit; the extra host memory: for the fork, the writer's private memory (the pages training rewrote while
  the writer lived, which the kernel copied), sampled from ``/proc/<writer>/smaps_rollup``; for the copies, the
  host buffers they are kept in (allocated once, reused by every later save);
* as many steps with no save in flight: the steps' own time, for the steps/s ratio.

Each save starts with the disk idle (``sync`` before it). Every number is the slowest rank's; medians, and the
medians of each round's own ratios, all measured in this one run. Before the rounds, each snapshot's files are
checked against a synchronous save of the same state, byte for byte.

    python bench/async_save.py                  # 246M, 5 rounds
    python bench/async_save.py --rounds 9
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import run_rank_workers  # noqa: E402
from maxtext_rss import model_arguments  # noqa: E402

#: The snapshots a save in the background can take (deepspeed_ext.config.SNAPSHOT_CHOICES).
SNAPSHOTS = ("fork", "copy")


class PrivateMemory:
    """The peak private memory (kB) of a process, and the CPU seconds it used, sampled every 20 ms on a thread
    until stopped."""

    def __init__(self, pid: int):
        self.pid, self.peak_kib, self.cpu_s, self._stop = pid, 0, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with open(f"/proc/{self.pid}/smaps_rollup") as rollup:
                    fields = {line.split(":")[0]: int(line.split()[1]) for line in rollup if "kB" in line}
                with open(f"/proc/{self.pid}/stat") as stat:
                    ticks = stat.read().rsplit(")", 1)[1].split()[11:13]  # utime, stime
                self.cpu_s = sum(int(tick) for tick in ticks) / os.sysconf("SC_CLK_TCK")
            except (OSError, ValueError, IndexError):
                return  # the writer has exited
            self.peak_kib = max(self.peak_kib, fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0))
            self._stop.wait(0.02)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak_kib


def worker(args: argparse.Namespace) -> None:
    """One rank of the measurement (under torchrun)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    import deepspeed_ext
    from deepspeed_ext.demo.models import batch, ds_config, finish_distributed
    from deepspeed_ext.runtime import ASYNC_SAVE_ATTR, PENDING_ATTR
    from deepspeed_ext.runtime.background_save import POOL_ATTR, SNAPSHOT_ATTR

    values = json.loads(Path(args.config).read_text())
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    model = AutoModelForCausalLM.from_config(config)
    world = int(os.environ["WORLD_SIZE"])
    engine, *_ = deepspeed_ext.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(tp=2, dp=world // 2, zero=1, dtype="bf16",
                                                           async_save=True))
    tokens = batch(1, 0, 1, vocab=config.vocab_size)

    def step() -> None:
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        engine.step()

    def slowest(seconds: float, op: str = "max") -> float:
        value = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return float(value)

    def timed(work) -> float:
        dist.barrier()
        start = time.perf_counter()
        work()
        return slowest(time.perf_counter() - start)

    def idle_disk() -> None:
        if dist.get_rank() == 0:
            os.sync()
        dist.barrier()

    for _ in range(2):
        step()
    out = Path(args.out)
    kinds = ("sync", *SNAPSHOTS)
    rows: dict[str, list[float]] = {"sync_save": [], "sync_cpu_s": []}
    for snapshot in SNAPSHOTS:
        rows.update({f"{snapshot}_{key}": [] for key in (
            "stall", "commit_after", "steps_during", "step_during", "step_alone", "mib", "writer_cpu_s")})
    # The files of each snapshot against a synchronous save of the same state (no step between the saves).
    setattr(engine, ASYNC_SAVE_ATTR, False)
    engine.save_checkpoint(str(out / "same" / "sync"), tag="step")
    setattr(engine, ASYNC_SAVE_ATTR, True)
    for snapshot in SNAPSHOTS:
        setattr(engine, SNAPSHOT_ATTR, snapshot)
        engine.save_checkpoint(str(out / "same" / snapshot), tag="step")
        deepspeed_ext.wait_for_saves(engine)
        if dist.get_rank() == 0:
            rows[f"{snapshot}_same_bytes"] = [_same_files(out / "same" / "sync" / "step",
                                                          out / "same" / snapshot / "step")]
    if dist.get_rank() == 0:
        shutil.rmtree(out / "same")
    for round_ in range(args.rounds):
        order = kinds[round_ % len(kinds):] + kinds[:round_ % len(kinds)]  # each first in turn
        for kind in order:
            idle_disk()
            if kind == "sync":
                setattr(engine, ASYNC_SAVE_ATTR, False)
                cpu = time.process_time()
                rows["sync_save"].append(timed(lambda: engine.save_checkpoint(str(out / f"sync{round_}"),
                                                                               tag="step")))
                rows["sync_cpu_s"].append(slowest(time.process_time() - cpu, "sum"))
                setattr(engine, ASYNC_SAVE_ATTR, True)
                continue
            setattr(engine, SNAPSHOT_ATTR, kind)
            rows[f"{kind}_stall"].append(timed(lambda: engine.save_checkpoint(str(out / f"{kind}{round_}"),
                                                                               tag="step")))
            returned = time.perf_counter()
            pending = getattr(engine, PENDING_ATTR)
            memory = PrivateMemory(pending.pid) if pending.pid is not None else None
            during = []
            while True:  # every rank agrees when the save is settled (the step's own collective check)
                start = time.perf_counter()
                step()
                during.append(slowest(time.perf_counter() - start))
                if not hasattr(engine, PENDING_ATTR):
                    break
            rows[f"{kind}_commit_after"].append(slowest(time.perf_counter() - returned))
            if memory is not None:  # the fork: the pages training rewrote while the writer lived
                rows[f"{kind}_mib"].append(slowest(memory.stop() / 1024, "sum"))
                rows[f"{kind}_writer_cpu_s"].append(slowest(memory.cpu_s, "sum"))
            else:  # the copies: the host buffers the pool keeps
                rows[f"{kind}_mib"].append(slowest(getattr(engine, POOL_ATTR).nbytes / 2**20, "sum"))
            rows[f"{kind}_steps_during"].append(len(during))
            rows[f"{kind}_step_during"].append(statistics.mean(during))
            alone = [timed(step) for _ in during]
            rows[f"{kind}_step_alone"].append(statistics.mean(alone))
        if dist.get_rank() == 0:
            for kind in kinds:
                shutil.rmtree(out / f"{kind}{round_}", ignore_errors=True)
        dist.barrier()
    if dist.get_rank() == 0:
        (out / "result.json").write_text(json.dumps(rows))
    finish_distributed()


def _same_files(sync: Path, background: Path) -> float:
    """1.0 if every file of the synchronous save is in the background one with the same bytes (the commit marker:
    the same but for its time), else 0.0."""
    names = sorted(p.name for p in sync.iterdir())
    same = names == sorted(p.name for p in background.iterdir())
    for name in names if same else []:
        left, right = (sync / name).read_bytes(), (background / name).read_bytes()
        if name == "deepspeed_ext.commit.json":
            left_json, right_json = json.loads(left), json.loads(right)
            left_json.pop("committed_at"), right_json.pop("committed_at")
            same = same and left_json == right_json
        else:
            same = same and left == right
        if not same:
            print(f"differs from the synchronous save's: {background / name}", flush=True)
            return 0.0
    return float(same)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(p)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    rows = run_rank_workers(args, __file__, "async_save")
    median = {key: statistics.median(values) for key, values in rows.items() if values}

    def paired(top: str, bottom: str) -> tuple[float, float, float]:
        ratios = sorted(a / b for a, b in zip(rows[top], rows[bottom], strict=True))
        return statistics.median(ratios), ratios[0], ratios[-1]

    print(f"\nasync_save, {args.layers}-layer Llama (hidden {args.hidden}), TP=2 ZeRO-1 bf16, {args.rounds} rounds "
          "(median s, slowest rank)")
    print(f"{'save_checkpoint, synchronous':46} {median['sync_save']:8.3f}   "
          f"(min {min(rows['sync_save']):.3f}, max {max(rows['sync_save']):.3f})")
    print(f"{'  its CPU s, both ranks':46} {median['sync_cpu_s']:8.3f}")
    for snapshot in SNAPSHOTS:
        stall, stall_low, stall_high = paired(f"{snapshot}_stall", "sync_save")
        slower, slower_low, slower_high = paired(f"{snapshot}_step_during", f"{snapshot}_step_alone")
        print(f"async_save, the {snapshot} snapshot")
        print(f"{'  save_checkpoint: the stall':46} {median[f'{snapshot}_stall']:8.3f}   {stall:.1%} of the "
              f"synchronous save (median of the rounds' own ratios; {stall_low:.1%}..{stall_high:.1%})")
        print(f"{'  committed, after the save returned':46} {median[f'{snapshot}_commit_after']:8.3f}   "
              f"({median[f'{snapshot}_steps_during']:.0f} training step(s) meanwhile)")
        print(f"{'  a training step, no save in flight':46} {median[f'{snapshot}_step_alone']:8.3f}")
        print(f"{'  a training step while the writer writes':46} {median[f'{snapshot}_step_during']:8.3f}   "
              f"{slower:.2f}x the step's time ({slower_low:.2f}..{slower_high:.2f})")
        what = "pages copied for the forked writers" if snapshot == "fork" else "the host buffers (pool)"
        print(f"{'  extra host memory, both ranks, MiB':46} {median[f'{snapshot}_mib']:8.0f}   ({what}; max "
              f"{max(rows[f'{snapshot}_mib']):.0f})")
        if rows[f"{snapshot}_writer_cpu_s"]:
            print(f"{'  CPU s of the forked writers (last sample)':46} "
                  f"{statistics.median(rows[f'{snapshot}_writer_cpu_s']):8.3f}")
        print(f"{'  files byte-identical to the synchronous save':46} {bool(rows[f'{snapshot}_same_bytes'][0])}")
    print(json.dumps({"median_s": median, "rounds": rows}))


if __name__ == "__main__":
    main()
