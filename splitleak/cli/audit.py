"""``splitleak calibrate|compare|audit``: the instrument's calibration, runs side by side, the main job."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from splitleak.audit.defaults import AUDIT_EPOCHS, AUDIT_N_EVAL, AUDIT_N_TRAIN, CONTROL_DOCS, DEFAULT_COVERAGES
from splitleak.cli.common import (
    DeviceOpt,
    DrawsOpt,
    ThreadsOpt,
    TlsDirOpt,
    app,
    console,
    parse_defences,
    progress,
    user_errors,
)
from splitleak.cli.runs import print_summary
from splitleak.data import N_CALIB, N_EVAL, N_TRAIN
from splitleak.errors import ConfigError, SplitleakError


@app.command("calibrate")
def calibrate_cmd(
    run_dir: Path = typer.Argument(..., help="a run directory written by `splitleak train`"),
    attack: str = typer.Option(
        ..., "--attack", help="the token attack to calibrate (vmi, activation, joint, sipit, ...)"
    ),
    out: Optional[Path] = typer.Option(
        None, "--out", help="output folder (default: RUN_DIR's parent / calibration-ATTACK)"
    ),
    coverage: list[float] = typer.Option(
        list(DEFAULT_COVERAGES), "--coverage", help="share of rows dosed; repeat for a ladder"
    ),
    amplitude: list[float] = typer.Option(
        [1.0], "--amplitude", help="strength of the planted signal in (0, 1]; repeat"
    ),
    copy: str = typer.Option("public", "--copy", help="the attacker's copy of the client layers: public or trained"),
    k: Optional[int] = typer.Option(None, "--k"),
    budget: Optional[int] = typer.Option(None, "--budget"),
    n_docs: Optional[int] = typer.Option(None, "--n-docs", help="calibrate on the first N captured documents"),
    seed: int = typer.Option(0, "--seed"),
    n_boot: int = typer.Option(2000, "--n-boot"),
    channel: str = typer.Option(
        "activations", "--channel", help="latent-probe only: dose the activations or the output-gradient rows"
    ),
    force: bool = typer.Option(False, "--force"),
    threads: Optional[int] = ThreadsOpt,
    quiet: bool = typer.Option(False, "--quiet"),
) -> None:
    """Inject a known token leak into the capture at rising dose and record where each metric (token
    top-1, rare-token top-1, cross-entropy, membership AUC) first detects it (Politis & Pappas 2026, §4).
    On a latent-mode run, `--attack latent-probe` runs the paper's 19-dose ladder on the probe battery."""
    # lazy: torch stays out of `splitleak --help`
    from splitleak.report.calibration import calibration_table, onset_text, write_calibration_report
    from splitleak.runtime import apply_threads

    with user_errors():
        apply_threads(threads)
        if attack == "latent-probe":
            _latent_ladder(run_dir, out, channel, seed, n_boot, force, quiet)
            return
        # lazy: torch stays out of `splitleak --help`
        from splitleak.audit.calibrate import METRICS, calibrate

        target = out if out is not None else run_dir.parent / f"calibration-{attack}"
        with progress(quiet) as prog:
            res = calibrate(
                run_dir,
                attack,
                out=target,
                coverages=coverage,
                amplitudes=amplitude,
                client_copy=copy,
                k=k,
                budget=budget,
                n_docs=n_docs,
                seed=seed,
                n_boot=n_boot,
                force=force,
                progress=prog,
            )
        header, rows = calibration_table(res.record)
        t = Table(title=f"dose-response of {attack} on {run_dir} (✓ detected)")
        for i, col in enumerate(header):
            t.add_column(col, justify="left" if i == 0 else "right")
        for row in rows:
            t.add_row(*row)
        console.print(t)
        for m in METRICS:
            console.print(f"{m}: {onset_text(res.record, m)}")
        console.print(f"calibration: {target / 'calibration.json'}")
        for p in write_calibration_report(target):
            console.print(f"report: {p}", highlight=False)


def _latent_ladder(run_dir: Path, out: Optional[Path], channel: str, seed: int, n_boot: int, force: bool, quiet: bool):
    # lazy: torch stays out of `splitleak --help`
    from splitleak.audit.dose_latent import dose_ladder

    target = (out if out is not None else run_dir.parent / "calibration-latent-probe") / "calibration.json"
    if target.exists() and not force:
        raise SplitleakError(f"{target} already exists; choose another --out or pass --force")
    with progress(quiet) as prog:
        res = dose_ladder(run_dir, channel=channel, seed=seed, n_boot=n_boot, progress=prog)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(res, indent=1))
    t = Table(title=f"dose ladder of the probe battery on {run_dir} ({channel})")
    for col in ("mode", "coverage", "amplitude", "token top-1 (pp) [low]", "verdict", "G (pp)", "rare top-1 (%)"):
        t.add_column(col, justify="right")
    for r in res["doses"]:
        tt, rare = r["token_top1"], r["rare_token_top1"]
        t.add_row(
            r["mode"],
            f"{r['coverage']:g}",
            f"{r['amplitude']:g}",
            f"{100 * tt['paired_effect']:+.2f} [{100 * tt['paired_low']:+.2f}]",
            tt["verdict"],
            f"{100 * r['gate']['statistic']:+.2f}",
            "n/a" if rare["accuracy"] is None else f"{100 * rare['accuracy']:.2f}",
        )
    console.print(t)
    for metric, by_axis in res["onsets"].items():
        console.print(
            f"{metric} onset: " + "; ".join(f"{axis}: {'never' if v is None else v}" for axis, v in by_axis.items())
        )
    console.print(f"calibration: {target}")


@app.command("compare")
def compare_cmd(
    runs: list[Path] = typer.Argument(..., help="run directories or audit folders"),
    figure: Optional[Path] = typer.Option(
        None, "--figure", help="write the leakage-against-cost figure as FIGURE.png and FIGURE.svg"
    ),
) -> None:
    """One table of the runs (defence, depth, utility, and recovery per attack, one line per attack),
    and the leakage-against-cost figure."""
    # lazy: torch stays out of `splitleak --help`
    from splitleak.report.compare import compare_runs, leakage_cost_figure, table_rows

    with user_errors():
        summaries = compare_runs(runs)
        header, rows = table_rows(summaries)
        t = Table(title="leakage and cost per run")
        for i, col in enumerate(header):
            t.add_column(col, justify="left" if i in (0, 1, 2, 8) else "right")
        for row in rows:
            t.add_row(*row)
        console.print(t)
        for r in summaries:
            if r.unverified is not None:
                console.print(
                    f"unverified: {r.path}: {r.unverified}; its utility is not shown (`splitleak verify` names "
                    "what changed: retrain or restore the run)",
                    highlight=False,
                )
        for r in summaries:
            if r.upper is not None:
                console.print(f"upper side: {r.path}: {r.upper}", highlight=False, soft_wrap=True)
        for r in summaries:
            if r.incomplete is not None:
                missing = r.incomplete["missing"]
                console.print(
                    f"incomplete: {r.path}: the audit did not finish ({r.incomplete['why']}); missing attacks: "
                    + (", ".join(missing) if missing else "not known" if missing is None else "none")
                    + f"; its strongest reading may be understated: continue it with `splitleak audit --out {r.path} "
                    "--resume` and the options it was started with",
                    highlight=False,
                    soft_wrap=True,
                )
        if figure is not None:
            for p in leakage_cost_figure(summaries, figure):
                console.print(f"figure: {p}")


def _checks(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"--certify takes a number of checks per position or 'exhaustive', got {text!r}") from None


@app.command("audit")
def audit_cmd(
    out: Optional[Path] = typer.Option(None, "--out", help="output folder (default: runs/audit-<time>)"),
    model: Optional[str] = typer.Option(None, "--model", help="default: smollm2-135m when installed, else tiny-gpt2"),
    model_path: Optional[Path] = typer.Option(None, "--model-path"),
    depth: Optional[int] = typer.Option(None, "--depth", help="default 6 (capped for models with fewer blocks)"),
    defence: list[str] = typer.Option(["none"], "--defence", help="defence name (repeat to compose, applied in order)"),
    defence_arg: list[str] = typer.Option([], "--defence-arg"),
    data: str = typer.Option("synthetic-pii", "--data"),
    data_path: Optional[Path] = typer.Option(None, "--data-path"),
    seed: int = typer.Option(0, "--seed"),
    steps: Optional[int] = typer.Option(None, "--steps", help="training steps (instead of --epochs)"),
    epochs: Optional[int] = typer.Option(
        None,
        "--epochs",
        help=f"passes over the training documents (default {AUDIT_EPOCHS}, as transformers' Trainer); under a noise "
        "defence the training traffic of every pass is read too, one crossing at a time and all at once",
    ),
    draws: str = DrawsOpt,
    n_calib: int = typer.Option(N_CALIB, "--n-calib"),
    n_train: Optional[int] = typer.Option(
        None,
        "--n-train",
        help=f"training documents, one step each per pass (default {AUDIT_N_TRAIN}; --mode latent: 64; the study's: "
        f"{N_TRAIN})",
    ),
    n_eval: Optional[int] = typer.Option(
        None,
        "--n-eval",
        help=f"evaluation documents the attacks read (default {AUDIT_N_EVAL}; --mode latent: 32 capture frames; the "
        f"study's: {N_EVAL})",
    ),
    force: bool = typer.Option(
        False, "--force", help="delete the audit folder --out (only one an audit wrote) and start the audit again"
    ),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="continue the audit that a kill or an error stopped in --out, with the options it was started with: "
        "the stages it finished are reused once their files check against its record (stages.json), the others run",
    ),
    device: str = DeviceOpt,
    threads: Optional[int] = ThreadsOpt,
    quiet: bool = typer.Option(False, "--quiet"),
    no_twin: bool = typer.Option(
        False, "--no-twin", help="with a defence, skip the undefended twin run (and the relative perplexity cost)"
    ),
    connect: Optional[str] = typer.Option(
        None, "--connect", help="HOST:PORT of a `splitleak serve`: audit the deployment (the runs train over TLS)"
    ),
    tls_dir: Optional[Path] = TlsDirOpt,
    certify: str = typer.Option(
        "32",
        "--certify",
        help="checks per position of the exact-inversion check on the trained layers, or 'exhaustive' (every "
        "position searched until it matches: about five minutes more on SmolLM2 with 48 documents)",
    ),
    mode: str = typer.Option(
        "plain",
        "--mode",
        help="the split: plain (the labels cross to the server for its loss), u-shape (the server runs the "
        "blocks from --depth to the second-to-last; the client keeps the last block, the head and the labels) "
        "or label-shielded (003: Bottom of --depth blocks and a Top of up to 5 on the client, the Trunk on the "
        "server), or latent (002's decoy system: its partition, its probes and their positive control)",
    ),
    latent_split: str = typer.Option(
        "main", "--latent-split", help="--mode latent: a named split of the model (main, mitigation, ...) or S/R"
    ),
    latent_arg: list[str] = typer.Option(
        [], "--latent-arg", help="--mode latent: KEY=VALUE of the decoy system (output_gradient=clip-noise: 002's fix)"
    ),
    control_docs: int = typer.Option(
        CONTROL_DOCS,
        "--control-docs",
        help="documents of each attack's mis-paired negative control (its twin given the traffic of other "
        "documents; 0: none, and the verdict says so)",
    ),
    server_capture: Optional[Path] = typer.Option(
        None,
        "--server-capture",
        help="with --connect: the server's --capture folder (readable here); the attacks then read the traffic "
        "as the server recorded it, after checking it is the same frames as the client's record",
    ),
) -> None:
    """The main job: train and capture on embedded defaults, attack the traffic, write a report."""
    # lazy: torch stays out of `splitleak --help`
    from splitleak.audit.plan import choose_default_model
    from splitleak.audit.run import run_audit
    from splitleak.report.audit_prose import audit_words

    with user_errors():
        if model is None:
            model, why = choose_default_model()
            console.print(f"model: [bold]{model}[/] ({why})")
        if out is None and resume:
            raise ConfigError(
                "--resume continues the audit in --out: pass --out with the folder of the audit to continue"
            )
        if out is None:
            out = Path("runs") / f"audit-{datetime.now():%Y%m%d-%H%M%S}"
        if mode == "latent":
            given = {"--depth": depth is not None, "--defence": defence != ["none"], "--connect": connect is not None,
                     "--server-capture": server_capture is not None, "--epochs": epochs is not None,
                     "--certify": certify != "32", "--no-twin": no_twin, "--n-calib": n_calib != N_CALIB,
                     "--control-docs": control_docs != CONTROL_DOCS}  # fmt: skip
            _latent_audit(out, model, model_path, latent_split, latent_arg, data, data_path, seed, steps, n_train,
                          n_eval, force, resume, device, threads, quiet, [k for k, v in given.items() if v])  # fmt: skip
            return
        if latent_arg or latent_split != "main":
            raise ConfigError("--latent-split and --latent-arg are for --mode latent")
        with progress(quiet) as prog:
            res = run_audit(
                out,
                model=model,
                words=audit_words,
                model_path=str(model_path) if model_path else None,
                depth=depth,
                defences=parse_defences(defence, defence_arg),
                data=data,
                data_path=str(data_path) if data_path else None,
                seed=seed,
                steps=steps,
                epochs=epochs,
                draws=draws,
                n_calib=n_calib,
                n_train=AUDIT_N_TRAIN if n_train is None else n_train,
                n_eval=AUDIT_N_EVAL if n_eval is None else n_eval,
                force=force,
                resume=resume,
                device=device,
                threads=threads,
                progress=prog,
                say=console.print,
                twin=not no_twin,
                connect=connect,
                tls_dir=tls_dir,
                server_capture=server_capture,
                certify=certify if certify == "exhaustive" else _checks(certify),
                control_docs=control_docs,
                mode=mode,
            )
        print_summary(res.run, res.utility_baseline)
        # lazy: torch stays out of `splitleak --help`
        from splitleak.report.audit import ATTACK_HEADER, attack_table_rows, write_audit_report

        written = write_audit_report(res.out)

        t = Table(title="leakage under both threat models")
        for i, col in enumerate(ATTACK_HEADER):
            t.add_column(col, justify="left" if i == 0 else "right")
        for row in attack_table_rows(res.attacks):
            t.add_row(*row)
        console.print(t)
        console.print(res.summary)
        console.print(f"[bold]{res.verdict}[/]")
        for p in written[:2]:
            console.print(f"report: {p}", highlight=False)


def _latent_audit(out, model, model_path, split, args, data, data_path, seed, steps, n_train, n_eval, force, resume,
                  device, threads, quiet, refused) -> None:  # fmt: skip
    """``splitleak audit --mode latent`` (``splitleak.audit.latent_audit``)."""
    # lazy: torch stays out of `splitleak --help`
    from splitleak.audit.latent_audit import run_latent_audit
    from splitleak.defences import parse_defence_args
    from splitleak.report.latent_audit import write_latent_audit_report

    if refused:
        raise ConfigError(
            f"{', '.join(refused)} do(es) not apply to --mode latent (the split is --latent-split, its settings "
            "--latent-arg, and the run trains --steps); drop them"
        )
    with progress(quiet) as prog:
        res = run_latent_audit(
            out, model=model, model_path=str(model_path) if model_path else None, split=split,
            latent_args=parse_defence_args(args), data=data, data_path=str(data_path) if data_path else None,
            seed=seed, steps=steps, n_train=n_train, n_eval=n_eval, force=force, resume=resume, device=device,
            threads=threads, progress=prog,
            say=console.print,
        )  # fmt: skip
    written = write_latent_audit_report(res.out)
    console.print(f"[bold]{res.verdict}[/]" + "".join(f"\n  {p}" for p in res.report["verdict_parts"]))
    for p in written:
        console.print(f"report: {p}", highlight=False)
