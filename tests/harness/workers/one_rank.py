"""One rank of a multi-rank run whose ranks are given different arguments (torchrun gives every rank the same), for
the tests of refusals that one rank makes and every rank must hear (tests/e2e/test_before_first_step_e2e.py).

    python one_rank.py cli|train RESULT -- ARGS...

with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set as torchrun sets them.
``cli`` runs ``deepspeed-ext ARGS`` (which sets up its own process group and takes it down); ``train`` runs the demo
training script with ARGS, then, whether it raised or not, meets the other ranks at a barrier: the rank's next
collective, where a rank left behind by one that gave up would wait. RESULT gets ``{"rank", "returncode" (cli),
"error" (train: the exception's type and message, or null), "seconds"}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    kind, result, separator, *args = sys.argv[1:]
    assert separator == "--" and kind in ("cli", "train"), sys.argv
    started = time.perf_counter()
    out: dict[str, object] = {"rank": int(os.environ["RANK"])}
    if kind == "cli":
        from deepspeed_ext.cli import main as cli_main
        out["returncode"] = cli_main(args)
    else:
        import torch.distributed as dist

        from deepspeed_ext.demo.train import main as train_main
        try:
            train_main(args)
            out["error"] = None
        except Exception as exc:  # what the test checks: the same refusal on every rank
            out["error"] = f"{type(exc).__name__}: {exc}"
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    out["seconds"] = time.perf_counter() - started
    Path(result).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
