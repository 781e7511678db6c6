"""Training and capture throughput of one split run (run by hand; not part of the test suite).

    .venv/bin/python benchmarks/train_capture.py --model smollm2-135m --depth 6 [--record]

Measures split-training and all-local tokens/s, capture tokens/s, model load time and peak RSS on
this machine, with the default document counts (128 training steps, 256 captured documents) on
WikiText-2 from ../shared/data. With --record it appends a row to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import platform
import resource
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from splitleak.models import load_model  # noqa: E402
from splitleak.training import make_train_config, run_training  # noqa: E402


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"


def record_row(section: str, row: str) -> None:
    """Insert ``row`` at the end of the table that follows the heading ``section`` in RESULTS.md."""
    path = HERE / "RESULTS.md"
    lines = path.read_text().splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith(section))
    i = next(j for j in range(start, len(lines)) if lines[j].startswith("|"))
    while i < len(lines) and lines[i].startswith("|"):
        i += 1
    lines.insert(i, row if row.endswith("\n") else row + "\n")
    path.write_text("".join(lines))


def record(section: str, row: str) -> None:
    """Append ``row`` with the current commit (short hash) as its last column to the table of ``section``."""
    commit = (
        subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
        or "uncommitted"
    )
    record_row(section, row + f" {commit} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--defence", default="none")
    ap.add_argument("--data", default="wikitext2")
    ap.add_argument("--data-path", default=str(HERE.parent.parent / "shared" / "data" / "wikitext-2-raw"))
    ap.add_argument("--n-train", type=int, default=128)
    ap.add_argument("--n-eval", type=int, default=256)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--record", action="store_true", help="append the result to benchmarks/RESULTS.md")
    a = ap.parse_args()

    t0 = time.perf_counter()
    lm = load_model(a.model)
    load_s = time.perf_counter() - t0
    cfg = make_train_config(
        model=a.model,
        depth=a.depth,
        defences=[{"name": a.defence}],
        data=a.data,
        data_path=a.data_path,
        n_train=a.n_train,
        n_eval=a.n_eval,
        seed=0,
    )
    with tempfile.TemporaryDirectory() as tmp:
        t1 = time.perf_counter()
        res = run_training(cfg, Path(tmp) / "run", device=a.device, threads=a.threads, lm=lm)
        total_s = time.perf_counter() - t1
    m = res.metrics
    dev = (
        "cuda: " + torch.cuda.get_device_name(0)
        if torch.cuda.is_available() and a.device != "cpu"
        else f"cpu: {cpu_name()}, {torch.get_num_threads()} threads"
    )
    row = (
        f"| {date.today().isoformat()} | {a.model} | {a.depth} | {a.defence} | {dev} | {load_s:.1f} | "
        f"{m['train_tokens_per_second']:.0f} | {m['all_local_train_tokens_per_second']:.0f} | "
        f"{m['capture']['tokens_per_second']:.0f} | {total_s:.0f} | {peak_rss_gib():.2f} |"
    )
    print(row)
    print(f"held-out CE {m['heldout_ce']:.4f}, all-local {m['all_local_ce']:.4f}, ΔU {m['delta_u']:+.6f}")
    if a.record:
        record("## Split training and capture", row)


if __name__ == "__main__":
    main()
