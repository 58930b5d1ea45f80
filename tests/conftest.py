import os
from pathlib import Path

# JAX reads these once, at import: a simulated 4-device CPU mesh for the MaxText/Orbax tests.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

#: tests/unit: library calls in this process. tests/e2e: torchrun runs of the real DeepSpeed engine, the CLI in a
#: subprocess, anything that needs a trained checkpoint; every test there is marked e2e.
E2E_DIR = Path(__file__).parent / "e2e"


@pytest.hookimpl(tryfirst=True)  # before -m selects on the marks
def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.is_relative_to(E2E_DIR):
            item.add_marker(pytest.mark.e2e)
