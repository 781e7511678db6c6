"""Throughput of the batched beam-search attacker against the naive reference (run by hand).

    .venv/bin/python benchmarks/attack_throughput.py --run RUN_DIR [--naive-docs 2] [--record]

RUN_DIR is a run of `splitleak train` (e.g. the `run/` folder that `make audit` writes; default
model smollm2-135m at depth 6). The script
1. measures this machine's float32 matmul throughput (GFLOP/s, 2048^3 products), five times before the
   search and five times after it; the floor reads the best of the ten (``MatmulReference``);
2. runs the activation-only attacker (k = 32, width 2, public copy) over all captured documents,
   batched with the key/value cache, and records wall time and peak RSS;
3. runs the naive reference (every prefix recomputed for every candidate, one document at a
   time) on the first --naive-docs documents, checks that the batched search returns identical
   tokens for them, and reports the per-document speed ratio;
4. counts the batched search's multiply-adds (token-forwards x 2 x client-block parameters, plus
   attention) and reports wall time against the floor that FLOPs / measured throughput gives.

With ``--command`` (and ``--attack activation``, ``joint`` or ``sipit``) it times the whole ``splitleak attack``
command as a user runs it (``--control-docs 0``: the mis-paired twin, on by default, is a second search the floor
does not count), from outside, ``--repeat`` times (the process's start, its imports, the model load, the
fit, the search and the result's write), and sets the median wall against the same floor: the attack's FLOPs over
the reference rate (the search counted as below for activation and joint plus what ``torch.utils.flop_counter``
counts outside it; for SipIt everything it computes, counted in an untimed pass). The row goes to the table "Whole
commands against their floor". With ``--worker`` as well, the commands run in a warm worker of the benchmark's own
(``splitleak worker start``, its folder in a temporary one): the worker's start and the first command (which loads the
model into it) are timed apart, then ``--repeat`` commands as above; the row goes to the table "Whole commands in the
warm worker". The worker's log must name every timed command, or no row is written.

With ``--breakdown`` (and ``--attack activation``, ``joint`` or ``sipit``) it runs the attack once as the worker does
with the model loaded (fit and reconstruct), then once more with every ATen operation timed (``op_time.OpTimes``), and
sets the time of the operations the floor counts (those with a FLOP formula) against the same floor: the lowest ratio
reachable if every other operation were free. The row goes to the table "What the floor leaves out".

With ``--attack gma-sl`` (or ``gma-sl-aware``) on a label-shielded run it times GMA-SL's label matching against
its floor: the FLOPs of the whole matching (the proxy Top's forward once per chunk, then per step the
vector-Jacobian product and its double backward), counted by ``torch.utils.flop_counter`` on untimed passes of
one and of three steps and extrapolated to the steps each chunk took in the timed pass. The row goes to the
table "GMA-SL against its floor".

With ``--attack NAME`` (activation, joint, joint-adaptive) it times the whole attack instead, as a grid job
runs it once its model is loaded: ``fit`` on a fresh knowledge (the ridge fit, and joint-adaptive's
calibration ranking) and ``reconstruct`` (the candidate lists, the gradient read-out, the gate, the beam
search), against a floor of the search's FLOPs as above plus the FLOPs of everything outside the search,
counted by ``torch.utils.flop_counter`` in an untimed pass (matrix products: the ridge fit's client forward
and solve, the cosine rankings against the vocabulary). The row goes to the table "Whole attacks against
their floor" (``--record``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from datetime import date
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from train_capture import cpu_name, peak_rss_gib, record  # noqa: E402

from splitleak.attacks import load_knowledge, load_traffic, make_attack  # noqa: E402
from splitleak.attacks.search import beam_search, beam_search_naive  # noqa: E402
from splitleak.runs.truth import eval_token_ids  # noqa: E402
from splitleak.runtime import keep_freed_memory  # noqa: E402


def matmul_gflops(n: int = 2048, reps: int = 5) -> float:
    """One timing of ``reps`` float32 n^3 products (GFLOP/s)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e9


class MatmulReference:
    """The floor's reference rate, taken beside the timed work: ``rounds`` timings before it and ``rounds``
    after, and the floor reads the best of them. One timing moved by 40 % from one minute to the next on a
    2-core machine (132 against 185 GFLOP/s), which made a search read 0.93 or 1.19 times its floor; the best
    of several is what the machine can do, so wall / floor is never flattered by a slow reference. The
    spread (slowest, fastest) is reported beside it."""

    def __init__(self, rounds: int = 5):
        self.rounds = rounds
        self.timings: list[float] = []

    def measure(self) -> None:
        self.timings += [matmul_gflops() for _ in range(self.rounds)]

    @property
    def best(self) -> float:
        return max(self.timings)

    def spread(self) -> str:
        return f"{min(self.timings):.0f}-{max(self.timings):.0f}"

    def cell(self) -> str:
        """The rate a row of RESULTS names: the best, with how many timings and their spread."""
        return f"{self.best:.0f} (best of {len(self.timings)}: {self.spread()})"


def run_identity(run: str | Path) -> dict[str, object]:
    """The model and cut of a run, as the benchmark rows name them."""
    manifest = json.loads((Path(run) / "manifest.json").read_text())
    return {"model": manifest["config"]["model"], "cut": manifest["split"]["cut"]}


def allocator() -> str:
    """Set glibc to keep freed memory as the command line and the grid's workers do
    (``runtime.keep_freed_memory``), and name the setting in force: ``keep`` or ``system``
    (``SPLITLEAK_MALLOC=system``, or not glibc)."""
    return "keep" if keep_freed_memory() else "system"


def row_head(run: str | Path, n: int, k: int, reference: MatmulReference) -> dict[str, object]:
    """The fields every attack row's JSON starts with: the run, its documents, k and the reference rate."""
    return {
        **run_identity(run),
        "docs": n,
        "k": k,
        "malloc": allocator(),
        "matmul_gflops": reference.best,
        "matmul_gflops_spread": reference.spread(),
    }


def device_cell() -> str:
    return f"cpu: {cpu_name()}, {torch.get_num_threads()} threads"


def search_flops(client, n_docs: int, T: int, k: int, width: int) -> float:
    """Multiply-adds x 2 of the batched search: every candidate token through the client blocks."""
    block_params = sum(p.numel() for b in client.blocks for p in b.parameters())
    d = client.embedding.shape[1]
    n_blocks = client.cut
    tokens = n_docs * (k + (T - 1) * width * k)
    dense = 2 * tokens * block_params
    # attention scores and weighted sums: each new token attends to ~t cached positions
    attn = sum(2 * 2 * d * (t + 1) * n_docs * (k if t == 0 else width * k) for t in range(T)) * n_blocks
    return float(dense + attn)


def outside_search_flops(kn, traffic, name: str, k: int) -> tuple[float, torch.Tensor]:
    """The FLOPs an attack computes outside its beam search (fit on a fresh knowledge, then its candidate
    lists), counted by torch's flop counter, and the candidates."""
    from splitleak.experiments.worker import _flop_counter  # torch's formulas and the CPU attention kernels

    attack = make_attack(name, k=k)
    with _flop_counter() as counter:
        cand = attack.fit(dataclasses.replace(kn)).candidates(traffic)
    return float(counter.get_total_flops()), cand


def whole_attack(a) -> None:
    """``--attack``: the whole attack (fit + reconstruct) against its floor (module docstring)."""
    reference = MatmulReference(a.rounds)
    kn = load_knowledge(a.run, "public")
    traffic = load_traffic(a.run)
    n, T = traffic.activations.shape[:2]
    rest, cand = outside_search_flops(kn, traffic, a.attack, a.k)
    search = search_flops(kn.client, n, T, a.k, 2)
    attack = make_attack(a.attack, k=a.k)
    fresh = dataclasses.replace(kn)  # an empty memo: the attack computes its ridge fit and lists itself
    reference.measure()
    t0 = time.perf_counter()
    rec = attack.fit(fresh).reconstruct(traffic)
    wall = time.perf_counter() - t0
    reference.measure()
    gflops = reference.best
    floor = (search + rest) / (gflops * 1e9)
    truth = torch.tensor(eval_token_ids(a.run, traffic.doc_ids))
    tok = float((rec.tokens == truth).float().mean())
    same = bool(torch.equal(rec.extra["candidates"], cand))  # the counted pass computed what the timed one did
    res = {
        "attack": a.attack,
        **row_head(a.run, n, a.k, reference),
        "wall_s": wall,
        "search_tflop": search / 1e12,
        "outside_search_tflop": rest / 1e12,
        "floor_s": floor,
        "wall_over_floor": wall / floor,
        "token_recovery": tok,
        "candidates_as_counted": same,
        "peak_rss_gib": peak_rss_gib(),
    }
    print(json.dumps(res, indent=2))
    if a.record:
        row = (
            f"| {date.today().isoformat()} | {a.attack} | {res['model']} | {res['cut']} | {n} | {a.k} | {device_cell()} | "
            f"{reference.cell()} | {search / 1e12:.2f} | "
            f"{rest / 1e12:.2f} | {wall:.1f} | {floor:.1f} | {wall / floor:.2f} | "
            f"{'yes' if same else 'NO'} | {tok:.4f} |"
        )
        record("### Whole attacks against their floor", row)


def attack_flops(kn, traffic, name: str, k: int, budget: int) -> float:
    """Every FLOP the attack computes once its model is loaded (fit and reconstruct), for the command's floor."""
    if name == "sipit":
        from splitleak.experiments.worker import _flop_counter  # torch's formulas and the CPU attention kernels

        with _flop_counter() as counter:
            make_attack("sipit", budget=budget).fit(dataclasses.replace(kn)).reconstruct(traffic)
        return float(counter.get_total_flops())
    n, T = traffic.activations.shape[:2]
    rest, _ = outside_search_flops(kn, traffic, name, k)
    return search_flops(kn.client, n, T, k, 2) + rest


def whole_command(a) -> None:
    """``--command``: the whole ``splitleak attack`` command against the attack's floor (module docstring)."""
    import os
    import statistics
    import subprocess
    import tempfile

    reference = MatmulReference(a.rounds)
    kn = load_knowledge(a.run, "public")
    traffic = load_traffic(a.run)
    n = traffic.activations.shape[0]
    flops = attack_flops(kn, traffic, a.attack, a.k, a.budget)
    del kn, traffic
    exe = Path(sys.executable).parent / "splitleak"
    size = ["--budget", str(a.budget)] if a.attack == "sipit" else ["--k", str(a.k)]
    walls = []
    reference.measure()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "SPLITLEAK_WORKER": "on" if a.worker else "off", "SPLITLEAK_WORKER_DIR": f"{tmp}/w"}
        start = first = None
        if a.worker:  # the worker's start, then one command that loads the model into it, each timed apart
            t0 = time.perf_counter()
            subprocess.run([str(exe), "worker", "start", "--idle", "600"], env=env, check=True, capture_output=True)
            start = time.perf_counter() - t0
        try:
            for i in range(a.repeat + (1 if a.worker else 0)):
                # the attack alone: its mis-paired twin (on by default) would search again, outside the floor's FLOPs
                cmd = [str(exe), "attack", str(a.run), "--attack", a.attack, *size, "--out", f"{tmp}/R{i}.json"]
                cmd += ["--quiet", "--control-docs", "0"]
                cmd += ["--threads", str(a.threads)] if a.threads else []
                t0 = time.perf_counter()
                subprocess.run(cmd, check=True, capture_output=True, env=env)
                walls.append(time.perf_counter() - t0)
        finally:
            if a.worker:
                subprocess.run([str(exe), "worker", "stop"], env=env, capture_output=True)
                served = Path(tmp, "w", "worker.log").read_text().count("'attack ")
                if served != len(walls):
                    raise SystemExit(f"the worker ran {served} of the {len(walls)} commands: not a worker's row")
        if a.worker:
            first, walls = walls[0], walls[1:]
    reference.measure()
    wall = statistics.median(walls)
    floor = flops / (reference.best * 1e9)
    res = {
        "attack": a.attack,
        **row_head(a.run, n, a.budget if a.attack == "sipit" else a.k, reference),
        "worker": a.worker,
        "worker_start_s": start,
        "first_command_s": first,
        "walls_s": walls,
        "median_wall_s": wall,
        "tflop": flops / 1e12,
        "floor_s": floor,
        "wall_over_floor": wall / floor,
    }
    print(json.dumps(res, indent=2))
    if a.record:
        head = f"| {date.today().isoformat()} | {a.attack} | {res['model']} | {res['cut']} | {n} | {res['k']} | "
        head += f"{device_cell()} | {reference.cell()} | {flops / 1e12:.2f} | "
        tail = f"{', '.join(f'{w:.1f}' for w in walls)} | {wall:.1f} | {floor:.1f} | {wall / floor:.2f} |"
        if a.worker:
            record("### Whole commands in the warm worker", f"{head}{start:.1f} | {first:.1f} | {tail}")
        else:
            record("### Whole commands against their floor", head + tail)


def breakdown(a) -> None:
    """``--breakdown``: one pass of the attack (fit and reconstruct, the model loaded) with every operation timed
    (``op_time.OpTimes``), against the floor of ``--command``: the counted operations' seconds over the floor is
    the lowest ratio reachable with every uncounted operation free."""
    from op_time import OpTimes

    reference = MatmulReference(a.rounds)
    kn = load_knowledge(a.run, "public")
    traffic = load_traffic(a.run)
    n = traffic.activations.shape[0]
    flops = attack_flops(kn, traffic, a.attack, a.k, a.budget)
    size = {"budget": a.budget} if a.attack == "sipit" else {"k": a.k}
    reference.measure()
    t0 = time.perf_counter()
    plain = make_attack(a.attack, **size).fit(dataclasses.replace(kn)).reconstruct(traffic)
    wall = time.perf_counter() - t0
    with OpTimes() as ops:
        t0 = time.perf_counter()
        timed = make_attack(a.attack, **size).fit(dataclasses.replace(kn)).reconstruct(traffic)
        timed_wall = time.perf_counter() - t0
    reference.measure()
    if not torch.equal(plain.tokens, timed.tokens):
        raise SystemExit("the timed pass read other tokens than the plain one: not the same pass")
    if abs(ops.counted_flops / flops - 1) > 0.05:  # e.g. a result kept from the plain pass: nothing computed again
        raise SystemExit(
            f"the timed pass computed {ops.counted_flops / 1e12:.3f} TFLOP against the floor's {flops / 1e12:.3f}: "
            "not the pass the floor counts"
        )
    floor = flops / (reference.best * 1e9)
    counted_rate = ops.counted_flops / ops.counted_s / 1e9
    res = {
        "attack": a.attack,
        **row_head(a.run, n, a.budget if a.attack == "sipit" else a.k, reference),
        "tflop_floor": flops / 1e12,
        "tflop_counted": ops.counted_flops / 1e12,
        "floor_s": floor,
        "wall_s": wall,
        "timed_wall_s": timed_wall,
        "counted_s": ops.counted_s,
        "counted_gflops": counted_rate,
        "uncounted_s": ops.uncounted_s,
        "wall_over_floor": wall / floor,
        "counted_over_floor": ops.counted_s / floor,
        "largest_uncounted": ops.largest_uncounted(),
    }
    print(json.dumps(res, indent=2))
    if a.record:
        largest = ", ".join(f"{k} {s:.2f}" for k, s in ops.largest_uncounted(4))
        row = (
            f"| {date.today().isoformat()} | {a.attack} | {res['model']} | {res['cut']} | {n} | {res['k']} | "
            f"{device_cell()} | {reference.cell()} | {flops / 1e12:.2f} | {floor:.1f} | {wall:.1f} | "
            f"{wall / floor:.2f} | {ops.counted_s:.1f} | {counted_rate:.0f} | **{ops.counted_s / floor:.2f}** | "
            f"{ops.uncounted_s:.1f} | {largest} | {timed_wall:.1f} |"
        )
        record("### What the floor leaves out: each operation timed", row)


def _matching_flops(kn, traffic, name: str, steps: int, params: dict) -> float:
    """The FLOPs of GMA-SL's matching capped at ``steps`` steps per chunk (its stop rule cannot act so early)."""
    from splitleak.experiments.worker import _flop_counter  # module hooks off: autograd.grad on a leaf

    with _flop_counter() as counter:
        make_attack(name, **{**params, "steps": steps}).fit(dataclasses.replace(kn)).reconstruct(traffic)
    return float(counter.get_total_flops())


def label_attack(a) -> None:
    """``--attack gma-sl``: the label matching against its floor (module docstring)."""
    reference = MatmulReference(a.rounds)
    kn = load_knowledge(a.run, "public", with_top=True)
    traffic = load_traffic(a.run)
    n = traffic.trunk_output.shape[0]
    params = json.loads(a.params)
    one, three = _matching_flops(kn, traffic, a.attack, 1, params), _matching_flops(kn, traffic, a.attack, 3, params)
    per_step = (three - one) / 2  # every chunk's steps together
    attack = make_attack(a.attack, **params)
    reference.measure()
    t0 = time.perf_counter()
    rec = attack.fit(dataclasses.replace(kn)).reconstruct(traffic)
    wall = time.perf_counter() - t0
    reference.measure()
    steps = rec.extra["steps"]
    chunks = len(steps)
    # the chunks hold equal numbers of documents where batch divides n; else the mean is an approximation
    flops = (one - per_step) + per_step * sum(steps) / chunks
    floor = flops / (reference.best * 1e9)
    truth = torch.tensor(eval_token_ids(a.run, traffic.doc_ids))
    labels = float((rec.extra["labels"] == truth[:, 1:]).float().mean())
    if a.labels_out:  # to set two readings side by side, position by position
        save_file({"labels": rec.extra["labels"].contiguous()}, a.labels_out)
    named = a.attack + (" (" + ", ".join(f"{k} {v}" for k, v in params.items()) + ")" if params else "")
    res = {
        "attack": named,
        **row_head(a.run, n, 0, reference),
        "wall_s": wall,
        "steps_per_chunk": steps,
        "matching_tflop": flops / 1e12,
        "floor_s": floor,
        "wall_over_floor": wall / floor,
        "label_recovery": labels,
        "peak_rss_gib": peak_rss_gib(),
    }
    print(json.dumps(res, indent=2))
    if a.record:
        row = (
            f"| {date.today().isoformat()} | {named} | {res['model']} | {res['cut']} | {n} | "
            f"{'/'.join(map(str, steps))} | {device_cell()} | {reference.cell()} | {flops / 1e12:.2f} | {wall:.1f} | "
            f"{floor:.1f} | {wall / floor:.2f} | {labels:.4f} |"
        )
        record("### GMA-SL against its floor", row)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument(
        "--attack", default=None, choices=["activation", "joint", "joint-adaptive", "sipit", "gma-sl", "gma-sl-aware"]
    )
    ap.add_argument("--command", action="store_true", help="time the whole `splitleak attack` command (--repeat runs)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--breakdown", action="store_true", help="one pass with every operation timed, against the floor (op_time)"
    )
    ap.add_argument(
        "--worker", action="store_true", help="with --command: in a warm worker (`splitleak worker start`) of its own"
    )
    ap.add_argument("--budget", type=int, default=32, help="SipIt's checks per position")
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--naive-docs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=5, help="reference matmul timings before and after the search")
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--labels-out", default=None, help="with --attack gma-sl: write the labels read (safetensors)")
    ap.add_argument(
        "--params", default="{}", help='with --attack gma-sl: its parameters, e.g. \'{"start": "uniform"}\''
    )
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    allocator()
    if a.command:
        if a.attack not in ("activation", "joint", "sipit"):
            ap.error("--command times activation, joint or sipit (--attack)")
        whole_command(a)
        return
    if a.breakdown:
        if a.attack not in ("activation", "joint", "sipit"):
            ap.error("--breakdown times activation, joint or sipit (--attack)")
        breakdown(a)
        return
    if a.attack in ("gma-sl", "gma-sl-aware"):
        label_attack(a)
        return
    if a.attack:
        whole_attack(a)
        return

    reference = MatmulReference(a.rounds)
    kn = load_knowledge(a.run, "public")
    traffic = load_traffic(a.run)
    attack = make_attack("activation", k=a.k).fit(kn)
    cand = attack.candidates(traffic)
    n, T = traffic.activations.shape[:2]
    reference.measure()
    t0 = time.perf_counter()
    fast = beam_search(kn.client, traffic.activations, cand, width=2)
    wall = time.perf_counter() - t0
    reference.measure()
    gflops = reference.best
    flops = search_flops(kn.client, n, T, a.k, 2)
    print(f"matmul {reference.cell()} GFLOP/s; search {flops / 1e12:.2f} TFLOP in {wall:.1f} s", flush=True)
    rss = peak_rss_gib()
    truth = torch.tensor(eval_token_ids(a.run, traffic.doc_ids))
    tok = float((fast.tokens == truth).float().mean())

    m = a.naive_docs
    t1 = time.perf_counter()
    fast_sub = beam_search(kn.client, traffic.activations[:m], cand[:m], width=2)
    fast_sub_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    slow = beam_search_naive(kn.client, traffic.activations[:m], cand[:m], width=2)
    naive_s = time.perf_counter() - t2
    identical = bool(torch.equal(fast_sub.tokens, slow.tokens)) and bool(torch.equal(fast_sub.tokens, fast.tokens[:m]))
    ratio_same = naive_s / fast_sub_s
    ratio_per_doc = (naive_s / m) / (wall / n)

    floor = flops / (gflops * 1e9)
    res = {
        **row_head(a.run, n, a.k, reference),
        "batched_s": wall,
        "peak_rss_gib": rss,
        "token_recovery": tok,
        "naive_docs": m,
        "naive_s": naive_s,
        "batched_same_docs_s": fast_sub_s,
        "identical": identical,
        "speedup_same_docs": ratio_same,
        "speedup_per_doc": ratio_per_doc,
        "search_tflop": flops / 1e12,
        "floor_s": floor,
        "wall_over_floor": wall / floor,
    }
    print(json.dumps(res, indent=2))
    if a.record:
        row = (
            f"| {date.today().isoformat()} | {res['model']} | {res['cut']} | {n} | {a.k} | {device_cell()} | "
            f"{reference.cell()} | "
            f"{wall:.0f} | {floor:.0f} | {wall / floor:.2f} | {rss:.2f} | {m} | {ratio_same:.1f} | {ratio_per_doc:.0f} | "
            f"{'yes' if identical else 'NO'} | {tok:.4f} |"
        )
        record("## Attack throughput", row)


if __name__ == "__main__":
    main()
