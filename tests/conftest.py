import gc
import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the hub is not reachable here; fail fast instead of retrying
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
#: the commands the tests start run in their own processes, never in a warm worker the user may have running
#: (splitleak.warm); tests/test_warm.py turns it on for its own workers
os.environ["SPLITLEAK_WORKER"] = "off"
#: under pytest-xdist (`make test`, `make check`: two workers on two cores) each worker, and each process a
#: test starts without --threads, computes on one torch thread, so the workers do not oversubscribe the cores;
#: the tokenizers' Rust library (WikiText-2's 4,000 passages per load) encodes on one thread too
XDIST_WORKER = "PYTEST_XDIST_WORKER" in os.environ
if XDIST_WORKER:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from scheduling import group_by_module_fixture, heavy_modules_first, write_group_suffix  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SPLITLEAK_SHARED", REPO.parent / "shared"))
WIKITEXT = SHARED / "data" / "wikitext-2-raw"
GPT2_TOKENIZER = SHARED / "data" / "gpt2-tokenizer"
#: set by .ci/run: a missing shared file fails the test instead of skipping it (CI has ../shared beside the clone)
REQUIRE_SHARED_ENV = "SPLITLEAK_REQUIRE_SHARED"


def need_shared(*paths: Path) -> None:
    """Skip the calling test where a file of ``../shared`` (or ``SPLITLEAK_SHARED``) is missing, saying where it
    was looked for; fail instead where ``SPLITLEAK_REQUIRE_SHARED=1`` (CI), so that no test is skipped silently
    there."""
    missing = [p for p in paths if not p.exists()]
    if not missing:
        return
    why = f"{missing[0]} is not here (set SPLITLEAK_SHARED to the folder that holds data/)"
    if os.environ.get(REQUIRE_SHARED_ENV) == "1":
        pytest.fail(f"{why}; {REQUIRE_SHARED_ENV}=1 requires it", pytrace=False)
    pytest.skip(why)


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1 if XDIST_WORKER else 2)


@pytest.fixture(scope="session")
def wikitext_dir():
    need_shared(WIKITEXT / "wiki.test.raw")
    return WIKITEXT


@pytest.fixture(scope="session")
def smollm2():
    from splitleak.models import preset_available

    ok, why = preset_available("smollm2-135m")
    if not ok:
        pytest.skip(f"smollm2-135m unavailable: {why}")
    return True


# ------------------------------------------------------------------ replayable OS draws

#: the seed of every OS draw a test's runs make in this process (``splitleak.seeds.entropy``: draws="os", the
#: latent mode's keys): drawn once per session by the controller, which pytest-xdist's workers inherit, printed in
#: the session header and beside every failure; set it to replay a session's draws
ENTROPY_ENV = "SPLITLEAK_TEST_ENTROPY"


def pytest_configure(config):
    if ENTROPY_ENV not in os.environ:  # the controller's pytest_configure runs before any worker is started
        import secrets

        os.environ[ENTROPY_ENV] = str(secrets.randbits(32))


def pytest_report_header(config):
    return f"{ENTROPY_ENV}={os.environ[ENTROPY_ENV]} (every test's OS draws; set it to replay them)"


class _Entropy:
    """``splitleak.seeds.entropy`` replaced, for one test or one shared run, by bytes from a generator keyed by
    the session's seed and ``key`` (a test's id, a shared run's configuration): the same draws on a replay,
    whichever worker or order runs it. Processes a test starts (a grid's workers) draw from the OS."""

    def __init__(self, key: str):
        import zlib

        import numpy as np

        self.rng = np.random.default_rng([int(os.environ[ENTROPY_ENV]), zlib.crc32(key.encode())])

    def __call__(self, n: int) -> bytes:
        return self.rng.bytes(n)

    def __enter__(self):
        import splitleak.seeds

        self.kept = splitleak.seeds.entropy
        splitleak.seeds.entropy = self
        return self

    def __exit__(self, *exc):
        import splitleak.seeds

        splitleak.seeds.entropy = self.kept


@pytest.fixture(autouse=True)
def _replayable_draws(request):
    with _Entropy(request.node.nodeid):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("replay", f"{ENTROPY_ENV}={os.environ[ENTROPY_ENV]} pytest '{item.nodeid}'"))


# ------------------------------------------------------------------ test tiers

TIERS = ("unit", "integration", "e2e")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Every test sits in exactly one tier (the markers in pyproject.toml), so `-m unit` and
    `make check` keep meaning what they say; `slow` is a flag on top of a tier. Checked before `-m`
    deselects anything, so a test without a tier fails every run, not only the runs that select it. Then the
    tests that share a module-scoped fixture join one pytest-xdist group, and the groups reach the scheduler
    (tests/scheduling.py). A test parametrized by `seed` is marked `reseed` on every seed after its first."""
    wrong = []
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.indices.get("seed", 0) > 0:
            item.add_marker(pytest.mark.reseed)  # the same test on a further seed: `make test` runs it
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            wrong.append(f"  {item.nodeid}: {', '.join(tiers) if tiers else 'no tier'}")
    if wrong:
        raise pytest.UsageError(
            f"{len(wrong)} test(s) need exactly one tier marker of {', '.join(TIERS)}: put "
            "`pytestmark = pytest.mark.unit` (or integration, e2e) at the top of a file that is one tier, "
            "or `@pytest.mark.unit` on each test (see the markers in pyproject.toml):\n" + "\n".join(wrong)
        )
    group_by_module_fixture(items)
    heavy_modules_first(items)
    write_group_suffix(config, items)


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, hypothesis, every test module) lives for the whole session:
    it is moved out of the collector's reach (``gc.freeze``), so that a full collection (Python's own, and those
    the product asks for between stages: ``training.run._all_local``) walks only what the tests made since. One
    took 0.25 s in a pytest process that had run two test files (profiled by hand); nothing frozen is ever freed,
    as nothing imported is."""
    gc.collect()
    gc.freeze()


# ------------------------------------------------------------------ shared tiny runs# ------------------------------------------------------------------ shared tiny runs


def _listing(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.relative_to(folder).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def _made_once(tmp_path_factory, name: str, make) -> tuple[Path, dict[str, tuple[int, int]]]:
    """``make(folder)`` once per session, even under pytest-xdist: the workers share one folder (the parent
    of their own base temps) and the first to ask makes it under a file lock while the others wait. Returns
    the folder and its listing as made, which the caller checks again at the end of its session."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    root = root.parent if XDIST_WORKER else root
    folder, record = root / name, root / f"{name}.listing.json"
    with FileLock(str(root / f"{name}.lock")):
        if not record.is_file():
            shutil.rmtree(folder, ignore_errors=True)  # what a worker that failed to make it left
            folder.parent.mkdir(parents=True, exist_ok=True)
            make(folder)
            record.write_text(json.dumps(_listing(folder)))
    listing = {k: (size, mtime) for k, (size, mtime) in json.loads(record.read_text()).items()}
    return folder, listing


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    """Tiny runs trained once per session, shared by every test that asks for the same configuration.

    ``shared_run(config)`` with a TrainConfig, or ``shared_run(**kwargs)`` with make_train_config's
    arguments, returns the run folder (trained on the CPU; once for all pytest-xdist workers). Read only:
    a test that writes into its run, or trains under a spy or a monkeypatch, trains its own. At the end of
    the session every shared run must still be what training left, or the session reports which files a
    test changed."""
    from splitleak.training import make_train_config, run_training

    runs: dict[str, tuple[Path, dict]] = {}

    def get(config=None, **kwargs) -> Path:
        if (config is None) == (not kwargs):
            raise TypeError("shared_run takes either a TrainConfig or make_train_config's arguments")
        config = config if config is not None else make_train_config(**kwargs)
        key = config.hash()
        if key not in runs:

            def train(folder: Path) -> None:
                with _Entropy(f"shared-run {key}"):  # the same draws whichever test asks first
                    run_training(config, folder / "run", device="cpu")

            folder, trained = _made_once(tmp_path_factory, f"shared-{key[:16]}", train)
            runs[key] = (folder / "run", trained)
        return runs[key][0]

    yield get
    for path, trained in runs.values():
        now = _listing(path.parent)
        changed = sorted(k for k in trained.keys() | now.keys() if trained.get(k) != now.get(k))
        assert not changed, f"a test wrote into the shared run {path} (read only; train your own): {changed}"


#: the options of the tiny audits shared by tests/test_compare.py and tests/test_audit_resume.py (``--draws
#: derived``: an audit trained again under them is the same audit, which the resume tests compare against)
TINY_AUDIT = [
    "--model", "tiny-gpt2", "--n-calib", "8", "--n-train", "8", "--n-eval", "12", "--device", "cpu",
    "--draws", "derived", "--threads", "1",  # the float sums of training depend on the number of threads
    "--epochs", "1",  # one pass: these audits are not about the training passes (tests/test_audit_passes.py is)
]  # fmt: skip


@pytest.fixture(scope="session")
def tiny_audit(tmp_path_factory):
    """Tiny audits made once per session (once for all pytest-xdist workers): ``tiny_audit(defence)``
    returns the folder of ``splitleak audit --defence DEFENCE`` with ``TINY_AUDIT``'s options. Read only (a
    test that writes works on a copy); at the end of the session each must still be what the audit left."""
    from typer.testing import CliRunner

    from splitleak.cli import app

    made: dict[str, tuple[Path, dict]] = {}

    def audit(folder: Path, defence: str) -> None:
        out = folder / "audit"
        r = CliRunner().invoke(app, ["audit", "--defence", defence, "--out", str(out), "--quiet", *TINY_AUDIT])
        assert r.exit_code == 0, r.output

    def made_by(defence: str):
        def make(folder: Path) -> None:
            with _Entropy(f"tiny-audit {defence}"):
                audit(folder, defence)

        return make

    def get(defence: str = "none") -> Path:
        if defence not in made:
            folder, written = _made_once(tmp_path_factory, f"audit-{defence}", made_by(defence))
            made[defence] = (folder / "audit", written)
        return made[defence][0]

    yield get
    for path, written in made.values():
        now = _listing(path.parent)
        changed = sorted(k for k in written.keys() | now.keys() if written.get(k) != now.get(k))
        assert not changed, f"a test wrote into the shared audit {path} (read only; copy it): {changed}"


@pytest.fixture
def plant(tmp_path, monkeypatch):
    """``plant(module, source, *attacks)``: register a planted attack as a plug-in module (``SPLITLEAK_PLUGINS``,
    so that a grid's worker processes register it too); returns the imported module. Every registration and the
    module are removed after the test."""
    import sys

    from splitleak.attacks.registry import PLUGINS_ENV, load_plugins, unregister

    planted: list[tuple[str, tuple[str, ...]]] = []

    def plant_module(module: str, source: str, *attacks: str):
        folder = tmp_path / "plugins"
        folder.mkdir(exist_ok=True)
        (folder / f"{module}.py").write_text(source)
        monkeypatch.syspath_prepend(str(folder))
        monkeypatch.setenv(PLUGINS_ENV, module)
        assert load_plugins() == [module]
        planted.append((module, attacks))
        return sys.modules[module]

    yield plant_module
    for module, attacks in planted:
        for name in attacks:
            unregister(name)
        sys.modules.pop(module, None)
