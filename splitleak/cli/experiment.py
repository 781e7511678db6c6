"""``splitleak experiment run|status|plan|report``: parses, then calls ``splitleak.experiments``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from splitleak.cli.common import app, console, err, first_line, user_errors
from splitleak.experiments.display import PlainReporter, RichReporter, SilentReporter

experiment_app = typer.Typer(
    help="Experiment grids: expand a spec into jobs, run them locally or on Ray, resume, show status.",
    no_args_is_help=True,
)
app.add_typer(experiment_app, name="experiment")

SpecArg = typer.Argument(..., help="a spec YAML file, or a shipped name (paper_main, partial_offloading, decoys)")
ProfileOpt = typer.Option(None, "--profile", help="a profile of the spec (quick, full, ...); default full when defined")
OverrideOpt = typer.Option(
    [],
    "--override",
    help="KEY=VALUE applied last; dotted keys, YAML values (model=tiny-gpt2, documents.n_eval=8, depths=[3,6])",
)
StoreOpt = typer.Option(None, "--store", help="results store folder (default: <spec stem>-results/ beside the spec)")


@experiment_app.command("run")
def run_cmd(
    spec: str = SpecArg,
    profile: Optional[str] = ProfileOpt,
    override: list[str] = OverrideOpt,
    executor: str = typer.Option("local", "--executor", help="local (process pool here) or ray"),
    workers: Optional[int] = typer.Option(
        None, "--workers", help="jobs at once (local default: half the cores; ray default: what the cluster holds)"
    ),
    threads: Optional[int] = typer.Option(
        None, "--threads", help="torch threads per job (local default: cores // workers; ray: 1)"
    ),
    address: Optional[str] = typer.Option(
        None, "--address", help="Ray cluster to join (default: start a local instance)"
    ),
    store: Optional[Path] = StoreOpt,
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda (ray: auto = cuda when the task got a GPU)"),
    gpus_per_job: Optional[float] = typer.Option(
        None, "--gpus-per-job", help="ray: GPUs declared per job (default 1 when the cluster has GPUs, else 0)"
    ),
    group: bool = typer.Option(
        True,
        "--group/--no-group",
        help="run the attack jobs of one run and copy as one task, sharing the model, capture and fits "
        "(the same results; --no-group: each job its own task)",
    ),
    quiet: bool = typer.Option(False, "--quiet", help="no progress output"),
) -> None:
    """Run every job of SPEC that the store does not hold yet (resumes after a kill); exit 1 when a job failed."""
    # lazy: torch stays out of `splitleak --help`
    from splitleak.experiments import run_grid

    with user_errors():
        if quiet:
            reporter = SilentReporter()
        elif console.is_terminal:
            reporter = RichReporter(console)
        else:
            reporter = PlainReporter(lambda s: console.print(s, highlight=False, markup=False, soft_wrap=True))
        res = run_grid(
            spec,
            profile=profile,
            overrides=override,
            executor=executor,
            workers=workers,
            threads=threads,
            address=address,
            store=store,
            device=device,
            gpus_per_job=gpus_per_job,
            reporter=reporter,
            group=group,
        )
    n = len(res.grid.jobs)
    console.print(
        f"{res.ran} job(s) ran, {res.reused} reused, {res.done_before} were already done, "
        f"{len(res.failures)} failed or skipped, of {n}"
        + (f"; {res.retried} attempt(s) ran again after their worker died" if res.retried else "")
        + f"; {res.seconds:.1f} s; store {res.store}",
        highlight=False,
        soft_wrap=True,
    )
    if res.nodes:  # Ray: every node that ran a job, one node included (a grid whose other node died)
        console.print(
            "jobs per node: " + ", ".join(f"{n}: {c}" for n, c in sorted(res.nodes.items())),
            highlight=False,
            soft_wrap=True,
        )
    if res.failures:
        err.print(f"[bold red]{len(res.failures)} job(s) did not finish:[/]", highlight=False)
        for f in res.failures:
            err.print(
                f"  {f.key[:12]}  {f.kind:<6} {f.summary}: {f.error_type}: {first_line(f.error)}",
                highlight=False,
                markup=False,
                soft_wrap=True,
            )
        err.print(
            f"details: `splitleak experiment status {spec}` (tracebacks in {res.store}/failed/)",
            highlight=False,
            markup=False,
        )
        raise typer.Exit(1)


@experiment_app.command("status")
def status_cmd(
    spec: str = SpecArg,
    profile: Optional[str] = ProfileOpt,
    override: list[str] = OverrideOpt,
    store: Optional[Path] = StoreOpt,
) -> None:
    """Count done / running / failed / pending jobs of SPEC in its store and list the failed ones."""
    # lazy: torch stays out of `splitleak --help`
    from splitleak.experiments import grid_status

    with user_errors():
        st = grid_status(spec, profile=profile, overrides=override, store=store)
    counts = st.counts()
    t = Table(title=f"{st.grid.loaded.name} (profile {st.grid.loaded.profile or 'base'}) in {st.store}")
    t.add_column("jobs")
    for s in ("done", "running", "failed", "pending", "total"):
        t.add_column(s, justify="right")
    for kind, row in counts.items():
        t.add_row(kind, *(str(row[s]) for s in ("done", "running", "failed", "pending")), str(sum(row.values())))
    tot = st.totals()
    t.add_row("all", *(str(tot[s]) for s in ("done", "running", "failed", "pending")), str(len(st.states)))
    console.print(t)
    for key, state in st.states.items():
        if state == "running":
            c = st.claims[key]
            console.print(
                f"running  {key[:12]}  {st.grid.by_key[key].summary} (pid {c.get('pid')} on {c.get('host')}, "
                f"since {c.get('started')})",
                highlight=False,
                markup=False,
            )
    for key, f in st.failures.items():
        console.print(
            f"failed   {key[:12]}  {f['summary']}: {f['error_type']}: {first_line(f['error'])}",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )


@experiment_app.command("plan")
def plan_cmd(
    spec: str = SpecArg,
    profile: Optional[str] = ProfileOpt,
    override: list[str] = OverrideOpt,
    jobs: bool = typer.Option(False, "--jobs", help="list every job with its key"),
) -> None:
    """Expand SPEC into its jobs and print how many of each kind; writes nothing."""
    # lazy: torch stays out of `splitleak --help`
    from splitleak.experiments import plan_grid

    with user_errors():
        grid = plan_grid(spec, profile=profile, overrides=override)
    c = grid.counts()
    console.print(
        f"{grid.loaded.name} (profile {grid.loaded.profile or 'base'}): {len(grid.jobs)} jobs: {c['train']} train, "
        f"{c['attack']} attack, {c['reuse']} reused for the inference setting; protocol "
        f"{grid.loaded.protocol_path} (sha256 {grid.protocol_hash[:12]})",
        highlight=False,
    )
    if jobs:
        for j in grid.jobs:
            console.print(f"{j.key[:12]}  {j.kind:<6} {j.summary}", highlight=False, markup=False, soft_wrap=True)


@experiment_app.command("report")
def report_cmd(
    spec: str = SpecArg,
    profile: Optional[str] = ProfileOpt,
    override: list[str] = OverrideOpt,
    store: Optional[Path] = StoreOpt,
    out: Path = typer.Option(..., "--out", help="folder for report.md, report.html and the figures (PNG + SVG)"),
    n_boot: Optional[int] = typer.Option(
        None,
        "--n-boot",
        help="bootstrap replicates for the protocol's tests, "
        "for a quick look (the report says so; the protocol's count is what counts)",
    ),
) -> None:
    """Write the report of SPEC's grid from its store: main test, family, recovery tables, figures."""
    # lazy: torch stays out of `splitleak --help`
    from splitleak.report.grid import grid_report

    with user_errors():
        rep = grid_report(spec, profile=profile, overrides=override, store=store, out=out, n_boot=n_boot)
    for p in rep.paths:
        console.print(str(p), highlight=False, markup=False, soft_wrap=True)
    if rep.analysis_error:
        err.print(
            f"note: the protocol's tests could not be evaluated: {rep.analysis_error}",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
