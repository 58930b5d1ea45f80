"""AutoEP (expert parallelism) against AutoTP on one MoE model: conversion speed and memory, and memory per rank.

Builds once (cached under --workdir) an 86M-parameter Mixtral (hidden 512, 4 layers, 8 experts of width 1024,
8 query / 2 KV heads, vocab 32000; 59 % of it experts) trained one step on 2 ranks (torchrun, gloo, CPU, ZeRO-1,
bf16) three ways: AutoEP at EP=2 (each rank holds 4 experts), AutoEP at EP=1 (every rank holds every expert,
ZeRO partitions them over the 2 ranks) and AutoTP at TP=2 with deepspeed-ext's Mixtral preset (attention split,
experts whole on both ranks). Then:

1. memory per rank while training (measured in the training run): the parameters each rank holds (bf16), its fp32
   masters and Adam moments (its ZeRO partition), and its peak RSS;
2. ``--rounds`` rounds, the order alternating each round, of ``cp -r`` of each tag directory (the I/O floor) and
   ``deepspeed-ext to-universal`` of it and of the same layout's tiny model (the command's fixed cost), each from a
   cold page cache with its final ``sync``: wall time and peak RSS, medians, the spread of the floor, and
   throughput against cp's, whole (cp time / command time) and per byte (cp time / time above the fixed cost).

    python bench/expert_parallel.py                  # about 3 minutes the first time, then about a minute
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import ROOT, du, timed  # noqa: E402

LAYOUTS = {  # name -> (train.py arguments, what it is)
    "autoep_ep2": (["--tp", "1", "--ep", "2"], "AutoEP EP=2 x DP=2"),
    "autoep_ep1": (["--tp", "1", "--ep", "1"], "AutoEP EP=1 x DP=2"),
    "autotp_tp2": (["--tp", "2"], "AutoTP TP=2 (preset)"),
}


def model_config() -> dict:
    import transformers
    config = transformers.MixtralConfig(vocab_size=32000, hidden_size=512, intermediate_size=1024,
                                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                                        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
                                        tie_word_embeddings=False)
    return json.loads(config.to_json_string(use_diff=False))


def worker() -> None:
    """One training step under torchrun (demo/train.py), then each rank's memory into MEMORY.rank<r>.json."""
    from deepspeed_ext.demo import train
    from deepspeed_ext.checkpoint import engine_private

    out = os.environ["DSX_BENCH_MEMORY"]

    def after_step(engine, step):  # the optimizer's state exists once it has stepped
        import torch
        import torch.distributed as dist
        params = sum(p.numel() * p.element_size() for p in engine.module.parameters())
        base = engine_private.base_optimizer(engine)
        states = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                  for group in base.param_groups for t in group["params"]}  # the fp32 masters (flat partitions)
        states.update({v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()
                       for st in base.state.values() for v in st.values() if torch.is_tensor(v)})
        with open("/proc/self/status") as status:
            peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) * 1024
        Path(f"{out}.rank{dist.get_rank()}.json").write_text(json.dumps(
            {"params": params, "optimizer": sum(states.values()), "peak_rss": peak}))

    train.run(sys.argv[2:], train.Hooks(after_step=after_step))
    from deepspeed_ext.demo.models import finish_distributed
    finish_distributed()


def build(work: Path, name: str, tiny: bool = False) -> tuple[Path, list[dict]]:
    """The checkpoint of layout ``name`` (built once) and its ranks' memory while training; ``tiny``: of the demo's
    tiny Mixtral instead (a command's fixed cost: interpreter, imports, metadata)."""
    save_dir = work / (f"{name}_tiny" if tiny else name)
    memory = save_dir.with_suffix(".memory")
    if not (save_dir / "latest").is_file():
        work.mkdir(parents=True, exist_ok=True)
        (work / "config.json").write_text(json.dumps(model_config()))
        print(f"building {save_dir} ({LAYOUTS[name][1]}, one step) ...", flush=True)
        model = [] if tiny else ["--model-config", str(work / "config.json")]
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        __file__, "--worker", *LAYOUTS[name][0], "--family", "mixtral", "--zero", "1", "--dtype",
                        "bf16", "--steps", "1", "--save-dir", str(save_dir), "--save-at", "1", *model], check=True,
                       cwd=ROOT, env={**os.environ, "DS_ACCELERATOR": "cpu", "DSX_BENCH_MEMORY": str(memory)},
                       capture_output=True)
    ranks = [json.loads(Path(f"{memory}.rank{r}.json").read_text()) for r in range(2)]
    return save_dir / "global_step1", ranks


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        worker()
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/dsx-bench-autoep"))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    built = {name: build(args.workdir, name) for name in LAYOUTS}
    tiny = {name: build(args.workdir, name, tiny=True)[0] for name in LAYOUTS}

    mib = 2 ** 20
    print("\nmemory per rank while training (one step, ZeRO-1, bf16):")
    print(f"  {'layout':<24} {'params (bf16)':>14} {'fp32 + Adam':>12} {'peak RSS':>10}")
    for name, (_, ranks) in built.items():
        top = max(ranks, key=lambda r: r["params"] + r["optimizer"])
        print(f"  {LAYOUTS[name][1]:<24} {top['params'] / mib:>10.1f} MiB {top['optimizer'] / mib:>8.1f} MiB "
              f"{max(r['peak_rss'] for r in ranks) / mib:>6.0f} MiB")

    out = args.workdir / "out"
    times: dict[tuple[str, str], list[dict[str, float]]] = {}
    for round_ in range(args.rounds):
        for name, (tag_dir, _) in (list(built.items()) if round_ % 2 == 0 else list(built.items())[::-1]):
            ours = [sys.executable, "-m", "deepspeed_ext", "to-universal"]
            pairs = [("cp -r", ["cp", "-r", str(tag_dir), str(out)], tag_dir),
                     ("to-universal", [*ours, str(tag_dir), "-o", str(out), "--quiet"], tag_dir),
                     ("to-universal tiny", [*ours, str(tiny[name]), "-o", str(out), "--quiet"], tiny[name])]
            for command, cmd, source in (pairs if round_ % 2 == 0 else pairs[::-1]):
                subprocess.run(["rm", "-rf", str(out)], check=True)
                times.setdefault((name, command), []).append(timed(cmd, source))
    subprocess.run(["rm", "-rf", str(out)], check=True)
    print(f"\nto-universal against cp -r, cold cache, medians of {args.rounds} (cp's own spread: min-max); "
          "'per byte': the time above the same command on the tiny model (its fixed cost)")
    print(f"  {'layout':<24} {'size':>9} {'cp -r':>18} {'to-universal':>13} {'vs cp':>6} {'tiny':>7} "
          f"{'per byte vs cp':>15} {'peak RSS':>9}")
    for name, (tag_dir, _) in built.items():
        cp = [t["wall"] for t in times[(name, "cp -r")]]
        ours = times[(name, "to-universal")]
        wall = statistics.median(t["wall"] for t in ours)
        fixed = statistics.median(t["wall"] for t in times[(name, "to-universal tiny")])
        print(f"  {LAYOUTS[name][1]:<24} {du(tag_dir) / mib:>5.0f} MiB {statistics.median(cp):>6.2f} s "
              f"({min(cp):.2f}-{max(cp):.2f}) {wall:>11.2f} s {statistics.median(cp) / wall:>5.2f}x "
              f"{fixed:>5.2f} s {statistics.median(cp) / (wall - fixed):>14.2f}x "
              f"{statistics.median(t['rss'] for t in ours) * 1024:>5.0f} MiB")


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
