"""Wall time, throughput and memory of an experiment grid, and what the full grid would cost
(run by hand; not part of the test suite).

    .venv/bin/python benchmarks/grid.py [--spec paper_main] [--profile quick] [--workers 2 --threads 1]
                                        [--device cpu|cuda] [--flops] [--no-group] [--record]

Runs `splitleak experiment run SPEC --profile PROFILE --executor local` in a subprocess on a fresh
store (the spec's protocol is copied to the temporary folder first, so the shipped protocol file
is not frozen by a benchmark), prints one line per finished job, samples the resident memory of the
whole process tree (driver and workers) every half second, and then projects the cost of the
spec's `full` profile on the same model from the measured per-job seconds:

- attack job: its measured seconds (fit + reconstruct, from the store) for the same configuration
  (depth, cut, defence, attack with its parameters and read-out, k, budget, copy, perturbation; a full job
  with none is unmeasured) and attack seed, scaled by full / quick
  evaluation documents (linear; an upper bound, since a larger batch of documents costs less per
  document), plus its mis-paired twin's seconds (the result's ``control``) scaled by the twins' document
  ratio (rows before commit 5ef6f50 left the twin out). A quick run with both of the full profile's attack
  seeds (``--override 'attack_seeds=[0, 1]'``) measures what the jobs that differ only in their seed share
  (``AttackInfo.seeded``); with one seed, every full job pays for its own search;
- train job: split-training and all-local seconds (training.json, all_local.json) scaled by the
  step ratio, the rest (utility evaluations, capture, writing) by the evaluation-document ratio.

With --flops every worker counts its job's floating-point operations (``SPLITLEAK_COUNT_FLOPS``,
see ``splitleak/experiments/worker.py``): the row then gives the measured FLOP rate of the jobs
(their counted FLOPs over their summed seconds) and the full grid's FLOPs, projected job by job with
the same scaling as its seconds (each job's counted FLOPs times the ratio of its projected to its
measured seconds). An attack job's counter also holds the rest of the job, mostly the mis-paired twin,
which reads min(CONTROL_DOCS, n_eval) documents in either profile (8 in the quick one, 16 in the full):
that share (the job's counted seconds outside fit + reconstruct, FLOPs apportioned by time) is scaled by
the twins' document ratio, not by the evaluation documents'. Rows before 2026-12-04 scaled it by 32
and overstate the full grid's FLOPs by up to twice. With --device cuda the jobs run on the GPU and the
projection is in GPU-hours.

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
from splitleak.experiments.cost import project, signature  # noqa: E402,F401  (signature: tests/test_grid_projection.py)

# What Gradients Add Appendix A: GPU hours summed over the executed work of each experiment, and what they cover
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


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return f"cuda: {torch.cuda.get_device_name(0)}"
    return f"cpu: {cpu_name()}"


def read_flops(folder: Path | None) -> dict[str, tuple[int, float]]:
    """job key -> (counted FLOPs, job seconds) from the workers' SPLITLEAK_COUNT_FLOPS records."""
    out: dict[str, tuple[int, float]] = {}
    for f in sorted(folder.glob("*.json")) if folder else ():
        d = json.loads(f.read_text())
        out[d["key"]] = (int(d["flops"]), float(d["seconds"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="paper_main")
    ap.add_argument("--profile", default="quick")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--override",
        action="append",
        default=[],
        help="extra KEY=VALUE for the spec; applied to the projected full grid too (fit for "
        "model, model_path, data.path; not for documents or seeds)",
    )
    ap.add_argument("--keep", default=None, help="store folder to keep (default: a temporary one)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the GPU of this machine)")
    ap.add_argument("--flops", action="store_true", help="count each job's FLOPs (torch.utils.flop_counter)")
    ap.add_argument(
        "--no-group",
        action="store_true",
        help="each attack job its own task (`run --no-group`): the work the jobs of one run and copy share, done per job",
    )
    ap.add_argument("--record", action="store_true", help="append the result to benchmarks/RESULTS.md")
    a = ap.parse_args()
    shared = HERE.parent.parent / "shared" / "data" / "wikitext-2-raw"
    reads_wikitext = load_spec(a.spec, a.profile, a.override).spec.data.source == "wikitext2"
    if reads_wikitext and shared.is_dir() and not any(o.startswith("data.path=") for o in a.override):
        a.override.append(f"data.path={shared}")  # offline: the shipped specs otherwise read the hub

    tmp = Path(tempfile.mkdtemp(prefix="grid-bench-"))
    loaded = load_spec(a.spec, a.profile, a.override)
    proto = tmp / loaded.protocol_path.name
    shutil.copy(loaded.protocol_path, proto)
    overrides = [*a.override, f"protocol={proto}"]
    store = Path(a.keep) if a.keep else tmp / "store"
    cmd = [
        sys.executable,
        "-m",
        "splitleak.cli",
        "experiment",
        "run",
        a.spec,
        "--profile",
        a.profile,
        "--store",
        str(store),
        "--executor",
        "local",
        "--workers",
        str(a.workers),
        "--threads",
        str(a.threads),
        "--device",
        a.device,
    ]
    for o in overrides:
        cmd += ["--override", o]
    if a.no_group:
        cmd.append("--no-group")
    env = dict(os.environ)
    flops_dir = tmp / "flops" if a.flops else None
    if flops_dir:
        env["SPLITLEAK_COUNT_FLOPS"] = str(flops_dir)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env)
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
    measured = read_flops(flops_dir)
    proj = project(a.spec, a.profile, overrides, store, measured)
    job_flops = sum(f for f, _ in measured.values())
    job_secs = sum(s for _, s in measured.values())
    rate = job_flops / job_secs if job_secs else None
    cores = a.workers * a.threads
    core_h = (proj["attack_s"] + proj["train_s"]) * a.threads / 3600
    gpu = a.device.startswith("cuda")
    gpu_h = (proj["attack_s"] + proj["train_s"]) / a.workers / 3600  # jobs share the one GPU
    per_eval = proj["attack_s"] / max(1, proj["attack_measured"])  # over the configurations measured
    model = ",".join(grid.loaded.spec.models)
    paper = PAPER.get(Path(a.spec).stem, ("n/a", "(no published figure for this spec)"))
    print(
        f"\nexit {rc}; {failed} failed; wall {wall:.0f} s; {executed / (wall / 3600):.0f} executed jobs/h; "
        f"peak RSS (all processes) {peak[0] / 2**30:.2f} GiB; load average {load_before[0]:.1f} -> {load_after[0]:.1f}"
    )
    print(
        f"full profile on {model}: {proj['counts']} jobs; projected {proj['attack_s'] / 3600:.1f} h of attack and "
        f"{proj['train_s'] / 3600:.1f} h of training job time at {a.threads} thread(s) per job = {core_h:.0f} "
        f"CPU core-hours ({core_h / cores:.0f} h wall on {cores} cores); {per_eval:.0f} s per attack evaluation "
        f"(documents x{proj['doc_ratio']:g}, steps x{proj['step_ratio']:g}; {proj['missing']} jobs without a "
        f"measurement). What Gradients Add reports {paper[0]} {paper[1]}."
    )
    full_pf = "—"
    if a.flops:
        full_pf = f"{proj['flops'] / 1e15:.1f}" if proj["flops"] is not None else "n/a"
    full_h = f"{gpu_h:.2f} GPU-h" if gpu else f"{core_h:.1f} core-h"
    if proj["missing"]:  # a profile that ran only some configurations cannot project the full grid
        full_h = f"n/a ({proj['missing']} of {sum(proj['counts'].values()) - proj['counts']['reuse']} jobs unmeasured)"
        full_pf = full_h if a.flops else full_pf
    if a.flops:
        print(
            f"FLOPs: {len(measured)} jobs counted, {job_flops / 1e12:.2f} TFLOP in {job_secs:.0f} job-seconds = "
            f"{(rate or 0) / 1e9:.1f} GFLOP/s per job at {a.threads} thread(s); full profile: "
            f"{full_pf} PFLOP ({proj['flops_missing']} jobs without a count)"
        )
    if gpu and not proj["missing"]:
        print(f"on this GPU: {gpu_h:.2f} GPU-hours for the full profile ({a.workers} job(s) at a time on one GPU)")
    row = (
        f"| {date.today().isoformat()} | {Path(a.spec).stem} ({a.profile}{', --no-group' if a.no_group else ''}) | {model} | {c['train']}/{c['attack']}/{c['reuse']} "
        f"| {failed} | {device_name(a.device)} | {a.workers} x {a.threads} | {wall:.0f} | {executed / (wall / 3600):.0f} | "
        f"{peak[0] / 2**30:.2f} | {load_before[0]:.1f} / {load_after[0]:.1f} | "
        f"{full_h} | {per_eval:.1f} | {f'{rate / 1e9:.1f}' if rate else '—'} | {full_pf} | {paper[0]} |"
    )
    print(row)
    if a.record:
        from train_capture import record

        record("## Experiment grid", row)
    if not a.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(rc)


if __name__ == "__main__":
    main()
