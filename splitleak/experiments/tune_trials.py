"""One trial of ``splitleak tune``: its grid (the depth, the undefended chain and its own, the suite against
its chain) run through ``splitleak.experiments`` into the tune's one store, its utility cost against the
undefended run at the same depth, and its arms scored against the gate (``splitleak.experiments.tune``'s
docstring says why the gate and when a trial stops early).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from splitleak.attacks.knowledge import public_model
from splitleak.attacks.registry import attack_info
from splitleak.audit.bounds import audit_bound
from splitleak.audit.gate import shipped_thresholds
from splitleak.audit.verdicts import arm_effects, arm_gate
from splitleak.errors import SplitleakError
from splitleak.experiments.runner import plan_grid, run_grid
from splitleak.experiments.spec_loading import load_spec
from splitleak.experiments.store import ResultsStore
from splitleak.experiments.tune import ADAPTIVE, Space, TrialConfig, TuneSettings, resolve_attacks
from splitleak.runs.truth import eval_token_ids, phase_documents
from splitleak.training.config import draws_of


@dataclass
class Outcome:
    """What one trial measured. ``stopped`` names why the suite stopped early (its numbers are then lower
    bounds); ``error`` why it could not run."""

    depth: int
    defence: str
    chain: list[dict[str, Any]]
    cost: float | None = None  # in the unit of the tune's utility
    rel_ppl: float | None = None
    delta_ce: float | None = None
    perplexity: float | None = None
    undefended_perplexity: float | None = None
    G: float | None = None  # the gate statistic over the arms run (a lower bound when stopped)
    gate_breaks: bool | None = None
    baseline_rate: float | None = None
    arms: list[dict[str, Any]] = field(default_factory=list)
    worst_reader: str | None = None
    worst_token_recovery: float | None = None
    within_budget: bool | None = None
    token_bound: float | None = None  # the most any reader can read: the mean token bound of the defended run
    doc_bound: float | None = None  # ... of whole documents
    epsilon_doc: float | None = None  # the largest per-document ε at the bound's δ
    bound_note: str | None = None  # why there is no bound, or what it rests on
    bound_holds: bool | None = None  # the bound at most the tune's bound_below (None: not asked)
    passes: bool = False
    stopped: str | None = None
    error: str | None = None
    train_keys: list[str] = field(default_factory=list)
    attack_keys: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _json_arg(v: Any) -> str:
    return json.dumps(v, separators=(",", ":"))


def write_base_spec(out: Path, settings: TuneSettings, space: Space) -> Path:
    """``OUT/spec.yaml``: the grid every trial overrides (depths, defences, attacks)."""
    spec = {
        "name": "tune",
        "description": "written by splitleak tune; each trial overrides depths, defences and attacks",
        "protocol": "shipped:paper_main",
        "models": [settings.model],
        "precision": settings.precision,
        "depths": list(space.depths),
        "defences": ["none"],
        "victim_seeds": [settings.victim_seed],
        "attack_seeds": [settings.seed],
        "client_copies": ["public"],
        "documents": {
            "n_calib": settings.n_calib,
            "n_train": settings.n_train,
            "n_eval": settings.n_eval,
            "doc_len": settings.doc_len,
            "seed": 0,
        },
        "steps": settings.steps,
        "data": {"source": settings.data, "path": settings.data_path},
        "all_local_baseline": False,
        "attacks": [],
    }
    if settings.model_path:
        spec["model_path"] = settings.model_path
    path = out / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def trial_spec(spec_path: Path, cfg: TrialConfig, attacks: list[tuple[str, dict[str, Any]]]):
    """The trial's grid: its depth, the undefended chain and its own, and the attacks against its chain only."""
    chains: list[Any] = ["none"]
    if not cfg.undefended:
        chains.append([dict(d) for d in cfg.chain])
    entries = [{**entry, "defences": [cfg.label]} for _, entry in attacks]
    overrides = [f"depths=[{cfg.depth}]", f"defences={_json_arg(chains)}", f"attacks={_json_arg(entries)}"]
    return load_spec(spec_path, None, overrides)


class GridEvaluator:
    """Runs a trial's jobs through the grid machinery into ``OUT/store`` and scores them."""

    def __init__(
        self,
        out: Path,
        settings: TuneSettings,
        space: Space,
        *,
        threads: int | None = None,
        device: str = "auto",
        reporter=None,
        n_boot: int = 2000,
    ):
        self.out, self.settings, self.space = out, settings, space
        self.spec_path = out / "spec.yaml"
        self.store = out / "store"
        self.attacks = resolve_attacks(settings.attacks)
        self.threads, self.device, self.reporter, self.n_boot = threads, device, reporter, n_boot
        self.jobs_ran = 0
        self._public: Any = None  # the public model: one for every trial (one model, one victim seed)

    def check(self) -> None:
        """Expand one grid with every chain at its defaults, so a bad argument or attack fails before any run."""
        chains: list[Any] = [[{"name": n} for n in c] for c in self.space.chains]
        overrides = [
            f"depths={_json_arg(list(self.space.depths))}",
            f"defences={_json_arg(chains)}",
            f"attacks={_json_arg([e for _, e in self.attacks])}",
        ]
        plan_grid(load_spec(self.spec_path, None, overrides))

    def _run(self, cfg: TrialConfig, attacks: list[tuple[str, dict[str, Any]]]):
        loaded = trial_spec(self.spec_path, cfg, attacks)
        res = run_grid(
            loaded, store=self.store, workers=1, threads=self.threads, device=self.device, reporter=self.reporter
        )
        self.jobs_ran += res.ran
        if res.failures:
            f = res.failures[0]
            raise TrialError(f"{f.kind} job {f.key[:12]} ({f.summary}) failed: {f.error_type}: {f.error}")
        return res.grid

    def _score(self, grid, outcome: Outcome, names: list[str]) -> Any:
        """Arm effects and the gate over the arms ``names`` of the trial's chain; fills ``outcome``."""
        rs = ResultsStore(self.store)
        by_name = dict(self.attacks)
        attack_of = {n: by_name[n]["attack"] for n in names}
        preds: dict[str, Any] = {}
        controls: dict[str, Any] = {}
        doc_ids: list[int] | None = None
        train_key = None
        keys = []
        for job in grid.of_kind("attack"):
            if job.fields["defence"] != outcome.defence:
                continue
            attack, copy = job.fields["attack"], job.fields["client_copy"]
            name = next(
                (n for n in names if by_name[n]["attack"] == attack and by_name[n]["client_copy"] == copy), None
            )
            if name is None and ADAPTIVE in names and attack_info(attack).adaptive:
                name = attack if copy == "public" else f"{attack}-{copy}"  # one of the chain's adaptive attacks
                attack_of[name] = attack
            if name is None:
                continue
            rows = sorted(rs.read_job("attack", job.key).to_pylist(), key=lambda r: r["doc_id"])
            ids = [r["doc_id"] for r in rows]
            if doc_ids is None:
                doc_ids = ids
            elif ids != doc_ids:
                raise TrialError(f"the attacks of {outcome.defence} read different documents")
            preds[name] = np.array([r["predicted"] for r in rows], dtype=np.int64)
            control = json.loads(rows[0]["result_json"]).get("control") if rows and rows[0].get("result_json") else None
            if control is not None:  # the job's mis-paired twin (splitleak.audit.verdicts)
                controls[name] = control["per_doc_delta"]
            train_key = job.train_key
            keys.append(job.key)
        assert doc_ids is not None and train_key is not None
        truth = eval_token_ids(rs.run_dir(train_key), doc_ids)
        th = shipped_thresholds()
        base, arms = arm_effects(
            preds, truth, controls=controls, n_boot=self.n_boot, alpha=th.alpha, seed=self.settings.seed
        )
        faults = [a.name for a in arms if a.control_verdict == "detected"]
        if faults:  # readings that are not readings of the traffic place no configuration on the frontier
            raise TrialError(
                f"instrument fault: the mis-paired negative control of {', '.join(faults)} reads above its floor "
                "(the attack reads the evaluation text by the documents' identity, not through the traffic)"
            )
        readers = [a for a in arms if not attack_info(attack_of[a.name]).control]
        gate = arm_gate(readers, base, th.alpha, th.gate)
        outcome.attack_keys = keys
        outcome.baseline_rate = base.rate
        outcome.arms = [
            {
                "name": a.name,
                "accuracy": a.accuracy,
                "effect": a.effect.estimate,
                "effect_low": a.effect.low,
                "effect_high": a.effect.high,
                "verdict": a.verdict,
                "control_verdict": a.control_verdict,
            }
            for a in arms
        ]
        worst = max(readers, key=lambda a: a.accuracy)
        outcome.worst_reader, outcome.worst_token_recovery = worst.name, worst.accuracy
        outcome.G, outcome.gate_breaks = gate.G, gate.breaks
        return arms

    def _utility(self, grid, outcome: Outcome) -> None:
        rs = ResultsStore(self.store)
        rows = {j.fields["defence"]: rs.read_job("train", j.key).to_pylist()[0] for j in grid.of_kind("train")}
        outcome.train_keys = sorted(j.key for j in grid.of_kind("train"))
        mine, ref = rows[outcome.defence], rows["none"]
        if mine["perplexity"] is None or ref["perplexity"] is None:
            raise TrialError("the train job measured no held-out perplexity")
        outcome.perplexity, outcome.undefended_perplexity = mine["perplexity"], ref["perplexity"]
        outcome.rel_ppl = mine["perplexity"] / ref["perplexity"] - 1.0
        outcome.delta_ce = mine["heldout_ce"] - ref["heldout_ce"]
        outcome.cost = outcome.rel_ppl if self.settings.utility == "rel-ppl" else outcome.delta_ce
        outcome.within_budget = outcome.cost <= self.settings.budget

    def _bound(self, grid, outcome: Outcome) -> None:
        """The upper side of the defended run (``splitleak.audit.bounds``) into ``outcome``; a defence whose
        mechanism tells its neighbours apart better than it declares is an instrument fault (``TrialError``)."""
        job = next(j for j in grid.of_kind("train") if j.fields["defence"] == outcome.defence)
        run = ResultsStore(self.store).run_dir(job.key)
        train = job.config["train"]
        self._public = public_model(run, self._public)  # loaded once, checked against each run's fingerprint
        docs = phase_documents(run, "capture")
        truth = np.array([d.token_ids for d in docs], dtype=np.int64)
        ids = [d.doc_id for d in docs]
        b = audit_bound(run, train["defences"], "plain", draws_of(train), ids, truth, self._public.model)
        faults = [m for m in b.get("mechanism_audit", []) if m["fault"]]
        if faults:
            raise TrialError(
                f"instrument fault: the mechanism of {outcome.defence} on {faults[0]['channel']} tells neighbours "
                f"apart better than the noise it declares allows (ε at least {faults[0]['epsilon_lower']:.3g} against "
                f"a claimed {faults[0]['epsilon_claimed']:.3g})"
            )
        if b.get("bounded"):
            outcome.token_bound, outcome.doc_bound = b["token_bound"], b["doc_bound"]
            outcome.epsilon_doc = b.get("epsilon_doc_max")
            outcome.bound_note = f"ε per document up to {b.get('epsilon_doc_max'):.3g} at δ {b['delta']:g}"
        else:
            outcome.bound_note = f"no formal bound: {b.get('why')}"
        below = self.settings.bound_below
        if below is not None:
            outcome.bound_holds = outcome.token_bound is not None and outcome.token_bound <= below

    def __call__(self, cfg: TrialConfig) -> Outcome:
        outcome = Outcome(cfg.depth, cfg.label, [dict(d) for d in cfg.chain])
        names = [n for n, _ in self.attacks]
        first = names[:1]
        grid = self._run(cfg, self.attacks[:1])
        self._utility(grid, outcome)
        self._bound(grid, outcome)
        arms = self._score(grid, outcome, first)
        probe = arms[0]
        if probe.effect.low > self.settings.stop_above:
            outcome.stopped = (
                f"{probe.name} reads {100 * probe.accuracy:.1f} % of tokens, {100 * probe.effect.low:+.1f} pp above the "
                f"constant baseline at the interval's lower end (> {100 * self.settings.stop_above:.1f} pp), so the "
                "whole suite breaks the gate"
            )
        elif not outcome.within_budget:
            outcome.stopped = f"over the utility budget ({outcome.cost:+.4g} > {self.settings.budget:g})"
        elif outcome.bound_holds is False:
            outcome.stopped = (
                f"no reader is bounded below {100 * (self.settings.bound_below or 0):.1f} % of tokens ("
                + (
                    f"the bound is {100 * outcome.token_bound:.1f} %)"
                    if outcome.token_bound is not None
                    else f"{outcome.bound_note})"
                )
            )
        if outcome.stopped is None and len(names) > 1:
            grid = self._run(cfg, self.attacks)
            self._score(grid, outcome, names)
        outcome.passes = bool(
            outcome.stopped is None
            and not outcome.gate_breaks
            and outcome.within_budget
            and outcome.bound_holds is not False
        )
        return outcome


class TrialError(SplitleakError):
    """A trial whose jobs could not run (recorded; the tune goes on)."""
