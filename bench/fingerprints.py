"""What resume fingerprints cost, at save and at load, on the 246M benchmark model (the one bench/convert.py uses:
hidden 1024, 16 layers, 16 query / 4 KV heads, intermediate 2816, vocab 32000), TP=2, ZeRO-1, bf16, with the real
engine (torchrun, gloo, CPU).

After one training step, ``--rounds`` rounds, alternating the order, of:

* ``save_checkpoint`` as DeepSpeed alone does it (the engine's own method, unhooked) and with deepspeed-ext
  (UC metadata + fingerprints: DeepSpeed's files written by zipsave, the same bytes, each rank's sums read from
  the blocks as they are written, then one all-reduce of 3 float64 numbers per parameter state; every file
  fsynced and the tag committed by its marker); and, for comparison, with deepspeed-ext as before zipsave
  (torch.save, the sums on a thread during it), DeepSpeed alone followed by an fsync of its files (the
  durability deepspeed-ext's save has), and deepspeed-ext with every fsync and early writeback skipped (what
  durability costs);
* the fingerprint computation alone, not overlapped with anything (``engine_fingerprints``);
* ``load_checkpoint`` of that save through the hook, which checks the fingerprints, and the check alone.

Every number is the slowest rank's wall time; medians are reported with the ratios, measured in this one run.

    python bench/fingerprints.py                 # 246M, 3 rounds
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import run_rank_workers  # noqa: E402
from maxtext_rss import model_arguments  # noqa: E402



def worker(args: argparse.Namespace) -> None:
    """One rank of the measurement (under torchrun)."""
    import torch
    import torch.distributed as dist

    import deepspeed_ext
    from deepspeed_ext.checkpoint.engine_fingerprints import engine_fingerprints
    from deepspeed_ext.demo.models import batch, ds_config, finish_distributed
    from deepspeed_ext.runtime import check_resume_fingerprints
    from transformers import AutoConfig, AutoModelForCausalLM

    values = json.loads(Path(args.config).read_text())
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    model = AutoModelForCausalLM.from_config(config)
    world = int(os.environ["WORLD_SIZE"])
    engine, *_ = deepspeed_ext.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(tp=2, dp=world // 2, zero=1, dtype="bf16"))
    tokens = batch(1, 0, 1, vocab=config.vocab_size)
    engine.backward(engine(input_ids=tokens, labels=tokens).loss)
    engine.step()
    plain_save = engine.save_checkpoint.__wrapped__  # DeepSpeed's own, without deepspeed-ext's hook
    import deepspeed_ext.runtime.save as runtime_save  # the save hook's choice of zipsave
    can_fuse = runtime_save.can_fuse

    def thread_save(*args, **kwargs):  # deepspeed-ext's save as it was before zipsave: the sums on a thread
        runtime_save.can_fuse = lambda engine: False
        try:
            return engine.save_checkpoint(*args, **kwargs)
        finally:
            runtime_save.can_fuse = can_fuse

    def synced_plain_save(*args, **kwargs):  # DeepSpeed alone, then its files fsynced: the durability ours has
        from deepspeed_ext.checkpoint import durable
        result = plain_save(*args, **kwargs)
        if dist.get_rank() == 0:
            durable.fsync_tree(os.path.join(args[0], kwargs["tag"]))
        dist.barrier()
        return result

    def unsynced_save(*args, **kwargs):  # deepspeed-ext's save, nothing made durable: what durability costs
        from deepspeed_ext.checkpoint import durable
        own_fsync, own_writeback = os.fsync, durable.start_writeback
        os.fsync = lambda fd: None
        durable.start_writeback = lambda fd, offset, length: None
        try:
            return engine.save_checkpoint(*args, **kwargs)
        finally:
            os.fsync, durable.start_writeback = own_fsync, own_writeback

    cpu: dict[str, list[float]] = {}

    def timed(work, cpu_key: str | None = None) -> float:
        """The slowest rank's wall time; with ``cpu_key``, the ranks' CPU time (all threads, summed) too, which
        other processes on the machine disturb less than the wall time."""
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        work()
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        used = torch.tensor([time.process_time() - start_cpu], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        dist.all_reduce(used)
        if cpu_key:
            cpu.setdefault(cpu_key, []).append(float(used))
        return float(took)

    out = Path(args.out)
    kinds = ["plain", "ext", "thread", "plainsync", "nosync"]
    rows: dict[str, list[float]] = {key: [] for key in (*(f"save_{kind}" for kind in kinds), "fingerprints",
                                                         "load_checked", "check")}
    for round_ in range(args.rounds):
        shift = round_ % len(kinds)
        order = kinds[shift:] + kinds[:shift]  # each kind first, second, ... and last in turn
        if round_ % 2:
            order.reverse()
        for kind in order:
            target = out / f"{kind}{round_}"
            save = {"plain": plain_save, "ext": engine.save_checkpoint, "thread": thread_save,
                    "plainsync": synced_plain_save, "nosync": unsynced_save}[kind]
            # Each save starts with the disk idle: the writeback of the save before it would otherwise be charged
            # to whichever save comes next, and to an fsync most of all.
            if dist.get_rank() == 0:
                os.sync()
            dist.barrier()
            rows[f"save_{kind}"].append(timed(lambda: save(str(target), tag="step1"), f"cpu_{kind}"))
            if dist.get_rank() == 0 and kind != "ext" and not (round_ == 0 and kind == "plain"):
                shutil.rmtree(target, ignore_errors=True)  # kept: ext (loaded below), plain0 (compared)
        rows["fingerprints"].append(timed(lambda: engine_fingerprints(engine)))
        load_dir = out / f"ext{round_}"
        rows["load_checked"].append(timed(lambda: engine.load_checkpoint(str(load_dir), tag="step1")))
        rows["check"].append(timed(lambda: check_resume_fingerprints(engine, load_dir / "step1")))
        if round_ == 0 and dist.get_rank() == 0:  # deepspeed-ext writes DeepSpeed's files byte for byte
            same = _same_files(out / "plain0" / "step1", out / "ext0" / "step1")
            cpu.setdefault("same_bytes_as_deepspeed", []).append(same)
        if dist.get_rank() == 0:
            for kind in kinds:
                shutil.rmtree(out / f"{kind}{round_}", ignore_errors=True)
        dist.barrier()
    if dist.get_rank() == 0:
        (out / "result.json").write_text(json.dumps({**rows, **cpu}))
    finish_distributed()


def _same_files(plain: Path, ext: Path) -> float:
    """1.0 if every file DeepSpeed wrote in ``plain`` is in ``ext`` with the same bytes, else 0.0."""
    import filecmp
    names = sorted(p.relative_to(plain) for p in plain.rglob("*") if p.is_file())
    return float(bool(names) and all(filecmp.cmp(plain / name, ext / name, shallow=False) for name in names))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(p)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    rows = run_rank_workers(args, __file__, "fingerprints")
    median = {key: statistics.median(values) for key, values in rows.items()}
    print(f"\nresume fingerprints, {args.layers}-layer Llama (hidden {args.hidden}), TP=2 ZeRO-1 bf16, "
          f"{args.rounds} rounds (median s, slowest rank)")
    print(f"{'save_checkpoint, DeepSpeed alone':42} {median['save_plain']:8.3f}")
    paired = statistics.median(ext / plain for ext, plain in zip(rows["save_ext"], rows["save_plain"], strict=True))
    print(f"{'save_checkpoint, with deepspeed-ext':42} {median['save_ext']:8.3f}   "
          f"{median['save_ext'] / median['save_plain'] - 1:+.1%} (median of the rounds' own ratios: "
          f"{paired - 1:+.1%})")
    paired_thread = statistics.median(t / p for t, p in zip(rows["save_thread"], rows["save_plain"], strict=True))
    print(f"{'  ... as before (torch.save, sums on a thread)':42} {median['save_thread']:8.3f}   "
          f"{median['save_thread'] / median['save_plain'] - 1:+.1%} (median of the rounds' own ratios: "
          f"{paired_thread - 1:+.1%})")
    for kind, label in (("plainsync", "DeepSpeed alone, then fsync of its files"),
                        ("nosync", "with deepspeed-ext, nothing made durable")):
        ratio = statistics.median(k / p for k, p in zip(rows[f"save_{kind}"], rows["save_plain"], strict=True))
        print(f"{label:42} {median[f'save_{kind}']:8.3f}   {ratio - 1:+.1%} vs DeepSpeed alone (median of the "
              "rounds' own ratios)")
    durable_ratio = statistics.median(e / p for e, p in zip(rows["save_ext"], rows["save_plainsync"], strict=True))
    print(f"{'with deepspeed-ext vs DeepSpeed alone + fsync':42} {durable_ratio - 1:+.1%} (median of the rounds' "
          "own ratios: the same durability on both sides)")
    print(f"{'the fingerprints alone (not overlapped)':42} {median['fingerprints']:8.3f}   "
          f"{median['fingerprints'] / median['save_plain']:.1%} of the save")
    cpu_ratio = statistics.median(e / p for e, p in zip(rows["cpu_ext"], rows["cpu_plain"], strict=True))
    cpu_thread = statistics.median(e / p for e, p in zip(rows["cpu_thread"], rows["cpu_plain"], strict=True))
    print(f"{'CPU s of a save, both ranks: DeepSpeed alone':42} {median['cpu_plain']:8.3f}")
    print(f"{'  with deepspeed-ext':42} {median['cpu_ext']:8.3f}   {cpu_ratio - 1:+.1%} (median of the rounds' "
          f"ratios); as before: {median['cpu_thread']:.3f}, {cpu_thread - 1:+.1%}")
    print(f"{'DeepSpeed files byte-identical (round 0)':42} {bool(rows['same_bytes_as_deepspeed'][0])}")
    print(f"{'load_checkpoint, checked':42} {median['load_checked']:8.3f}")
    print(f"{'  of which the fingerprint check':42} {median['check']:8.3f}   "
          f"{median['check'] / median['load_checked']:.1%} of the load")
    print(json.dumps({"median_s": median, "rounds": rows}))


if __name__ == "__main__":
    main()
