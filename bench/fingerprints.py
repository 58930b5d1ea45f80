"""What resume fingerprints cost, at save and at load, on the 246M benchmark model (the one bench/convert.py uses:
hidden 1024, 16 layers, 16 query / 4 KV heads, intermediate 2816, vocab 32000), TP=2, ZeRO-1, bf16, with the real
engine (torchrun, gloo, CPU).

After one training step, ``--rounds`` rounds, alternating the order, of:

* ``save_checkpoint`` as DeepSpeed alone does it (the engine's own method, unhooked) and with deepspeed-ext
  (UC metadata + fingerprints: each rank's sums on a thread while DeepSpeed writes, then one all-reduce of 3
  float64 numbers per parameter state);
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
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import llama_config  # noqa: E402
from maxtext_rss import model_arguments  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def worker(args: argparse.Namespace) -> None:
    """One rank of the measurement (under torchrun)."""
    import torch
    import torch.distributed as dist

    import deepspeed_ext
    from deepspeed_ext.checkpoint.fingerprint import engine_fingerprints
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

    def timed(work) -> float:
        dist.barrier()
        start = time.perf_counter()
        work()
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return float(took)

    out = Path(args.out)
    rows: dict[str, list[float]] = {key: [] for key in
                                    ("save_plain", "save_ext", "fingerprints", "load_checked", "check")}
    for round_ in range(args.rounds):
        order = ["plain", "ext"] if round_ % 2 == 0 else ["ext", "plain"]
        for kind in order:
            target = out / f"{kind}{round_}"
            save = plain_save if kind == "plain" else engine.save_checkpoint
            rows[f"save_{kind}"].append(timed(lambda: save(str(target), tag="step1")))
        rows["fingerprints"].append(timed(lambda: engine_fingerprints(engine)))
        load_dir = out / f"ext{round_}"
        rows["load_checked"].append(timed(lambda: engine.load_checkpoint(str(load_dir), tag="step1")))
        rows["check"].append(timed(lambda: check_resume_fingerprints(engine, load_dir / "step1")))
        if dist.get_rank() == 0:
            for kind in ("plain", "ext"):
                shutil.rmtree(out / f"{kind}{round_}", ignore_errors=True)
        dist.barrier()
    if dist.get_rank() == 0:
        (out / "result.json").write_text(json.dumps(rows))
    finish_distributed()


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
    work = Path(args.workdir) / "fingerprints"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "config.json").write_text(json.dumps(llama_config(args)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           "--worker", "--config", str(work / "config.json"), "--out", str(work), "--rounds", str(args.rounds)]
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    rows = json.loads((work / "result.json").read_text())
    median = {key: statistics.median(values) for key, values in rows.items()}
    print(f"\nresume fingerprints, {args.layers}-layer Llama (hidden {args.hidden}), TP=2 ZeRO-1 bf16, "
          f"{args.rounds} rounds (median s, slowest rank)")
    print(f"{'save_checkpoint, DeepSpeed alone':42} {median['save_plain']:8.3f}")
    paired = statistics.median(ext / plain for ext, plain in zip(rows["save_ext"], rows["save_plain"], strict=True))
    print(f"{'save_checkpoint, with deepspeed-ext':42} {median['save_ext']:8.3f}   "
          f"{median['save_ext'] / median['save_plain'] - 1:+.1%} (median of the rounds' own ratios: "
          f"{paired - 1:+.1%})")
    print(f"{'the fingerprints alone (overlapped in a save)':42} {median['fingerprints']:8.3f}   "
          f"{median['fingerprints'] / median['save_plain']:.1%} of the save")
    print(f"{'load_checkpoint, checked':42} {median['load_checked']:8.3f}")
    print(f"{'  of which the fingerprint check':42} {median['check']:8.3f}   "
          f"{median['check'] / median['load_checked']:.1%} of the load")
    print(json.dumps({"median_s": median, "rounds": rows}))


if __name__ == "__main__":
    main()
