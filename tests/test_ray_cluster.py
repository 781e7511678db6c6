"""A real Ray cluster on this machine: a head and two worker nodes, each in its own network namespace
(joined by a bridge in a fourth namespace, private 10.x addresses), started with ``ray start`` as one
would start them on separate machines. Each worker node also has its own PID namespace (killing the
node kills everything on it at once) and its own mount namespace, in which a private tmpfs holds its
Ray temp folder and its scratch store, and another tmpfs hides the driver's folder (spec, store, the
head's temp folder): a worker cannot see the driver's store, so the results can only come back
through Ray. The driver runs in the head's network namespace, as ``splitleak experiment run
--executor ray --address HEAD:PORT``.

Needs root and ``ip netns``; skipped with the reason where they are not permitted (a CI container).
Everything is bounded in time and torn down in ``finally``: the nodes' PID namespaces, the network
namespaces with their veth pairs, and any process left that names this test's folder.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from test_experiments import TINY_COUNTS, scores, write_spec

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None, reason="ray is not installed (pip install 'splitleak[ray]')"
    ),
]

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
NET = "10.213.0"  # in namespaces of their own: no address or port of this machine can clash
PORT = 6379
NODES = {"head": 1, "w1": 2, "w2": 3}  # node -> last octet of its address
JOBS = sum(TINY_COUNTS[k] for k in ("train", "attack"))  # executed jobs (the reuse jobs are copies)

WAIT_FOR_WORKERS = """
import json, sys, time, ray
ray.init(address=sys.argv[1], log_to_driver=False)
t0 = time.monotonic()
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    if sum(n["Resources"].get("CPU", 0) > 0 for n in alive) >= 2:
        break
    if time.monotonic() - t0 > 120:
        sys.exit("the worker nodes did not join: " + json.dumps([n["NodeManagerAddress"] for n in alive]))
    time.sleep(0.5)
print(json.dumps({n["NodeManagerAddress"]: n["NodeID"] for n in alive}))
"""


def _run(*args: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {r.returncode}: {r.stderr.strip()}")
    return r


@functools.cache
def _why_not_permitted() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns)"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"needs the {tool} command"
    probe = f"slprobe{os.getpid() % 100000}"
    try:
        r = _run("ip", "netns", "add", probe, timeout=10, check=False)
        if r.returncode != 0:
            return f"ip netns is not permitted here: {r.stderr.strip()}"
        with tempfile.TemporaryDirectory() as folder:  # a tmpfs mounted in a node's own mount namespace
            mount = ["sh", "-c", 'mount -t tmpfs -o size=1m tmpfs "$0"', folder]
            r = _run("ip", "netns", "exec", probe, "unshare", "--pid", "--fork", "--mount-proc", *mount, check=False)
        if r.returncode != 0:
            return f"unshare --pid --mount-proc with a tmpfs mount is not permitted here: {r.stderr.strip()}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"ip netns is not usable here: {exc}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None


class NamespaceCluster:
    """The namespaces, the bridge, the nodes' processes and their teardown."""

    def __init__(self, root: Path, hidden: Path):
        self.root, self.hidden = root, hidden
        self.tag = f"sl{os.getpid() % 100000}"  # names of at most 15 characters, as interfaces need
        self.ns = {n: f"{self.tag}{n}" for n in (*NODES, "sw")}
        self.veths = [f"{self.tag}{n}{end}" for n in NODES for end in "01"]
        self.procs: dict[str, subprocess.Popen] = {}
        self.driver: subprocess.Popen | None = None  # a driver run in the background (its own session)
        self.env = {
            **os.environ,
            "PYTHONPATH": str(REPO),  # the nodes' workers import this checkout of splitleak
            "HF_HUB_OFFLINE": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
            # the cluster's own token (not ~/.ray/auth_token, which other clusters on this machine may use)
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(32),
            # the head notices a dead node within seconds, not the default half minute
            "RAY_health_check_period_ms": "1000",
            "RAY_health_check_timeout_ms": "1000",
            "RAY_health_check_failure_threshold": "3",
            "COLUMNS": "400",  # the driver's summary lines unwrapped
        }

    def ip(self, node: str) -> str:
        return f"{NET}.{NODES[node]}"

    @property
    def address(self) -> str:
        return f"{self.ip('head')}:{PORT}"

    def network(self) -> None:
        sw = self.ns["sw"]
        for ns in self.ns.values():
            _run("ip", "netns", "add", ns)
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        for node in NODES:
            ns, inner, outer = self.ns[node], f"{self.tag}{node}0", f"{self.tag}{node}1"
            _run("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
            _run("ip", "link", "set", inner, "netns", ns)
            _run("ip", "link", "set", outer, "netns", sw)
            _run("ip", "-n", sw, "link", "set", outer, "master", "br0")
            _run("ip", "-n", sw, "link", "set", outer, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.ip(node)}/24", "dev", inner)
            _run("ip", "-n", ns, "link", "set", inner, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "route", "add", "default", "dev", inner)  # Ray finds its address by a route out

    def _start(self, node: str, script: str, env: dict[str, str]) -> None:
        log = open(self.root / f"{node}.log", "wb")  # noqa: SIM115 - the node's process holds it
        cmd = ["ip", "netns", "exec", self.ns[node], "unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
        cmd += ["--propagation", "private", "sh", "-c", script]
        self.procs[node] = subprocess.Popen(
            cmd, env={**self.env, **env}, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()

    def start_head(self) -> None:
        temp = self.hidden / "head-ray"
        temp.mkdir(parents=True)
        script = (
            f'exec "$RAY" start --head --node-ip-address {self.ip("head")} --port {PORT} --num-cpus 0 '
            f'--temp-dir "$TEMP" --include-dashboard false --object-store-memory 200000000 --block'
        )
        self._start("head", script, {"RAY": str(BIN / "ray"), "TEMP": str(temp)})

    def private_root(self, node: str) -> Path:
        return self.root / f"{node}-private"

    def start_worker(self, node: str) -> None:
        priv = self.private_root(node)
        priv.mkdir()
        script = (
            'mount -t tmpfs -o size=4g tmpfs "$PRIV" && mount -t tmpfs -o size=1m tmpfs "$HIDDEN" && '
            'mkdir -p "$PRIV/ray" "$PRIV/scratch" "$PRIV/tmp" && '
            f'exec "$RAY" start --address {self.address} --node-ip-address {self.ip(node)} --num-cpus 1 '
            '--temp-dir "$PRIV/ray" --object-store-memory 200000000 --block'
        )
        env = {
            "RAY": str(BIN / "ray"),
            "PRIV": str(priv),
            "HIDDEN": str(self.hidden),
            "TMPDIR": str(priv / "tmp"),
            "SPLITLEAK_SCRATCH": str(priv / "scratch"),
        }
        self._start(node, script, env)

    def in_head(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns["head"], *args]

    def wait_for_workers(self) -> dict[str, str]:
        """{address: Ray node id} of the alive nodes, once both workers have joined."""
        r = subprocess.run(
            self.in_head(sys.executable, "-c", WAIT_FOR_WORKERS, self.address),
            capture_output=True,
            text=True,
            timeout=180,
            env=self.env,
            cwd=REPO,
        )
        assert r.returncode == 0, r.stdout + r.stderr + self.logs()
        return json.loads(r.stdout.strip().splitlines()[-1])

    def jobs_running(self, node: str) -> list[str]:
        """Key prefixes of the jobs whose scratch store is on ``node`` now, read through its mount
        namespace (``/proc/PID/root``): its private folder is empty seen from here."""
        scratch = Path(f"/proc/{self.procs[node].pid}/root") / self.private_root(node).relative_to("/") / "scratch"
        try:
            return [p.name.split("-")[1] for p in scratch.iterdir() if p.name.startswith("splitleak-")]
        except OSError:  # the node is starting or gone
            return []

    def kill(self, node: str) -> None:
        """The node dies at once: its PID namespace's first process is killed, and the kernel kills the rest."""
        proc = self.procs[node]
        proc.kill()  # unshare --kill-child passes the SIGKILL on to the namespace's first process
        proc.wait(timeout=30)

    def logs(self) -> str:
        out = []
        for p in sorted(self.root.glob("*.log")):
            out.append(f"--- {p.name}\n" + p.read_text(errors="replace")[-3000:])
        return "\n".join(out)

    def teardown(self) -> None:
        if self.driver is not None and self.driver.poll() is None:
            os.killpg(self.driver.pid, signal.SIGKILL)
            self.driver.wait(timeout=30)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        for veth in self.veths:  # a pair not yet moved into its namespace when a step failed
            subprocess.run(["ip", "link", "del", veth], capture_output=True, timeout=30)
        _kill_what_names(self.root)


def _kill_what_names(folder: Path) -> None:
    """SIGKILL any process left whose command line names ``folder`` (this test's own Ray processes)."""
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit() or int(pid_dir.name) == os.getpid():
            continue
        try:
            cmdline = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(folder) in cmdline:
            try:
                os.kill(int(pid_dir.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _nodes_line(output: str) -> dict[str, int]:
    """{Ray node id prefix: jobs} from the CLI's `jobs per node:` line."""
    line = output.split("jobs per node: ", 1)[1].replace("\n", " ") if "jobs per node: " in output else ""
    return {m[0]: int(m[1]) for m in re.findall(r"Ray node ([0-9a-f]+)\): (\d+)", line)}


def _check_store(store: Path, clean_store: Path) -> None:
    """Every job once in the store (its one row file; one row per evaluation document), nothing failed,
    no claim or temporary file left, and the results those of the local executor."""
    from splitleak.experiments import read_results

    per_key: dict[str, int] = {}
    for row in read_results(store).to_pylist():
        per_key[row["key"]] = per_key.get(row["key"], 0) + 1
    clean: dict[str, int] = {}
    for row in read_results(clean_store).to_pylist():
        clean[row["key"]] = clean.get(row["key"], 0) + 1
    assert per_key == clean and set(per_key.values()) == {4}
    assert sorted(r["key"] for r in read_results(store, "train").to_pylist()) == sorted(
        r["key"] for r in read_results(clean_store, "train").to_pylist()
    )
    assert read_results(store, "failed").num_rows == 0
    assert not list(store.rglob(".*.tmp")) and not list((store / "claims").glob("*.json"))
    assert scores(store) == scores(clean_store)
    assert scores(store, "train") == scores(clean_store, "train")


def _grid_cmd(cluster: NamespaceCluster, spec: Path, store: Path) -> list[str]:
    return cluster.in_head(
        sys.executable, "-m", "splitleak.cli", "experiment", "run", str(spec), "--store", str(store),
        "--executor", "ray", "--address", cluster.address, "--threads", "1", "--device", "cpu",
    )  # fmt: skip


def _grid_across(cluster: NamespaceCluster, workers: dict[str, str], store: Path, clean_store: Path) -> None:
    """The tiny grid across the cluster: both worker nodes run jobs, each job lands in the store once."""
    t0 = time.monotonic()
    r = subprocess.run(
        _grid_cmd(cluster, cluster.hidden / "grid" / "tiny.yaml", store),
        capture_output=True, text=True, timeout=400, env=cluster.env, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:] + cluster.logs()
    per_node = _nodes_line(r.stdout)
    print(f"grid across the cluster in {time.monotonic() - t0:.1f} s; jobs per worker node: {per_node}")
    assert f"{JOBS} job(s) ran, 4 reused" in r.stdout, r.stdout[-2000:]
    assert set(per_node) == set(workers.values()) and sum(per_node.values()) == JOBS, (per_node, workers)
    _check_store(store, clean_store)
    for w in workers:  # the workers' private folders are theirs: empty seen from here
        assert not any(cluster.private_root(w).iterdir())


def _grid_losing_a_node(cluster: NamespaceCluster, workers: dict[str, str], store: Path, clean_store: Path) -> None:
    """The grid again, and node w2 killed while it runs a job: no job is lost or stored twice."""
    from splitleak.experiments import read_results

    log_path = cluster.root / "driver-killed.log"
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        cluster.driver = subprocess.Popen(
            _grid_cmd(cluster, cluster.hidden / "grid" / "tiny.yaml", store),
            env=cluster.env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    attacks = store / "attacks"
    while not (len(list(attacks.glob("*.parquet"))) >= 2 and (running := cluster.jobs_running("w2"))):
        assert cluster.driver.poll() is None, log_path.read_text()[-4000:]
        assert time.monotonic() - t0 < 300, "node w2 never ran a job after the first results were in"
        time.sleep(0.05)
    before = len(list(attacks.glob("*.parquet")))
    cluster.kill("w2")
    print(
        f"killed node w2 ({workers['w2']}) {time.monotonic() - t0:.1f} s into the grid, with {before} attack "
        f"results in and job(s) {running} running on it"
    )
    cluster.driver.wait(timeout=400)
    out = log_path.read_text()
    assert cluster.driver.returncode == 0, out[-4000:] + cluster.logs()
    per_node = _nodes_line(out)
    retried = [ln for ln in out.splitlines() if "worker died" in ln]
    print(f"grid with a killed node in {time.monotonic() - t0:.1f} s; jobs per node: {per_node}; retried: {retried}")
    assert sum(per_node.values()) == JOBS and workers["w1"] in per_node
    _check_store(store, clean_store)
    done = {r["key"][:12] for kind in ("attack", "train") for r in read_results(store, kind).to_pylist()}
    assert set(running) <= done  # the job the node died with ran again, on the other node


def test_a_grid_runs_across_a_namespace_cluster_and_survives_a_killed_node(tmp_path):
    """Both worker nodes run jobs, every job lands in the driver's store exactly once, the results are
    the local executor's; then a worker node killed mid-grid loses no job."""
    why = _why_not_permitted()
    if why:
        pytest.skip(why)
    from splitleak.experiments import run_grid

    t_all = time.monotonic()
    spec = write_spec(tmp_path / "local")
    clean_store = tmp_path / "local" / "store"
    t0 = time.monotonic()
    assert run_grid(spec, workers=2, threads=1, store=clean_store, device="cpu").ok
    print(f"\nlocal executor: the tiny grid in {time.monotonic() - t0:.1f} s")

    root = Path(tempfile.mkdtemp(prefix="slc-", dir="/tmp"))  # short: Ray's socket paths live under it
    cluster = NamespaceCluster(root, root / "driver")  # the driver's folder, hidden from the worker nodes
    try:
        cluster.network()
        cluster.start_head()
        t0 = time.monotonic()
        for w in ("w1", "w2"):  # they retry until the head's GCS answers
            cluster.start_worker(w)
        ids = cluster.wait_for_workers()
        workers = {w: ids[cluster.ip(w)][:12] for w in ("w1", "w2")}
        print(f"cluster up in {time.monotonic() - t0:.1f} s: {ids}")
        write_spec(cluster.hidden / "grid")
        _grid_across(cluster, workers, cluster.hidden / "store", clean_store)
        _grid_losing_a_node(cluster, workers, cluster.hidden / "store-killed", clean_store)
    finally:
        cluster.teardown()
        shutil.rmtree(root, ignore_errors=True)
    print(f"all in {time.monotonic() - t_all:.1f} s")
