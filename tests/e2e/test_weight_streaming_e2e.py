"""Weights streamed from a live DeepSpeed engine (docs/weight-streaming.md): ``hf_weights`` on every rank, and
``send_weights`` to receivers outside the training job, which load them into a transformers model.

Each run trains the demo's tiny model on two ranks and, after each save, sends an update and iterates
``hf_weights``. The receivers are separate processes (``workers/receive_weights.py``), as inference engines are.
What each got is held against ``to-hf`` of the checkpoint saved at the same step: ``hf_weights`` equal to its
files bit for bit, the receiver's logits of a fixed batch equal to those of the ``to-hf`` model (max |Δ| = 0 in
bf16), version by version. Refusals: an update missed, a receiver of another model, a training rank gone mid-update.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from harness.runner import child_env, cli, run_logged, zygote_workers

WORKERS = Path(__file__).parent.parent / "harness" / "workers"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _start_receiver(out: Path, port: int, *args: str) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    log = open(out.with_suffix(".log"), "w")
    return subprocess.Popen([sys.executable, str(WORKERS / "receive_weights.py"), "--group", f"127.0.0.1:{port}",
                             "--senders", "2", "--out", str(out), *args], env=child_env(), stdout=log,
                            stderr=subprocess.STDOUT)


def _finish(receiver: subprocess.Popen, timeout: float = 120) -> int:
    try:
        return receiver.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        receiver.kill()
        raise AssertionError("a receiver hung") from None


def _train(tmp: Path, port: int, args: list[str], check: bool = True) -> subprocess.CompletedProcess:
    return run_logged([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                       str(WORKERS / "stream_weights.py"), "--group", f"127.0.0.1:{port}", "--dtype", "bf16",
                       "--save-dir", str(tmp / "ckpt"), *args], tmp / "train.log", check=check)


def _to_hf(tmp: Path, step: int, *options: str) -> Path:
    out = tmp / f"hf{step}{'_'.join(options)}"
    if out.is_dir():
        return out
    cli(["to-hf", str(tmp / "ckpt"), "--tag", f"global_step{step}", "-o", str(out), *options], tmp / "to-hf.log")
    return out


def _files(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    found: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        found.update(load_file(path))
    return found


def _assert_same_tensors(streamed: dict[str, torch.Tensor], written: dict[str, torch.Tensor]) -> None:
    assert list(streamed) and sorted(streamed) == sorted(written)
    for name, tensor in written.items():
        assert streamed[name].dtype == tensor.dtype and torch.equal(streamed[name], tensor), name


def _reference_logits(hf_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from deepspeed_ext.demo.models import eval_batch
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=eval_batch()).logits


def _check_updates(tmp: Path, received: Path, steps: list[int], *to_hf_options: str, names: str = "hf") -> None:
    """After each step's save: hf_weights as to-hf wrote that checkpoint, and the receiver's model as to-hf's."""
    for version, step in enumerate(steps, start=1):
        hf_dir = _to_hf(tmp, step, *to_hf_options)
        if names == "files":
            _assert_same_tensors(torch.load(tmp / "hfw" / f"step{step}.pt"), _files(hf_dir))
        logits = torch.load(received / f"logits_v{version}.pt")
        reference = _reference_logits(hf_dir)
        assert logits.dtype == reference.dtype == torch.bfloat16
        assert (logits.float() - reference.float()).abs().max().item() == 0, f"update {version}"


def test_tensor_parallel_updates_refusals_a_rank_gone_and_an_engine_receiving(tmp_path):
    """AutoTP TP=2, four receivers of one group: a transformers model, a model with fewer KV heads, and a DeepSpeed
    engine of another job and layout (ZeRO-3 over two ranks, each a receiver keeping its partitions).

    Updates 1 to 3 equal to-hf's output of the checkpoints saved at those steps (the model's logits; the engine's
    own checkpoint after each, converted, bit for bit). The fourth update's version skips one: refused by each in one
    line, the sinks untouched. The model with fewer KV heads refuses every update, naming the first tensor that does
    not fit. In the fifth the last training rank leaves after one bucket: every receiver gives it up in one line
    and ends, none hangs."""
    port = _free_port()
    good = _start_receiver(tmp_path / "recv", port, "--receivers", "4", "--updates", "5")
    other = _start_receiver(tmp_path / "other", port, "--receivers", "4", "--receiver", "1", "--updates", "5",
                            "--kv-heads", "2")
    command, env = zygote_workers(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(WORKERS / "receive_into_engine.py"), "--group", f"127.0.0.1:{port}", "--senders", "2", "--updates", "5",
         "--receivers", "4", "--first-receiver", "2", "--save-dir", str(tmp_path / "received"), "--tp", "1",
         "--zero", "3"], child_env())
    engine = subprocess.Popen(command, env=env, stdout=open(tmp_path / "engine.log", "w"), stderr=subprocess.STDOUT)
    started = time.monotonic()
    failed = _train(tmp_path, port, ["--tp", "2", "--zero", "1", "--steps", "5", "--receivers", "4", "--hf-weights",
                                     str(tmp_path / "hfw"), "--hf-names", "files", "--versions", "1,2,3,5,6",
                                     "--bucket-bytes", "4096", "--die-at", "5",
                                     *[a for s in (1, 2, 3, 4, 5) for a in ("--save-at", str(s))]], check=False)
    assert failed.returncode != 0  # its last rank left mid-update, as asked
    assert _finish(good, timeout=150) == 0 and _finish(other, timeout=150) == 0
    assert _finish(engine, timeout=150) == 0, (tmp_path / "engine.log").read_text()[-3000:]
    assert time.monotonic() - started < 400
    _check_updates(tmp_path, tmp_path / "recv", [1, 2, 3], names="files")
    assert [p.name for p in sorted((tmp_path / "recv").glob("logits_*"))] == [f"logits_v{v}.pt" for v in (1, 2, 3)]
    skipped, cut = (tmp_path / "recv" / "refused.txt").read_text().splitlines()
    assert skipped == ("weight update 5: expected version 4, this is 5 (an update was missed); refused, the sink "
                       "keeps version 3")
    assert cut.startswith("weight update 6: incomplete, refused (") and cut.endswith(
        "the sink holds part of it (tensors were loaded as they arrived)"), cut
    lines = (tmp_path / "other" / "refused.txt").read_text().splitlines()
    assert len(lines) == 5 and not list((tmp_path / "other").glob("logits_*"))
    assert lines[0] == ("weight update 1: model.layers.0.self_attn.k_proj.weight is [16, 64] in the update, [8, 64] "
                        "in the receiving LlamaForCausalLM (another model, or a model sharded another way?); refused, "
                        "the sink keeps what it held"), lines[0]
    for version in (1, 2, 3):  # the engine's checkpoint after the update, as the trainer's at that step
        received = tmp_path / f"received_hf{version}"
        cli(["to-hf", str(tmp_path / "received"), "--tag", f"v{version}", "-o", str(received)], tmp_path / "to-hf.log")
        _assert_same_tensors(_files(received), _files(_to_hf(tmp_path, version)))
    assert sorted(p.name for p in (tmp_path / "received").glob("v*")) == ["v1", "v2", "v3"]
    for rank in (0, 1):
        skipped, cut = (tmp_path / "received" / f"refused.rank{rank}.txt").read_text().splitlines()
        assert skipped.startswith("weight update 5: expected version 4") and cut.startswith("weight update 6: incomplete")


def test_zero3_updates_atomic(tmp_path):
    """ZeRO-3 DP=2: each rank sends its own partitions; the receiver loads each update once it is whole."""
    port = _free_port()
    receiver = _start_receiver(tmp_path / "recv", port, "--updates", "3", "--atomic")
    _train(tmp_path, port, ["--tp", "1", "--zero", "3", "--steps", "3", "--hf-weights", str(tmp_path / "hfw"),
                            "--hf-names", "files", "--bucket-bytes", "65536",
                            *[a for s in (1, 2, 3) for a in ("--save-at", str(s))]])
    assert _finish(receiver) == 0
    _check_updates(tmp_path, tmp_path / "recv", [1, 2, 3], names="files")


def test_expert_parallel_updates(tmp_path):
    """AutoEP EP=2 (Mixtral): each rank sends its experts; the receiver's transformers model has them fused as
    transformers 5 keeps them (gate_up_proj), the files' names one expert at a time."""
    port = _free_port()
    receiver = _start_receiver(tmp_path / "recv", port, "--updates", "3", "--family", "mixtral")
    _train(tmp_path, port, ["--family", "mixtral", "--tp", "1", "--zero", "1", "--ep", "2", "--steps", "3",
                            "--hf-weights", str(tmp_path / "hfw"), "--hf-names", "files",
                            *[a for s in (1, 2, 3) for a in ("--save-at", str(s))]])
    assert _finish(receiver) == 0
    _check_updates(tmp_path, tmp_path / "recv", [1, 2, 3], names="files")


def test_lora_updates_merged_and_adapters_alone(tmp_path):
    """peft LoRA under AutoTP TP=2: the receiver (a plain model) gets the merged weights, as to-hf --merge writes
    them; hf_weights(adapters="only") gives what to-hf writes as the PEFT adapter, bit for bit; and a receiver that is
    the peft model takes the adapters alone over a second group (a few KB an update), the same tensors."""
    port, adapters_port = _free_port(), _free_port()
    receiver = _start_receiver(tmp_path / "recv", port, "--updates", "2")
    peft_receiver = _start_receiver(tmp_path / "peft", adapters_port, "--updates", "2", "--peft-lora", "4")
    _train(tmp_path, port, ["--tp", "2", "--zero", "1", "--lora", "4", "--steps", "2", "--hf-weights",
                            str(tmp_path / "hfw"), "--hf-names", "files", "--hf-adapters", str(tmp_path / "adapters"),
                            "--adapters-group", f"127.0.0.1:{adapters_port}", "--save-at", "1", "--save-at", "2"])
    assert _finish(receiver) == 0 and _finish(peft_receiver) == 0
    _check_updates(tmp_path, tmp_path / "recv", [1, 2], "--merge", names="files")
    for step in (1, 2):
        streamed = torch.load(tmp_path / "adapters" / f"step{step}.pt")
        _assert_same_tensors(streamed, _files(_to_hf(tmp_path, step)))
        # The live names (".default." in them), in the dtype peft keeps adapters in (fp32): the same values.
        received = torch.load(tmp_path / "peft" / f"adapters_v{step}.pt")
        _assert_same_tensors({name.replace(".default.", "."): t.to(torch.bfloat16) for name, t in received.items()},
                             streamed)
