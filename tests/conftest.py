import os
from pathlib import Path

# JAX reads these once, at import: a simulated 4-device CPU mesh for the MaxText/Orbax tests.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

#: tests/unit: library calls in this process. tests/e2e: torchrun runs of the real DeepSpeed engine, the CLI in a
#: subprocess, anything that needs a trained checkpoint; every test there is marked e2e.
E2E_DIR = Path(__file__).parent / "e2e"

#: scripts/test.sh runs the suite on two pytest-xdist workers (--dist loadgroup). A file's tests stay on one
#: worker, so the trained checkpoints its tests share (session and module fixtures) are built once; these files'
#: tests share little beyond one quick scenario, so each test function is a group of its own.
SPLIT_BY_FUNCTION = {"test_end_to_end.py", "test_optimizer_paths.py"}
#: These files' tests are grouped by model family (their ``family`` parameter, or a ``family`` mark): a family's
#: tests share its trained run.
SPLIT_BY_FAMILY = {"test_model_families.py"}
#: These files' tests (each a MaxText run of its own) are each a group.
SPLIT_EACH = {"test_maxtext_model_code.py"}
#: The longest groups start first, so neither worker is left alone with one at the end.
LONGEST_FIRST = ["test_install.py", "test_trainers.py", "test_kv_heads.py"]


@pytest.hookimpl(tryfirst=True)  # before -m selects on the marks, and before xdist reads the groups
def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.is_relative_to(E2E_DIR):
            item.add_marker(pytest.mark.e2e)
        group = item.path.name
        if group in SPLIT_BY_FUNCTION:
            group += "::" + getattr(item, "originalname", item.name)
        elif group in SPLIT_BY_FAMILY:
            callspec = getattr(item, "callspec", None)
            mark = item.get_closest_marker("family")
            family = callspec.params.get("family") if callspec else None
            group += "::" + str(family or (mark.args[0] if mark else ""))
        elif group in SPLIT_EACH:
            group += "::" + item.name
        item.add_marker(pytest.mark.xdist_group(group))
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
