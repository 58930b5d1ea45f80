"""An output being staged is interrupted (SIGINT) while a thread re-creates it by path, as a library's writer
threads do (tensorstore makes a file's directories, then writes it); for tests/unit/test_source_safety.py.

    python interrupted_staging.py OUT main|thread

``main``: the signal is sent to the process from the main thread. ``thread``: it is delivered to another thread
(``pthread_kill``) while the main thread waits in a lock that nothing will release: the C-level handler runs on
that other thread, and the main thread never gets to run the Python-level one. Either way the process must end
with exit 130, one line, and (once it and its sweeper are gone) nothing of OUT or its staging left.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from deepspeed_ext.checkpoint import output


def main() -> None:
    out, where = Path(sys.argv[1]), sys.argv[2]
    output.exit_on_interrupt()
    with output.staged(out) as partial:
        written = threading.Event()

        def rewrite() -> None:  # by path, for as long as the process lives
            while True:
                try:
                    (partial / "leaf").mkdir(parents=True, exist_ok=True)
                    (partial / "leaf" / "chunk").write_bytes(b"x" * 4096)
                except OSError:  # between the rename and the re-creation
                    continue
                written.set()

        threading.Thread(target=rewrite, daemon=True).start()
        written.wait()
        if where == "thread":
            def interrupt_here() -> None:
                time.sleep(0.2)  # the main thread is in its lock by then
                signal.pthread_kill(threading.get_ident(), signal.SIGINT)
                threading.Event().wait()

            threading.Thread(target=interrupt_here, daemon=True).start()
        else:
            os.kill(os.getpid(), signal.SIGINT)
        never = threading.Lock()
        never.acquire()
        never.acquire()  # the main thread waits here for good


if __name__ == "__main__":
    main()
