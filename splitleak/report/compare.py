"""Leakage against cost across runs: `splitleak compare RUN_DIR...`.

Each argument is a run directory (from `splitleak train`) or an audit folder (holding ``run/`` and
``attacks/*.json``). For every run: defence, depth, seed, utility (held-out cross-entropy,
perplexity, ΔU), the relative perplexity change against the undefended run of the same model,
data, split and seed when one is among the arguments, and token / document / span recovery of
every attack result found beside it. The figure plots leakage (token and whole-document recovery of
the strongest attack run against each run, defence-aware ones such as ``mixup-unmix`` included)
against that perplexity change (What Gradients Add Figure 6 pools the attacks instead; with defence-aware attacks
a pool would dilute the one that undoes the defence).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from splitleak.audit.evaluate import attack_label as _label
from splitleak.audit.stages import STAGES, audit_state
from splitleak.audit.utility import split_baseline, utility_baseline
from splitleak.data import LABELS
from splitleak.defences import build_defence
from splitleak.errors import IntegrityError, SplitleakError
from splitleak.metrics import fmt_pct
from splitleak.privacy.accounting import DELTA
from splitleak.privacy.bound import count_crossings, run_epsilon
from splitleak.privacy.guarantee import chain_guarantees
from splitleak.report.figures import recovery_cost_figure
from splitleak.runs.chain import verify_chain
from splitleak.runs.journal import read_run_json
from splitleak.runs.verify import verify_run
from splitleak.training.config import TrainConfig, config_from_record
from splitleak.training.config import adaptive_attacks_of as config_adaptive_attacks


@dataclass
class RunSummary:
    path: Path
    config: dict[str, Any]
    metrics: dict[str, Any]
    attacks: list[dict[str, Any]] = field(default_factory=list)
    rel_ppl_change: float | None = None
    #: why the run does not verify (``verify_run``'s message), or None for an intact, complete run: the
    #: utility of an unverified run is never shown as measured, nor used as another run's baseline
    unverified: str | None = None
    #: an audit folder whose audit did not finish (``splitleak.audit.stages.audit_state``: why, and the
    #: labels of the attacks it is missing, None when unknown), or None for a finished audit or a run
    incomplete: dict[str, Any] | None = None
    #: the upper side of the verdict (``_upper_side``), or None for an unverified run
    upper: str | None = None

    @property
    def defence(self) -> str:
        names = [d["name"] for d in self.config["defences"]]
        return "+".join(names) if names else "none"

    @property
    def depth(self) -> str:
        c = self.config
        if c.get("offload_start") is not None:
            return f"b={c['offload_start']},s={c['offload_length']}"
        return str(c["depth"])

    def key(self) -> tuple:
        c = self.config
        return (
            c["model"],
            c["data"],
            c["depth"],
            c.get("offload_start"),
            c.get("offload_length"),
            c["seed"],
            c["n_train"],
            c["n_eval"],
            c.get("steps"),
        )

    def strongest(self, what: str) -> float | None:
        """The best reading of any attack run against this run (the majority control excluded): what
        an attacker gets, whichever attack it picks. A mean over attacks would reward a run for
        having been attacked by more weak attacks."""
        vals = [a[what] for a in self.attacks if a.get(what) is not None and a["attack"] != "majority"]
        return max(vals) if vals else None


def load_summary(path: str | Path) -> RunSummary:
    path = Path(path)
    run = path / "run" if (path / "run" / "manifest.json").is_file() else path
    if (path / STAGES).is_file() and not (path / "run" / "metrics.json").is_file():
        raise SplitleakError(
            f"{path} is an audit that stopped before its run finished (killed, or failed): nothing to compare yet; "
            f"continue it with `splitleak audit --out {path} --resume` and the options it was started with"
        )
    if not (run / "manifest.json").is_file() or not (run / "metrics.json").is_file():
        raise SplitleakError(
            f"{path} is neither a finished run directory nor an audit folder (no manifest.json and metrics.json); "
            "pass folders written by `splitleak train` or `splitleak audit`"
        )
    manifest, metrics = read_run_json(run, "manifest.json"), read_run_json(run, "metrics.json")
    if (manifest.get("config") or {}).get("latent") is not None:
        raise SplitleakError(
            f"{path} is a latent-mode run (002's decoy system), which reads no tokens per document to compare; its "
            "audit is its own report (`splitleak audit --mode latent`). Compare split runs and their audits"
        )
    v = verify_run(run)  # metrics.json edited (a held-out CE of 0.123, NaN) is not what the run measured
    unverified = None if v.ok and v.status == "complete" else (v.message if not v.ok else f"the run {v.status}")
    if unverified is None:  # a resumed run: what it trained on is whole only with the runs it continues
        try:
            verify_chain(run)
        except IntegrityError as exc:
            unverified = str(exc)
    if run != path and unverified is None:  # an audit: ΔU as it derives it, from its verified runs only
        metrics, twin_problem = _audit_delta_u(path, manifest, metrics)
        unverified = twin_problem
    attacks = []
    adir = path / "attacks"
    if adir.is_dir():
        for f in sorted(adir.glob("*.json")):
            attacks.append(json.loads(f.read_text()))
    incomplete = audit_state(path) if run != path else None  # killed or failed: some attacks never ran
    upper = _upper_side(path, run, manifest["config"]) if unverified is None else None
    return RunSummary(
        path, manifest["config"], metrics, attacks, unverified=unverified, incomplete=incomplete, upper=upper
    )


#: the verdict's parts that say the upper side (``report.audit_prose``)
UPPER_PARTS = ("Upper side:", "INSTRUMENT FAULT", "Over the whole training traffic")


def _upper_side(path: Path, run: Path, config: dict[str, Any]) -> str:
    """The other side of the verdict: an audit's, as its report says it (the bound, the mechanism's game, the
    whole training traffic); for a run, the largest ε per document over its recorded crossings under the chain's
    declared noise (the token bound needs the public model's κ: the audit gives it)."""
    report = path / "report.json"
    if run != path and report.is_file():
        parts = json.loads(report.read_text()).get("verdict_parts") or []
        said = [p for p in parts if p.startswith(UPPER_PARTS)]
        return " ".join(said) or "the audit's report names no upper side (written before it was measured)"
    chain = [build_defence(d["name"], dict(d.get("args") or {})) for d in config["defences"] if d["name"] != "none"]
    guarantees = chain_guarantees(chain)
    if not guarantees.by_channel:
        return "no formal bound: no defence of the chain adds noise with a guarantee; a stronger reader may read up to 100 %"
    if config.get("draws") != "os":
        return f"no formal bound: the noise is keyed by the run seed (draws {config.get('draws')})"
    exclude = ["labels"] if config.get("offload_start") is None and config.get("shielded") is None else []
    eps, how = run_epsilon(count_crossings(run), guarantees, int(config["doc_len"]), exclude)
    if eps is None:
        return f"no formal bound: {how}"
    return f"ε ≤ {eps:.3g} per document at δ = {DELTA:g} over every recorded crossing ({how}); the audit gives the token bound"


def _audit_delta_u(path: Path, manifest: dict[str, Any], metrics: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """An audit's ΔU without an all-local run of its own (``audit.run.utility_baseline``), recomputed from
    what verifies, not read from its ``report.json`` (which nothing vouches for): the split run itself when
    undefended, else its undefended twin ``twin/``, which must verify, complete, to be used (else the
    second value says why and the audit's utility is not shown as measured)."""
    config = manifest["config"]
    defended = any(d.get("name") != "none" for d in config.get("defences", []))
    if config.get("shielded") is not None:
        split = split_baseline("label-shielded")
    else:
        split = split_baseline("u-shape" if manifest.get("split", {}).get("u_shape") else "plain")
    cost = None
    twin = path / "twin"
    if defended and split != "other" and twin.is_dir():
        tv = verify_run(twin)
        if not tv.ok or tv.status != "complete":
            return metrics, f"its undefended twin {twin} does not verify ({tv.message if not tv.ok else tv.status})"
        cost = {"twin_heldout_ce": read_run_json(twin, "metrics.json").get("heldout_ce")}
    base = utility_baseline(metrics, cost, defended=defended, split=split)
    if base.get("delta_u") is None:
        return metrics, None
    return {**metrics, "all_local_ce": base["all_local_ce"], "delta_u": base["delta_u"]}, None


def compare_runs(paths: Sequence[str | Path]) -> list[RunSummary]:
    runs = [load_summary(p) for p in paths]
    base = {r.key(): r for r in runs if r.defence == "none" and r.unverified is None}
    for r in runs:
        b = base.get(r.key())
        if r.unverified is None and b is not None and b.metrics.get("perplexity"):
            r.rel_ppl_change = r.metrics["perplexity"] / b.metrics["perplexity"] - 1.0
    return runs


def table_rows(runs: list[RunSummary]) -> tuple[list[str], list[list[str]]]:
    """Long format: one row per (run, attack); the utility columns repeat for each attack of a run."""
    header = [
        "run",
        "defence",
        "depth",
        "seed",
        "held-out CE",
        "perplexity",
        "ΔU",
        "Δ ppl vs none",
        "attack",
        "token %",
        "document %",
        "name %",
        "number %",
        "identifier %",
        "knows the defence",
    ]
    rows = []
    for r in runs:
        m = r.metrics
        util = [str(r.path), r.defence, r.depth, str(r.config["seed"])]
        if r.unverified is not None:  # what its metrics.json says is not vouched for by its journal
            util += ["unverified"] * 4
        else:
            util += [
                f"{m['heldout_ce']:.4f}",
                f"{m['perplexity']:.2f}",
                "n/a" if m.get("delta_u") is None else f"{m['delta_u']:+.4f}",
                "n/a" if r.rel_ppl_change is None else f"{100 * r.rel_ppl_change:+.2f} %",
            ]
        scored = [a for a in r.attacks if a.get("token_recovery") is not None]
        if not scored and r.incomplete is None:
            rows.append(util + ["(no attack results)", "", "", "", "", "", ""])
        built = set(adaptive_attacks_of(r.config))
        for a in scored:
            spans = a.get("span_recovery") or {}
            rows.append(
                util
                + [_label(a), fmt_pct(a["token_recovery"]), fmt_pct(a["doc_recovery"])]
                + ["n/a" if spans.get(c) is None else fmt_pct(spans[c]) for c in LABELS]
                + ["yes" if a["attack"] in built else ""]
            )
        if r.incomplete is not None:  # the attacks a killed or failed audit never ran, each named
            missing = r.incomplete["missing"]
            for label in missing if missing is not None else ["(attacks not known: audit incomplete)"]:
                rows.append(util + [label, "incomplete", "incomplete", "", "", "", ""])
    return header, rows


def adaptive_attacks_of(config: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    """The attacks built for a run's defences, from its recorded configuration."""
    return config_adaptive_attacks(
        config_from_record({k: v for k, v in config.items() if k in TrainConfig.model_fields})
    )


def leakage_cost_figure(runs: list[RunSummary], out_stem: str | Path) -> list[Path]:
    """Token and whole-document recovery of the strongest attack against the perplexity change, one
    labelled point per run; writes OUT.png and OUT.svg."""
    pts = [r for r in runs if r.rel_ppl_change is not None and r.strongest("token_recovery") is not None]
    if not pts:
        raise SplitleakError(
            "nothing to plot: the figure needs, for each defended run, the undefended run of the same model, "
            "data, split and seed among the arguments, and attack results beside the runs (audit folders)"
        )

    def panel(what: str) -> list[tuple[float, float, str, bool]]:
        out = []
        for r in pts:
            cost, leak = r.rel_ppl_change, r.strongest(what)
            # pts keeps runs with a cost and a token recovery; an attack scores doc and token recovery together
            assert cost is not None and leak is not None
            label = f"{r.defence}, depth {r.depth}" + (" (audit incomplete)" if r.incomplete is not None else "")
            out.append((100 * cost, 100 * leak, label, r.defence == "none"))
        return out

    return recovery_cost_figure(
        {"token recovery": panel("token_recovery"), "whole-document recovery": panel("doc_recovery")},
        out_stem,
        xlabel="cost: held-out perplexity change vs. undefended run (%)",
        ylabel="{title} (%), strongest attack",
    )
