import pytest

from harness.scenario import Scenario


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
