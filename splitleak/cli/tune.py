"""``splitleak tune``: parses, then calls ``splitleak.experiments.tune``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from splitleak.cli.common import DeviceOpt, ThreadsOpt, app, console, user_errors
from splitleak.experiments.tune import DEFAULT_ATTACKS, TuneSettings, parse_enqueue
from splitleak.report.tune import render_tune


@app.command("tune")
def tune_cmd(
    out: Path = typer.Option(..., "--out", help="folder of the tune: study.db, store/, tune.json, tune.md, frontier"),
    budget: float = typer.Option(
        ..., "--budget", help="the utility cost allowed (> 0): 0.05 = +5 % perplexity (rel-ppl) or 0.05 nats (delta-ce)"
    ),
    utility: str = typer.Option(
        "rel-ppl",
        "--utility",
        help="rel-ppl: perplexity change against the undefended run at the same depth; delta-ce: held-out "
        "cross-entropy change (= ΔU)",
    ),
    model: str = typer.Option("smollm2-135m", "--model", help="a preset (smollm2-135m, tiny-gpt2, ...) or an id"),
    model_path: Optional[str] = typer.Option(None, "--model-path", help="a local model directory"),
    depth: list[int] = typer.Option([3, 6], "--depth", help="cut depths to search; repeat (--depth 2 --depth 4)"),
    defence: list[str] = typer.Option(
        [],
        "--defence",
        help="defences (or chains, quant8+clip-noise) to search; repeat; default: none and every defence that "
        "declares a search range and runs on a plain split",
    ),
    attacks: str = typer.Option(
        ",".join(DEFAULT_ATTACKS),
        "--attacks",
        help="the suite, cheapest first (the first is the early-stop probe): vmi, activation, joint, sipit, "
        "sipit-trained, adaptive (the attacks built for the trial's defences; not first)",
    ),
    n_trials: int = typer.Option(20, "--n-trials", help="trials in all (a rerun resumes up to this many)"),
    seed: int = typer.Option(0, "--seed", help="the sampler's and the attacks' seed"),
    victim_seed: int = typer.Option(1, "--victim-seed", help="the training run's seed"),
    stop_above: float = typer.Option(
        0.05, "--stop-above", help="stop a trial when the first attack's effect (lower end) is above this (>= 0.01)"
    ),
    bound_below: Optional[float] = typer.Option(
        None,
        "--bound-below",
        help="pass only where no reader can read more than this share of tokens (the defended run's mean token "
        "bound, informed adversary; e.g. 0.1), besides the gate; default: the bound is recorded, not required",
    ),
    enqueue: list[str] = typer.Option(
        [],
        "--enqueue",
        help="try first: depth=D,defence=NAME[,ARG=VALUE]; repeat (e.g. depth=3,defence=clip-noise,sigma=1)",
    ),
    no_undefended: bool = typer.Option(
        False, "--no-undefended", help="do not try the undefended point at each depth first"
    ),
    data: str = typer.Option("synthetic-pii", "--data", help="synthetic-pii, wikitext2, ..."),
    data_path: Optional[Path] = typer.Option(None, "--data-path", help="folder of the data (wikitext2 offline)"),
    precision: str = typer.Option("float32", "--precision"),
    n_calib: int = typer.Option(32, "--n-calib"),
    n_train: int = typer.Option(128, "--n-train"),
    n_eval: int = typer.Option(64, "--n-eval"),
    doc_len: int = typer.Option(32, "--doc-len"),
    steps: Optional[int] = typer.Option(None, "--steps", help="training steps (default: one pass)"),
    threads: Optional[int] = ThreadsOpt,
    device: str = DeviceOpt,
    quiet: bool = typer.Option(False, "--quiet"),
) -> None:
    """Search cut depth × defence × strength for the configurations that hold the gate against the attack
    suite within a utility budget (and, with --bound-below, whose bound says no reader can read more), and draw
    the privacy–utility frontier. A rerun resumes."""
    # lazy: torch stays out of `splitleak --help`
    from splitleak.experiments.tune_study import tune

    def say(s: str) -> None:
        if not quiet:
            console.print(s, highlight=False, markup=False, soft_wrap=True)

    with user_errors():
        settings = TuneSettings(
            model=model,
            budget=budget,
            utility=utility,
            attacks=tuple(a.strip() for a in attacks.split(",") if a.strip()),
            seed=seed,
            victim_seed=victim_seed,
            data=data,
            data_path=str(data_path.resolve()) if data_path is not None else None,
            model_path=str(Path(model_path).resolve()) if model_path else None,
            precision=precision,
            n_calib=n_calib,
            n_train=n_train,
            n_eval=n_eval,
            doc_len=doc_len,
            steps=steps,
            stop_above=stop_above,
            bound_below=bound_below,
        )
        res = tune(
            out,
            settings,
            depths=depth,
            defences=defence or None,
            n_trials=n_trials,
            enqueue=[parse_enqueue(e) for e in enqueue],
            undefended_first=not no_undefended,
            threads=threads,
            device=device,
            say=say,
            render=render_tune,
        )
    console.print(
        f"{res.ran_trials} trial(s) ran now ({res.jobs_ran} job(s)); {len(res.trials)} in the study; "
        f"{len(res.passing)} pass; frontier: trials {', '.join(map(str, res.frontier)) or 'none'}",
        highlight=False,
    )
    if res.passing:
        best = next(t for t in res.trials if t["number"] == res.passing[0])
        bound = (
            f"no reader above {100 * best['token_bound']:.1f} % of tokens"
            if best.get("token_bound") is not None
            else "no formal bound"
        )
        console.print(
            f"cheapest passing: trial {best['number']}, depth {best['depth']}, {best['defence']} "
            f"(cost {best['cost']:+.4g}, G {100 * best['G']:+.2f} pp, {bound})",
            highlight=False,
            markup=False,
        )
    else:
        console.print("no configuration passes; see tune.md", highlight=False)
    for p in res.paths:
        console.print(str(p), highlight=False, markup=False, soft_wrap=True)
