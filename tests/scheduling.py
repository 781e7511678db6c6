"""How the suite spreads over pytest-xdist workers (``--dist loadgroup``, the Makefile's), called from
tests/conftest.py. Kept apart from the conftest (no torch) so that tests/test_scheduling.py can run it in
small pytest processes of its own."""

from __future__ import annotations

import pytest

#: fixture scopes built once per module (or class) in each process that runs one of their tests
PER_MODULE = ("module", "class", "package")


def group_by_module_fixture(items) -> None:
    """Under ``--dist loadgroup`` each test without an ``xdist_group`` goes to whichever worker is free, so a
    module-scoped fixture (a trained run, a grid, a built wheel) was built again on every worker that ran one
    of its tests. Every test that uses such a fixture, directly or through another, joins its module's group,
    so that the fixture is built once; a test that names its own group keeps it."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        info = getattr(item, "_fixtureinfo", None)
        if info is not None and any(d[-1].scope in PER_MODULE for d in info.name2fixturedefs.values() if d):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def group_names(item) -> list[str]:
    """The ``xdist_group`` names of a test, as pytest-xdist reads them."""
    names = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
    return sorted(names)


def write_group_suffix(config, items) -> None:
    """pytest-xdist (3.8) tells its scheduler a test's group by appending ``@group`` to the test's node id on
    the worker, but it writes ``item._nodeid``, which pytest 9.2 no longer reads (it derives ``nodeid`` from a
    structured id): every ``xdist_group`` was silently ignored (pytest-xdist issue 1386). On a worker under
    ``--dist loadgroup`` this writes the suffix where pytest reads it; with a pytest that still reads
    ``_nodeid`` it does nothing, and pytest-xdist's own suffix stands."""
    if not getattr(config.option, "loadgroup", False):  # set on the workers of --dist loadgroup only
        return
    try:
        from _pytest.nodeid import NodeId  # lazy: pytest's private module, absent before pytest 9.2
    except ImportError:  # a pytest before structured node ids: pytest-xdist's suffix works there
        return
    for item in items:
        names = group_names(item)
        if names and isinstance(getattr(item, "_id", None), NodeId):
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")


#: tiers whose tests take seconds to a minute each (whole audits and grids, the real model)
HEAVY = ("e2e", "slow")


def heavy_modules_first(items) -> None:
    """pytest-xdist hands out work in collection order, so a module of minute-long tests that sorts late in the
    alphabet (test_mirage_grid, test_ray_cluster, test_tune) ran while the other worker had run out of work:
    the suite's wall time was the later worker's. Modules holding an ``e2e`` or ``slow`` test move to the front,
    in their order, and the seconds-long tests fill in behind them; each module's tests stay together and in
    their order, so module-scoped fixtures are built as before."""
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)

    def light(module: str) -> bool:
        return not any(item.get_closest_marker(m) is not None for item in modules[module] for m in HEAVY)

    items[:] = [item for module in sorted(modules, key=light) for item in modules[module]]
