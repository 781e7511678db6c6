"""Split training over loopback TLS against the same run in one process (run by hand; not a test).

    .venv/bin/python benchmarks/transport.py --model smollm2-135m --depth 6 [--record]
    .venv/bin/python benchmarks/transport.py --model tiny-gpt2 --depth 2 [--record]

Starts `splitleak serve` as a separate process on 127.0.0.1 (a fresh private CA in a temporary
folder), trains the configuration against it with `run_training(connect=...)`, then trains the same
configuration in one process, and reports:

- split-training seconds per step over TLS and in one process, and their ratio (the goal of issue 14:
  <= 1.3 for SmolLM2 at depth 6);
- bytes per training step: the tensor bytes of the activations and the returned gradient, the
  messages as sent (the SLK1 envelope with its JSON header, plus the frame blob with its own header),
  and the WebSocket and TLS 1.3 framing computed on top (per message 2-14 bytes of WebSocket header
  + 4 bytes of mask for client frames; per TLS record of at most 16 KiB, 22 bytes: header, content
  type, AES-GCM tag). TCP/IP headers are not counted;
- peak RSS of the client (this process, up to the end of the TLS run) and of the server process.

Both sides run with the same thread count. The messages alternate (the client waits for each
reply), so the two processes never compute at once. With --record it appends a row to RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from train_capture import cpu_name, peak_rss_gib, record  # noqa: E402

from splitleak.training import make_train_config, run_training  # noqa: E402
from splitleak.wire.client import wait_port  # noqa: E402
from splitleak.wire.tls import init_tls  # noqa: E402

TLS_RECORD = 16384
TLS_RECORD_OVERHEAD = 22  # 5-byte header + 1 content-type byte + 16-byte AES-GCM tag (TLS 1.3)


def ws_header(n: int, client: bool) -> int:
    base = 2 if n < 126 else (4 if n < 65536 else 10)
    return base + (4 if client else 0)


def framed(n: int, client: bool) -> int:
    """Bytes of one binary WebSocket message of n bytes inside TLS 1.3 records."""
    ws = n + ws_header(n, client)
    return ws + TLS_RECORD_OVERHEAD * max(1, math.ceil(ws / TLS_RECORD))


def vm_hwm_gib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--data", default="wikitext2")
    ap.add_argument("--data-path", default=str(HERE.parent.parent / "shared" / "data" / "wikitext-2-raw"))
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--n-eval", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--record", action="store_true", help="append the result to benchmarks/RESULTS.md")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfg = make_train_config(
        model=a.model,
        depth=a.depth,
        data=a.data,
        data_path=a.data_path,
        n_calib=4,
        n_train=a.steps,
        n_eval=a.n_eval,
        steps=a.steps,
        all_local_baseline=False,
        seed=0,
    )
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        init_tls(tmp_path / "tls")
        server = subprocess.Popen(
            [sys.executable, "-m", "splitleak.cli", "serve", "--listen", "127.0.0.1:0", "--tls-dir",
             str(tmp_path / "tls"), "--capture", str(tmp_path / "cap"), "--threads", str(a.threads)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(HERE.parent)},
        )  # fmt: skip
        try:
            assert server.stdout is not None
            line = server.stdout.readline()
            if not line.startswith("listening on "):
                raise SystemExit(f"the server did not start: {line!r}")
            port = int(line.rsplit(":", 1)[1])
            wait_port("127.0.0.1", port)
            remote = run_training(
                cfg, tmp_path / "remote", device="cpu", connect=f"127.0.0.1:{port}", tls_dir=tmp_path / "tls"
            )
            client_rss = peak_rss_gib()
            session = tmp_path / "cap" / "session-0000"
            t0 = time.monotonic()
            while (
                not (session / "journal.jsonl").is_file() or '"complete"' not in (session / "journal.jsonl").read_text()
            ):
                if time.monotonic() - t0 > 60:
                    raise SystemExit("the server's capture did not close")
                time.sleep(0.1)
            server_rss = vm_hwm_gib(server.pid)
        finally:
            server.terminate()
            server.wait(timeout=30)
        local = run_training(cfg, tmp_path / "local", device="cpu")
        messages = json.loads((tmp_path / "remote" / "wire" / "messages.json").read_text())
        ledger = json.loads((tmp_path / "local" / "wire" / "train-ledger.json").read_text())
        train_frames = [m for m in messages if m["header"].get("phase") == "train"]
        sent = sum(8 + len(json.dumps(m["header"], sort_keys=True)) + m["bytes"] for m in train_frames)
        on_tls = sum(
            framed(8 + len(json.dumps(m["header"], sort_keys=True)) + m["bytes"], m["direction"] == "client->server")
            for m in train_frames
        )
        blobs = sum(e["blob_bytes"] for e in ledger)
        tensor = sum(math.prod(m["header"]["shape"]) * 4 for m in train_frames)  # float32 rows
    per_step = {k: v / a.steps for k, v in {"tensor": tensor, "blob": blobs, "sent": sent, "tls": on_tls}.items()}
    tls_s = cfg.doc_len / remote.metrics["train_tokens_per_second"]  # seconds per step (one document)
    local_s = cfg.doc_len / local.metrics["train_tokens_per_second"]
    ratio = tls_s / local_s
    dev = f"cpu: {cpu_name()}, {a.threads} threads per process"
    row = (
        f"| {date.today().isoformat()} | {a.model} | {a.depth} | {a.steps} | {dev} | {local_s * 1000:.1f} | "
        f"{tls_s * 1000:.1f} | {ratio:.2f} | {per_step['tensor']:,.0f} | {per_step['sent']:,.0f} | "
        f"{per_step['tls']:,.0f} | {per_step['tls'] / per_step['tensor']:.4f} | {client_rss:.2f} | {server_rss:.2f} |"
    )
    print(row)
    print(f"frame blobs per step {per_step['blob']:,.0f} bytes")
    if a.record:
        record("## Transport", row)


if __name__ == "__main__":
    main()
