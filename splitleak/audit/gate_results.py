"""Attack results read under a protocol's gate (``splitleak.audit.gate``): probe-battery results with their
shuffled-label twins, and the token attacks of split runs, each with its run's utility gate."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from splitleak.attacks.registry import REGISTRY
from splitleak.audit.gate import (
    TWIN_PREFIX,
    GateThresholds,
    passes,
    reread_probes,
    unverified_utility,
    utility_gate,
)
from splitleak.audit.predictions import read_predictions, verified_metrics
from splitleak.audit.verdicts import arm_effects, arm_gate
from splitleak.errors import DataError
from splitleak.runs.truth import eval_token_ids


def latent_utility(run_dir: str | Path, th: GateThresholds) -> dict[str, Any]:
    """A latent run's utility gate: its held-out CE over the frozen pretrained model (``metrics.json``'s
    ``ce_increase_over_pretrained``, 002's Δ loss), read only from a run that verifies (else marked unverified)."""
    reference = "the frozen pretrained model (002's Δ loss)"
    m, why = verified_metrics(run_dir)
    if m is None:
        return unverified_utility(run_dir, why, th, reference)
    ce = m.get("ce_increase_over_pretrained")
    if ce is None and m.get("heldout_ce") is not None and m.get("pretrained_ce") is not None:
        ce = float(m["heldout_ce"]) - float(m["pretrained_ce"])
    return utility_gate(None if ce is None else float(ce), th, reference)


def split_utility(run_dir: str | Path, run_config: dict[str, Any], th: GateThresholds) -> dict[str, Any]:
    """A split run's utility gate: ΔU, its held-out CE over the all-local run (``metrics.json``); an
    undefended plain split is its own reference (it reproduces the all-local run exactly), so ΔU = 0. ΔU is
    read only from a run that verifies; else the utility is marked unverified and the run cannot pass."""
    defences = [d.get("name") for d in run_config.get("defences", [{"name": "none"}])]
    plain = run_config.get("offload_start") is None and run_config.get("shielded") is None
    if plain and all(d == "none" for d in defences):
        return utility_gate(0.0, th, "itself (undefended: the plain split reproduces the all-local run)")
    m, why = verified_metrics(run_dir)
    if m is None:
        return unverified_utility(run_dir, why, th, "the all-local run (ΔU)")
    du = m.get("delta_u")
    return utility_gate(None if du is None else float(du), th, "the all-local run (ΔU)")


def gate_inputs(found: Sequence[tuple[Path, dict[str, Any]]]) -> list[dict[str, Any]]:
    """What a gate protocol reads of attack results (``splitleak.audit.analysis.find_results``): each
    probe-battery result, and the token attacks of each split run grouped by run (the audit's arms)."""
    out: list[dict[str, Any]] = []
    split: dict[str, list[tuple[Path, dict[str, Any]]]] = {}
    for path, res in found:
        if "probes" in res:
            out.append({"kind": "latent", "path": path, "result": res})
        elif res.get("token_recovery") is not None:
            info = REGISTRY.get(res["attack"])
            if info is not None and info.control:
                continue  # a control reads no signal of the victim's text: no arm of the gate
            split.setdefault(res["run"]["config_hash"], []).append((path, res))
    for key, group in split.items():
        out.append({"kind": "split", "run_config_hash": key, "results": group})
    return out


def _split_label(res: dict[str, Any]) -> str:
    p = res.get("attack_params", {})
    extra = f" k={p['k']}" if "k" in p else (f" budget={p['budget']}" if "budget" in p else "")
    copy = (res.get("config") or {}).get("client_copy", "public")
    return f"{res['attack']}{extra}" + ("" if copy == "public" else f", {copy} copy")


def _read_latent(item: dict[str, Any], th: GateThresholds) -> dict[str, Any]:
    path, res = item["path"], item["result"]
    probes = res["probes"]
    rows = read_predictions(path, res, ["arm", "frame_id", "paired_delta"])
    own = [r for r in rows if not str(r.get("arm", "")).startswith(TWIN_PREFIX)]
    twin_rows = [
        {**r, "arm": str(r["arm"])[len(TWIN_PREFIX) :]} for r in rows if str(r.get("arm", "")).startswith(TWIN_PREFIX)
    ]
    utility = latent_utility(res["run"]["dir"], th)
    seed = (res.get("attack_params") or {}).get("seed", 0)
    v = reread_probes(probes, own, seed, th, utility)
    twin = probes.get("negative_control")
    v["negative_control"] = None if twin is None else _read_twin(twin, twin_rows, seed, th, v)
    if v["negative_control"] is not None and v["negative_control"]["detected_in"]:
        views = ", ".join(v["negative_control"]["detected_in"])
        v["instrument_fault"] = True
        v["passes"] = False
        v["verdict"] = (
            f"INSTRUMENT FAULT: the shuffled-label twin reads detected in {views}, so the battery reads what its "
            f"labels cannot give it; no verdict (the arms alone: {v['verdict']})"
        )
    else:
        v["instrument_fault"] = False
    threat = (res.get("attack_params") or {}).get("threat", "oracle")  # results written before threat models
    v["threat"] = threat
    if threat == "oracle":
        v["privacy_holds"] = v["passes"] = None
        v["verdict"] = f"ORACLE, an upper bound and not a verdict (it read the client's record): {v['verdict']}"
    run_cfg = res["run"]["config"]
    latent = run_cfg.get("latent") or {}
    return {
        "kind": "latent probe battery",
        "result": str(path),
        "attack": res["attack"],
        "config_hash": res["config_hash"],
        "protocol_hash": res.get("protocol_hash"),
        "run": res["run"]["dir"],
        "model": run_cfg.get("model"),
        "victim_seed": run_cfg.get("seed"),
        "latent": {
            k: latent.get(k) for k in ("split_after", "resume_at", "width", "decoys", "sigma", "output_gradient")
        },
        **v,
    }


def _read_twin(
    twin: dict[str, Any], rows: list[dict[str, Any]], seed: Any, th: GateThresholds, arms: dict[str, Any]
) -> dict[str, Any]:
    """The battery's shuffled-label twin, which 002 declares must read at floor, read at the protocol's α and
    gate from its per-frame differences (a result written before they were kept: the verdict its job read at
    the shipped thresholds, and it says so); ``detected_in`` names the views where it reads above floor."""
    names = {a["arm"]: a for a in twin["arms"]}
    if rows:
        by_view = reread_probes(twin, rows, seed, th)["by_view"]
        detected = [view for view, r in by_view.items() if r.get("verdict") == "detected"]
        read_at = "the protocol's alpha"
    else:
        by_view = twin.get("by_view") or {}
        detected = [view for view, r in by_view.items() if r.get("verdict") == "detected"]
        if not by_view and (twin.get("verdict") or {}).get("verdict") == "detected":
            detected = ["the battery"]
        read_at = "the shipped thresholds the job read it at (the result keeps no per-frame twin differences)"
    return {
        "type": twin.get("type"),
        "verdict": "detected" if detected else "at floor",
        "detected_in": detected,
        "read_at": read_at,
        "by_view_best": {
            view: None
            if r.get("best_arm") not in names
            else {k: names[r["best_arm"]][k] for k in ("arm", "paired_effect", "paired_low", "paired_high")}
            for view, r in arms["by_view"].items()
        },
    }


def _read_split(item: dict[str, Any], th: GateThresholds) -> dict[str, Any]:
    group = item["results"]
    predictions: dict[str, np.ndarray] = {}
    doc_ids: list[int] | None = None
    for path, res in group:
        rows = sorted(read_predictions(path, res, ["doc_id", "predicted"]), key=lambda r: int(r["doc_id"]))
        ids = [int(r["doc_id"]) for r in rows]
        if doc_ids is None:
            doc_ids = ids
        elif ids != doc_ids:
            raise DataError(f"{path} scores other documents than the other results of its run; one run, one set")
        label = _split_label(res)
        if label in predictions:
            raise DataError(f"two results of run {item['run_config_hash'][:12]} are both {label!r}; keep one")
        predictions[label] = np.array([r["predicted"] for r in rows], dtype=np.int64)
    assert doc_ids is not None
    res0 = group[0][1]
    truth = eval_token_ids(res0["run"]["dir"], doc_ids)
    base, arms = arm_effects(predictions, truth, alpha=th.alpha)
    g = arm_gate(arms, base, th.alpha, th.gate)
    utility = split_utility(res0["run"]["dir"], res0["run"]["config"], th)
    words = f"G = {100 * g.G:+.2f} pp over J = {len(arms)} arms: {'breaks' if g.breaks else 'holds'} the gate"
    words += f" (+{100 * th.gate:.2f} pp)"
    if utility.get("passes") is False:
        words += f"; {utility['text']}: not a passing configuration"
    elif utility.get("max") is not None or utility.get("unverified"):
        words += f"; {utility['text']}"
    cfg = res0["run"]["config"]
    return {
        "kind": "split attacks",
        "results": [str(p) for p, _ in group],
        "attacks": [
            {"attack": r["attack"], "config_hash": r["config_hash"], "protocol_hash": r.get("protocol_hash")}
            for _, r in group
        ],
        "run": res0["run"]["dir"],
        "model": cfg.get("model"),
        "victim_seed": cfg.get("seed"),
        "depth": cfg.get("depth"),
        "defence": "+".join(d["name"] for d in cfg.get("defences", [{"name": "none"}])),
        "thresholds": th.as_dict(),
        "constant_baseline": {"token_id": base.token_id, "rate": base.rate},
        "arms": [
            {
                "arm": a.name,
                "accuracy": a.accuracy,
                "paired_effect": a.effect.estimate,
                "paired_low": a.effect.low,
                "paired_high": a.effect.high,
                "verdict": a.verdict,
            }
            for a in arms
        ],  # fmt: skip
        "J": len(arms),
        "declared_J": th.arms,
        "family": "the run's token attacks less the controls (002's declared J names its probe battery, not these)",
        "gate_statistic": g.G,
        "alpha_bonf": g.alpha_bonf,
        "breaks_gate": g.breaks,
        "privacy_holds": not g.breaks,
        "utility": utility,
        "passes": passes(not g.breaks, utility),
        "verdict": words,
    }


def analyse_gate(th: GateThresholds, inputs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each input of ``gate_inputs`` read under ``th``: one verdict per battery result and per split run."""
    out = []
    for item in inputs:
        out.append(_read_latent(item, th) if item["kind"] == "latent" else _read_split(item, th))
    return out


def gate_hash_records(inputs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The (attack, config_hash, protocol_hash) of every result in ``inputs``, for ``check_results``."""
    recs = []
    for item in inputs:
        pairs = [(item["path"], item["result"])] if item["kind"] == "latent" else item["results"]
        recs += [
            {
                "attack": r.get("attack"),
                "config_hash": r.get("config_hash", "?"),
                "protocol_hash": r.get("protocol_hash"),
            }
            for _, r in pairs
        ]
    return recs
