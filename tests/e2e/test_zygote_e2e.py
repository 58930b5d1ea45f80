"""The test harness's zygote (tests/harness/workers/zygote.py): a worker it forks in place of torchrun's fresh one
is that worker in all a test can see: its arguments, directory, environment, descriptors, ``sys.path``, exit code
or signal, and it goes when its launcher goes. What it refuses (another environment) runs afresh."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import runner

PROBE = """
import json, os, random, signal, sys
mode = sys.argv[1]
if mode == "report":
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "pid": os.getpid(),
                      "ppid": os.getppid(), "probe": os.environ.get("ZYGOTE_PROBE"), "random": random.random(),
                      "modules": "deepspeed" in sys.modules, "input": sys.stdin.read()}))
    sys.stderr.write("to stderr\\n")
    sys.exit(3)
if mode == "raise":
    raise ValueError("raised by the worker")
if mode == "signal":
    os.kill(os.getpid(), signal.SIGTERM)
if mode == "wait":
    open(sys.argv[2], "w").write(str(os.getpid()))
    import time
    time.sleep(600)
"""


@pytest.fixture(scope="module")
def zygote():
    started = runner._Zygote()
    yield started
    started.close()


def _launch(zygote, script: Path, *args: str, env: dict | None = None, **popen) -> subprocess.Popen:
    environment = {**runner.child_env(), "DSX_TEST_ZYGOTE": str(zygote.socket), **(env or {})}
    return subprocess.Popen([sys.executable, "-u", str(runner.ZYGOTE_LAUNCH), str(script), *args], env=environment,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **popen)


def test_a_forked_worker_is_the_fresh_one_in_all_a_test_sees(zygote, tmp_path):
    script = tmp_path / "scripts" / "probe.py"
    script.parent.mkdir()
    script.write_text(PROBE)
    timing = tmp_path / "timing.log"
    reports = []
    for _ in range(2):
        proc = _launch(zygote, script, "report", "x y", env={"RANK": "1", "DSX_TEST_TIMING_LOG": str(timing)},
                       cwd=tmp_path)
        out, err = proc.communicate("from stdin", timeout=120)
        assert proc.returncode == 3 and err == "to stderr\n", (proc.returncode, err)
        reports.append(json.loads(out))
    first, second = reports
    assert first["argv"] == [str(script), "report", "x y"] and first["cwd"] == str(tmp_path)
    assert first["path0"] == str(script.parent) and first["input"] == "from stdin"
    assert first["modules"] and first["ppid"] == zygote.proc.pid  # forked: DeepSpeed imported already
    assert first["random"] != second["random"]  # seeded afresh, not the zygote's state in every child
    assert not timing.exists()  # nothing ran afresh


def test_an_exception_and_a_signal_end_the_launcher_as_they_end_the_worker(zygote, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    raised = _launch(zygote, script, "raise")
    _, err = raised.communicate(timeout=120)
    assert raised.returncode == 1 and err.rstrip().endswith("ValueError: raised by the worker"), err
    signalled = _launch(zygote, script, "signal")
    signalled.communicate(timeout=120)
    assert signalled.returncode == -signal.SIGTERM


def test_a_worker_goes_when_its_launcher_is_killed_and_a_signal_to_the_launcher_reaches_it(zygote, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    for how in (signal.SIGKILL, signal.SIGTERM):
        pid_file = tmp_path / f"pid.{how.name}"
        proc = _launch(zygote, script, "wait", str(pid_file))
        deadline = time.monotonic() + 120
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        worker = int(pid_file.read_text())
        proc.send_signal(how)
        proc.communicate(timeout=60)
        assert proc.returncode == -how  # SIGTERM: forwarded, and the launcher ends as the worker did
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{worker}") and time.monotonic() < deadline:
            time.sleep(0.05)  # the zygote reaps it
        assert not os.path.exists(f"/proc/{worker}"), how


def test_another_environment_runs_afresh_and_says_why(zygote, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    timing = tmp_path / "timing.log"
    proc = _launch(zygote, script, "report", env={"ZYGOTE_PROBE": "set", "DSX_TEST_TIMING_LOG": str(timing)})
    out, _ = proc.communicate("", timeout=120)
    report = json.loads(out)
    assert proc.returncode == 3 and report["probe"] == "set" and not report["modules"]
    assert report["pid"] == proc.pid  # the launcher became the worker
    assert "its environment differs in ZYGOTE_PROBE" in timing.read_text()


def test_torchrun_commands_are_rewritten_only_for_workers_that_build_an_engine():
    env = runner.child_env()
    train = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
             str(runner.TRAIN_WORKER), "--tp", "2"]
    command, with_zygote = runner.zygote_workers(train, env)
    assert command == [*train[:5], str(runner.ZYGOTE_LAUNCH), *train[5:]]
    assert with_zygote["DSX_TEST_ZYGOTE"]
    module = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "-m", "deepspeed_ext.demo.train",
              "--steps", "1"]
    command, _ = runner.zygote_workers(module, env)
    assert command == [*module[:5], str(runner.ZYGOTE_LAUNCH), "-m", "deepspeed_ext.demo.train", "--steps", "1"]
    cli = [sys.executable, "-m", "torch.distributed.run", "--standalone", "-m", "deepspeed_ext", "to-universal", "x"]
    assert runner.zygote_workers(cli, env) == (cli, env)  # the CLI never imports DeepSpeed: afresh
