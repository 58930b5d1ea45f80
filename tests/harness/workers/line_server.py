"""The loop of the tests' request servers in .venv-maxtext (maxtext_forward.py, maxtext_train.py): one JSON
request a line of stdin, one JSON answer a line of stdout, until stdin closes."""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable


def answer_lines(handle: Callable[[dict], dict]) -> None:
    """``handle(request)`` for each request; its answer, or ``{"ok": false, "error": TRACEBACK}`` where it raised
    (the caller fails its test with it; the next request starts afresh). Whatever the libraries print goes to
    stderr, so stdout holds only the answers."""
    answers, sys.stdout = sys.stdout, sys.stderr
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            answer = handle(json.loads(line))
        except Exception:
            answer = {"ok": False, "error": traceback.format_exc()}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()
