"""``splitleak reproduce``: parses, then calls ``splitleak.reproduce``."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional

import typer

from splitleak.cli.common import app, console, err, user_errors


@app.command("reproduce")
def reproduce_cmd(
    papers: list[str] = typer.Argument(None, help="000, 002, 003 or all (none: only the --claims files)"),
    profile: Optional[str] = typer.Option(
        "quick", "--profile", help="quick (this machine) or full (the papers' counts)"
    ),
    plan: bool = typer.Option(False, "--plan", help="list the claims and the jobs that measure them; run nothing"),
    out: Optional[Path] = typer.Option(None, "--out", help="folder for the stores and the report"),
    resume: bool = typer.Option(False, "--resume", help="continue the reproduction in --out (finished jobs are kept)"),
    claims: list[Path] = typer.Option([], "--claims", help="a claims file of one's own, besides the papers'"),
    override: list[str] = typer.Option([], "--override", help="KEY=VALUE applied to every spec (as in experiment run)"),
    data: Optional[Path] = typer.Option(
        None,
        "--data",
        help="folder of WikiText-2's wiki.*.raw files for the specs that read WikiText-2 "
        "(none: the datasets library fetches it); the specs that generate their texts ignore it",
    ),
    executor: str = typer.Option("local", "--executor", help="local or ray"),
    address: Optional[str] = typer.Option(None, "--address", help="Ray cluster to join"),
    workers: Optional[int] = typer.Option(None, "--workers", help="jobs at once"),
    n_boot: int = typer.Option(20_000, "--n-boot", help="bootstrap replicates per claim"),
    price_from: Optional[Path] = typer.Option(
        None,
        "--price-from",
        help="with --plan --profile full: price each grid in core-hours from the quick reproduction in this "
        "folder (its measured job seconds, projected job by job)",
    ),
) -> None:
    """Put each headline claim of the papers beside splitleak's own measurement: plan, run, report."""
    # lazy: the grid machinery stays out of `splitleak --help`
    from splitleak.reproduce.judge import VERDICTS
    from splitleak.reproduce.plan import plan_reproduction
    from splitleak.reproduce.run import check_plan, claim_files, reproduce

    papers = papers or []
    with user_errors():
        if plan:
            files = claim_files(papers, claims)
            p = plan_reproduction([f for f, _ in files], profile, override, data)
            for spec, g in p.grids.items():
                c = g.counts()
                runs = "" if spec in p.needed() else " (not run: no claim it measures has a reader yet)"
                console.print(
                    f"{spec} (profile {profile}): {c['train']} train, {c['attack']} attack jobs{runs}", highlight=False
                )
            for c in [*p.claims, *p.analogues]:
                state = c.why_not or f"{c.jobs} job(s) of {c.spec}"
                on = f" on {c.analogue}" if c.analogue else ""
                console.print(f"  {c.claim_id}{on}: {state}", highlight=False, markup=False, soft_wrap=True)
            check_plan(p)
            if price_from is not None:
                _print_prices(p, price_from, profile)
            return
        if out is None:
            err.print("reproduce: pass --out DIR (or --plan to list what would run)", highlight=False)
            raise typer.Exit(2)
        rep = reproduce(
            papers,
            out,
            profile=profile,
            claims=claims,
            overrides=override,
            resume=resume,
            data=data,
            n_boot=n_boot,
            command="splitleak " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
            run_grid_kwargs={"executor": executor, "address": address, "workers": workers},
            say=lambda s: console.print(s, highlight=False, markup=False),
        )
    for paper, js in rep.judgements.items():
        tally = ", ".join(f"{sum(j.verdict == v for j in js)} {v}" for v in VERDICTS)
        console.print(f"{paper}: {len(js)} claims: {tally}", highlight=False)
    console.print(f"report: {rep.report['md']} and {rep.report['html']}", highlight=False)
    if any(rep.failures.values()):
        err.print(f"jobs did not finish: {rep.failures}; rerun with --resume", highlight=False)
        raise typer.Exit(1)


def _print_prices(p, measured: Path, profile: Optional[str]) -> None:
    # lazy: as in reproduce_cmd, the grid machinery stays out of `splitleak --help`
    from splitleak.reproduce.plan import price

    if profile != "full":
        err.print("--price-from prices the full profile: pass --profile full", highlight=False)
        raise typer.Exit(2)
    total: dict[str, float] = {}
    for row in price(p, measured):
        jobs = f"{row.jobs.get('train', 0)} train + {row.jobs.get('attack', 0)} attack jobs"
        if row.hours is None:
            console.print(f"{row.spec}: {jobs}; unpriced: {row.why}", highlight=False)
            continue
        total[row.unit] = total.get(row.unit, 0.0) + row.hours
        gap = f" ({row.unmeasured} jobs the quick profile did not measure are left out)" if row.unmeasured else ""
        at = f" at {row.threads} thread(s) per job" if row.unit == "core-hours" else ""
        console.print(f"{row.spec}: {jobs}; {row.hours:,.1f} {row.unit}{at}{gap}", highlight=False)
    sums = ", ".join(f"{h:,.1f} {unit}" for unit, h in total.items()) or "nothing priced"
    console.print(
        f"total {sums}, from the job seconds measured in {measured} (a quick run on a GPU prices in GPU-hours)",
        highlight=False,
    )
