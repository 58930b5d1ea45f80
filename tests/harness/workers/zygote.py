"""torchrun's workers for the tests without importing torch, DeepSpeed and transformers in each of them: this process
imports them once, then forks a child per worker that ``zygote_launch.py`` (what torchrun runs in their place)
asks for. The child becomes ``python -u SCRIPT ARGS`` (or ``python -u -m MODULE ARGS``) in the launcher's
directory, environment, stdin, stdout and stderr, and ends as that process would: its exit code, or the signal that
ended it, goes back to the launcher, which ends the same way. Those imports are ~10 CPU-s per worker on the CI
machine, most of a tiny training run: the suite's torchrun workers spent about a third of its time importing.

    .venv/bin/python zygote.py SOCKET

Requests come over a Unix seqpacket socket at SOCKET, one message each: ``{"argv", "env", "cwd", "python"}`` with
the launcher's descriptors 0, 1, 2. The answers: ``{"pid": N}`` once the child runs, then ``{"returncode": N}``
(negative: the signal that ended it); or ``{"refused": WHY}``, and the launcher runs the worker itself: another
Python, or an environment that differs from this process's in anything but what torchrun sets per worker (what the
preloaded modules read as they were imported would differ from a fresh process's).

The child watches its launcher: once the launcher is gone (killed by torchrun's agent, or by a test), the child is
SIGKILLed, as torchrun's own worker would have been. What is imported here is what every training worker imports
(nothing a worker imports only in some runs: the Trainer, Accelerate, peft, whose presence deepspeed-ext reads), and
imports start no thread (checked: a fork copies only the thread that forks).
"""

from __future__ import annotations

import json
import os
import socket
import sys

#: What torchrun's agent sets per worker, and what the test harness sets per run: the only variables in which a
#: request's environment may differ from this process's.
PER_WORKER = {"GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK",
              "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "WORLD_SIZE",
              "PYTEST_CURRENT_TEST"}
#: deepspeed-ext's own variables (DEEPSPEED_EXT_FAULT, the harness's DSX_TEST_*) may differ too: nothing here
#: imports deepspeed-ext (checked), so they are read by the child alone, as in a fresh process.
PER_WORKER_PREFIXES = ("TORCHELASTIC_", "DEEPSPEED_EXT_", "DSX_")
#: The largest request (its environment, mostly).
MESSAGE_BYTES = 1 << 20


def preload() -> None:
    import threading

    import numpy  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import transformers  # noqa: F401
    import transformers.modeling_utils  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401

    import deepspeed  # noqa: F401
    import deepspeed.comm  # noqa: F401
    import deepspeed.runtime.engine  # noqa: F401
    import deepspeed.runtime.zero.stage3  # noqa: F401
    import deepspeed.runtime.zero.stage_1_and_2  # noqa: F401
    assert not [name for name in sys.modules if name.split(".")[0] == "deepspeed_ext"], "deepspeed-ext imported"
    threads = len(os.listdir("/proc/self/task"))
    assert threading.active_count() == 1 and threads == 1, f"the preloaded modules started {threads - 1} threads"


#: The environment this process started with, and what its imports changed in it (deepspeed sets
#: PYTORCH_NVML_BASED_CUDA_CHECK, torch TORCHINDUCTOR_CACHE_DIR): a fresh worker's imports would change the same.
STARTED_WITH = dict(os.environ)
IMPORTS_CHANGED: dict[str, str | None] = {}


def refusal(request: dict) -> str | None:
    """Why this process cannot stand in for the request's fresh worker, or None."""
    if request["python"] != sys.executable:
        return f"another Python ({request['python']})"
    env = request["env"]
    differ = sorted(key for key in set(env) | set(STARTED_WITH)
                    if env.get(key) != STARTED_WITH.get(key) and key not in PER_WORKER
                    and not key.startswith(PER_WORKER_PREFIXES)
                    # set already, by a parent that imported the same modules, to what our imports set it to
                    and not (key in IMPORTS_CHANGED and env.get(key) == IMPORTS_CHANGED[key]))
    return f"its environment differs in {', '.join(differ)}" if differ else None


def become(request: dict, fds: list[int], conn: socket.socket) -> None:
    """In the forked child: become the request's worker. Returns only by raising (SystemExit included), which ends
    the child as the worker's own ending would end a fresh interpreter."""
    import random
    import runpy
    import signal
    import threading

    import numpy
    for fd, target in zip(fds, (0, 1, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for key, value in IMPORTS_CHANGED.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    # Seeded from the OS at import in a fresh process; here they would be this process's, the same in every child.
    random.seed()
    numpy.random.seed()

    def watch() -> None:
        """The launcher never writes after its request: anything received, or the end of the connection, means it
        is gone."""
        try:
            conn.recv(1)
        finally:
            os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="zygote-launcher-watch", daemon=True).start()
    argv = request["argv"]
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()  # as ``python -m`` sets it
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))  # as ``python SCRIPT`` sets it
        runpy.run_path(argv[0], run_name="__main__")
    raise SystemExit(0)


def serve(path: str) -> None:
    import ctypes
    import selectors
    ctypes.CDLL(None).prctl(1, 15)  # PR_SET_PDEATHSIG, SIGTERM: this process ends with the test process that started it
    if os.getppid() == 1:
        return  # it ended already
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)  # launchers that come while the imports run wait in the backlog
    preload()
    IMPORTS_CHANGED.update({key: os.environ.get(key) for key in set(os.environ) | set(STARTED_WITH)
                            if os.environ.get(key) != STARTED_WITH.get(key)})
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    running: dict[int, tuple[int, socket.socket]] = {}  # pidfd: (pid, the launcher's connection)
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    message, fds, _, _ = socket.recv_fds(conn, MESSAGE_BYTES, 3)
                    request = json.loads(message)
                except (OSError, ValueError):
                    conn.close()
                    continue
                why = refusal(request) if len(fds) == 3 else "no descriptors"
                if why is not None:
                    for fd in fds:
                        os.close(fd)
                    conn.send(json.dumps({"refused": why}).encode())
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    for pidfd, (_, other) in running.items():
                        os.close(pidfd)
                        other.close()
                    become(request, fds, conn)
                for fd in fds:
                    os.close(fd)
                conn.send(json.dumps({"pid": pid}).encode())
                pidfd = os.pidfd_open(pid)
                running[pidfd] = (pid, conn)
                selector.register(pidfd, selectors.EVENT_READ)
            else:
                pidfd = key.fd
                pid, conn = running.pop(pidfd)
                selector.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                try:
                    conn.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:
                    pass  # the launcher is gone
                conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
