import subprocess

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


@pytest.fixture
def small_disk(tmp_path):
    """A 2.5 MB tmpfs (a real full disk): room for one save of the tiny model (1.5 MB), not two. Root only: skipped
    where it cannot be mounted, a failure under CI=true, which runs as root (tests/conftest.py)."""
    import os
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2500k", "tmpfs", str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
