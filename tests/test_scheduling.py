"""How the suite spreads over pytest-xdist workers (tests/scheduling.py): the tests that share a module-scoped
fixture run on one worker, so that the fixture is built once, not once per worker; and an ``xdist_group``
keeps its tests on one worker under pytest 9.2, where pytest-xdist 3.8's own grouping silently does nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from scheduling import group_by_module_fixture, heavy_modules_first

pytest_plugins = ("pytester",)

TESTS = Path(__file__).resolve().parent

FIXTURES = """
import pytest

@pytest.fixture(scope="module")
def built():
    return 1

@pytest.fixture
def through(built):
    return built

@pytest.fixture
def plain():
    return 2

@pytest.fixture(scope="session")
def everywhere():
    return 3

class TestKind:
    @pytest.fixture(scope="class")
    def per_class(self):
        return 4

    def test_in_a_class(self, per_class):
        pass

def test_direct(built):
    pass

def test_through_another_fixture(through):
    pass

def test_plain(plain, everywhere, tmp_path):
    pass

@pytest.mark.xdist_group("ray")
def test_with_its_own_group(built):
    pass

@pytest.mark.parametrize("x", [1, 2])
def test_parametrised(x, built):
    pass
"""


@pytest.mark.unit
def test_tests_that_share_a_module_fixture_join_their_module_s_group(pytester, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # collecting one small module needs no plugin
    items = pytester.getitems(FIXTURES)
    group_by_module_fixture(items)
    groups = {item.name: [m.args[0] for m in item.iter_markers("xdist_group")] for item in items}
    module = items[0].nodeid.split("::")[0]
    assert module.endswith(".py")
    assert groups == {
        "test_in_a_class": [module],  # a class-scoped fixture is built once per process too
        "test_direct": [module],
        "test_through_another_fixture": [module],
        "test_plain": [],  # function- and session-scoped fixtures only: scheduled freely
        "test_with_its_own_group": ["ray"],  # a group the test names wins
        "test_parametrised[1]": [module],
        "test_parametrised[2]": [module],
    }


# the two tests of each pair come first in their module, so that pytest-xdist, scheduling test by test, hands
# them to different workers when it ignores their group (as it did before tests/scheduling.py)
WORKERS = """
import os
import pytest

def record(what):
    with open(os.environ["SCHEDULING_LOG"], "a") as f:
        f.write(f"{what} {os.environ['PYTEST_XDIST_WORKER']}\\n")

@pytest.mark.xdist_group("pair")
def test_pair_first():
    record("pair")

@pytest.mark.xdist_group("pair")
def test_pair_second():
    record("pair")

@pytest.fixture(scope="module")
def built():
    record("built")

def test_uses_first(built):
    record("uses")

def test_uses_second(built):
    record("uses")

def test_free_first():
    pass

def test_free_second():
    pass
"""

CONFTEST = f"""
import sys

import pytest

sys.path.insert(0, {str(TESTS)!r})
from scheduling import group_by_module_fixture, write_group_suffix

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    group_by_module_fixture(items)
    write_group_suffix(config, items)
"""


@pytest.mark.integration
def test_under_two_workers_a_group_runs_on_one_worker_and_a_module_fixture_is_built_once(pytester, monkeypatch):
    pytest.importorskip("xdist")
    for var in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID", "PYTEST_ADDOPTS"):
        monkeypatch.delenv(var, raising=False)
    log = pytester.path / "scheduling.log"
    monkeypatch.setenv("SCHEDULING_LOG", str(log))
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # three small processes: xdist alone, named below
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_workers=WORKERS)
    args = ("-p", "xdist.plugin", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider")
    result = pytester.runpytest_subprocess(*args, timeout=120)
    result.assert_outcomes(passed=6)
    lines = [line.split() for line in log.read_text().splitlines()]
    where = {what: sorted(w for kind, w in lines if kind == what) for what in ("pair", "built", "uses")}
    assert len(where["pair"]) == 2 and len(set(where["pair"])) == 1, where
    assert len(where["uses"]) == 2 and len(set(where["uses"])) == 1, where
    assert len(where["built"]) == 1, where  # built once, on the worker that ran both its tests
    assert where["built"] == where["uses"][:1]


@pytest.mark.unit
def test_modules_with_heavy_tests_come_first_and_each_module_stays_whole_and_in_order(pytester, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makeini("[pytest]\nmarkers =\n    e2e: e\n    slow: s\n    unit: u\n")
    pytester.makepyfile(
        test_a="import pytest\n\ndef test_a1():\n    pass\n\ndef test_a2():\n    pass\n",
        test_b="import pytest\n\ndef test_b1():\n    pass\n\n@pytest.mark.e2e\ndef test_b2():\n    pass\n",
        test_c="import pytest\n\n@pytest.mark.unit\ndef test_c1():\n    pass\n",
        test_d="import pytest\n\npytestmark = pytest.mark.slow\n\ndef test_d1():\n    pass\n\ndef test_d2():\n    pass\n",
    )
    items, _ = pytester.inline_genitems("-p", "no:cacheprovider")  # the folder's modules, in name order
    assert [i.name for i in items] == ["test_a1", "test_a2", "test_b1", "test_b2", "test_c1", "test_d1", "test_d2"]
    heavy_modules_first(items)
    assert [i.name for i in items] == ["test_b1", "test_b2", "test_d1", "test_d2", "test_a1", "test_a2", "test_c1"]
