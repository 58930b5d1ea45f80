"""``--distributed`` past one machine: two torchrun launchers, each a "host" of one rank (``--nnodes 2``, its own
``--node-rank``, a static rendezvous at the first's address), convert a block-FP8 release into the universal form
on a file system both see. The output is byte for byte the single-process conversion's, every file; a second job
in which one host cannot read the release refuses on both with the same line and publishes nothing."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import torch

from deepspeed_ext.demo.models import build_model
from harness import releases
from harness.cli import universal_in
from harness.runner import child_env, cli


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _two_hosts(arguments: list[str], logs: Path, sources: tuple[Path, Path]) -> list[subprocess.CompletedProcess]:
    """``deepspeed-ext ARGUMENTS --distributed`` launched by two torchrun processes, node ranks 0 and 1 (host
    ``n`` reads ``sources[n]``), each in a directory of its own; both waited for."""
    port = _free_port()
    env = {**child_env(), "GLOO_SOCKET_IFNAME": "lo"}
    launches = []
    for node, source in enumerate(sources):
        home = logs / f"host{node}"
        home.mkdir(parents=True)
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                   "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port), "-m",
                   "deepspeed_ext", arguments[0], str(source), *arguments[1:], "--distributed", "--quiet"]
        log = open(home / "log", "w")
        launches.append((subprocess.Popen(command, cwd=home, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    done = []
    for process, log in launches:
        try:
            process.wait(timeout=600)
        finally:
            log.close()
        done.append(subprocess.CompletedProcess(process.args, process.returncode, Path(log.name).read_text()))
    return done


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_two_hosts_write_what_one_process_writes(tmp_path):
    release = releases.write_fp8(build_model("llama", seed=5).to(torch.bfloat16), tmp_path / "release")
    single = tmp_path / "single"
    cli(["from-hf", str(release), "-o", str(single), "--quiet"], tmp_path / "single.log")

    shared = tmp_path / "shared"  # the file system both hosts see
    out = shared / "universal"
    for run in _two_hosts(["from-hf", "-o", str(out)], tmp_path / "job", (release, release)):
        assert run.returncode == 0, run.stdout[-3000:]
    ours, theirs = universal_in(out), universal_in(single)
    assert _files(ours) == _files(theirs) and len(_files(ours)) > 10
    for relative in _files(theirs):
        assert (ours / relative).read_bytes() == (theirs / relative).read_bytes(), relative
    assert sorted(p.name for p in shared.iterdir()) == ["universal"]  # nothing else, no partial output

    # One host's copy of the release is damaged: both refuse with one line, nothing is published.
    damaged = tmp_path / "damaged"
    shutil.copytree(release, damaged)
    shard = sorted(damaged.glob("*.safetensors"))[0]
    os.truncate(shard, 7)
    refused = _two_hosts(["from-hf", "-o", str(tmp_path / "shared2" / "universal")], tmp_path / "job2",
                         (release, damaged))
    assert all(run.returncode != 0 for run in refused)
    lines = [line for line in refused[0].stdout.splitlines() if line.startswith("deepspeed-ext: error:")]
    assert len(lines) == 1 and shard.name in lines[0], refused[0].stdout[-3000:]
    assert not (tmp_path / "shared2").exists() or not any((tmp_path / "shared2").iterdir())  # nothing published
