"""The checks that need an accelerator, as one command (scripts/gpu-check.sh runs it): the real DeepSpeed engine
on CUDA, through deepspeed-ext's save, background save (the copy snapshot), restore, fingerprints, converters and
weight streams.

NCCL needs a GPU per rank, so on a one-GPU machine a run on CUDA is one rank (NCCL); the TP=2 runs are on the CPU
(gloo), and the checkpoints cross between the two. Each check prints one line, ``PASS`` or ``FAIL``, with its
numbers; the command exits non-zero if any failed. ``--device cpu`` runs the same checks with CPU engines only (a
dry run of this script on a machine without a GPU: it proves the script, not the CUDA paths).

    bash scripts/gpu-check.sh                 # on the GPU machine
    bash scripts/gpu-check.sh --device cpu    # the dry run
    bash scripts/gpu-check.sh --skip-bench    # without the 1B-parameter stall bench
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "tests" / "harness" / "workers" / "train.py"
STREAM = ROOT / "tests" / "harness" / "workers" / "stream_weights.py"
RECEIVE = ROOT / "tests" / "harness" / "workers" / "receive_weights.py"
RESULTS: list[tuple[str, bool, str]] = []


def report(name: str, ok: bool, detail: str) -> None:
    RESULTS.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def run_ranks(nproc: int, args: list[str], log: Path, accelerator: str, script: Path = TRAIN) -> bool:
    """``script ARGS`` on ``nproc`` ranks under torchrun, DeepSpeed's accelerator ``accelerator`` ("cuda": NCCL,
    one rank per GPU; "cpu": gloo). The output in ``log``; whether it succeeded."""
    env = {**os.environ, "DS_ACCELERATOR": accelerator, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(script), *args]
    with open(log, "w") as out:
        proc = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=900)
    if proc.returncode != 0:
        print(f"  ({' '.join(args[:8])} ...) failed with {proc.returncode}; its end:\n"
              + "".join(log.read_text().splitlines(keepends=True)[-25:]), flush=True)
    return proc.returncode == 0


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepspeed_ext", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}, timeout=900)


def losses(result: Path) -> dict[int, float]:
    return {int(step): loss for step, loss in json.loads(result.read_text())["losses"].items()}


def same_files(a: Path, b: Path) -> list[str]:
    """The files of tag ``a`` that differ from tag ``b``'s (the commit marker: but for its time)."""
    differ = []
    for path in sorted(a.iterdir()):
        other = b / path.name
        if not other.is_file():
            differ.append(f"{path.name} (missing)")
        elif path.name == "deepspeed_ext.commit.json":
            left, right = (json.loads(p.read_text()) for p in (path, other))
            left.pop("committed_at"), right.pop("committed_at")
            if left != right:
                differ.append(path.name)
        elif path.read_bytes() != other.read_bytes():
            differ.append(path.name)
    return differ


def check_background_saves(work: Path, accelerator: str) -> None:
    """On the accelerator, ZeRO-1 and ZeRO-3, bf16: each save made synchronously, then in the background with the
    copy snapshot (and with a fork, which must fall back to a synchronous save there): the same bytes."""
    for zero in (1, 3):
        root = work / f"saves-zero{zero}"
        root.mkdir()
        args = ["--tp", "1", "--zero", str(zero), "--dtype", "bf16", "--steps", "4", "--save-at", "2",
                "--save-at", "4", "--async-save", "copy", "--save-dir", str(root / "async"),
                "--also-save-synchronously", str(root / "sync"), "--result", str(root / "result.json")]
        started = time.perf_counter()
        if not run_ranks(1, args, root / "train.log", accelerator):
            report(f"{accelerator} train + async_save copy, ZeRO-{zero}", False, f"the run failed ({root}/train.log)")
            continue
        differ = [f"{tag}/{name}" for tag in ("global_step2", "global_step4")
                  for name in same_files(root / "sync" / tag, root / "async" / tag)]
        latest = (root / "async" / "latest").read_text()
        report(f"{accelerator} train + async_save copy, ZeRO-{zero}", not differ and latest == "global_step4",
               f"files byte-identical to the synchronous save: {not differ} {differ[:3]}; latest {latest}; "
               f"{time.perf_counter() - started:.0f} s; losses {losses(root / 'result.json')}")


def check_cross_device_resumes(work: Path, accelerator: str) -> None:
    """A TP=2 CPU checkpoint resumed at TP=1 on the accelerator, and the accelerator's checkpoint resumed at TP=2 on
    the CPU: each resume's fingerprints checked (a mismatch fails the run), its first loss next to the loss the
    saving run itself went on to."""
    cpu, gpu = work / "cpu-tp2", work / "gpu-tp1"
    for root in (cpu, gpu):
        root.mkdir()
    base = ["--zero", "1", "--dtype", "bf16", "--steps", "4", "--save-at", "2"]
    made = (run_ranks(2, ["--tp", "2", *base, "--save-dir", str(cpu / "save"), "--result", str(cpu / "r.json")],
                      cpu / "train.log", "cpu")
            and run_ranks(1, ["--tp", "1", *base, "--save-dir", str(gpu / "save"), "--result", str(gpu / "r.json")],
                          gpu / "train.log", accelerator))
    if not made:
        report("checkpoints cross devices", False, "a saving run failed")
        return
    for name, source, nproc, tp, device in (("TP=2 CPU -> TP=1 " + accelerator, cpu, 1, "1", accelerator),
                                            (f"TP=1 {accelerator} -> TP=2 CPU", gpu, 2, "2", "cpu")):
        result = source / f"resumed-{device}.json"
        ok = run_ranks(nproc, ["--tp", tp, "--zero", "1", "--dtype", "bf16", "--steps", "4", "--load-dir",
                               str(source / "save"), "--result", str(result)], source / f"resume-{device}.log", device)
        detail = "the resume failed (fingerprints or load)"
        if ok:
            saved, resumed = losses(source / "r.json"), losses(result)
            detail = (f"fingerprints matched; loss at step 3: resumed {resumed[3]:.5f}, the saving run "
                      f"{saved[3]:.5f}")
            ok = abs(resumed[3] - saved[3]) < 0.05 * abs(saved[3])  # bf16 on another device's kernels
        report(f"resume {name}", ok, detail)


def check_converters(work: Path) -> None:
    """to-universal and to-hf of the accelerator-saved checkpoint: each output verified against the fingerprints
    recorded at save (the tensors read equal the saved ones), and the HF weights against the universal ones."""
    save = work / "gpu-tp1" / "save"
    if not save.is_dir():
        report("converters on a GPU-saved checkpoint", False, "no checkpoint (its run failed)")
        return
    steps = [("to-universal", cli("to-universal", str(save), "-o", str(work / "universal"), "--quiet")),
             ("verify universal", cli("verify", str(work / "universal"))),
             ("to-hf", cli("to-hf", str(work / "universal"), "-o", str(work / "hf"))),
             ("verify hf", cli("verify", str(work / "hf"))),
             ("compare", cli("compare", str(save), str(work / "universal")))]
    failed = [(name, proc) for name, proc in steps if proc.returncode != 0]
    report("to-universal / to-hf of a GPU-saved checkpoint", not failed,
           "; ".join(f"{name}: {(proc.stderr or proc.stdout).strip().splitlines()[-1:] }" for name, proc in failed)
           or "verified against the fingerprints recorded at save; compare: "
           + (steps[-1][1].stdout.strip().splitlines() or [""])[-1])


def check_weight_stream(work: Path, accelerator: str) -> None:
    """A ZeRO-3 engine on the device (one rank) sends two updates to a receiver process on the CPU (a gloo weight
    group: the pieces leave device memory one by one) and iterates hf_weights; both against to-hf of the
    checkpoints it saved at those steps: the files bit for bit, the receiver's logits exactly."""
    import socket

    import torch
    directory = work / "weights"
    directory.mkdir(parents=True, exist_ok=True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"),
                                                                     os.environ.get("PYTHONPATH")]))}
    with open(directory / "receiver.log", "w") as out:
        receiver = subprocess.Popen([sys.executable, str(RECEIVE), "--group", f"127.0.0.1:{port}", "--senders", "1",
                                     "--updates", "2", "--out", str(directory / "received")], stdout=out,
                                    stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    ok = run_ranks(1, ["--group", f"127.0.0.1:{port}", "--hf-weights", str(directory / "streamed"), "--hf-names",
                       "files", "--tp", "1", "--zero", "3", "--dtype", "bf16", "--steps", "2", "--save-dir",
                       str(directory / "ckpt"), "--save-at", "1", "--save-at", "2"], directory / "train.log",
                   accelerator, script=STREAM)
    ok = receiver.wait(timeout=300) == 0 and ok
    details = []
    if ok:
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        from deepspeed_ext.demo.models import eval_batch
        for step in (1, 2):
            out = directory / f"hf{step}"
            proc = cli("to-hf", str(directory / "ckpt"), "--tag", f"global_step{step}", "-o", str(out))
            ok = ok and proc.returncode == 0
            if proc.returncode != 0:
                details.append(proc.stderr.strip()[-300:])
                continue
            written = {name: t for path in sorted(out.glob("*.safetensors")) for name, t in load_file(path).items()}
            streamed = torch.load(directory / "streamed" / f"step{step}.pt", map_location="cpu")
            same = sorted(written) == sorted(streamed) and all(torch.equal(written[n], streamed[n]) for n in written)
            model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, attn_implementation="eager")
            with torch.no_grad():
                reference = model.eval()(input_ids=eval_batch()).logits
            received = torch.load(directory / "received" / f"logits_v{step}.pt")
            delta = (reference.float() - received.float()).abs().max().item()
            ok = ok and same and delta == 0
            details.append(f"update {step}: hf_weights {'==' if same else '!='} to-hf files, receiver logits max |d| "
                           f"{delta}")
    report(f"weight stream ({accelerator} ZeRO-3 engine -> a receiver)", ok, "; ".join(details) or "did not run")


def check_stall_bench(work: Path, accelerator: str, hidden: int, layers: int) -> None:
    """The stall of a save in the background (copy snapshot) against a synchronous save, one rank, bf16, ZeRO-1,
    at a 1-3B shape (absolute times hold on a GPU): bench/gpu_async_stall.py."""
    out = work / "bench"
    out.mkdir()
    script = ROOT / "bench" / "gpu_async_stall.py"
    ok = run_ranks(1, ["--hidden", str(hidden), "--layers", str(layers), "--out", str(out)], out / "bench.log",
                   accelerator, script=script)
    if not ok:
        report("async stall bench", False, f"the bench failed ({out}/bench.log)")
        return
    result = json.loads((out / "result.json").read_text())
    report("async stall bench", result["stall_ratio"] <= 0.05,
           f"{result['parameters'] / 1e9:.2f}B parameters: synchronous save {result['sync_s']:.2f} s, "
           f"copy snapshot stall {result['stall_s']:.3f} s ({result['stall_ratio']:.1%}), committed "
           f"{result['commit_after_s']:.1f} s later, {result['steps_during']} steps meanwhile, step "
           f"{result['step_alone_s']:.3f} s alone / {result['step_during_s']:.3f} s during, host buffers "
           f"{result['pool_gib']:.1f} GiB (pinned: {result['pinned']}), files identical: {result['same_bytes']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda (the GPU machine) or cpu (a dry run of this script, no GPU)")
    p.add_argument("--workdir", help="where the runs write (default: a new temporary directory)")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--bench-hidden", type=int, default=2048)
    p.add_argument("--bench-layers", type=int, default=22, help="22 x 2048: a 1.1B-parameter Llama")
    args = p.parse_args()
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu-check: torch sees no CUDA device here (--device cpu for a dry run without one)")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="deepspeed_ext_gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU (dry run)"
    print(f"gpu-check on {device}, torch {torch.__version__}, in {work}", flush=True)
    started = time.perf_counter()
    check_background_saves(work, args.device)
    check_cross_device_resumes(work, args.device)
    check_converters(work)
    check_weight_stream(work, args.device)
    if not args.skip_bench:
        check_stall_bench(work, args.device, args.bench_hidden, args.bench_layers)
    failed = [name for name, ok, _ in RESULTS if not ok]
    print(f"gpu-check: {len(RESULTS) - len(failed)} of {len(RESULTS)} passed in {time.perf_counter() - started:.0f} s"
          + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
