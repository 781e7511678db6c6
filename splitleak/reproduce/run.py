"""``splitleak reproduce``: the claims of one or more papers, the grids that measure them, the report.

The grids run into ``OUT/stores/<spec>/`` (``experiments.run_grid``: a killed run resumes there, and nothing
measured is thrown away); ``OUT/reproduction.json`` records what was asked (papers, profile, overrides, the
claims files' hashes), so that ``--resume`` continues the same reproduction and nothing else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from splitleak.errors import ConfigError
from splitleak.reproduce.claims import PAPERS, Claim, ClaimsFile, load_claims
from splitleak.reproduce.judge import N_BOOT, Judgement, assess
from splitleak.reproduce.plan import ReproductionPlan, plan_reproduction
from splitleak.reproduce.positions import with_positions
from splitleak.reproduce.report import write_report
from splitleak.reproduce.wire import with_wire

RECORD = "reproduction.json"


@dataclass
class Reproduction:
    plan: ReproductionPlan
    judgements: dict[str, list[Judgement]] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)  # spec -> jobs that did not finish
    ran: dict[str, int] = field(default_factory=dict)  # spec -> jobs this call ran (0 on a finished resume)
    report: dict[str, Path] = field(default_factory=dict)


def claim_files(papers: Sequence[str], claims: Sequence[str | Path] = ()) -> list[tuple[ClaimsFile, str]]:
    """The shipped claims of ``papers`` (``all``: every paper) and any claims files of one's own."""
    names = list(PAPERS) if "all" in papers else list(papers)
    unknown = [p for p in names if p not in PAPERS]
    if unknown:
        raise ConfigError(f"unknown paper(s) {', '.join(unknown)}; reproduce one of {', '.join(PAPERS)} or all")
    if not names and not claims:
        raise ConfigError(f"name a paper ({', '.join(PAPERS)} or all) or pass --claims FILE")
    files = [load_claims(p) for p in names] + [load_claims(c) for c in claims]
    seen = [f.paper for f, _ in files]
    dup = sorted({p for p in seen if seen.count(p) > 1})
    if dup:
        raise ConfigError(f"two claims files speak for paper {', '.join(dup)}; pass one per paper")
    return files


def judge_claim(
    claim: Claim,
    rows: Sequence[dict[str, Any]],
    train: Sequence[dict[str, Any]],
    n_boot: int = N_BOOT,
    latent: Any = None,
) -> Judgement:
    """The verdict on ``claim`` from a store's rows, and on the same claim read by its strongest reader."""
    j = assess(claim, rows, train, n_boot, latent)
    strong = claim.with_stronger()
    if strong is not None:
        j.stronger = assess(strong, rows, train, n_boot, latent)
    return j


def latent_of(rows: Sequence[dict[str, Any]], train: Sequence[dict[str, Any]]) -> Any:
    """The grid report's latent summary of a store, or None where it holds no latent rows."""
    # lazy: the grid report's latent section imports the gate's statistics, needed only for a latent store
    from splitleak.report.grid_latent import is_latent, latent_summary

    return latent_summary(rows, train) if any(is_latent(r) for r in rows) else None


def check_plan(plan: ReproductionPlan) -> None:
    missing = plan.missing()
    if missing:
        raise ConfigError(
            f"{len(missing)} claim(s) name jobs their spec does not plan at profile {plan.profile!r}: "
            + "; ".join(f"{c.claim_id} (spec {c.spec})" for c in missing)
            + ". Add the configurations to the spec, or correct the claim's treatment and control"
        )


def recorded_papers(out: Path) -> list[str]:
    """The papers the reproduction in ``out`` was asked for before (none where it holds none)."""
    path = out / RECORD
    return list(json.loads(path.read_text()).get("papers", [])) if path.is_file() else []


def _record(out: Path, asked: dict[str, Any], resume: bool) -> None:
    """Record what the reproduction runs (its grids: papers, profile, overrides). A resume must ask the same
    profile and overrides; it may add papers (their specs' grids run into stores of their own, and a grid
    already finished reruns nothing), and the record then names the union. The claims files may change between
    runs (a claim corrected, a number added): they change no job, and every report names the hashes it judged
    against."""
    path = out / RECORD
    if path.is_file():
        before = json.loads(path.read_text())
        if not resume:
            raise ConfigError(f"{out} holds a reproduction already; pass --resume to continue it, or another --out")
        fixed = ("profile", "overrides", "data")
        if {k: before.get(k) for k in fixed} != {k: asked[k] for k in fixed}:
            raise ConfigError(
                f"{out} holds a reproduction of {before.get('papers')} at profile {before.get('profile')} with "
                f"overrides {before.get('overrides')} and data {before.get('data')}; --resume continues it at the "
                "same profile, overrides and data only (use another --out)"
            )
        merged = {
            **before,
            **asked,
            "papers": sorted({*before.get("papers", []), *asked["papers"]}),
            "specs": sorted({*before.get("specs", []), *asked["specs"]}),
        }
        if merged != before:
            path.write_text(json.dumps(merged, indent=2) + "\n")
        return
    if out.exists() and any(out.iterdir()) and not resume:
        raise ConfigError(f"{out} exists and is not a reproduction's folder; choose an empty or new --out")
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asked, indent=2) + "\n")


def _record_execution(out: Path, kwargs: dict[str, Any]) -> None:
    """How this call runs its jobs (executor, workers, threads per job, device), for pricing a full profile from
    the jobs' measured seconds (``plan.price``); a resume with other settings replaces it and says so."""
    # lazy: the executors import the torch-free planning helpers only
    from splitleak.experiments.executors import plan_workers

    executor = kwargs.get("executor") or "local"
    workers, threads = kwargs.get("workers"), kwargs.get("threads")
    if executor == "local":
        workers, threads = plan_workers(workers, threads)
    now = {"executor": executor, "workers": workers, "threads": threads or 1, "device": kwargs.get("device", "cpu")}
    path = out / RECORD
    record = json.loads(path.read_text())
    before = record.get("execution")
    if before not in (None, now):
        now["note"] = f"earlier jobs ran with {before}"
    record["execution"] = now
    path.write_text(json.dumps(record, indent=2) + "\n")


def reproduce(
    papers: Sequence[str],
    out: str | Path,
    *,
    profile: str | None = "quick",
    claims: Sequence[str | Path] = (),
    overrides: Sequence[str] = (),
    resume: bool = False,
    data: str | Path | None = None,
    n_boot: int = N_BOOT,
    command: str = "",
    run_grid_kwargs: dict[str, Any] | None = None,
    say: Callable[[str], None] = lambda _: None,
) -> Reproduction:
    """Plan, run every spec's grid into ``out``, judge every claim, write the report (module docstring)."""
    # lazy: the grid runner imports torch
    from splitleak.experiments import read_results, run_grid

    out = Path(out)
    files = claim_files(papers, claims)
    if resume:  # the papers a reproduction judged before are judged again: a resume never shrinks its report
        asked_now = {f.paper for f, _ in files}
        files += [load_claims(p) for p in recorded_papers(out) if p in PAPERS and p not in asked_now]
    plan = plan_reproduction([f for f, _ in files], profile, overrides, data)
    check_plan(plan)
    asked = {
        "papers": sorted(f.paper for f, _ in files),
        "specs": sorted(plan.grids),
        "profile": profile,
        "overrides": list(overrides),
        "data": None if data is None else str(Path(data).resolve()),
    }
    _record(out, asked, resume)
    _record_execution(out, run_grid_kwargs or {})
    rep = Reproduction(plan)
    rows: dict[str, list[dict[str, Any]]] = {}
    train: dict[str, list[dict[str, Any]]] = {}  # a spec not run reads as an empty store
    for spec in plan.grids:
        rows[spec], train[spec] = [], []
        if spec not in plan.needed():
            say(f"{spec}: not run (no claim it measures has a reader yet)")
            continue
        store = out / "stores" / Path(spec).stem
        say(f"{spec}: {len(plan.grids[spec].jobs)} jobs into {store}")
        res = run_grid(spec, profile=profile, overrides=plan.overrides[spec], store=store, **(run_grid_kwargs or {}))
        rep.failures[spec], rep.ran[spec] = len(res.failures), res.ran
        rows[spec] = with_positions(read_results(store, "attack", as_rows=True), store)
        train[spec] = with_wire(read_results(store, "train", as_rows=True), store)
    latent = {spec: latent_of(rows[spec], train[spec]) for spec in rows}
    for f, _ in files:
        rep.judgements[f.paper] = []
        for c in f.claims:
            j = judge_claim(c, rows[c.spec], train[c.spec], n_boot, latent[c.spec])
            for a in f.analogues:
                ac = a.of(c)
                if ac is not None:
                    j.analogues[a.name] = judge_claim(ac, rows[a.spec], train[a.spec], n_boot, latent[a.spec])
            rep.judgements[f.paper].append(j)
    meta = {"profile": profile, "n_boot": n_boot, "command": command or "splitleak reproduce", "failures": rep.failures}
    rep.report = write_report(out, files, rep.judgements, meta)
    return rep
