"""``python -m deepspeed_ext ARGS`` for the tests, a fresh process each time, without importing torch each time:
this process imports what every command imports (torch, numpy, the CLI's own modules), then forks a child per
request that runs the command as ``python -m deepspeed_ext`` would and exits as it would (its exit code, or the
signal that ended it). Used by ``harness.runner.cli``; a command costs tenths of a second instead of seconds.

    .venv/bin/python cli_server.py

Each line on stdin is a request: ``{"argv": [...], "env": {...}, "stdout": FILE, "stderr": FILE}`` (the command
runs in this process's directory). The answers, one JSON line each on stdout: ``{"pid": N}`` once the child runs, then ``{"returncode": N}``
(negative: the signal that ended it) once it has ended.

JAX, Orbax and tensorstore are imported here too (the MaxText commands' seconds of start): importing them starts
no thread (checked below: a fork copies only the thread that forks), their backends start in the child.
What is not imported here on purpose: DeepSpeed (commands read checkpoints without it, and what they read
depends on whether it is imported: ``serialization.allowed_globals``), transformers (a command imports it only
where it needs it). Environment variables that those modules read as they are imported are therefore the
request's own, as in a fresh process; the ones torch and JAX read here are the same for every request
(``harness.runner`` restarts this server, or runs a real subprocess, when they are not).
"""

from __future__ import annotations

import json
import os
import sys


def preload() -> None:
    import threading

    import numpy  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import tqdm  # noqa: F401

    import deepspeed_ext.cli  # noqa: F401
    tasks = len(os.listdir("/proc/self/task"))  # torch's own, which every command has anyway
    import jax  # noqa: F401
    import orbax.checkpoint  # noqa: F401
    import tensorstore  # noqa: F401
    assert threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == tasks, \
        "importing JAX / Orbax started a thread: a forked command would lack it"
    assert "deepspeed" not in sys.modules and "transformers" not in sys.modules, "the server must not import these"


def run_command(request: dict, answers: int) -> None:
    """In the forked child: become ``python -m deepspeed_ext ARGV`` in the request's environment,
    with stdout and stderr in its files. Returns only by raising (SystemExit included), which ends the child as
    the command's own ending would end a fresh interpreter: exit code, atexit handlers, flushed output."""
    import runpy
    os.close(answers)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = os.getcwd()  # as ``python -m`` sets it, not this script's directory
    sys.argv = [sys.argv[0], *request["argv"]]
    runpy.run_module("deepspeed_ext", run_name="__main__", alter_sys=True)
    raise SystemExit(0)


def serve() -> None:
    # The answers go to the pipe that is stdout now; whatever a module prints goes to stderr.
    answers = os.dup(1)
    os.dup2(2, 1)
    preload()
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run_command(request, answers)
        os.write(answers, (json.dumps({"pid": pid}) + "\n").encode())
        _, status = os.waitpid(pid, 0)
        os.write(answers, (json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n").encode())


if __name__ == "__main__":
    serve()
