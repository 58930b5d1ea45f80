import os

# JAX reads these once, at import: a simulated 4-device CPU mesh for the MaxText/Orbax tests.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

from e2e import Scenario



@pytest.fixture(scope="session")
def scenarios(tmp_path_factory):
    """``scenarios(name, **kw)``: a trained and converted Scenario, built once per test session."""
    cache: dict[str, Scenario] = {}

    def get(name: str, convert: bool = True, **kwargs) -> Scenario:
        if name not in cache:
            scenario = Scenario(root=tmp_path_factory.mktemp(name), **kwargs).train()
            cache[name] = scenario.convert() if convert else scenario
        return cache[name]

    return get
