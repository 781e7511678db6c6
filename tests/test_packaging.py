"""A wheel install carries what the checkout has: the shipped specs, the shipped protocols frozen,
the CLI package; and running a shipped spec never writes into the installed package."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e  # builds and installs the wheel, then runs the installed package


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    built = subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if built.returncode != 0:
        pytest.fail(f"building the wheel failed: {built.stderr[-2000:]}")
    (wheel,) = (tmp / "dist").glob("splitleak-*.whl")
    site = tmp / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, timeout=300)
    return wheel, site


def test_the_wheel_ships_specs_frozen_protocols_and_the_cli(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    for spec in ("paper_main", "partial_offloading"):
        assert f"splitleak/experiments/specs/{spec}.yaml" in names
        assert f"splitleak/audit/protocols/{spec}.yaml" in names
        assert f"splitleak/audit/protocols/{spec}.yaml.frozen.json" in names
    assert {"splitleak/cli/__init__.py", "splitleak/cli/__main__.py"} <= names
    claims = {f"splitleak/reproduce/claims/{p}.yaml" for p in ("000", "002", "003")}
    assert claims | {"splitleak/reproduce/claims/CLAIMS.sha256.json"} <= names
    assert not any(n.startswith("tests/") or n.endswith(".pyc") for n in names)


def _tree(d: Path) -> dict[str, int]:
    return {str(p.relative_to(d)): p.stat().st_mtime_ns for p in d.rglob("*") if "__pycache__" not in p.parts}


def test_a_shipped_spec_plans_from_an_installed_package_without_writing_into_it(installed, tmp_path):
    _, site = installed
    before = _tree(site)
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    code = (
        "import splitleak, splitleak.experiments as e; "
        "p = e.resolve_spec_path('paper_main'); print(p); "
        "print(e.load_spec('paper_main', 'quick').default_store()); "
        "from splitleak.audit.protocol import SHIPPED, load_protocol; "
        "print(load_protocol(SHIPPED / 'paper_main.yaml')[1])"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    spec, store, digest = r.stdout.split()
    assert Path(spec).is_relative_to(site)  # found in the installed package, not in the checkout
    assert Path(store) == tmp_path / "paper_main-results"  # a shipped spec's store goes to the current directory
    assert len(digest) == 64
    plan = subprocess.run(
        [sys.executable, "-m", "splitleak.cli", "experiment", "plan", "paper_main", "--profile", "quick"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plan.returncode == 0, plan.stderr
    assert "attack" in plan.stdout
    assert _tree(site) == before  # nothing written into the package (no frozen record, no store)
    assert not (tmp_path / "paper_main-results").exists()  # planning writes nothing
