"""What torchrun runs in place of a test's worker (``zygote_launch.py SCRIPT ARGS`` or ``zygote_launch.py -m MODULE
ARGS``): the worker itself is forked by the test process's zygote (``zygote.py``, at ``$DSX_TEST_ZYGOTE``), which
has imported torch, DeepSpeed and transformers once. This process imports nothing heavy; it hands the zygote its
arguments, directory, environment and descriptors 0-2, passes on the signals torchrun's agent sends (SIGTERM,
SIGINT, ...) and ends as the worker ended (its exit code, or the same signal). Where the zygote refuses (another
Python, an environment that differs in what the preloaded modules read), cannot be reached, or none is set, it
becomes the worker itself: ``python -u SCRIPT ARGS``, as torchrun would have run it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def fresh(why: str) -> None:
    log = os.environ.get("DSX_TEST_TIMING_LOG")
    if log:  # what the suite's timing log counts: workers that paid for their own imports, and why
        with open(log, "a") as out:
            test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
            out.write(f"{os.getpid()}\tfresh-worker\t0\t{why[:200]}\t{test}\n")
    os.execv(sys.executable, [sys.executable, "-u", *sys.argv[1:]])


def main() -> None:
    path = os.environ.get("DSX_TEST_ZYGOTE")
    if not path:
        fresh("no zygote")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(path)
        request = {"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(), "python": sys.executable}
        socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
        answer = json.loads(conn.recv(1 << 16) or b"{}")
    except (OSError, ValueError) as error:
        answer = {"refused": f"the zygote did not answer: {error}"}
    if "pid" not in answer:
        conn.close()
        fresh(answer.get("refused", "the zygote ended"))
    pid = answer["pid"]
    for sig in FORWARDED:
        signal.signal(sig, lambda number, _frame: os.kill(pid, number))
    message = conn.recv(1 << 16)
    if not message:  # the zygote is gone: its child would go on unwatched by anyone but us
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        sys.stderr.write("zygote_launch.py: the zygote ended before the worker\n")
        os._exit(1)
    returncode = json.loads(message)["returncode"]
    if returncode < 0:  # ended by a signal: so is this process (SIGKILL's disposition cannot be set, nor need be)
        if -returncode in FORWARDED:
            signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
        os._exit(128 - returncode)  # a signal this process ignores (SIGPIPE): the shell's code for it
    os._exit(returncode)


if __name__ == "__main__":
    main()
