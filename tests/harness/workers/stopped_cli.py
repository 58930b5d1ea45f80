"""``deepspeed-ext ARGS`` stopped at a named point of its work: the process sends itself SIGKILL (kill -9, the OOM
killer) or SIGINT (Ctrl-C) the COUNT-th time a conversion reaches POINT, for the tests of what an interrupted
conversion leaves (tests/e2e/test_end_to_end.py, tests/e2e/test_source_safety_e2e.py).

    python stopped_cli.py POINT COUNT SIGNAL -- ARGS...

POINT is where a writer takes its input from the source, through :class:`LogicalTensor`, the one class every
source hands its tensors over in. The one point, ``range-read``: a range of a tensor state has been handed over
whole (the writer asked ``LogicalTensor.blocks`` for a block after its last), as every writer streams a DeepSpeed
or Hugging Face source. to-universal / from-hf have then written that state's bytes into its ``NAME.tmp`` file,
not yet renamed; to-maxtext is inside Orbax's write of a leaf (its staging holds Orbax's temporary step).

The saves have fault points of their own (``DEEPSPEED_EXT_FAULT``, deepspeed_ext/checkpoint/faults.py); the
converters have none, so the point is set here. Stopping at a point of the work instead of after a delay is what
makes the tests deterministic: on a fast machine a timed kill finds the conversion finished.

The thread that reached the point then waits for good: a Ctrl-C cannot be outrun by the rest of the conversion
(publishing before the signal handler runs), so the test sees the interrupt land mid-write every time. Before the
signal, ``stopped at POINT #COUNT`` goes to stdout, so a test tells this stop from any other end.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

POINTS = ("range-read", )


def install(point: str, count: int, sig: signal.Signals) -> None:
    from deepspeed_ext.checkpoint.tensor import LogicalTensor
    reached = 0
    lock = threading.Lock()  # writer threads reach the points concurrently

    def arrive() -> None:
        nonlocal reached
        with lock:
            reached += 1
            now = reached
        if now != count:
            return
        sys.stdout.write(f"stopped at {point} #{count}\n")
        sys.stdout.flush()
        os.kill(os.getpid(), sig)
        threading.Event().wait()  # SIGKILL ends us here; SIGINT's handler runs in the main thread meanwhile

    blocks = LogicalTensor.blocks

    def counted_blocks(self: LogicalTensor, *args: Any, **kwargs: Any) -> Iterator[Any]:
        yield from blocks(self, *args, **kwargs)
        arrive()  # the consumer asked for more after the last block: the range is handed over

    LogicalTensor.blocks = counted_blocks  # type: ignore[method-assign]


def main() -> None:
    point, count, name, separator, *args = sys.argv[1:]
    if point not in POINTS or separator != "--":
        raise SystemExit(__doc__)
    install(point, int(count), signal.Signals[name])
    from deepspeed_ext.cli import main as cli_main
    sys.argv = ["deepspeed-ext", *args]
    sys.exit(cli_main())  # no argv: run as the program, with its own Ctrl-C handling


if __name__ == "__main__":
    main()
