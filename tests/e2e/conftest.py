import pytest

from harness.scenario import Scenario, scenario_cache_dir, shared_scenario


@pytest.fixture(scope="session")
def scenarios(tmp_path_factory):
    """``scenarios(name, **kw)``: a trained and converted Scenario, trained once per test run (the first worker to
    ask trains it, the other copies it: ``shared_scenario``) and built once per worker."""
    cache: dict[tuple[str, bool, str], Scenario] = {}
    trained = scenario_cache_dir(tmp_path_factory.getbasetemp())

    def get(name: str, convert: bool = True, **kwargs) -> Scenario:
        key = (name, convert, Scenario(root=tmp_path_factory.getbasetemp(), **kwargs).spec())
        if key not in cache:
            cache[key] = shared_scenario(name, tmp_path_factory.mktemp(name), trained, convert=convert, **kwargs)
        return cache[key]

    return get
