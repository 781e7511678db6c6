"""Where a grid worker's memory goes, job by job (run by hand; not part of the test suite).

    .venv/bin/python benchmarks/worker_memory.py [--spec paper_main] [--profile quick] [--jobs 24]
                                                 [--depth 6] [--defence none] [--record]

Plans the spec's profile, takes one train job (the first with ``--depth`` and ``--defence``) and up to
``--jobs`` of its attack jobs, one of each attack family first, and runs them one after another in *this*
process through ``splitleak.experiments.worker.execute_job``, exactly as one pool worker does. After each
job it prints the process's resident memory (VmRSS) and its peak so far (VmHWM), so a job that leaves
memory behind shows as a step that does not come back down; the peak is reset before each job (Linux
``/proc/self/clear_refs``), so each line shows that job's own peak. The largest is what one worker of a
grid needs.

With --record it adds a row to the table of benchmarks/RESULTS.md's section "Memory of one grid worker".
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from splitleak.experiments import plan_grid  # noqa: E402
from splitleak.experiments.worker import execute_job  # noqa: E402


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """Start VmHWM again from the current resident size (Linux: ``echo 5 > /proc/self/clear_refs``), so
    each job's line shows its own peak."""
    Path("/proc/self/clear_refs").write_text("5")


def gib(kib: int) -> float:
    return kib / 2**20


HEADER = "| date | spec (profile) | job | jobs | wall s | peak GiB | resident after GiB | commit |"


def record(line: str) -> None:
    """Insert ``line`` after the last row of this benchmark's table in RESULTS.md."""
    lines = (HERE / "RESULTS.md").read_text().splitlines(keepends=True)
    at = next(i for i, text in enumerate(lines) if text.strip() == HEADER) + 2
    while at < len(lines) and lines[at].startswith("|"):
        at += 1
    lines.insert(at, line)
    (HERE / "RESULTS.md").write_text("".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default="paper_main")
    ap.add_argument("--profile", default="quick")
    ap.add_argument("--jobs", type=int, default=24, help="attack jobs to run after the train job")
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--defence", default="none")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        shared = HERE.parent.parent / "shared" / "data" / "wikitext-2-raw"
        overrides = [f"data.path={shared}"] if shared.is_dir() else []  # offline: the specs otherwise read the hub
        g = plan_grid(args.spec, profile=args.profile, overrides=overrides)
        train = next(
            j
            for j in g.of_kind("train")
            if j.fields["depth"] == args.depth and j.fields["defence"].split("(")[0] == args.defence
        )
        attacks = [j for j in g.of_kind("attack") if j.train_key == train.key]
        first: dict[str, object] = {}
        for j in attacks:
            first.setdefault(j.fields["attack"], j)
        order = list(first.values()) + [j for j in attacks if j not in first.values()]
        jobs = [train, *order[: args.jobs]]
        store = Path(tmp) / "store"
        print(f"baseline: rss {gib(status_kib('VmRSS')):.2f} GiB", flush=True)
        rows = []
        t0 = time.perf_counter()
        for j in jobs:
            reset_peak()
            res = execute_job(j.to_dict(), str(store), "cpu", args.threads)
            rss, hwm = gib(status_kib("VmRSS")), gib(status_kib("VmHWM"))
            rows.append((j.summary, res["status"], res.get("seconds", 0.0), rss, hwm))
            print(
                f"{res['status']:<6} {res.get('seconds', 0):6.1f} s  after {rss:5.2f}  peak {hwm:5.2f} GiB  {j.summary}",
                flush=True,
            )
            if res["status"] != "done":
                print(res.get("error"), file=sys.stderr)
        wall = time.perf_counter() - t0
    peak = max(r[4] for r in rows)
    last = rows[-1][3]
    print(f"{len(rows)} jobs, {wall:.0f} s; peak {peak:.2f} GiB, resident after the last job {last:.2f} GiB")
    if args.record:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
        commit += " + uncommitted changes" if dirty.stdout.strip() else ""
        line = (
            f"| {date.today().isoformat()} | {args.spec} ({args.profile}) | train depth {args.depth}, {args.defence} | "
            f"1 train + {len(rows) - 1} attack | {wall:.0f} | {peak:.2f} | {last:.2f} | {commit} |\n"
        )
        record(line)
        print("recorded in benchmarks/RESULTS.md")


if __name__ == "__main__":
    main()
