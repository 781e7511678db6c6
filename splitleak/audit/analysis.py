"""Apply a frozen protocol to results: the main test, the Bonferroni family, and the
partial-offloading tests (What Gradients Add §3 "Statistics", §5 "Analysis").

The input is a long table of per-document scores, one record per (attack evaluation, document),
carrying the fields a protocol's selectors name:

- of the attack: its identity (``attacks.config.IDENTITY``): ``attack``, ``k``, ``budget``,
  ``readout`` (how a gradient-reading attack reads the gradient; ``effective_readout``),
  ``client_copy``, ``attack_seed``, ``gradient_noise``, ``gradient_bits``, ``inference``, ``phase``
  and ``params`` (every other hyperparameter, as canonical JSON);
- of the run: ``model``, ``depth``, ``offload_start``, ``offload_length``, ``defence`` (defence
  names joined by ``+``), ``data``, ``victim_seed``;
- the scores: ``doc_id``, ``token_correct``, ``token_counted``, ``exact``;
- ``protocol_hash``: every record must carry the protocol's hash, or the analysis refuses it.

A selector (``{attack: joint, k: 32, client_copy: public, depth: 6}``) picks the records whose
fields equal every value it names; fields it does not name default to the plain training
setting (``SELECTOR_DEFAULTS``: no defence, no observer-side gradient perturbation, not the
inference setting, the default gradient read-out), so that ``joint`` does not also pick the
perturbed joint attacks or the pseudo-label map. A selector that still matches more than one
configuration (two values of a hyperparameter in ``params``, say) is refused, naming them. For
each victim seed (a trained model) the per-document score is averaged over attack seeds; the
crossed bootstrap then resamples models and documents.
``rows_from_results`` builds the table from ``splitleak attack`` / ``splitleak audit`` output, and
the experiment store yields the same records.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from splitleak.attacks.config import CONFIG_FIELDS, IDENTITY_FIELDS, attack_identity, canonical
from splitleak.attacks.registry import readout_attacks
from splitleak.audit.gate import thresholds_of
from splitleak.audit.gate_results import analyse_gate, gate_hash_records
from splitleak.audit.predictions import (
    RESULT_FIX,
    read_predictions,  # noqa: F401  (re-exported)
    verified_metrics,
)
from splitleak.audit.protocol import Protocol, check_results
from splitleak.errors import ConfigError, DataError, IntegrityError, SplitleakError
from splitleak.files import config_hash, read_json, validated
from splitleak.stats import bonferroni_alpha, heldout_rmse, paired_difference_ci, partial_r2_test

#: the attack's fields of a record: its identity (``attacks.config.IDENTITY``, derived from AttackConfig:
#: ``params`` holds every hyperparameter without a field of its own, as canonical JSON)
ATTACK_FIELDS = IDENTITY_FIELDS
RUN_FIELDS = ("model", "depth", "offload_start", "offload_length", "defence", "data", "victim_seed", "data_seed")
#: the run's fields of one configuration (the victim seeds are its replicates; the data seed is checked apart)
CONFIG_RUN_FIELDS = tuple(f for f in RUN_FIELDS if f not in ("victim_seed", "data_seed"))
#: the attacks that take a gradient read-out (attacks.core.READOUTS), from the torch-free registry,
#: and its default
READOUT_ATTACKS = readout_attacks()
DEFAULT_READOUT = "gradient"
SELECTOR_DEFAULTS = {
    "defence": "none",
    "gradient_noise": None,
    "gradient_bits": None,
    "inference": False,
    "readout": DEFAULT_READOUT,
}


def effective_readout(r: dict[str, Any]) -> str | None:
    """The read-out a record's attack used: None for attacks that read no gradient; for a
    gradient-reading attack recorded before read-outs existed, the pseudo-label map it then used."""
    if r.get("attack") not in READOUT_ATTACKS:
        return None
    return r.get("readout") or "pseudo-map"


@functools.lru_cache(maxsize=4096)
def _per_doc_labels(result_json: str, span: str = "") -> dict[int, float]:
    """A label attack's per-document label recovery (of a ``span``'s labels: answer, query) from its job's result
    (``audit.extras.label_scores``), parsed once per job (every document row of a job carries the same result)."""
    key = f"{span}_label_recovery_per_doc" if span else "label_recovery_per_doc"
    return {int(d): float(v) for d, v in json.loads(result_json).get(key) or []}


def document_label_recovery(r: dict[str, Any], span: str = "") -> float:
    """The share of one document's labels (of its ``span``'s) a label attack recovered (NaN where its result has
    none per document: a store written before they were recorded, or a document without that span)."""
    key = r.get("result_json") or ""
    return (_per_doc_labels(key, span) if key else {}).get(int(r["doc_id"]), np.nan)


METRICS = {
    "token_recovery": lambda r: r["token_correct"] / r["token_counted"] if r["token_counted"] else np.nan,
    "doc_recovery": lambda r: float(bool(r["exact"])),
    "label_recovery": document_label_recovery,
    "answer_label_recovery": lambda r: document_label_recovery(r, "answer"),
    "query_label_recovery": lambda r: document_label_recovery(r, "query"),
    # 003 App. E: how much better a document's answer is read than its query
    "answer_minus_query_label_recovery": lambda r: (
        document_label_recovery(r, "answer") - document_label_recovery(r, "query")
    ),
}


@dataclass(frozen=True)
class ComparisonResult:
    treatment: dict[str, Any]
    control: dict[str, Any]
    metric: str
    estimate: float | None
    low: float | None
    high: float | None
    alpha: float
    mark: float
    passes: bool
    n_models: int
    n_docs: int
    missing: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Analysis:
    protocol: str
    protocol_hash: str
    main: ComparisonResult | None
    family: list[ComparisonResult]
    family_alpha: float | None
    family_passes: bool | None
    partial_offloading: list[dict[str, Any]]
    gate: list[dict[str, Any]] = field(default_factory=list)  # the gate test's verdicts (splitleak.audit.gate)
    gate_thresholds: dict[str, Any] | None = None  # what they were read against: the protocol's own
    notes: list[str] = field(default_factory=list)  # the protocol's tests these results did not evaluate, and why

    def as_dict(self) -> dict[str, Any]:
        return {
            "protocol": self.protocol,
            "protocol_hash": self.protocol_hash,
            "main": None if self.main is None else self.main.as_dict(),
            "family": [c.as_dict() for c in self.family],
            "family_alpha": self.family_alpha,
            "family_passes": self.family_passes,
            "partial_offloading": self.partial_offloading,
            "gate": self.gate,
            "gate_thresholds": self.gate_thresholds,
            "notes": self.notes,
        }


def defence_label(run_config: dict[str, Any]) -> str:
    return "+".join(d["name"] for d in run_config.get("defences", [{"name": "none"}]))


def run_fields(run_config: dict[str, Any]) -> dict[str, Any]:
    """The run-level selector fields of a training configuration."""
    return {
        "model": run_config.get("model"),
        "depth": run_config.get("depth"),
        "offload_start": run_config.get("offload_start"),
        "offload_length": run_config.get("offload_length"),
        "defence": defence_label(run_config),
        "data": run_config.get("data"),
        "victim_seed": run_config.get("seed"),
        "data_seed": run_config.get("data_seed"),
    }


class _ResultRun(BaseModel):
    model_config = ConfigDict(extra="allow")
    dir: str
    config_hash: str
    config: dict[str, Any]


class ResultCore(BaseModel):
    """What the analysis reads from an attack's RESULT.json; the rest is free (it grows with the attacks)."""

    model_config = ConfigDict(extra="allow", strict=True)  # a leakage index may be NaN; a recovery never
    attack: str
    config: dict[str, Any]
    config_hash: str
    run: _ResultRun
    protocol_hash: str | None = None
    token_recovery: float | None = Field(default=None, ge=0, le=1)
    leakage_index: float | None = None
    predictions: str | None = None
    predictions_sha256: str | None = None


def read_result(path: str | Path) -> dict[str, Any] | None:
    """An attack result (RESULT.json of ``splitleak attack --out`` or of the audit), checked: valid JSON,
    the fields the analysis reads with their types (``ResultCore``), and both configuration hashes
    matching their configurations. ``None`` for a JSON file that is no attack result (a run's metrics,
    a report); an IntegrityError in one line, naming the file and the fix, for one that is not JSON or
    claims to be a result and is damaged."""
    path = Path(path)
    data = read_json(path, "attack result", RESULT_FIX, mapping=False)
    if not isinstance(data, dict) or not {"attack", "config_hash"} <= data.keys():
        return None
    res = validated(ResultCore, data, path, RESULT_FIX)
    if config_hash(res.config) != res.config_hash:
        raise IntegrityError(f"{path}: config_hash does not match the attack's config (one was changed); {RESULT_FIX}")
    if config_hash(res.run.config) != res.run.config_hash:
        raise IntegrityError(f"{path}: run.config_hash does not match the run's config (one was changed); {RESULT_FIX}")
    return data


def find_results(paths: Iterable[str | Path], skipped: list[Path] | None = None) -> list[tuple[Path, dict[str, Any]]]:
    """Attack results among ``paths``: JSON files written by ``splitleak attack --out`` or the audit,
    given directly or found under directories. A damaged JSON file among them is refused (``read_result``),
    never skipped: an analysis that silently dropped a result would test another family. JSON objects
    that are no attack result (a run's metrics, a report) are appended to ``skipped``, for the caller to
    name."""
    found = []
    for p in map(Path, paths):
        if not p.exists():
            raise SplitleakError(f"{p} does not exist; pass attack result files or folders holding them")
        files = sorted(f for f in p.rglob("*.json") if not f.name.startswith(".")) if p.is_dir() else [p]
        for f in files:
            res = read_result(f)
            if res is not None:
                found.append((f, res))
            elif skipped is not None:
                skipped.append(f)
    if not found:
        raise SplitleakError("no attack results found; pass RESULT.json files written by `splitleak attack --out`")
    return found


def rows_from_results(found: Sequence[tuple[Path, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One record per (result, document) from results and their Parquet predictions."""
    rows = []
    for path, res in found:
        if res.get("token_recovery") is None:
            continue  # property inference: no per-token scores
        base = attack_identity(res["config"])
        base.update(run_fields(res["run"]["config"]))
        base.update({"protocol_hash": res.get("protocol_hash"), "config_hash": res["config_hash"]})
        for d in read_predictions(path, res, ["doc_id", "token_correct", "token_counted", "exact"]):
            rows.append({**base, **d})
    return rows


def run_rows_from_results(found: Sequence[tuple[Path, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One record per property-inference result, with its run's ΔU (for the partial-offloading tests).

    The run directory named in the result must still exist (its metrics.json holds ΔU) and verify,
    complete: a run whose metrics.json was edited is refused in one line, never read as measured nor
    dropped from the test without a word (a test on fewer runs would be another test)."""
    rows = []
    checked: dict[str, dict[str, Any]] = {}
    for path, res in found:
        if res.get("leakage_index") is None:
            continue
        metrics_path = Path(res["run"]["dir"]) / "metrics.json"
        if not metrics_path.is_file():
            raise SplitleakError(
                f"result {res['config_hash'][:12]} names run {res['run']['dir']}, which has no "
                "metrics.json; keep the run directories beside their results"
            )
        if res["run"]["dir"] not in checked:
            m, why = verified_metrics(res["run"]["dir"])
            if m is None:
                raise IntegrityError(
                    f"{path} names run {res['run']['dir']}, which does not verify ({why}): its ΔU is not what it "
                    f"measured; run `splitleak verify {res['run']['dir']}`, then restore or retrain the run"
                )
            checked[res["run"]["dir"]] = m
        m = checked[res["run"]["dir"]]
        if not isinstance(m.get("delta_u"), (int, float, type(None))) or isinstance(m.get("delta_u"), bool):
            raise IntegrityError(f"{metrics_path}: delta_u is not a number; rerun `splitleak train` for that run")
        rows.append(
            {
                **run_fields(res["run"]["config"]),
                "attack": res["attack"],
                "config_hash": res["config_hash"],
                "protocol_hash": res.get("protocol_hash"),
                "leakage_index": res["leakage_index"],
                "delta_u": m.get("delta_u"),
            }
        )
    return rows


def select(rows: Sequence[dict[str, Any]], selector: dict[str, Any]) -> list[dict[str, Any]]:
    """The records whose fields equal every value ``selector`` names (module docstring). The attack's
    fields compare in canonical form (``attacks.config.canonical``): ``params`` as a mapping
    (``params: {order: ridge}``) or its JSON, matched whole (``params: null``: none), ``budget``
    as an int or ``exhaustive``, a field a record lacks as its default."""
    unknown = set(selector) - set(ATTACK_FIELDS) - set(RUN_FIELDS)
    if unknown:
        raise ConfigError(f"selector names unknown field(s) {sorted(unknown)}; use {ATTACK_FIELDS + RUN_FIELDS}")
    try:
        wanted = {k: canonical(k, v) if k in ATTACK_FIELDS and k != "readout" else v for k, v in selector.items()}
    except (ValueError, ConfigError) as exc:  # params that are neither a mapping nor its JSON
        raise ConfigError(f"selector {selector}: {exc}") from None
    full = {**SELECTOR_DEFAULTS, **wanted}
    readout = full.pop("readout")

    def value(r: dict[str, Any], k: str) -> Any:
        return canonical(k, r.get(k)) if k in ATTACK_FIELDS else r.get(k)

    return [
        r
        for r in rows
        if all(_same(value(r, k), v) for k, v in full.items()) and effective_readout(r) in (None, readout)
    ]


def _same(value: Any, wanted: Any) -> bool:
    if wanted is False:
        return not value  # inference: absent or False
    return value == wanted


def score_matrix(rows: Sequence[dict[str, Any]], metric: str) -> tuple[np.ndarray, list[Any], list[int]]:
    """(victim seeds × documents) matrix of a metric, averaged over attack seeds."""
    if metric not in METRICS:
        raise ConfigError(f"unknown metric {metric!r}; use one of {sorted(METRICS)}")
    configs: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in rows:  # one configuration: the attack's identity less its seed, on one kind of trained model
        config = {f: canonical(f, r.get(f)) for f in CONFIG_FIELDS} | {"readout": effective_readout(r)}
        config |= {f: r.get(f) for f in CONFIG_RUN_FIELDS}
        configs.setdefault(tuple(config.values()), config)
    if len(configs) > 1:
        found = list(configs.values())
        differ = [f for f in found[0] if len({repr(c[f]) for c in found}) > 1]
        candidates = "; ".join(" ".join(f"{f}={c[f]}" for f in differ) for c in found)
        raise ConfigError(
            f"the selector matches {len(configs)} different configurations ({candidates}); name "
            f"{', '.join(differ)} in it so that it picks one"
        )
    data_seeds = {r.get("data_seed") for r in rows}
    if len(data_seeds) > 1:
        raise DataError(
            f"the runs drew their documents with different data seeds {sorted(map(str, data_seeds))}, so document j "
            "is a different text in different runs and cannot be paired; train every victim seed with one --data-seed"
        )
    cells: dict[tuple[Any, int], list[float]] = {}
    for r in rows:
        cells.setdefault((r["victim_seed"], int(r["doc_id"])), []).append(METRICS[metric](r))
    seeds = sorted({s for s, _ in cells})
    docs = sorted({d for _, d in cells})
    m = np.full((len(seeds), len(docs)), np.nan)
    for (s, d), v in cells.items():
        m[seeds.index(s), docs.index(d)] = float(np.mean(v))
    return m, seeds, docs


def paired_matrices(
    rows: Sequence[dict[str, Any]], treatment: dict[str, Any], control: dict[str, Any], metric: str
) -> tuple[np.ndarray, np.ndarray, list[Any], list[int]] | str:
    """Treatment's and control's (victim seeds x documents) matrices on the seeds and documents both have, with
    those seeds and documents; or why there are none."""
    t_rows, c_rows = select(rows, treatment), select(rows, control)
    if not (t_rows and c_rows):
        return "no results for the " + " and ".join(n for n, r in (("treatment", t_rows), ("control", c_rows)) if not r)
    mt, st, dt = score_matrix(t_rows, metric)
    mc, sc, dc = score_matrix(c_rows, metric)
    seeds = [s for s in st if s in sc]
    docs = [d for d in dt if d in dc]
    if not seeds or not docs:
        return "treatment and control share no victim seed or document"
    a = mt[np.ix_([st.index(s) for s in seeds], [dt.index(d) for d in docs])]
    b = mc[np.ix_([sc.index(s) for s in seeds], [dc.index(d) for d in docs])]
    if np.isnan(a).any() or np.isnan(b).any():
        raise DataError("some (victim seed, document) cells lack a score; every model must be scored on every document")
    return a, b, seeds, docs


def compare(
    rows: Sequence[dict[str, Any]],
    treatment: dict[str, Any],
    control: dict[str, Any],
    *,
    metric: str,
    alpha: float,
    mark: float,
    n_boot: int,
    seed: int,
) -> ComparisonResult:
    """Paired crossed-bootstrap interval of treatment minus control on the models and documents both
    have; passes when its lower end is above ``mark``."""
    paired = paired_matrices(rows, treatment, control, metric)
    if isinstance(paired, str):
        return ComparisonResult(treatment, control, metric, None, None, None, alpha, mark, False, 0, 0, paired)
    a, b, seeds, docs = paired
    iv = paired_difference_ci(a, b, n_boot=n_boot, alpha=alpha, seed=seed)
    return ComparisonResult(
        treatment,
        control,
        metric,
        iv.estimate,
        iv.low,
        iv.high,
        alpha,
        mark,
        bool(iv.low > mark),
        len(seeds),
        len(docs),
    )


def analyse(
    protocol: Protocol,
    protocol_hash: str,
    rows: Sequence[dict[str, Any]],
    run_rows: Sequence[dict[str, Any]] = (),
    gate_inputs: Sequence[dict[str, Any]] = (),
) -> Analysis:
    """Evaluate the protocol's main test, its family, its partial-offloading tests and its gate test
    (``gate_inputs`` from ``splitleak.audit.gate_results.gate_inputs``, read at the protocol's gate, α, J and
    utility gate); ``notes`` name every declared test these results did not evaluate.

    Refuses (IntegrityError) any record not written under ``protocol_hash``."""
    check_results(
        [
            {
                "attack": r.get("attack"),
                "config_hash": r.get("config_hash", "?"),
                "protocol_hash": r.get("protocol_hash"),
            }
            for r in list(rows) + list(run_rows)
        ]
        + gate_hash_records(gate_inputs),
        protocol_hash,
    )
    main = None
    if protocol.main_test is not None:
        t = protocol.main_test
        main = compare(
            rows,
            t.treatment,
            t.control,
            metric=t.metric,
            alpha=t.alpha,
            mark=t.pass_mark,
            n_boot=t.n_boot,
            seed=t.bootstrap_seed,
        )
    fam_results: list[ComparisonResult] = []
    fam_alpha = fam_pass = None
    if protocol.family is not None and (protocol.family.comparisons or protocol.family.controls):
        f = protocol.family
        fam_alpha = bonferroni_alpha(f.alpha, f.size)
        for i, c in enumerate(f.expand(protocol.main_test)):
            fam_results.append(
                compare(
                    rows,
                    c.treatment,
                    c.control,
                    metric=f.metric,
                    alpha=fam_alpha,
                    mark=0.0,
                    n_boot=f.n_boot,
                    seed=f.bootstrap_seed + i,
                )
            )
        fam_pass = all(c.passes for c in fam_results)
    po = analyse_partial_offloading(protocol, run_rows) if run_rows else []
    th = thresholds_of(protocol, protocol_hash)
    gate = analyse_gate(th, gate_inputs) if th is not None else []
    notes = unevaluated(protocol, gate, bool(po), sum(g["kind"] == "latent" for g in gate_inputs))
    return Analysis(
        protocol.name,
        protocol_hash,
        main,
        fam_results,
        fam_alpha,
        fam_pass,
        po,
        gate,
        None if th is None else th.as_dict(),
        notes,
    )


def unevaluated(protocol: Protocol, gate: Sequence[dict[str, Any]], po_read: bool, batteries: int) -> list[str]:
    """One line per test the protocol declares that this analysis did not evaluate, saying why, so that
    an analysis never reads as empty without a word (``tests`` entries; the main test and the family
    say for themselves when their results are missing)."""
    notes = []
    gate_read = bool(gate)
    twins = any(g.get("negative_control") is not None for g in gate)
    has_gate = thresholds_of(protocol, "") is not None
    if batteries and not has_gate:
        notes.append(
            f"{batteries} probe-battery result(s) are read only under a gate, and protocol {protocol.name} declares "
            "none (no thresholds.gate): not read"
        )
    for t in protocol.tests:
        what = ", ".join(f"{k}={v}" for k, v in t.items() if k != "rule")
        if t.get("statistic") in ("gate", "paired_effect_A", "paired_effect_N"):
            if not has_gate:
                notes.append(f"test {what}: the protocol declares no thresholds.gate to read it against")
            elif not gate_read:
                notes.append(
                    f"test {what}: no probe-battery result and no split token attack among the results to read it on"
                )
            elif t.get("statistic") == "paired_effect_N" and not twins:
                notes.append(
                    f"test {what}: no probe-battery result with its shuffled-label twin among the results (a split "
                    "run's negative controls are the audit's, read by `splitleak audit`)"
                )
        elif "outcome" in t and "defence" in t:
            if not po_read:
                notes.append(f"test {what}: no property-inference result with its run's ΔU among the results")
        elif "claim" in t:
            notes.append(
                f"test {what}: a claim over a grid of runs, evaluated by the label-shielded section of the grid's "
                "report (`splitleak experiment report`) from the grid's store at the protocol's thresholds, not "
                "from loose results"
            )
        else:
            notes.append(f"test {what}: `protocol analyse` does not evaluate tests of this shape")
    return notes


def analyse_partial_offloading(protocol: Protocol, run_rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """What Gradients Add §5: for each model and test {outcome, defence}, partial R² of the start beyond length with its
    permutation p-value and seed-bootstrap interval, and the held-out-seed RMSE check.

    ``run_rows``: one record per run with ``defence``, ``victim_seed``, ``offload_start``,
    ``offload_length`` and the outcomes (``delta_u``, ``leakage_index``). The held-out seeds are the
    protocol's last two victim seeds."""
    th = protocol.thresholds
    test_seeds = protocol.victim_seeds[-2:]  # What Gradients Add §5: fit on seeds 11-66, evaluate on 77 and 88
    out = []
    models = sorted({str(r.get("model")) for r in run_rows})
    for i, (model, test) in enumerate((m, t) for m in models for t in protocol.tests):
        if "outcome" not in test or "defence" not in test:
            continue
        rows = [
            r
            for r in run_rows
            if r.get("defence") == test["defence"]
            and r.get(test["outcome"]) is not None
            and r.get("offload_length") is not None
            and str(r.get("model")) == model
        ]
        rec: dict[str, Any] = {
            "model": model,
            "outcome": test["outcome"],
            "defence": test["defence"],
            "runs": len(rows),
        }
        if len({r["victim_seed"] for r in rows}) < 2:
            rec["missing"] = "fewer than two victim seeds with this defence and outcome"
            out.append(rec)
            continue
        y = [float(r[test["outcome"]]) for r in rows]
        s = [int(r["offload_length"]) for r in rows]
        b = [int(r["offload_start"]) for r in rows]
        seeds = [r["victim_seed"] for r in rows]
        level = float(th.get("bootstrap_level", 0.9875))
        pr = partial_r2_test(
            y,
            s,
            b,
            seeds,
            n_perm=int(th.get("permutations", 10_000)),
            seed=i,
            alpha_boot=1 - level,
            n_boot=int(th.get("bootstrap_draws", 10_000)),
        )
        rec.update(
            {
                "partial_r2": pr.partial_r2,
                "p_value": pr.p_value,
                "low": pr.low,
                "high": pr.high,
                "passes": bool(
                    pr.partial_r2 >= th.get("partial_r2_min", 0.10) and pr.p_value < th.get("permutation_p_max", 0.0125)
                ),
            }
        )
        if set(test_seeds) & set(seeds) and set(seeds) - set(test_seeds):
            try:
                h = heldout_rmse(y, s, b, seeds, test_seeds, required=th.get("heldout_rmse_reduction", 0.10))
                rec["heldout"] = asdict(h) | {"test_seeds": test_seeds}
            except DataError as exc:
                rec["heldout"] = {"missing": str(exc)}
        out.append(rec)
    return out
