"""What a reproduction runs: the shipped experiment specs its claims name, at one profile, and which of their
jobs measure each claim. A claim that a reader of the store could measure but that no job of its spec selects
is an error of the claims file or the spec, found before anything runs (``splitleak reproduce --plan``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from splitleak.audit.analysis import READOUT_ATTACKS, select
from splitleak.errors import ConfigError
from splitleak.reproduce.claims import Claim, ClaimsFile
from splitleak.reproduce.dose import dose_jobs, is_dose
from splitleak.reproduce.judge import TRAIN_METRICS, measurable, member_claim
from splitleak.reproduce.latent import is_latent, plan_jobs
from splitleak.reproduce.offload import is_offload
from splitleak.reproduce.offload import plan_jobs as offload_jobs
from splitleak.reproduce.ranking import is_ranking, ranking_jobs
from splitleak.reproduce.wire import WIRE_METRICS


@dataclass
class ClaimPlan:
    claim_id: str
    spec: str
    jobs: int  # attack jobs of the spec its treatment and control select together
    why_not: str = ""  # why no reader measures it ("" where one does)
    analogue: str = ""  # the analogue it is read on ("": the claim's own setting)


@dataclass
class ReproductionPlan:
    profile: str | None
    grids: dict[str, Any]  # spec name -> its planned Grid
    claims: list[ClaimPlan] = field(default_factory=list)
    overrides: dict[str, list[str]] = field(default_factory=dict)  # spec name -> the overrides it runs with
    analogues: list[ClaimPlan] = field(default_factory=list)  # the claims read on their files' analogues

    def missing(self) -> list[ClaimPlan]:
        """Measurable claims no job of their spec selects."""
        return [c for c in self.claims if not c.why_not and c.jobs == 0]

    def needed(self) -> list[str]:
        """The specs at least one measurable claim reads (an analogue's where one of its jobs measures a claim):
        the others' grids are planned, not run (no reader of their claims is built yet, so their jobs would
        measure nothing the report shows)."""
        own = {c.spec for c in self.claims if not c.why_not}
        return sorted(own | {c.spec for c in self.analogues if not c.why_not and c.jobs})


def job_rows(grid, kind: str = "attack") -> list[dict[str, Any]]:
    """The attack and reuse jobs (or with ``kind="train"`` the train jobs) of a planned grid as the rows
    ``select`` reads (a job's fields are the store's columns; a gradient attack's read-out is its default where
    the spec names none)."""
    rows = []
    for j in grid.jobs:
        if (j.kind == "train") != (kind == "train"):
            continue
        f = dict(j.fields)
        if f.get("readout") is None and f.get("attack") in READOUT_ATTACKS:
            f["readout"] = "gradient"
        rows.append(f)
    return rows


DATA_SOURCES = ("wikitext2", "text")  # the sources that read a folder or file (the others generate their texts)


def spec_overrides(spec: str, profile: str | None, overrides: Sequence[str], data: str | None) -> list[str]:
    """``overrides``, and ``data.path=DATA`` where ``data`` is given and the spec reads its documents from a
    path it does not name itself (WikiText-2 offline; the specs that generate their texts take none)."""
    # lazy: the spec loader imports pydantic models of the whole experiment machinery
    from splitleak.experiments.spec_loading import load_spec

    out = list(overrides)
    if data is None:
        return out
    loaded = load_spec(spec, profile=profile, overrides=out)
    if loaded.spec.data.source in DATA_SOURCES and loaded.spec.data.path is None:
        out.append(f"data.path={Path(data).resolve()}")
    return out


def _jobs(st: Any, rows: list[dict[str, Any]]) -> int:
    """The jobs that measure one statistic: those of its arms, where every arm has some (a difference needs
    both)."""
    arms = [
        len(select(rows, {k: v for k, v in arm.items() if v is not None}))
        for arm in (st.treatment, st.control)
        if arm is not None
    ]
    return sum(arms) if all(arms) else 0


def plan_reproduction(
    claim_files: Sequence[ClaimsFile],
    profile: str | None = "quick",
    overrides: Sequence[str] = (),
    data: str | Path | None = None,
) -> ReproductionPlan:
    """Plan every spec the claims name (``experiments.plan_grid``) and count the jobs of each claim;
    ``data`` is the documents' folder for the specs that read one (``spec_overrides``)."""
    # lazy: planning a grid imports the experiment machinery (torch-free, but heavy)
    from splitleak.experiments import plan_grid

    specs = sorted(
        {c.spec for f in claim_files for c in f.claims}
        | {a.spec for f in claim_files for a in f.analogues if any(a.of(c) for c in f.claims)}
    )
    grids, per_spec = {}, {}
    for spec in specs:
        try:
            per_spec[spec] = spec_overrides(spec, profile, overrides, None if data is None else str(data))
            grids[spec] = plan_grid(spec, profile=profile, overrides=per_spec[spec])
        except ConfigError as exc:
            raise ConfigError(
                f"the claims name spec {spec!r}, which does not plan at profile {profile!r}: {exc}"
            ) from None
    plan = ReproductionPlan(profile, grids, overrides=per_spec)
    rows = {spec: job_rows(g) for spec, g in grids.items()}
    trains = {spec: job_rows(g, "train") for spec, g in grids.items()}
    for f in claim_files:
        for c in f.claims:
            plan.claims.append(_claim_plan(c, rows, trains))
            for a in f.analogues:
                ac = a.of(c)
                if ac is not None:
                    plan.analogues.append(_claim_plan(ac, rows, trains, a.name))
    return plan


def _claim_plan(c: Claim, rows: dict[str, Any], trains: dict[str, Any], analogue: str = "") -> ClaimPlan:
    why = measurable(c)
    n = 0
    if not why and is_latent(c):  # a family's members each select their own arm
        stats = c.statistic.members() if c.statistic.kind == "family" else [c.statistic]
        n = sum(plan_jobs(member_claim(c, st), rows[c.spec]) for st in stats)
    elif not why and is_offload(c):
        n = offload_jobs(c, rows[c.spec])
    elif not why and is_dose(c):
        n = dose_jobs(c, rows[c.spec])
    elif not why and is_ranking(c):
        n = ranking_jobs(c, rows[c.spec])
    elif not why:
        stats = c.statistic.members() if c.statistic.kind == "family" else [c.statistic]
        n = sum(
            _jobs(st, trains[c.spec] if st.metric in (*TRAIN_METRICS, *WIRE_METRICS) else rows[c.spec]) for st in stats
        )
    return ClaimPlan(c.id, c.spec, n, why, analogue)


@dataclass
class Price:
    spec: str
    hours: float | None  # None: unpriced (``why``)
    jobs: dict[str, int]
    unmeasured: int = 0
    why: str = ""
    unit: str = "core-hours"  # or GPU-hours, where the measured jobs ran on a GPU
    threads: int = 1  # per job, as the measured jobs ran


def price(plan: ReproductionPlan, measured: str | Path) -> list[Price]:
    """What each spec the plan runs costs at its ``full`` profile, projected job by job from the quick
    reproduction in ``measured`` (``experiments.cost.project``: its stores' measured job seconds, at the threads
    its record says each job ran with; GPU-hours where its jobs ran on a GPU, workers at a time). A spec whose
    quick store is missing, or whose full jobs the quick profile did not measure, is priced as far as it can be
    and says what is missing."""
    # lazy: the projection reads Parquet stores (pyarrow)
    from splitleak.experiments.cost import project

    measured = Path(measured)
    record_path = measured / "reproduction.json"
    if not record_path.is_file():
        raise ConfigError(f"{measured} holds no reproduction (no reproduction.json); price from a quick run's --out")
    record = json.loads(record_path.read_text())
    execution = record.get("execution") or {}
    threads = execution.get("threads")
    gpu = str(execution.get("device", "cpu")).startswith("cuda")
    if not threads:
        raise ConfigError(f"{record_path} does not say how many threads each job ran with; rerun it with --resume")
    out = []
    for spec in plan.needed():
        store = measured / "stores" / Path(spec).stem
        overrides = spec_overrides(spec, record["profile"], record.get("overrides", []), record.get("data"))
        full = plan_grid_counts(spec, overrides)
        if not store.is_dir():
            out.append(Price(spec, None, full, why=f"no store of {spec} in {measured}"))
            continue
        proj = project(spec, record["profile"], overrides, store)
        seconds = proj["attack_s"] + proj["train_s"]
        if gpu:  # the jobs shared the one GPU, workers at a time
            out.append(Price(spec, seconds / (execution.get("workers") or 1) / 3600, proj["counts"], proj["missing"],
                             unit="GPU-hours"))  # fmt: skip
        else:
            out.append(Price(spec, seconds * threads / 3600, proj["counts"], proj["missing"], threads=threads))
    return out


def plan_grid_counts(spec: str, overrides: list[str]) -> dict[str, int]:
    # lazy: as in plan_reproduction
    from splitleak.experiments import plan_grid

    return plan_grid(spec, profile="full", overrides=overrides).counts()
