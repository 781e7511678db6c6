"""The attacks' Adam as torch's fused kernel against the default one, paired (run by hand).

    .venv/bin/python benchmarks/fused_adam.py --run RUN_DIR [--docs 8] [--threads 1] [--repeats 3]
        [--attack gma-sl --attack bisr-f ...] [--steps 40] [--sip-epochs 40]

RUN_DIR is a label-shielded run of `splitleak train --mode label-shielded` (a run of the `mirage` grid's store
will do). GMA-SL, gma-sl-aware and BiSR optimise soft labels Z over the whole vocabulary with Adam, 12.2 M
floats for a chunk of 8 documents of 32 tokens on SmolLM2-135M; torch's default Adam on the CPU makes about ten
passes over them a step, the fused kernel one. For each --attack the script runs the attack's own code on the
first --docs captured documents (``fit`` on the public knowledge, ``reconstruct``), once with the attacks'
optimiser as it is (``runtime.fused_optimizer``: fused) and once with it replaced by the default kernel,
alternating, --repeats times each, and prints the median seconds of each, their ratio, and how many of the
predicted tokens the two agree on in the last repeat (the two kernels round differently, so the optimisation can
end elsewhere).
--steps sets the attack's step budget (``steps`` for the GMA attacks, ``b_steps``/``f_steps`` for BiSR); its
stopping rule stays on, so the steps each run took (summed over chunks and stages) are printed beside the times.
BiSR's time includes its SIP inverter's training (AdamW, also through ``fused_optimizer``), --sip-epochs
epochs of it (BiSR's own default: 40).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import splitleak.attacks.bisr as bisr  # noqa: E402
import splitleak.attacks.gma as gma  # noqa: E402
import splitleak.attacks.gma_aware as gma_aware  # noqa: E402
import splitleak.attacks.sip as sip  # noqa: E402
from splitleak.attacks import load_knowledge, load_traffic, make_attack  # noqa: E402

MODULES = (gma, gma_aware, bisr, sip)
STEP_PARAM = {"gma-sl": "steps", "gma-sl-aware": "steps", "bisr": "b_steps", "bisr-f": "f_steps"}


def default_kernel(cls, params, **kwargs):
    return cls(list(params), **kwargs)


def run_once(name: str, params: dict, knowledge, traffic, fused: bool) -> tuple[float, torch.Tensor, int]:
    saved = [m.fused_optimizer for m in MODULES]
    if not fused:
        for m in MODULES:
            m.fused_optimizer = default_kernel
    try:
        attack = make_attack(name, **params)
        start = time.perf_counter()
        recon = attack.fit(knowledge).reconstruct(traffic)
        seconds = time.perf_counter() - start
        taken = sum(sum(recon.extra.get(k, [])) for k in ("steps", "b_steps", "f_steps"))
        return seconds, recon.tokens, taken
    finally:
        for m, f in zip(MODULES, saved):
            m.fused_optimizer = f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--sip-epochs", type=int, default=40)
    ap.add_argument("--attack", action="append", choices=sorted(STEP_PARAM))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    knowledge = load_knowledge(args.run, "public", with_top=True)
    traffic = load_traffic(args.run).subset(range(args.docs))
    print(
        f"| attack | step budget | steps taken, default / fused | docs | threads | default s (median of {args.repeats}) "
        "| fused s | default/fused | tokens equal |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.attack or ["gma-sl"]:
        times: dict[bool, list[float]] = {False: [], True: []}
        tokens: dict[bool, torch.Tensor] = {}
        taken: dict[bool, int] = {}
        params = {STEP_PARAM[name]: args.steps} | ({"sip_epochs": args.sip_epochs} if name.startswith("bisr") else {})
        for _ in range(args.repeats):
            for fused in (False, True):
                s, tokens[fused], taken[fused] = run_once(name, params, knowledge, traffic, fused)
                times[fused].append(s)
        d, f = statistics.median(times[False]), statistics.median(times[True])
        same = float((tokens[False] == tokens[True]).float().mean())
        print(
            f"| {name} | {args.steps} | {taken[False]} / {taken[True]} | {args.docs} | {args.threads} | {d:.1f} | {f:.1f} "
            f"| {d / f:.2f} | {100 * same:.1f} % |"
        )


if __name__ == "__main__":
    main()
