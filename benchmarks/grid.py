"""Wall time, throughput and memory of an experiment grid, and what the full grid would cost
(run by hand; not part of the test suite).

    .venv/bin/python benchmarks/grid.py [--spec paper_main] [--profile quick] [--workers 2 --threads 1] [--record]

Runs `splitleak experiment run SPEC --profile PROFILE --executor local` in a subprocess on a fresh
store (the spec's protocol is copied to the temporary folder first, so the shipped protocol file
is not frozen by a benchmark), prints one line per finished job, samples the resident memory of the
whole process tree (driver and workers) every half second, and then projects the cost of the
spec's `full` profile on the same model from the measured per-job seconds:

- attack job: its measured seconds (fit + reconstruct, from the store) for the same configuration
  (depth, defence, attack, k, budget, copy, perturbation), scaled by full / quick evaluation
  documents (linear; an upper bound, since a larger batch of documents costs less per document);
- train job: split-training and all-local seconds (training.json, all_local.json) scaled by the
  step ratio, the rest (utility evaluations, capture, writing) by the evaluation-document ratio.

With --record it appends a row to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from splitleak.experiments import load_spec, plan_grid, read_results  # noqa: E402

# 000 Appendix A: GPU hours summed over the executed work of each experiment, and what they cover
PAPER = {
    "paper_main": (336.1, "GPU-hours of attack wall-clock for 3,200 executed evaluations (GPT-2)"),
    "partial_offloading": (1.369, "GPU-hours for the 200 GPT-2 training runs"),
}


def tree_rss_bytes(root: int) -> int:
    """Resident memory of ``root`` and all its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    page = os.sysconf("SC_PAGE_SIZE")
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            rss[int(d.name)] = int((d / "statm").read_text().split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += rss.get(pid, 0)
        stack.extend(children.get(pid, []))
    return total


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown cpu"


def signature(f: dict) -> tuple:
    return (f["depth"], f["offload_start"], f["offload_length"], f["defence"], f.get("attack"), f.get("k"),
            f.get("budget"), f.get("client_copy"), f.get("perturbation"), f.get("inference"))


def project(spec: str, quick_profile: str, overrides: list[str], store: Path) -> dict:
    """Projected seconds of the full profile from the quick run's per-job seconds."""
    quick = plan_grid(spec, profile=quick_profile, overrides=overrides)
    models = quick.loaded.spec.models  # the full grid, on the model that was measured
    full = plan_grid(spec, profile="full", overrides=[*overrides, f"model=[{', '.join(models)}]"])
    qd, fd = quick.loaded.spec.documents, full.loaded.spec.documents
    doc_ratio = fd.n_eval / qd.n_eval
    step_ratio = (full.loaded.spec.steps or fd.n_train) / (quick.loaded.spec.steps or qd.n_train)

    attack_s: dict[tuple, float] = {}
    for r in read_results(store).to_pylist():
        if r["kind"] == "attack":
            attack_s[signature({**r})] = r["seconds"]
    train_s: dict[tuple, tuple[float, float]] = {}
    for r in read_results(store, "train").to_pylist():
        run = store / r["run_dir"]
        train = json.loads((run / "training.json").read_text())["seconds"]
        local_path = run / "all_local.json"
        local = json.loads(local_path.read_text())["seconds"] if local_path.is_file() else 0.0
        train_s[signature(r)] = (train + local, r["seconds"] - train - local)

    total_attack = total_train = 0.0
    missing = 0
    for j in full.jobs:
        if j.kind == "attack":
            s = attack_s.get(signature(j.fields))
            if s is None:
                missing += 1
                continue
            total_attack += s * doc_ratio
        elif j.kind == "train":
            s2 = train_s.get(signature(j.fields))
            if s2 is None:
                missing += 1
                continue
            total_train += s2[0] * step_ratio + s2[1] * doc_ratio
    c = full.counts()
    return {"attack_s": total_attack, "train_s": total_train, "missing": missing, "counts": c,
            "doc_ratio": doc_ratio, "step_ratio": step_ratio}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="paper_main")
    ap.add_argument("--profile", default="quick")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--override", action="append", default=[], help="extra KEY=VALUE for the spec")
    ap.add_argument("--keep", default=None, help="store folder to keep (default: a temporary one)")
    ap.add_argument("--record", action="store_true", help="append the result to benchmarks/RESULTS.md")
    a = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="grid-bench-"))
    loaded = load_spec(a.spec, a.profile, a.override)
    proto = tmp / loaded.protocol_path.name
    shutil.copy(loaded.protocol_path, proto)
    overrides = [*a.override, f"protocol={proto}"]
    store = Path(a.keep) if a.keep else tmp / "store"
    cmd = [sys.executable, "-m", "splitleak.cli", "experiment", "run", a.spec, "--profile", a.profile,
           "--store", str(store), "--executor", "local", "--workers", str(a.workers), "--threads", str(a.threads),
           "--device", "cpu"]
    for o in overrides:
        cmd += ["--override", o]
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    peak = [0]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], tree_rss_bytes(proc.pid))
            time.sleep(0.5)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    for line in proc.stdout:  # type: ignore[union-attr]
        print(line, end="", flush=True)
    rc = proc.wait()
    wall = time.perf_counter() - t0
    done.set()
    th.join()
    load_after = os.getloadavg()

    grid = plan_grid(a.spec, profile=a.profile, overrides=overrides)
    c = grid.counts()
    failed = read_results(store, "failed").num_rows
    executed = c["train"] + c["attack"]
    proj = project(a.spec, a.profile, overrides, store)
    cores = a.workers * a.threads
    core_h = (proj["attack_s"] + proj["train_s"]) * a.threads / 3600
    per_eval = proj["attack_s"] / max(1, proj["counts"]["attack"])
    model = ",".join(grid.loaded.spec.models)
    paper = PAPER.get(Path(a.spec).stem, ("n/a", "(no published figure for this spec)"))
    print(f"\nexit {rc}; {failed} failed; wall {wall:.0f} s; {executed / (wall / 3600):.0f} executed jobs/h; "
          f"peak RSS (all processes) {peak[0] / 2**30:.2f} GiB; load average {load_before[0]:.1f} -> {load_after[0]:.1f}")
    print(f"full profile on {model}: {proj['counts']} jobs; projected {proj['attack_s'] / 3600:.1f} h of attack and "
          f"{proj['train_s'] / 3600:.1f} h of training job time at {a.threads} thread(s) per job = {core_h:.0f} "
          f"CPU core-hours ({core_h / cores:.0f} h wall on {cores} cores); {per_eval:.0f} s per attack evaluation "
          f"(documents x{proj['doc_ratio']:g}, steps x{proj['step_ratio']:g}; {proj['missing']} jobs without a "
          f"measurement). 000 reports {paper[0]} {paper[1]}.")
    row = (
        f"| {date.today().isoformat()} | {Path(a.spec).stem} ({a.profile}) | {model} | {c['train']}/{c['attack']}/{c['reuse']} "
        f"| {failed} | cpu: {cpu_name()} | {a.workers} x {a.threads} | {wall:.0f} | {executed / (wall / 3600):.0f} | "
        f"{peak[0] / 2**30:.2f} | {load_before[0]:.1f} / {load_after[0]:.1f} | {core_h:.1f} | {per_eval:.1f} | "
        f"{paper[0]} |"
    )
    print(row)
    if a.record:
        from train_capture import record_row

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=HERE).stdout.strip() or "uncommitted"
        record_row("## Experiment grid", row + f" {commit} |")
    if not a.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(rc)


if __name__ == "__main__":
    main()
