"""The study of ``splitleak tune``: Optuna asks for configurations, ``tune_trials`` evaluates them, and
every trial lands in ``OUT/study.db`` and ``OUT/tune.json``; the frontier is the Pareto front of utility
cost against the worst reader's recovery (``splitleak.experiments.tune``'s docstring describes the tune).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

import optuna
from optuna.trial import TrialState

from splitleak.audit.gate import shipped_thresholds
from splitleak.errors import ConfigError
from splitleak.experiments.tune import (
    Space,
    TrialConfig,
    TuneSettings,
    build_space,
    check_enqueued,
    sample,
    trial_params,
)
from splitleak.experiments.tune_trials import GridEvaluator, Outcome, TrialError, write_base_spec
from splitleak.files import json_default
from splitleak.models import load_model

STUDY_NAME = "splitleak-tune"


def sampler_seed(seed: int, n: int) -> int:
    return int.from_bytes(hashlib.sha256(f"splitleak-tune|{seed}|{n}".encode()).digest()[:4], "little")


def open_study(out: Path):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    out.mkdir(parents=True, exist_ok=True)
    return optuna.create_study(
        study_name=STUDY_NAME,
        storage=f"sqlite:///{out / 'study.db'}",
        directions=["minimize", "minimize"],
        load_if_exists=True,
    )


@dataclass
class TuneResult:
    out: Path
    trials: list[dict[str, Any]]
    frontier: list[int]
    passing: list[int]
    ran_trials: int
    jobs_ran: int
    paths: list[Path]


def _settings_hash(settings: TuneSettings, space: Space) -> str:
    blob = json.dumps({"settings": settings.as_dict(), "space": space.as_dict()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def run_study(
    out: Path,
    space: Space,
    evaluate: Callable[[TrialConfig], Outcome],
    *,
    n_trials: int,
    seed: int,
    enqueue: Sequence[dict[str, Any]] = (),
    say: Callable[[str], None] = lambda s: None,
) -> tuple[Any, int]:
    """Ask, evaluate and tell until the study holds ``n_trials`` finished trials. A trial left running by a
    killed tune is marked failed and asked again with the same parameters. Returns (study, trials run)."""
    study = open_study(out)
    if not study.trials:
        for params in enqueue:
            check_enqueued(params, space)
            study.enqueue_trial(params, skip_if_exists=True)
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):  # a killed tune's last trial
        study.tell(t.number, state=TrialState.FAIL)  # failed without an outcome: not counted, not reported
        study.enqueue_trial(t.params)
        say(f"trial {t.number} was interrupted; running its configuration again")

    def finished() -> int:
        return sum(
            1
            for t in study.get_trials(deepcopy=False)
            if t.state == TrialState.COMPLETE or (t.state == TrialState.FAIL and "outcome" in t.user_attrs)
        )

    ran = 0
    while (n := finished()) < n_trials:
        study.sampler = optuna.samplers.TPESampler(seed=sampler_seed(seed, n))
        trial = study.ask()
        cfg = sample(trial, space)
        say(f"trial {trial.number}: depth {cfg.depth}, {cfg.label}")
        try:
            outcome = evaluate(cfg)
        except TrialError as exc:
            outcome = Outcome(cfg.depth, cfg.label, [dict(d) for d in cfg.chain], error=str(exc))
            trial.set_user_attr("outcome", outcome.as_dict())
            study.tell(trial, state=TrialState.FAIL)
            say(f"trial {trial.number} failed: {exc}")
            ran += 1
            continue
        trial.set_user_attr("outcome", outcome.as_dict())
        assert outcome.cost is not None and outcome.G is not None
        study.tell(trial, [outcome.cost, outcome.G])
        say(
            f"trial {trial.number}: cost {outcome.cost:+.4g}, G {100 * outcome.G:+.2f} pp, worst reader "
            f"{outcome.worst_reader} {100 * (outcome.worst_token_recovery or 0):.1f} %, "
            + ("no bound" if outcome.token_bound is None else f"none above {100 * outcome.token_bound:.1f} %")
            + " -> "
            + ("PASS" if outcome.passes else "fail")
            + (f" (stopped: {outcome.stopped})" if outcome.stopped else "")
        )
        ran += 1
    return study, ran


def tune(
    out: str | Path,
    settings: TuneSettings,
    *,
    depths: Sequence[int],
    defences: Sequence[str] | None = None,
    n_trials: int = 20,
    enqueue: Sequence[dict[str, Any]] = (),
    undefended_first: bool = True,
    threads: int | None = None,
    device: str = "auto",
    reporter=None,
    say: Callable[[str], None] = lambda s: None,
    evaluate: Callable[[TrialConfig], Outcome] | None = None,
    n_blocks: int | None = None,
    render: Render | None = None,
) -> TuneResult:
    """Search and record every trial in ``OUT/tune.json`` (see ``splitleak.experiments.tune``'s docstring); ``render`` draws the
    frontier and writes ``tune.md`` (``splitleak.report.tune.render_tune``, as ``splitleak tune`` does).

    The undefended configuration at each depth is tried first (``undefended_first``), then ``enqueue``
    (Optuna parameters, ``trial_params``), then what the sampler proposes. Rerunning with the same
    settings resumes: finished trials are kept and every job already in ``OUT/store`` is reused."""
    out = Path(out)
    settings.check()
    # the spec lies in OUT, and a relative path in it would resolve against OUT
    if settings.data_path is not None:
        settings = replace(settings, data_path=str(Path(settings.data_path).resolve()))
    if settings.model_path is not None:
        settings = replace(settings, model_path=str(Path(settings.model_path).resolve()))
    if n_trials < 1:
        raise ConfigError(f"--n-trials must be >= 1, got {n_trials}")
    if n_blocks is None and evaluate is None:
        n_blocks = model_blocks(settings)
    space = build_space(depths, defences, n_blocks, settings.model)
    digest = _settings_hash(settings, space)
    record = out / "tune-settings.json"
    if record.exists():
        old = json.loads(record.read_text())
        if old.get("hash") != digest:
            raise ConfigError(
                f"{out} holds a tune of other settings (model, budget, data, attacks, depths or defences differ; "
                f"see {record}); choose another --out, or rerun with the same settings to resume"
            )
    ev: Callable[[TrialConfig], Outcome]
    jobs: Callable[[], int]
    if evaluate is None:
        with tempfile.TemporaryDirectory() as tmp:  # every chain, attack and argument checked before a write
            write_base_spec(Path(tmp), settings, space)
            GridEvaluator(Path(tmp), settings, space).check()
        out.mkdir(parents=True, exist_ok=True)
        write_base_spec(out, settings, space)
        grid_ev = GridEvaluator(out, settings, space, threads=threads, device=device, reporter=reporter)
        ev = grid_ev

        def jobs() -> int:
            return grid_ev.jobs_ran
    else:
        out.mkdir(parents=True, exist_ok=True)
        ev = evaluate

        def jobs() -> int:
            return 0

    if not record.exists():
        record.write_text(
            json.dumps({"hash": digest, "settings": settings.as_dict(), "space": space.as_dict()}, indent=1) + "\n"
        )
    first = [trial_params(d, "none") for d in space.depths] if undefended_first and ("none",) in space.chains else []
    study, ran = run_study(out, space, ev, n_trials=n_trials, seed=settings.seed, enqueue=[*first, *enqueue], say=say)
    trials = collect_trials(study)
    result = write_outputs(out, settings, space, trials, render)
    return TuneResult(out, trials, result["frontier"], result["passing"], ran, jobs(), result["paths"])


def model_blocks(settings: TuneSettings) -> int:
    """The number of blocks of the tune's model (loads it once)."""
    lm = load_model(settings.model, seed=0, model_path=settings.model_path)
    return int(lm.info["n_blocks"])


def collect_trials(study) -> list[dict[str, Any]]:
    out = []
    for t in study.get_trials(deepcopy=False):
        if t.state not in (TrialState.COMPLETE, TrialState.FAIL):
            continue
        o = t.user_attrs.get("outcome")
        if o is None:
            continue
        out.append({"number": t.number, "state": t.state.name.lower(), "params": dict(t.params), **o})
    return out


# ------------------------------------------------------------------ outputs


#: what draws a tune's report: (out, settings, space, trials, passing, frontier numbers) -> the paths written
Render = Callable[[Path, "TuneSettings", "Space", list, list, list], list[Path]]


def write_outputs(
    out: Path, settings: TuneSettings, space: Space, trials: list[dict[str, Any]], render: Render | None = None
) -> dict[str, Any]:
    """``tune.json`` from the trials, and what ``render`` draws from them (the CLI passes
    ``splitleak.report.tune.render_tune``: ``frontier.png`` / ``.svg`` and ``tune.md``)."""
    th = shipped_thresholds()
    scored = [t for t in trials if t["error"] is None]
    # a stopped trial's recovery is a lower bound, exact only when it already reads every token
    exact = [t["stopped"] is None or t["worst_token_recovery"] >= 1.0 for t in scored]
    front_idx = pareto_front([(t["cost"], t["worst_token_recovery"]) for t in scored], exact)
    frontier = [scored[i]["number"] for i in front_idx]
    passing = sorted((t for t in trials if t["passes"]), key=lambda t: (t["cost"], t["G"], t["number"]))
    for t in trials:
        t["on_frontier"] = t["number"] in frontier
    record = {
        "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "settings": settings.as_dict(),
        "space": space.as_dict(),
        "privacy": f"the gate of Politis & Pappas 2026 (Eq. 1) over the suite's readers: passes when G <= "
        f"+{100 * th.gate:.2f} pp (α {th.alpha:g}, the {th.protocol} protocol shipped with splitleak)",
        "gate_thresholds": th.as_dict(),
        "utility": settings.utility,
        "budget": settings.budget,
        "frontier": frontier,
        "passing": [t["number"] for t in passing],
        "cheapest_passing": passing[0]["number"] if passing else None,
        "trials": trials,
    }
    (out / "tune.json").write_text(json.dumps(record, indent=1, default=json_default) + "\n")
    paths = [out / "tune.json"]
    if render is not None:  # the frontier figure and tune.md (``splitleak.report.tune.render_tune``)
        paths += render(out, settings, space, trials, passing, frontier)
    return {"frontier": frontier, "passing": [t["number"] for t in passing], "paths": paths}


def pareto_front(points: Sequence[tuple[float, float]], exact: Sequence[bool] | None = None) -> list[int]:
    """Indices of the non-dominated points when both coordinates are minimised: no other point is at
    least as good in both and better in one. Equal points are all kept. In input order.

    ``exact[i]`` False marks a point whose second coordinate is only a lower bound (a trial stopped
    early): it may be dominated, but it neither dominates another point nor lies on the frontier."""
    known = list(exact) if exact is not None else [True] * len(points)
    out = []
    for i, (x, y) in enumerate(points):
        if not known[i]:
            continue
        dominated = any(
            known[j] and (qx <= x and qy <= y) and (qx < x or qy < y) for j, (qx, qy) in enumerate(points) if j != i
        )
        if not dominated:
            out.append(i)
    return out
