import os
from pathlib import Path

# JAX reads these once, at import: a simulated 4-device CPU mesh for the MaxText/Orbax tests.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

#: tests/unit: library calls in this process. tests/e2e: torchrun runs of the real DeepSpeed engine, the CLI in a
#: subprocess, anything that needs a trained checkpoint; every test there is marked e2e.
E2E_DIR = Path(__file__).parent / "e2e"

#: scripts/test.sh runs the suite on three pytest-xdist workers (--dist loadgroup). A file's tests stay on one
#: worker, so what its tests share (module fixtures, a scenario's resumes) is built once; trained scenarios are
#: trained once per run whichever worker asks (harness.scenario.shared_scenario). These files' tests share little
#: beyond scenarios, so each test function is a group of its own.
SPLIT_BY_FUNCTION = {"test_end_to_end.py", "test_optimizer_paths.py"}
#: These files' tests are grouped by model family (their ``family`` parameter, or a ``family`` mark): a family's
#: tests share its trained run.
SPLIT_BY_FAMILY = {"test_model_families.py", "test_recent_families_e2e.py"}
#: These files' tests (each a MaxText run or conversion of its own, sharing no fixture but trained scenarios) are
#: each a group: as one group, tests/unit/test_maxtext.py alone was most of the fast tier's wall time (and
#: test_hf.py, a conversion per family, its last 50 s on one worker), and
#: test_maxtext_continue_e2e.py (a MaxText training run per test) 13 minutes of one worker.
SPLIT_EACH = {"test_maxtext_model_code.py", "test_maxtext.py", "test_maxtext_continue_e2e.py", "test_conformance.py",
              "test_maxtext_optimizer_e2e.py", "test_hf.py", "test_recent_releases.py"}
#: tests/e2e/test_weight_streaming_e2e.py stays one group: each of its tests runs six processes beside the workers'
#: pools (two training ranks, two receivers, a receiving engine's two ranks); three at once ran the machine out of
#: memory (24 GiB), and the kernel killed a worker.
#: The longest groups start first, so no worker is left alone with one at the end (scripts/test.sh passes
#: --no-loadscope-reorder, else pytest-xdist orders the groups by their number of tests instead); the rest keep
#: collection order, the many short unit-test groups last, where they fill in. By the seconds their processes ran
#: in a CI run (DSX_TEST_TIMING_LOG), test_install.py's single test first; test_weight_streaming_e2e.py early
#: also while the workers' pools are still few (its six processes each need memory).
LONGEST_FIRST = ["test_install.py", "test_trainers.py", "test_save_safety_e2e.py", "test_weight_streaming_e2e.py",
                 "test_pipeline_parallel.py", "test_async_save_e2e.py", "test_fingerprints_e2e.py",
                 "test_older_deepspeed.py", "test_node_local_e2e.py", "test_adapters_trainer_e2e.py",
                 "test_maxtext_continue_e2e.py", "test_kv_heads.py", "test_expert_parallel.py", "test_maxtext.py"]

#: The skips that stay skips under CI=true, by their exact reason: each is about the platform the test runs on,
#: which no setup changes, not about something scripts/setup.sh installs. Every other skip (a missing package or
#: environment, a tmpfs that cannot be mounted, a missing syscall) fails under CI instead (``_failed_in_ci``):
#: a CI run that quietly tested less would pass without testing. Add a reason here only for such a platform fact.
PLATFORM_SKIPS = {
    # tests/unit/test_ranges.py: the reader finds mapped files in Linux's /proc; CI runs on Linux, so it runs there.
    "finds mapped files in /proc/self/maps",
    # tests/unit/test_zipcheck.py: setup.py installs isal only on the CPU architectures it has wheels for.
    "isal is installed only where it has wheels",
}


def _failed_in_ci(report: pytest.TestReport | pytest.CollectReport) -> None:
    """Under CI=true, a skip (of a test, or of a whole module at its collection) not in PLATFORM_SKIPS becomes a
    failure naming its reason and where it was raised."""
    if not report.skipped or hasattr(report, "wasxfail"):  # an xfail is reported as a skip: it is no skip
        return
    from harness.environments import in_ci  # (pytest.ini: pythonpath = tests) imported once a test skips
    if not in_ci():
        return
    path, line, message = report.longrepr  # a skip's longrepr: where it was raised, and "Skipped: <reason>"
    reason = message.removeprefix("Skipped: ")
    if reason not in PLATFORM_SKIPS:
        report.outcome = "failed"
        report.longrepr = (f"{path}:{line}: skipped under CI=true, where no test may skip but for the platform "
                           f"(tests/conftest.py: PLATFORM_SKIPS): {reason}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    _failed_in_ci(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A module that skips at its top (``pytest.importorskip``, ``pytest.skip(..., allow_module_level=True)``) is
    a skipped collection, not a skipped test."""
    report = yield
    _failed_in_ci(report)
    return report


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
            # pytest-xdist reads a group after the node id's last "@" only if no "]" follows it: no brackets here.
            group += "::" + item.name.replace("[", "(").replace("]", ")")
        item.add_marker(pytest.mark.xdist_group(group))
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: the controller, as each worker's collection arrives
def pytest_xdist_node_collection_finished(node, ids):
    """Fail at once, not 15 minutes later, where --dist loadgroup groups nothing. pytest-xdist (3.8) sends a test's
    group to the scheduler as a ``@group`` suffix it writes into the worker's node id; pytest 9.2 keeps node ids
    where that write no longer lands (pytest-xdist issue #1386), so every test would run wherever, and a file's
    module fixtures would be built on both workers. requirements-dev.txt pins a pytest where it lands."""
    if node.config.getvalue("dist") != "loadgroup":
        return
    lost = [nodeid for nodeid in ids if nodeid.rfind("@") < nodeid.rfind("]")]  # as pytest-xdist reads the group
    if lost:
        import xdist
        raise pytest.UsageError(
            f"--dist loadgroup groups nothing with pytest {pytest.__version__} and pytest-xdist {xdist.__version__} "
            f"({len(lost)} of {len(ids)} node ids from {node.gateway.id} carry no @group, e.g. {lost[0]}): install "
            "requirements-dev.txt's versions (bash scripts/setup.sh), or run without --dist loadgroup")


def pytest_sessionfinish(session, exitstatus):
    """The pooled torchrun workers end with the session, on every xdist worker, not only at its exit (an ended
    worker runs no exit handlers; the ranks also leave by themselves once their test process is gone)."""
    import sys
    runner = sys.modules.get("harness.runner")
    if runner is not None:
        runner.close_pools()
