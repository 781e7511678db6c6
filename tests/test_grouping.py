"""Each piece of work once per grid (issue 35, ``splitleak.experiments.sharing``): the attack jobs of one run
and copy run as one worker task and share the model load, the capture read, the ridge fit, the candidate
lists, the mis-paired twins and SipIt's search; every row they write equals, bit for bit, the row of the job
run alone, and a task whose worker dies midway loses only its unfinished jobs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from served import REPO, child_env
from test_experiments import write_spec

pytestmark = pytest.mark.e2e

# two victim seeds (two runs) x two copies: four groups. Nested k and two attack seeds (their mis-paired twins),
# the same traffic read with and without gradients (inference), perturbed gradients, a shuffled control,
# property inference, SipIt's three budgets (through the trained copy, which matches, and through the public
# one, which leaves the largest search at once)
SPEC = """\
name: grouped
protocol: proto.yaml
model: tiny-gpt2
depths: [2]
defences: [none]
victim_seeds: [1, 2]
attack_seeds: [0]
client_copies: [public, trained]
documents: {n_calib: 4, n_train: 4, n_eval: 4, doc_len: 8}
steps: 2
attacks:
  - {attack: activation, k: [4, 8], attack_seeds: [0, 1], inference: true}
  - {attack: joint, k: 4, client_copy: public, perturbations: [none, {gradient_bits: 8}], attack_seeds: [0, 1]}
  - {attack: shuffled-gradient, k: 4, client_copy: public}
  - {attack: property, client_copy: public}
  - {attack: sipit, budget: [16, 32, 64]}
"""
#: per run: activation (2 k x 2 copies x 2 seeds), joint (2 perturbations x 2 seeds), shuffled, property, SipIt
#: (3 x 2 copies)
PER_RUN = {"activation": 8, "joint": 4, "shuffled-gradient": 1, "property": 1, "sipit": 6}
#: per run, the jobs whose reading is another seed's (``AttackInfo.seeded`` False): activation's seed 1 (2 k x 2
#: copies) and joint's (unperturbed, and rounded gradients: the rounding draws nothing)
SHARED_READINGS = 4 + 2
ATTACK_JOBS = 2 * sum(PER_RUN.values())
REUSED = 2 * PER_RUN["activation"]  # the activation jobs counted in inference too


def rows(store: Path) -> dict[tuple, dict]:
    """Every attack row by (job, document), all columns but the timings (``seconds``, in the row and
    anywhere in its result, and the note that says whose search a job's seconds left out)."""
    from splitleak.experiments import read_results

    def untimed(obj):
        if isinstance(obj, dict):
            return {
                k: untimed(v) for k, v in obj.items() if k not in ("seconds", "reconstruction_shared_with_attack_seed")
            }
        if isinstance(obj, list):
            return [untimed(v) for v in obj]
        return obj

    out = {}
    for r in read_results(store, as_rows=True):
        r = {k: v for k, v in r.items() if k != "seconds"}
        r["result_json"] = untimed(json.loads(r["result_json"]))
        out[(r["key"], r["doc_id"], r["arm"])] = r
    return out


COUNTED = {  # module, name: what each call does once
    "model": ("splitleak.experiments.worker", "cached_model"),  # a copy of the model's weights
    "capture": ("splitleak.attacks.knowledge", "load_capture"),  # a capture read
    "verify": ("splitleak.runs.verify", "verify_run"),  # the run re-hashed
    "ridge": ("splitleak.attacks.base", "fit_ridge"),
    "ranking": ("splitleak.attacks.base", "cosine_topk"),  # a candidate list over the vocabulary
    "sipit": ("splitleak.attacks.sipit", "sipit"),  # one SipIt search at one budget
    "sipit_budgets": ("splitleak.attacks.sipit", "sipit_budgets"),  # one search for several
    "beam": ("splitleak.attacks.beam", "beam_search"),  # one beam search of one traffic
}


def _counted(monkeypatch) -> dict[str, int]:
    import importlib

    calls = dict.fromkeys(COUNTED, 0)
    for what, (module, name) in COUNTED.items():
        mod = importlib.import_module(module)
        real = getattr(mod, name)

        def counting(*a, _real=real, _what=what, **k):
            calls[_what] += 1
            return _real(*a, **k)

        monkeypatch.setattr(mod, name, counting)
    return calls


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The grid's spec and a store holding its two trained runs (the train jobs run as a grid would)."""
    from splitleak.experiments import plan_grid
    from splitleak.experiments.worker import execute_job

    root = tmp_path_factory.mktemp("grouping")
    spec = write_spec(root, SPEC, "grouped.yaml")
    g = plan_grid(spec)
    for job in g.of_kind("train"):
        assert execute_job(job.to_dict(), str(root / "trained"), device="cpu", threads=1)["status"] == "done"
    return spec, root / "trained"


@pytest.fixture(scope="module")
def executed(trained, tmp_path_factory):
    """The grid's attack jobs run on copies of the trained store: in their four tasks (``execute_jobs``, as a
    worker runs a task), and each alone (``execute_job``); with the shared computations counted."""
    from splitleak.experiments import plan_grid
    from splitleak.experiments.sharing import task_key
    from splitleak.experiments.store import ResultsStore, reuse_rows
    from splitleak.experiments.worker import execute_job, execute_jobs

    spec, store = trained
    g = plan_grid(spec)
    jobs = [j.to_dict() for j in g.of_kind("attack")]
    tasks: dict[tuple, list] = {}
    for job in jobs:
        tasks.setdefault(task_key(job), []).append(job)
    out = {}
    for mode in ("grouped", "alone"):
        root = tmp_path_factory.mktemp(mode) / "store"
        shutil.copytree(store, root)
        with pytest.MonkeyPatch.context() as mp:
            calls = _counted(mp)
            if mode == "grouped":
                statuses = [s for task in tasks.values() for s in execute_jobs(task, str(root), "cpu", 1)]
            else:
                statuses = [execute_job(job, str(root), "cpu", 1) for job in jobs]
        assert [s["status"] for s in statuses] == ["done"] * len(jobs), [s.get("error") for s in statuses]
        rs = ResultsStore(root)
        for j in g.of_kind("reuse"):  # the reused inference measurements too, as the scheduler writes them
            rs.write_rows("attack", j.key, reuse_rows(j.to_dict(), rs.read_job("attack", j.reuse_of)))
        out[mode] = (root, dict(calls), len(tasks))
    return g, out


def test_grouped_rows_equal_each_job_run_alone_bit_for_bit(executed):
    from splitleak.experiments import read_results

    g, out = executed
    assert g.counts() == {"train": 2, "attack": ATTACK_JOBS, "reuse": REUSED}
    mine, theirs = rows(out["grouped"][0]), rows(out["alone"][0])
    assert len(mine) == 4 * (ATTACK_JOBS + REUSED)  # every job once, one row per document
    assert mine == theirs  # predictions, scores, controls, keys, configurations and digests
    # the jobs that read another seed's search say so, and name it; run alone, none does
    noted = {
        r["key"]: json.loads(r["result_json"]).get("reconstruction_shared_with_attack_seed")
        for r in read_results(out["grouped"][0], as_rows=True)
        if r["key"] in {j.key for j in g.of_kind("attack")}  # the executed jobs (a reuse row copies its source's)
    }
    assert sorted(v for v in noted.values() if v is not None) == [0] * 2 * SHARED_READINGS
    alone_noted = [json.loads(r["result_json"]) for r in read_results(out["alone"][0], as_rows=True)]
    assert not any("reconstruction_shared_with_attack_seed" in r for r in alone_noted)


def test_each_task_did_its_shared_work_once(executed):
    """What the alone jobs each did for themselves, the four tasks did once each: the model copy, the
    capture read, the run's verification, the ridge fit; the candidate lists once per traffic and twin;
    SipIt once per traffic for its three budgets; a search once per traffic, its twins reading it."""
    _, out = executed
    alone, grouped, tasks = out["alone"][1], out["grouped"][1], out["grouped"][2]
    assert tasks == 4
    assert alone["model"] == alone["capture"] == alone["verify"] == ATTACK_JOBS
    assert grouped["model"] == grouped["capture"] == grouped["verify"] == tasks
    assert alone["ridge"] == ATTACK_JOBS and grouped["ridge"] == tasks  # property: VMI beside it (leakage index)
    # each ranked job ranks its traffic and its mis-paired twin (property: its VMI, no twin); a task ranks its
    # traffic once and each twin once: one per attack seed, and the perturbed jobs' own (whose twins carry the
    # perturbed gradients)
    twinned = 2 * (PER_RUN["activation"] + PER_RUN["joint"] + PER_RUN["shuffled-gradient"])
    assert alone["ranking"] == 2 * twinned + 2 * PER_RUN["property"]
    # per run: public (seeds 0 and 1, unperturbed and perturbed), trained (seeds 0 and 1)
    assert grouped["ranking"] == 2 * (1 + 4) + 2 * (1 + 2)
    # every twin here covers all four documents, so it holds the arm's rows in the arm's order and reads the arm's
    # search (``Knowledge.memo_content``): a beam job alone searches once; in a task the jobs that differ only in
    # their seed search the traffic once (activation: 2 k x 2 copies; joint: unperturbed and rounded; the
    # shuffled control reads its seed), and the twins search nothing; where the rounded gradients give the raw ones'
    # candidates (here they do), joint's two perturbations are one search
    assert alone["beam"] == twinned
    assert 2 * (4 + 1 + 1) <= grouped["beam"] <= 2 * (4 + 2 + 1)
    assert alone["sipit"] == 2 * PER_RUN["sipit"] and alone["sipit_budgets"] == 0  # each job; its twin reads it
    assert grouped["sipit"] == 0 and grouped["sipit_budgets"] == tasks  # each task's traffic, its twins read it


def test_a_group_whose_worker_dies_midway_keeps_its_finished_jobs_and_runs_each_other_once(trained, executed, tmp_path):
    """SIGKILL the worker in the middle of a task: the jobs it finished stay as written, the one it was
    running is recorded as retried and runs again, the rest run without a retry, each job once."""
    from splitleak.experiments import plan_grid, read_results

    spec, trained_store = trained
    clean = executed[1]["grouped"][0]
    store = tmp_path / "store"
    shutil.copytree(trained_store, store)  # the runs trained: the grid starts with its attack tasks
    g = plan_grid(spec)
    attack_keys = {j.key for j in g.of_kind("attack")}
    cmd = [sys.executable, "-m", "splitleak.cli", "experiment", "run", str(spec), "--store", str(store)]
    cmd += ["--workers", "1", "--threads", "1", "--device", "cpu", "--quiet"]
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    attacks, claims = store / "attacks", store / "claims"
    try:
        t0 = time.monotonic()
        killed = None
        while killed is None:
            assert proc.poll() is None, "the grid ended before its worker could be killed"
            assert time.monotonic() - t0 < 240, "no task got three jobs in within 240 s"
            finished = {p.stem for p in attacks.glob("*.parquet")} & attack_keys if attacks.is_dir() else set()
            running = [p for p in claims.glob("*.json") if p.stem in attack_keys] if claims.is_dir() else []
            if len(finished) >= 3 and running:
                try:
                    info = json.loads(running[0].read_text())
                except (FileNotFoundError, json.JSONDecodeError):
                    continue
                before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in attacks.glob("*.parquet")}
                os.kill(info["pid"], signal.SIGKILL)
                killed = info["pid"]
            time.sleep(0.01)
        output, _ = proc.communicate(timeout=600)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, output
    assert killed != proc.pid
    retried = read_results(store, "retried", as_rows=True)
    # the job it died in (the one claimed as it was killed, or the next if that one ended just then), only it
    assert len(retried) == 1 and retried[0]["attempt"] == 1
    assert retried[0]["key"] in attack_keys and f"{retried[0]['key']}.parquet" not in before
    assert "1 attempt(s) ran again after their worker died" in " ".join(output.split())
    for name, (data, mtime) in before.items():  # what the task had finished is kept as written
        p = attacks / name
        assert p.read_bytes() == data and p.stat().st_mtime_ns == mtime, name
    counts: dict[str, int] = {}
    for r in read_results(store, as_rows=True):
        counts[r["key"]] = counts.get(r["key"], 0) + 1
    assert counts == {j.key: 4 for j in g.jobs if j.kind != "train"}
    assert rows(store) == rows(clean)
    assert read_results(store, "failed").num_rows == 0 and not list(claims.glob("*.json"))


WARM_CHILD = """
import gc, json, weakref
import torch
from splitleak.experiments.worker import release_memory, warm_worker
from splitleak.models import load_model

warm_worker()
frozen, tracked = gc.get_freeze_count(), len(gc.get_objects())
lm = load_model("tiny-gpt2", seed=0)  # a job's objects, made after the freeze ...
cycle = [lm.model]
cycle.append(cycle)  # ... in a reference cycle, which only the collector frees
alive = weakref.ref(lm.model)
del lm, cycle
release_memory()
print(json.dumps({"frozen": frozen, "tracked": tracked, "alive": alive() is not None, "after": len(gc.get_objects())}))
"""


def test_a_warm_worker_freezes_its_imports_and_still_frees_a_job_s_objects():
    # release_memory's gc.collect walked every object of torch and transformers after every job (0.18 s each);
    # warm_worker moves them to the permanent generation once, before any job: a job's garbage, even in a
    # cycle, is still freed after the job
    out = subprocess.run(
        [sys.executable, "-c", WARM_CHILD], capture_output=True, text=True, timeout=300, env=child_env(), cwd=REPO
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["frozen"] > 100_000 and got["tracked"] < got["frozen"] / 20, got  # the imports are frozen
    assert not got["alive"] and got["after"] < got["frozen"] / 20, got  # the job's model was collected
