"""The ``deepspeed_ext`` logger the runtime writes to: its lines show in the training log beside DeepSpeed's,
configurable by name as usual."""

from __future__ import annotations

import logging

logger = logging.getLogger("deepspeed_ext")
if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[deepspeed-ext] %(levelname)s: %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
