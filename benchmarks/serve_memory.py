"""The memory of `splitleak serve` under hostile clients (run by hand, not part of the suite).

    .venv/bin/python benchmarks/serve_memory.py [--cases all] [--record]

Starts `splitleak serve` in a subprocess on a loopback port with the tiny random model (tiny-gpt2),
once per case, with the default maxima, runs one hostile client case against it from this process,
and reads the server's peak resident memory (VmHWM in /proc/PID/status) and its most threads. The
cases are those of issue 33:

- ``baseline``: one well-behaved session (hello, a training step, close), for reference;
- ``at-the-maxima``: four sessions at once (the default ``--max-concurrent``) each send three training
  steps as large as the default maxima allow (32 rows x 64 tokens = --max-frame-tokens 2048): the
  bound the other cases stay under;
- ``oversized-hello``: three hellos asking for ``capture_batch=512, doc_len=256`` (before the maxima: a
  server killed for memory under 3 GiB), refused before any model loads;
- ``unanswered-forwards``: in a U-shape, four sessions at once each send forwards of 32 rows and never
  a backward-top, 170 in all if the server took them (before: out of memory); each session is refused
  at its second;
- ``oversized-messages``: three sessions each send one 150 MiB message after the welcome (before: the
  whole message read, +750-900 MiB), refused unread by the WebSocket layer;
- ``silent-after-hello``: eight clients send a valid hello and go silent (before: 8 model copies and 21
  threads for 300 s); at most ``--max-concurrent`` (4) are admitted, the rest told the server is busy;
- ``silent-before-hello``: eight clients connect and send nothing; admitted ones end at the hello timeout.

Before the handshake (anyone who can reach the port, no certificate; the defaults ``--max-pending 64
--max-pending-per-address 8 --handshake-timeout 10``), each while a legitimate client from 127.0.0.1 trains a
step, whose returned gradient must have the same bits as the same step on the quiet server (taken first):

- ``silent-tcp-flood``: 10,000 TCP connections that never send a byte, from 4 loopback addresses
  (127.0.0.2-5), 500 open at a time (before: a thread per socket for 30 s, 301 threads from 300 sockets);
- ``slow-loris``: 48 peers from 6 addresses send a TLS record header and then a byte every 0.5 s;
- ``failed-handshake-flood``: 2,000 plaintext connections from one address (each a failed TLS handshake).

The hostile addresses hold at most 8 pending places each, so they leave room under the 64 for the legitimate
client. A flood from more than 64 / 8 addresses fills every place: the server stays bounded, but a newcomer is
then refused until a place frees (availability under a distributed flood is the network's to defend).

With --record it adds the rows to benchmarks/RESULTS.md's section "Memory of `serve` under hostile clients".
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from splitleak.wire.frames import Frame, encode  # noqa: E402
from splitleak.wire.transport import frame_header, new_nonce, pack, unpack  # noqa: E402

CASES = (
    "baseline",
    "at-the-maxima",
    "oversized-hello",
    "unanswered-forwards",
    "oversized-messages",
    "silent-after-hello",
    "silent-before-hello",
    "silent-tcp-flood",
    "slow-loris",
    "failed-handshake-flood",
)
SECTION = "## Memory of `serve` under hostile clients (`benchmarks/serve_memory.py`)"


def in_parallel(fn, n: int, timeout: float = 300.0) -> None:
    """Run ``fn(0) .. fn(n - 1)`` in ``n`` threads at once (n clients of the server) and wait for all."""
    threads = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)


def proc_meminfo_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / (1 << 20)
    return float("nan")


def proc_status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


class Server:
    """`splitleak serve` in a subprocess; samples its thread count while it runs."""

    def __init__(self, tls: Path, *flags: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "splitleak.cli", "serve", "--listen", "127.0.0.1:0", "--tls-dir", str(tls),
             "--threads", "1", *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        line = self.proc.stdout.readline()
        if not line.startswith("listening on 127.0.0.1:"):
            self.proc.kill()
            raise RuntimeError(line + self.proc.stderr.read())
        self.port = int(line.rsplit(":", 1)[1])
        self.start_rss = proc_status(self.proc.pid, "VmRSS")
        self.threads = 0
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                self.threads = max(self.threads, proc_status(self.proc.pid, "Threads"))
            except (OSError, RuntimeError):
                return
            time.sleep(0.02)

    def finish(self) -> dict:
        peak = proc_status(self.proc.pid, "VmHWM")
        self._stop.set()
        self._sampler.join(timeout=5)
        self.proc.terminate()
        try:
            _, err = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate(timeout=30)
        return {"start_mib": self.start_rss / 1024, "peak_mib": peak / 1024, "threads": self.threads, "log": err}


def hello(**over) -> dict:
    from splitleak.defences import DefenceChain
    from splitleak.models import SplitModel, load_model
    from splitleak.seeds import model_init_seed
    from splitleak.training import make_train_config
    from splitleak.training.config import ServerConfig
    from splitleak.wire.client import hello_for

    split_kw = over.pop("split", {"depth": 2})
    cfg = make_train_config(
        model="tiny-gpt2", n_calib=4, n_train=6, n_eval=6, steps=4, all_local_baseline=False, seed=1, **split_kw,
        **over,
    )  # fmt: skip
    lm = load_model(cfg.model, precision=cfg.precision, seed=model_init_seed(cfg.seed))
    split = SplitModel(lm, cfg.depth, cfg.offload_start, cfg.offload_length)
    chain = DefenceChain.from_specs([d.model_dump() for d in cfg.defences], cfg.seed)
    server_config = ServerConfig.of(cfg, random_init=True).as_dict()
    return hello_for(server_config, lm.fingerprint(), split.spec.as_dict(), chain.describe())


def connect(port: int, tls: Path, max_size=None):
    from websockets.sync.client import connect as ws_connect

    from splitleak.wire.tls import client_context

    return ws_connect(
        f"wss://127.0.0.1:{port}/", ssl=client_context(tls), compression=None, proxy=None, max_size=max_size,
        open_timeout=30,
    )  # fmt: skip


def say_hello(conn, h: dict) -> dict:
    conn.send(pack({**h, "seq": 0, "nonce": new_nonce()}))
    reply, _ = unpack(conn.recv(timeout=60))
    return reply


def forward(step: int, rows: int, tokens: int = 32, width: int = 64, labels: bool = True) -> Frame:
    g = torch.Generator().manual_seed(step)
    return Frame(
        "forward",
        step,
        tuple(range(rows)),
        torch.randn(rows, tokens, width, generator=g),
        torch.ones(rows, tokens, dtype=torch.int64),
        "train",
        labels=torch.zeros(rows, tokens, dtype=torch.int64) if labels else None,
    )


def send_frame(conn, frame: Frame, seq: int, session: str | None):
    blob = encode(frame)
    conn.send(pack({**frame_header(frame, blob, seq), "session": session}, blob))
    return unpack(conn.recv(timeout=60))[0]


def _step_bits(port: int, tls: Path) -> str:
    """A legitimate client's hello and one training step: the sha256 of the returned gradient's bits."""
    import hashlib

    conn = connect(port, tls)
    w = say_hello(conn, hello())
    header, payload = unpack(_send_raw(conn, forward(0, 1), 1, w.get("session")))
    conn.send(pack({"type": "close", "seq": 2, "nonce": new_nonce(), "session": w.get("session")}))
    conn.close()
    return f"{header.get('kind')} " + hashlib.sha256(bytes(payload or b"")).hexdigest()[:16]


def _send_raw(conn, frame: Frame, seq: int, session: str | None) -> bytes:
    blob = encode(frame)
    conn.send(pack({**frame_header(frame, blob, seq), "session": session}, blob))
    return conn.recv(timeout=120)


def _raw(port: int, address: str):
    import socket

    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(10)
    s.bind((address, 0))
    s.connect(("127.0.0.1", port))
    return s


def _flood(port: int, case: str, stop: threading.Event, counts: dict) -> None:
    """The hostile side of a pre-handshake case, until ``stop``."""
    if case == "silent-tcp-flood":
        wave: list = []
        for i in range(10_000):
            try:
                wave.append(_raw(port, f"127.0.0.{2 + i % 4}"))
                counts["opened"] = counts.get("opened", 0) + 1
            except OSError:
                counts["failed"] = counts.get("failed", 0) + 1
            if len(wave) >= 500:
                for s in wave:
                    s.close()
                wave = []
        for s in wave:
            s.close()
    elif case == "slow-loris":
        peers = [_raw(port, f"127.0.0.{2 + i % 6}") for i in range(48)]
        for s in peers:
            s.sendall(bytes([0x16, 0x03, 0x01, 0x02, 0x00]))
        t0 = time.monotonic()
        while time.monotonic() - t0 < 15:
            alive = 0
            for s in peers:
                try:
                    s.sendall(b"\x00")
                    alive += 1
                except OSError:
                    pass
            if alive:
                counts["open at s"] = int(time.monotonic() - t0)
            time.sleep(0.5)
        for s in peers:
            s.close()
    else:  # failed-handshake-flood
        for _ in range(2000):
            try:
                with _raw(port, "127.0.0.2") as s:
                    s.sendall(b"GET / HTTP/1.1\r\n\r\n")
                    while s.recv(64):
                        pass
            except OSError:
                pass
            counts["sent"] = counts.get("sent", 0) + 1


def run_case(case: str, tls: Path) -> dict:
    srv = Server(tls)
    notes: list[str] = []
    try:
        if case == "baseline":
            h = hello()
            conn = connect(srv.port, tls)
            w = say_hello(conn, h)
            reply = send_frame(conn, forward(0, 1), 1, w.get("session"))
            conn.send(pack({"type": "close", "seq": 2, "nonce": new_nonce(), "session": w.get("session")}))
            conn.recv(timeout=30)
            conn.close()
            notes.append(f"one step answered with a {reply.get('kind')}")
        elif case == "at-the-maxima":
            h = hello(capture_batch=16, doc_len=64)  # 16 x 2 = 32 rows x 64 tokens = 2048 (--max-frame-tokens)
            kinds = []

            def steps(i: int) -> None:
                conn = connect(srv.port, tls)
                w = say_hello(conn, h)
                for step in range(3):
                    kinds.append(send_frame(conn, forward(step, 32, tokens=64), 1 + step, w.get("session")).get("kind"))
                conn.send(pack({"type": "close", "seq": 4, "nonce": new_nonce(), "session": w.get("session")}))
                conn.recv(timeout=60)
                conn.close()

            in_parallel(steps, 4)
            notes.append(f"{kinds.count('backward')} of 12 steps of 32 x 64 answered")
        elif case == "oversized-hello":
            h = hello(capture_batch=512, doc_len=256)
            for _ in range(3):
                conn = connect(srv.port, tls)
                reply = say_hello(conn, h)
                conn.close()
            said = str(reply.get("message", reply))
            notes.append("3 refused, " + ("naming --max-rows" if "--max-rows" in said else f"as {said[:80]}"))
        elif case == "unanswered-forwards":
            h = hello(split={"offload_start": 1, "offload_length": 2})
            sent = []

            def flood(i: int) -> None:
                conn = connect(srv.port, tls)
                w = say_hello(conn, h)
                n = 0
                try:
                    for step in range(170 // 4 + 1):
                        reply = send_frame(conn, forward(step, 32, labels=False), 1 + step, w.get("session"))
                        if reply.get("type") != "frame":
                            break
                        n += 1
                except Exception:  # noqa: BLE001 (the server closed the session)
                    pass
                sent.append(n)
                conn.close()

            in_parallel(flood, 4)
            notes.append(f"forwards answered per session: {sorted(sent)} (of up to {170 // 4 + 1} sent each)")
        elif case == "oversized-messages":
            h = hello()
            junk = b"SLK1" + bytes(150 << 20)
            codes = []
            for _ in range(3):
                conn = connect(srv.port, tls)
                say_hello(conn, h)
                try:
                    conn.send(junk)
                    conn.recv(timeout=60)
                except Exception as exc:  # noqa: BLE001
                    rcvd = getattr(exc, "rcvd", None)
                    codes.append(rcvd.code if rcvd is not None else type(exc).__name__)
                conn.close()
            notes.append(f"close codes {codes}")
        elif case in ("silent-after-hello", "silent-before-hello"):
            h = hello()
            conns, replies = [], []
            for _ in range(8):
                conn = connect(srv.port, tls)
                conns.append(conn)
                if case == "silent-after-hello":
                    try:
                        conn.send(pack({**h, "seq": 0, "nonce": new_nonce()}))
                    except Exception:  # noqa: BLE001 (refused at once)
                        pass
            if case == "silent-after-hello":
                for conn in conns:
                    try:
                        replies.append(unpack(conn.recv(timeout=60))[0].get("type"))
                    except Exception:  # noqa: BLE001
                        replies.append("closed")
                notes.append(f"replies: {replies.count('welcome')} welcome, {replies.count('error')} busy")
            time.sleep(12.0)  # past the hello timeout (10 s), well before the idle timeout (300 s)
            for conn in conns:
                conn.close()
        elif case in ("silent-tcp-flood", "slow-loris", "failed-handshake-flood"):
            quiet = _step_bits(srv.port, tls)
            stop, counts = threading.Event(), {}
            hostile = threading.Thread(target=_flood, args=(srv.port, case, stop, counts))
            t0 = time.monotonic()
            hostile.start()
            time.sleep(2.0)
            during = _step_bits(srv.port, tls)  # a legitimate client in the middle of it
            took = time.monotonic() - t0
            hostile.join(timeout=600)
            notes.append(
                f"legitimate step {'the same bits' if during == quiet else 'DIFFERENT bits'} as on the quiet server "
                f"(answered {took:.1f} s into the flood); {counts}"
            )
        else:
            raise SystemExit(f"unknown case {case!r}; one of {', '.join(CASES)}")
        time.sleep(0.5)
    finally:
        out = srv.finish()
    log = "\n".join(line for line in out["log"].splitlines() if line.startswith("serve: "))  # the log, not the report
    counts = {
        "log lines": len(log.splitlines()),
        "refused before the handshake": log.count("before its handshake"),
        "no hello": log.count("no hello within"),
        "busy": log.count("the server is busy"),
        "idle": log.count("idle timeout"),
    }
    if any(counts.values()):
        notes.append("server log: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v))
    out["notes"] = "; ".join(notes)
    out["case"] = case
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="all", help="comma-separated, or all: " + ", ".join(CASES))
    ap.add_argument("--record", action="store_true", help="add the rows to benchmarks/RESULTS.md")
    args = ap.parse_args()
    cases = CASES if args.cases == "all" else tuple(args.cases.split(","))
    torch.manual_seed(0)
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # websockets' note on connect() without `with`
    from splitleak.wire.tls import init_tls

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tls = init_tls(Path(tmp) / "tls").folder
        for case in cases:
            t0 = time.monotonic()
            r = run_case(case, tls)
            r["seconds"] = time.monotonic() - t0
            rows.append(r)
            print(
                f"{case:22s} start {r['start_mib']:7.1f} MiB  peak {r['peak_mib']:7.1f} MiB  threads {r['threads']:3d}  "
                f"{r['seconds']:5.1f} s  {r['notes']}",
                flush=True,
            )
    if args.record:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE)
        cpu = next(
            (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.startswith("model name")),
            platform.machine(),
        )  # fmt: skip
        mem = proc_meminfo_gib()
        cpu = f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB"
        lines = [
            f"| {date.today()} | {r['case']} | {r['start_mib']:.0f} | {r['peak_mib']:.0f} | {r['threads']} | "
            f"{r['notes'] or '—'} | {cpu} | {commit.stdout.strip()} |"
            for r in rows
        ]
        path = HERE / "RESULTS.md"
        text = path.read_text()
        if SECTION not in text:
            raise SystemExit(f"add the section {SECTION!r} with its table to {path} first")
        head, _, tail = text.partition(SECTION)
        nxt = tail.find("\n## ")
        body, rest = (tail, "") if nxt < 0 else (tail[:nxt], tail[nxt:])
        path.write_text(head + SECTION + body.rstrip("\n") + "\n" + "\n".join(lines) + "\n" + rest)


if __name__ == "__main__":
    main()
