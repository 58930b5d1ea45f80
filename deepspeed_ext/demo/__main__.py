"""``python -m deepspeed_ext.demo``: the user story on a built-in tiny Llama, end to end.

1. Train at TP=2 (ZeRO-1, bf16) for 5 steps with ``deepspeed_ext.initialize``, saving at step 3.
2. ``deepspeed-ext to-universal`` the checkpoint.
3. Resume from it at TP=1, TP=3 and TP=4 and train steps 4-5.
4. Print the losses side by side with the uninterrupted TP=2 run.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from deepspeed_ext.demo.runner import cli, read_losses, torchrun_train

SAVE_AT, STEPS, SOURCE_TP, TARGET_TPS = 3, 5, 2, (1, 3, 4)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deepspeed_ext.demo", description=__doc__.splitlines()[0])
    p.add_argument("--workdir", help="keep checkpoints and logs here (default: a temporary directory)")
    args = p.parse_args(argv)
    from deepspeed_ext.errors import MissingExtraError
    from deepspeed_ext.extras import require
    try:
        require("hf", "the demo (its tiny models are transformers models)")
    except MissingExtraError as exc:
        print(f"deepspeed-ext demo: error: {exc}", file=sys.stderr)
        return 2
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="deepspeed_ext_demo_"))
    marker = workdir / ".deepspeed_ext_demo"
    if workdir.exists() and any(workdir.iterdir()):
        if not marker.exists():  # never delete a directory a previous demo run did not create
            p.error(f"--workdir {workdir} is not empty and was not created by the demo")
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    marker.touch()
    save_dir, logs = workdir / "checkpoints", workdir / "logs"
    common = ["--zero", "1", "--dtype", "bf16", "--steps", str(STEPS), "--progress"]
    phases = 2 + len(TARGET_TPS)

    def say(text: str) -> None:
        print(text, flush=True)

    t0 = time.time()
    say(f"[1/{phases}] training a tiny Llama (GQA 16q/4kv, vocab 101) at TP={SOURCE_TP}, ZeRO-1, bf16; "
        f"saving at step {SAVE_AT} into {save_dir}")
    torchrun_train(SOURCE_TP, ["--tp", str(SOURCE_TP), *common, "--save-dir", str(save_dir), "--save-at",
                               str(SAVE_AT), "--result", str(workdir / "baseline.json")], logs / "train_tp2.log")
    say(f"[2/{phases}] deepspeed-ext to-universal {save_dir}")
    cli(["to-universal", str(save_dir), "--quiet"], logs / "convert.log")
    say(f"      -> {save_dir / f'global_step{SAVE_AT}_universal'}")
    losses = {f"TP={SOURCE_TP} uninterrupted": read_losses(workdir / "baseline.json")}
    for phase, tp in enumerate(TARGET_TPS, start=3):
        say(f"[{phase}/{phases}] resuming from the universal checkpoint at TP={tp}: steps {SAVE_AT + 1}-{STEPS}")
        result = workdir / f"resume_tp{tp}.json"
        torchrun_train(tp, ["--tp", str(tp), *common, "--load-dir", str(save_dir), "--result", str(result)],
                       logs / f"resume_tp{tp}.log")
        losses[f"TP={tp} resumed"] = read_losses(result)

    columns = list(losses)
    say("")
    say("step  " + "  ".join(f"{c:>20}" for c in columns))
    for step in range(1, STEPS + 1):
        cells = [f"{losses[c][step]:>20.6f}" if step in losses[c] else f"{'-':>20}" for c in columns]
        say(f"{step:>4}  " + "  ".join(cells))
    base = losses[columns[0]]
    worst = max(abs(losses[c][s] - base[s]) / abs(base[s]) for c in columns[1:] for s in losses[c])
    say(f"\nlargest relative difference of a resumed loss from the uninterrupted run: {worst:.2e}")
    say(f"done in {time.time() - t0:.0f}s; checkpoints and logs in {workdir}")
    return 0 if worst <= 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
