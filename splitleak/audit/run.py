"""`splitleak audit`: train and capture on embedded defaults, attack the captured traffic under both
threat models (the public copy of the client layers and the client's trained layers, with the
exact-inversion check on the latter), report.

Layout of the output folder: ``run/`` is the verifiable run directory (see ``splitleak.runs``),
``attacks/`` one RESULT.json + Parquet per attack, ``calibration/`` the injected-leak dose ladder
(``splitleak.audit.calibrate``), ``report.json`` the summary; ``splitleak.report.audit`` renders it as
``report.md`` and ``report.html``.

The verdict uses the words of Politis & Pappas 2026, §3 (``splitleak.audit.verdicts``): each attack arm's token top-1
accuracy is read as a paired effect over the constant baseline with a document-bootstrap interval
(**detected** / **at floor**), beside its mis-paired negative control; the gate G over the
arms **breaks** above +1.0 pp. Token top-1 may stand behind the verdict only because the audit
measures its dose-response curve on the same capture first; if that curve never detects the
injected leak, the verdict says the instrument is uncalibrated instead of "at floor".
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from splitleak.attacks import load_knowledge, load_traffic, make_attack_config
from splitleak.audit.calibrate import CalibrationResult, calibrate, read_calibration
from splitleak.audit.channels import IN_CLEAR, channel_table, not_attacked, run_declaration
from splitleak.audit.defaults import AUDIT_N_EVAL, AUDIT_N_TRAIN
from splitleak.audit.evaluate import attack_label, run_attack
from splitleak.audit.gate import audit_utility, gate_record, shipped_thresholds
from splitleak.audit.stages import START_AGAIN, AuditStages
from splitleak.audit.verdicts import CONTROL_DOCS, arm_effects, arm_gate, recovery_intervals
from splitleak.data import N_CALIB
from splitleak.errors import ConfigError, SplitleakError
from splitleak.files import json_default
from splitleak.metrics import fmt_pct
from splitleak.models import PRESETS, load_model, preset_available
from splitleak.progress import Progress
from splitleak.runs.captures import load_capture
from splitleak.runs.journal import read_run_json
from splitleak.runs.manifest import find_session
from splitleak.runs.truth import eval_token_ids
from splitleak.runs.verify import VerifyResult, verify_run
from splitleak.seeds import model_init_seed
from splitleak.stats import frame_weights
from splitleak.training import DefenceConfig, RunResult, make_train_config, run_training
from splitleak.training.config import adaptive_attacks_of

DEFAULT_MODEL = "smollm2-135m"
FALLBACK_MODEL = "tiny-gpt2"
DEFAULT_DEPTH = 6
#: checks per position of the audit's exact-inversion check on the trained copy (two rounds of 16)
CERTIFY_CHECKS = 32
#: the attacks the audit runs, (name, parameters, copy), in the main setting of What Gradients Add
#: (k = 32; SipIt with 32 checks per token). Two threat models (What Gradients Add §3): an observer
#: with the public pretrained copy of the client layers, and an attacker holding the client's trained
#: layers. On the trained copy, SipIt is also the exact-inversion check: a position whose recomputed
#: activation matches the observed one is certified (the cut is injective there). The audit bounds it
#: at What Gradients Add's 32 checks per position by default (``certify``): where the candidate order
#: ranks the true token deeper the position is read but not certified, and so are the positions after
#: it (their prefix is then wrong), and the report says within how many checks. Without the bound
#: (``--certify exhaustive``) every position is searched until it matches, at a cost that grows with how
#: deep the candidate order ranks the true tokens (measured in benchmarks/RESULTS.md, "Exhaustive SipIt").
AUDIT_ATTACKS: tuple[tuple[str, dict[str, Any], str], ...] = (
    ("majority", {}, "public"),
    ("vmi", {}, "public"),
    ("activation", {"k": 32}, "public"),
    ("joint", {"k": 32}, "public"),
    ("sipit", {"budget": 32}, "public"),
    ("sipit", {"budget": CERTIFY_CHECKS}, "trained"),
)
#: what each copy means for a reader of the report
THREAT_MODELS = {
    "public": "an observer of the activations and gradients (no labels) with the public pretrained weights of the "
    "client layers",
    "trained": "an attacker holding the client's trained layers",
}
#: the third threat model, which no attack needs to play: the server reads every channel it receives
SERVER_THREAT = "the untrusted server itself: every channel it receives, the labels included where the split sends them"
#: documents the report shows token by token (those whose scores lie closest to the attacks' means)
EXAMPLE_DOCS = 3
#: the calibration the audit runs before it may give a verdict on token top-1
CALIBRATION_ATTACK = "vmi"
CALIBRATION_COVERAGES = (0.02, 0.06, 0.10, 0.30, 1.0)
CALIBRATION_DOCS = 64
#: bootstrap replicates of the per-arm intervals
ARM_BOOT = 10_000


#: defence-aware attacks the audit adds when the traffic carries the channel they read
CONDITIONAL_ATTACKS = (("probe_activations", "mixup-unmix", {"k": 32}, "public"),)
#: the audit's settings of the attacks built for a defence (``Defence.adaptive``), as the suite's own: k = 32
#: candidates, 32 checks per position; an attack not listed runs with its defaults
ADAPTIVE_PARAMS: dict[str, dict[str, Any]] = {
    "sipit-aware": {"budget": 32},
    "activation-aware": {"k": 32},
    "seed-search": {"budget": 32},
    "mixup-unmix": {"k": 32},
    "mixup-history": {"k": 32},
}
#: the splits the audit runs in (``--mode``): where the labels go is what changes the server's reading
AUDIT_MODES = ("plain", "u-shape", "label-shielded")
#: the label-shielded audit's Top: 003's five blocks, or as many as leave the Trunk one block (ours)
SHIELDED_TOP = 5
#: readers the audit adds in a split mode: in the label-shielded split the labels are read through the output
#: gradient (GMA-SL, 003 §3)
MODE_ATTACKS: dict[str, tuple[tuple[str, dict[str, Any], str], ...]] = {"label-shielded": (("gma-sl", {}, "public"),)}
#: the channels the audit's injected-leak calibration doses (its positive control)
CALIBRATED_CHANNELS = ("activations",)


def split_fields(mode: str, depth: int, n_blocks: int) -> dict[str, Any]:
    """The training configuration's split fields for an audit ``mode`` cut after ``depth`` blocks."""
    rest = n_blocks - depth - 1  # blocks between the cut and the client's last one
    if mode == "plain":
        return {"depth": depth}
    if rest < 1:
        raise ConfigError(
            f"--mode {mode} needs at least one server block between the client's first {depth} and its last one; "
            f"the model has {n_blocks} blocks: pass a smaller --depth"
        )
    if mode == "u-shape":
        return {"offload_start": depth, "offload_length": rest}
    return {"shielded": {"bottom": depth, "top": min(SHIELDED_TOP, rest)}}


def check_certify(certify: int | str) -> None:
    if certify != "exhaustive" and (isinstance(certify, bool) or not isinstance(certify, int) or certify < 1):
        raise ConfigError(f"--certify takes a number of checks per position (>= 1) or 'exhaustive', got {certify!r}")


def audit_attacks(
    traffic,
    certify: int | str = CERTIFY_CHECKS,
    adaptive: dict[str, tuple[str, ...]] | None = None,
    mode: str = "plain",
) -> list[tuple[str, dict[str, Any], str]]:
    """``AUDIT_ATTACKS`` with the exact-inversion check's bound (``certify``: checks per position, or
    ``exhaustive``), plus each defence-aware attack whose channel the traffic carries, plus the attacks built
    for the run's defences (``adaptive``: name -> the defences it is built for) on the public copy, and
    ``sipit-aware`` on the trained copy too, where it is the exact-inversion check through the defence."""
    check_certify(certify)
    base = [
        (name, {**params, "budget": certify}, copy) if (name, copy) == ("sipit", "trained") else (name, params, copy)
        for name, params, copy in AUDIT_ATTACKS
    ]
    extra = [
        (name, params, copy) for field, name, params, copy in CONDITIONAL_ATTACKS if getattr(traffic, field) is not None
    ] + list(MODE_ATTACKS.get(mode, ()))
    built = []
    for name in adaptive or {}:
        built.append((name, dict(ADAPTIVE_PARAMS.get(name, {})), "public"))
        if name == "sipit-aware":
            built.append((name, {**ADAPTIVE_PARAMS[name], "budget": certify}, "trained"))
    out: list[tuple[str, dict[str, Any], str]] = []
    for item in base + extra + built:
        if not any((item[0], item[2]) == (n, c) for n, _, c in out):
            out.append(item)
    return out


def choose_default_model() -> tuple[str, str]:
    ok, where = preset_available(DEFAULT_MODEL)
    if ok:
        return DEFAULT_MODEL, f"the default real model, from {where}"
    return FALLBACK_MODEL, f"{DEFAULT_MODEL} is not available ({where}); falling back to the tiny random model"


@dataclass
class AuditResult:
    out: Path
    run: RunResult
    capture: dict[str, Any]
    summary: str
    attacks: list[dict[str, Any]]
    verdict: str
    utility_baseline: dict[str, Any] | None = None  # the all-local loss and ΔU, and where they come from


def capture_summary(run_dir: Path) -> dict[str, Any]:
    cap = load_capture(run_dir)
    if cap.gradients is None:
        raise ConfigError(f"{run_dir} recorded no returned gradient (top-only training); the audit reads one")
    act, grad = cap.activations.double(), cap.gradients.double()
    return {
        "documents": len(cap),
        "tokens_per_document": int(cap.mask.shape[1]),
        "width": int(act.shape[-1]),
        "activation_rms": float(act.pow(2).mean().sqrt()),
        "gradient_rms": float(grad.pow(2).mean().sqrt()),
        "all_zero_gradient_rows": int((cap.gradients == 0).all(dim=-1).sum()),
        "bytes_on_disk": sum(p.stat().st_size for p in (run_dir / "wire").glob("capture-*.safetensors")),
    }


#: what an audit writes into its folder (``run_audit``); ``--force`` deletes a folder that holds only these
AUDIT_ENTRIES = frozenset(
    {"run", "twin", "attacks", "calibration", "report.json", "report.md", "report.html", "stages.json"}
)


def check_audit_out(out: Path, force: bool, resume: bool = False) -> bool:
    """Refuse an ``--out`` that the audit must not write into (one line): one that exists and is not
    empty without ``force`` or ``resume``; with either, a link (whatever it leads to) or a folder that is
    not an audit folder splitleak wrote (its run, or only what an audit writes). True when ``out`` is to
    be deleted (``force``); ``resume`` keeps it, for ``AuditStages.prior`` to check what it holds."""
    from splitleak.runs.store import is_run_dir, refuse_clobber

    if force and resume:
        raise ConfigError("--resume continues the audit in --out and --force deletes it to start again; pass one")
    refuse_clobber(out)
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return False
    if not force and not resume:
        raise SplitleakError(
            f"{out} already exists and is not empty; pass --resume to continue the audit there, --force to start "
            "it again, or choose another --out"
        )
    names = {p.name for p in out.iterdir() if not p.name.endswith(".tmp")} if out.is_dir() else {out.name}
    ours = out.is_dir() and names <= AUDIT_ENTRIES and (not (out / "run").exists() or is_run_dir(out / "run"))
    if not ours:
        raise SplitleakError(
            f"{out} is not an audit folder (it holds {', '.join(sorted(names - AUDIT_ENTRIES)[:3]) or 'a run that splitleak did not write'}, "
            f"which an audit never writes), and {'--force deletes' if force else '--resume continues'} only what "
            "splitleak wrote; choose another --out"
        )
    return force


def run_audit(
    out: str | Path,
    *,
    model: str,
    model_path: str | None = None,
    depth: int | None = None,
    defences: list[dict[str, Any]] | None = None,
    data: str = "synthetic-pii",
    data_path: str | None = None,
    seed: int = 0,
    steps: int | None = None,
    draws: str = "os",
    n_calib: int = N_CALIB,
    n_train: int = AUDIT_N_TRAIN,
    n_eval: int = AUDIT_N_EVAL,
    force: bool = False,
    resume: bool = False,
    device: str = "auto",
    threads: int | None = None,
    progress: Progress | None = None,
    say: Callable[[str], None] = print,
    twin: bool = True,
    connect: str | None = None,
    tls_dir: str | Path | None = None,
    server_capture: str | Path | None = None,
    certify: int | str = CERTIFY_CHECKS,
    control_docs: int = CONTROL_DOCS,
    mode: str = "plain",
) -> AuditResult:
    """Train and capture, verify, attack with ``AUDIT_ATTACKS``, calibrate, and write the report.

    ``control_docs``: documents of each arm's mis-paired negative control (``splitleak.audit.verdicts``;
    0 runs none, and the verdict then says the controls were not run).

    ``mode``: the split (``AUDIT_MODES``): ``plain`` (the labels cross to the server for its loss),
    ``u-shape`` (the server runs blocks ``depth`` … n−2, the client keeps the last block, the head, the
    labels and the loss) or ``label-shielded`` (003: Bottom of ``depth`` blocks and Top of up to
    ``SHIELDED_TOP`` blocks on the client, the Trunk on the server). Outside the plain split the all-local
    baseline is trained (the identity that spares it is tested for the plain split only).

    With a defence and ``twin``, the same run without the defence is trained too (``out/twin``, no
    all-local baseline) so that the cost reads as the relative perplexity change against it (What Gradients Add §4.5).

    ``resume``: continue the audit that a kill or an error stopped in ``out`` (``splitleak.audit.stages``):
    each stage it finished is reused once its files hash as it recorded them (a run must also verify,
    complete), the others are done again; refused in one line when ``out`` was audited with other
    settings or a finished stage's files were changed. The report is the one an uninterrupted audit writes."""
    out = Path(out)
    clear = check_audit_out(out, force, resume)  # before anything is loaded, trained or deleted
    # the stages a stopped audit finished, their files checked against its record, before anything is loaded
    prior = AuditStages.prior(out) if resume and out.is_dir() and any(out.iterdir()) else None
    check_certify(certify)  # before anything is trained or written
    if mode not in AUDIT_MODES:
        raise ConfigError(f"unknown --mode {mode!r}; the audit runs in {', '.join(AUDIT_MODES)}")
    if control_docs and control_docs < 2:
        raise ConfigError(f"--control-docs takes 0 (no controls) or at least 2 documents, got {control_docs}")
    if server_capture is not None and connect is None:
        raise ConfigError("--server-capture is the capture folder of the server that --connect names; pass both")
    preset = PRESETS.get(model)
    lm = load_model(model, seed=model_init_seed(seed), model_path=model_path)
    n_blocks = lm.info["n_blocks"]
    if depth is None:
        depth = min(DEFAULT_DEPTH, n_blocks // 2) if n_blocks <= DEFAULT_DEPTH else DEFAULT_DEPTH
        if depth != DEFAULT_DEPTH:
            say(f"depth: {depth} ({model} has only {n_blocks} blocks; the default depth {DEFAULT_DEPTH} does not fit)")
    defended = any(d["name"] != "none" for d in defences or [])
    cfg = make_train_config(
        model=model,
        model_path=model_path,
        **split_fields(mode, depth, n_blocks),
        defences=defences or [{"name": "none"}],
        data=data,
        data_path=data_path,
        seed=seed,
        steps=steps,
        draws=draws,
        n_calib=n_calib,
        n_train=n_train,
        n_eval=n_eval,
        # the all-local run only where nothing else gives it (utility_baseline): without a defence the plain
        # split run reproduces it exactly, with one the undefended twin does
        all_local_baseline=(defended and not twin) or mode != "plain",
    )
    settings = {
        "config": cfg.as_dict(),
        "twin": bool(twin and defended),
        "certify": certify,
        "control_docs": control_docs,
        "connect": connect,
        "server_capture": None if server_capture is None else str(server_capture),
    }
    if clear:
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    if resume and prior is None:
        say(f"resume: {out} holds no audit yet; starting it")
    stages = AuditStages.begin(out, settings, prior)
    try:
        return _audit_stages(
            out, stages, lm, cfg, model, preset, depth, data, defended, seed, device, threads, progress, say, twin,
            connect, tls_dir, server_capture, certify, control_docs, mode,
        )  # fmt: skip
    except BaseException as exc:  # an error or an interrupt: the record says where it stopped (a kill, nothing)
        try:
            stages.stopped(stages.data.pop("current", "run"), exc)
        except OSError:  # a full disk: the record stays as the last finished stage left it
            pass
        raise


def _audit_stages(
    out, stages, lm, cfg, model, preset, depth, data, defended, seed, device, threads, progress, say, twin, connect,
    tls_dir, server_capture, certify, control_docs, mode,
) -> AuditResult:  # fmt: skip
    """``run_audit``'s stages, each skipped where ``stages`` records it finished (its files verified)."""
    deployed: dict[str, Any] = {"connect": connect, "tls_dir": tls_dir}
    # the model is loaded once: training, the all-local baseline, the twin and each attacker's copy start
    # from clones of the pristine weights (load_knowledge checks them against the run's fingerprint)
    pristine = lm.clone()
    if _stage_to_train(stages, out, "run", cfg, "the audit's run", say):
        run_training(
            cfg, out / "run", device=device, threads=threads, progress=progress, lm=lm, pristine=pristine.clone,
            **deployed,
        )  # fmt: skip
    ver = _finish_stage(stages, out, "run", cfg, "the audit's run")
    del lm  # the trained weights; the attacker holds its own copy
    # the metrics as the run recorded them (the same whether trained now or by the audit a kill stopped)
    run = RunResult(out / "run", read_run_json(out / "run", "metrics.json"), cfg)
    cap = capture_summary(out / "run")
    # the label-shielded readers fit on the pretrained Top as well (GMA-SL, 003 §3)
    knowledges = {
        "public": load_knowledge(out / "run", "public", lm=pristine.clone(), with_top=mode == "label-shielded")
    }
    traffic_dir, session = out / "run", None
    if server_capture is not None:  # attack what the server recorded, once it is shown to be what crossed
        session = find_session(server_capture, out / "run")
        sv = verify_run(session)
        if not sv.ok:
            raise SplitleakError(f"the server's capture {session} does not verify: {sv.message}")
        traffic_dir = session
        say(f"traffic: the server's capture {session} (the same frames as the client's record)")
    traffic = load_traffic(traffic_dir)
    adaptive = adaptive_attacks_of(cfg)
    th = shipped_thresholds()  # the audit runs on embedded defaults: the shipped gate_002's gate, α and utility gate
    results = []
    predictions: dict[str, Any] = {}
    controls: dict[str, Any] = {}
    planned = audit_attacks(traffic, certify, adaptive, mode)
    stems = [name if copy == "public" else f"{name}-{copy}" for name, _, copy in planned]
    stages.plan([{"stem": s, "attack": n, "params": p, "copy": c} for s, (n, p, c) in zip(stems, planned)])
    unplanned = sorted(
        p.name for p in (out / "attacks").glob("*") if not p.name.startswith(".") and p.stem not in stems
    ) if (out / "attacks").is_dir() else []  # fmt: skip
    if unplanned:
        raise SplitleakError(
            f"{out / 'attacks'} holds {', '.join(unplanned[:3])}, no attack of this audit; move it out, or {START_AGAIN}"
        )
    for stem, (name, params, copy) in zip(stems, planned):
        acfg = make_attack_config(attack=name, client_copy=copy, attack_seed=seed, params=params)
        path = out / "attacks" / f"{stem}.json"
        stages.data["current"] = f"attack {stem}"
        if stages.done(f"attack:{stem}"):
            res = _finished_attack(path, acfg, cfg.hash())
            say(f"resume: attack {stem} ({path.name} as recorded)")
        else:
            stages.clear_files(f"attacks/{stem}.json", f"attacks/{stem}.parquet")
            if copy not in knowledges:
                knowledges[copy] = load_knowledge(out / "run", copy, lm=pristine.clone())
            run_attack(
                traffic_dir,
                acfg,
                out=path,
                knowledge=knowledges[copy],
                traffic=traffic,
                progress=progress,
                documents=out / "run" if session is not None else None,
                control_docs=control_docs,
                protocol_hash=th.protocol_hash,  # `protocol analyse gate_002.yaml OUT/attacks` reads them
            )
            stages.finish(f"attack:{stem}", [f"attacks/{stem}.json", f"attacks/{stem}.parquet"])
            res = _finished_attack(path, acfg, cfg.hash())  # as written: the same whether run now or resumed
        predictions[attack_label(res)] = [row["predicted"] for row in res.pop("per_doc")]
        if "control" in res:
            controls[attack_label(res)] = res["control"]["per_doc_delta"]
        res["threat_model"] = copy
        if name in adaptive:
            res["built_for"] = list(adaptive[name])
        results.append(res)
    truth = eval_token_ids(out / "run", traffic.doc_ids)
    examples = example_documents(out / "run", traffic.doc_ids, results, predictions, knowledges["public"])
    base, arms = arm_effects(predictions, truth, controls=controls, n_boot=ARM_BOOT, alpha=th.alpha, seed=seed)
    weights = frame_weights(len(truth), ARM_BOOT, np.random.default_rng([seed, 0x9EC]))
    for res in results:
        res["intervals"] = recovery_intervals(predictions[attack_label(res)], truth, weights)
    probe_arms = [a for a in arms if not a.name.startswith("majority")]
    gate = arm_gate(probe_arms, base, th.alpha, th.gate)
    stages.data["current"] = "calibration"
    if stages.done("calibration"):
        say(f"resume: the calibration ({out / 'calibration' / 'calibration.json'} as recorded)")
    else:
        stages.clear_files("calibration")
        if "trained" not in knowledges:  # every attack on the trained copy was resumed: the membership frames need it
            knowledges["trained"] = load_knowledge(out / "run", "trained", lm=pristine.clone())
        calibrate(
            out / "run",
            CALIBRATION_ATTACK,
            gate=th.gate,
            out=out / "calibration",
            coverages=CALIBRATION_COVERAGES,
            n_docs=min(CALIBRATION_DOCS, len(traffic)),
            seed=seed,
            progress=progress,
            knowledge=knowledges["public"],
            traffic=traffic,
            trained=knowledges.get("trained"),
        )
        stages.finish("calibration", ["calibration/calibration.json"])
    cal = CalibrationResult(out / "calibration", read_calibration(out / "calibration"))  # as written
    for res in results:
        arm = next(a for a in arms if a.name == attack_label(res))
        res["arm"] = arm.as_dict()
    m = run.metrics
    cost = None
    if twin and defended:
        twin_cfg = cfg.model_copy(update={"defences": (DefenceConfig(name="none"),), "all_local_baseline": False})
        if _stage_to_train(stages, out, "twin", twin_cfg, "the audit's undefended twin", say):
            say("training the undefended twin (same model, split, data and seed) for the cost of the defence")
            run_training(
                twin_cfg, out / "twin", device=device, threads=threads, progress=progress, lm=pristine.clone(),
                **deployed,
            )  # fmt: skip
        _finish_stage(stages, out, "twin", twin_cfg, "the audit's undefended twin")
        tm = read_run_json(out / "twin", "metrics.json")
        measured = m["perplexity"] is not None and tm["perplexity"] is not None
        cost = {
            "twin_dir": "twin",
            "twin_config_hash": twin_cfg.hash(),
            "twin_heldout_ce": tm["heldout_ce"],
            "twin_perplexity": tm["perplexity"],
            "rel_ppl_change": m["perplexity"] / tm["perplexity"] - 1.0 if measured else None,
            "ce_change": m["heldout_ce"] - tm["heldout_ce"] if measured else None,
        }
    verdicts = {
        "constant_baseline": {"token_id": base.token_id, "rate": base.rate},
        "gate": {
            "G": gate.G,
            "breaks": gate.breaks,
            "alpha_bonf": gate.alpha_bonf,
            "gate": gate.gate,
            "arms": [a.name for a in probe_arms],
            **gate_record(th, [a.name for a in probe_arms]),
        },
        "calibration": {
            "attack": CALIBRATION_ATTACK,
            "onsets": cal.onsets,
            "documents": cal.record["documents"],
            "zero_dose": {k: cal.record["doses"][0][k] for k in cal.onsets},
        },
    }
    verdicts["utility_gate"] = audit_utility(
        utility_baseline(m, cost, defended=defended, exact_split=mode == "plain"), th, defended
    )
    channels = channel_table(out / "run", results, calibrated=CALIBRATED_CHANNELS)
    verdict_parts = [
        verdict_line(results, arms, probe_arms, gate, cal.record),
        verdicts["utility_gate"]["sentence"],
        server_sentence(channels, results, mode),
        readers_sentence(results),
        adaptive_sentence(results, cfg),
        channels_sentence(channels),
    ]
    verdict = " ".join(p for p in verdict_parts if p)
    baseline = utility_baseline(m, cost, defended=defended, exact_split=mode == "plain")
    utility_text = (
        f"held-out CE {m['heldout_ce']:.4f} ("
        + (
            f"all-local {baseline['all_local_ce']:.4f}, ΔU {baseline['delta_u']:+.4f}"
            if baseline["delta_u"] is not None
            else "ΔU not measured"
        )
        + f"; {baseline['source']})"
        if m["heldout_ce"] is not None
        else f"held-out CE not measured on the client ({m.get('heldout_measured', '')})"
    )
    summary = (
        f"{model}{' (preset)' if preset else ''}, depth {depth}, defence "
        f"{'+'.join(d['name'] for d in cfg.as_dict()['defences'])}, {data}: {utility_text}; captured "
        f"{cap['documents']} documents × {cap['tokens_per_document']} tokens × width {cap['width']}; run verified "
        f"({ver.message})."
    )
    if connect is not None:
        summary += f" Deployed over TLS against {connect}; the attacks read " + (
            f"the server's capture ({session.name})." if session is not None else "the client's record of the wire."
        )
    if cost is not None and cost["rel_ppl_change"] is not None:
        summary += (
            f" Cost of the defence: perplexity {m['perplexity']:.2f} against {cost['twin_perplexity']:.2f} "
            f"undefended ({100 * cost['rel_ppl_change']:+.2f} %)."
        )
    report = {
        "config": cfg.as_dict(),
        "config_hash": cfg.hash(),
        "metrics": m,
        "capture": cap,
        "verify": ver.message,
        "attacks": results,
        "verdict": verdict,
        "verdict_parts": [p for p in verdict_parts if p],
        "verdicts": verdicts,
        "summary": summary,
        "cost": cost,
        "utility_baseline": baseline,
        "channels": channels,
        "threat_models": {**THREAT_MODELS, "server": SERVER_THREAT},
        "mode": mode,
        "examples": examples,
        "channel_notes": list(run_declaration(out / "run").notes),
        "deployment": None
        if connect is None
        else {"server": connect, "traffic": str(traffic_dir), "recorded_by": "server" if session else "client"},
        "torch_threads": torch.get_num_threads(),
    }
    stages.data["current"] = "report"
    (out / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True, default=json_default) + "\n")
    stages.data.pop("current", None)
    stages.complete()
    return AuditResult(out, run, cap, summary, results, verdict, baseline)


def _finished_attack(path: Path, acfg, run_config_hash: str) -> dict[str, Any]:
    """An attack result the audit wrote (``path``: RESULT.json, its predictions beside it), read back and
    checked: its hashes (``read_result``), the predictions' digest, and that it is this attack on this run.
    The dictionary ``run_attack`` returned, with ``per_doc`` holding the predictions."""
    from splitleak.audit.analysis import read_result
    from splitleak.audit.predictions import read_predictions

    res = read_result(path)
    if res is None or res.get("config_hash") != acfg.hash() or res["run"].get("config_hash") != run_config_hash:
        raise SplitleakError(
            f"{path} is not the result of the audit's attack {acfg.attack} on its run (another attack or run wrote "
            f"it); {START_AGAIN}"
        )
    res["per_doc"] = read_predictions(path, res, ["doc_id", "predicted"])
    res.pop("predictions", None)
    res.pop("predictions_sha256", None)
    return res


def _stage_to_train(stages, out: Path, name: str, cfg, what: str, say) -> bool:
    """Whether the audit's run stage ``name`` (a run in ``out / name`` of ``cfg``) must be trained: not
    when ``stages`` records it finished (it is reused); else what an unfinished attempt left is cleared."""
    stages.data["current"] = name
    if stages.done(name):
        say(f"resume: {what} {out / name} (its journal as recorded)")
        return False
    stages.clear_run(name, cfg.hash())
    return True


def _finish_stage(stages, out: Path, name: str, cfg, what: str) -> VerifyResult:
    """The run stage ``name``, trained now or reused, must verify, complete, as a run of ``cfg``; then it is
    recorded finished. Returns its verification."""
    v = verify_run(out / name)
    if not v.ok or v.status != "complete":
        why = v.message if not v.ok else f"the run {v.status}"
        raise SplitleakError(
            f"{what} {out / name} does not verify: {why}" + ("" if not stages.done(name) else f"; {START_AGAIN}")
        )
    if read_run_json(out / name, "manifest.json").get("config_hash") != cfg.hash():
        raise SplitleakError(f"{out / name} is a run of another configuration than the audit's; {START_AGAIN}")
    if not stages.done(name):
        stages.finish(name, [f"{name}/journal.jsonl"])
    return v


def utility_baseline(
    m: dict[str, Any], cost: dict[str, Any] | None, defended: bool, exact_split: bool = True
) -> dict[str, Any]:
    """The all-local loss and ΔU = L_split − L_all-local, from whichever run gives them without training
    the whole model once more: with no defence the split run itself (it reproduces the all-local run
    exactly: same modules, same order, AdamW per parameter; tested), with a defence the undefended twin
    (the same identity), else the all-local baseline the run trained (``--no-twin``)."""
    if m.get("heldout_ce") is None:
        return {"all_local_ce": None, "delta_u": None, "source": "the client measured no held-out loss"}
    if not exact_split:  # a U-shape or label-shielded split: the audit trained the all-local run
        if m.get("all_local_ce") is not None:
            return {"all_local_ce": m["all_local_ce"], "delta_u": m["delta_u"], "source": "the all-local baseline run"}
        return {"all_local_ce": None, "delta_u": None, "source": "no all-local run"}
    if not defended:
        return {
            "all_local_ce": m["heldout_ce"],
            "delta_u": 0.0,
            "source": "no defence: the split run reproduces the all-local run exactly (tested), so it is not "
            "trained again",
        }
    if cost is not None and cost.get("twin_heldout_ce") is not None:
        return {
            "all_local_ce": cost["twin_heldout_ce"],
            "delta_u": m["heldout_ce"] - cost["twin_heldout_ce"],
            "source": "from the undefended twin, which reproduces the all-local run exactly (tested)",
        }
    if m.get("all_local_ce") is not None:
        return {"all_local_ce": m["all_local_ce"], "delta_u": m["delta_u"], "source": "the all-local baseline run"}
    return {"all_local_ce": None, "delta_u": None, "source": "no all-local run and no twin"}


def adaptive_sentence(results: list[dict[str, Any]], cfg) -> str:
    """Who reads the traffic knowing the defence (Kerckhoffs): the strongest attack built for the run's
    defences under each threat model, beside the strongest that ignores them; empty without a defence."""
    from splitleak.defences import build_defence

    chain = [d for d in cfg.defences if d.name != "none"]
    if not chain:
        return ""
    built = [r for r in results if r.get("built_for")]
    names = ", ".join(d.name for d in chain)
    if not built:
        return f"No attack built for {names} read this traffic: the verdict rests on attacks that ignore the defence."
    parts = []
    for copy in THREAT_MODELS:
        aware = worst_reader([r for r in built if r.get("threat_model", "public") == copy])
        blind = worst_reader([r for r in results if not r.get("built_for") and r.get("threat_model", "public") == copy])
        if aware is None:
            continue
        text = (
            f"{attack_label(aware)}{' on the public copy' if copy == 'public' else ''} reads {fmt_pct(aware['token_recovery'])} % of tokens and {fmt_pct(aware['doc_recovery'])} % of whole "
            "documents"
        )
        if blind is not None:
            more = (aware["doc_recovery"], aware["token_recovery"]) > (blind["doc_recovery"], blind["token_recovery"])
            text += (
                f", {'more than' if more else 'no more than'} the best attack that ignores the defence "
                f"({attack_label(blind)}: {fmt_pct(blind['token_recovery'])} %, {fmt_pct(blind['doc_recovery'])} %)"
            )
        found = (aware.get("attack_summary") or {}).get("key_found")
        if found:
            text += f"; it found the key of the client's draws (run seed {aware['attack_summary']['run_seed']})"
        parts.append(text)
    for r in built:
        summary = r.get("attack_summary") or {}
        if summary.get("applies") and not summary.get("key_found"):
            parts.append(
                f"{attack_label(r)} tried {summary['tried']} run seeds as the key of the forward noise and found none "
                f"(draws={summary.get('draws')})"
            )
    notes = sorted({build_defence(d.name, d.args).adaptive_note for d in chain} - {""})
    return (
        f"Attacks built for {names} (they know its mechanism and public arguments): "
        + "; ".join(parts)
        + "."
        + (f" Why they apply: {' '.join(notes)}." if notes else "")
    )


def server_sentence(channels: list[dict[str, Any]], results: list[dict[str, Any]], mode: str) -> str:
    """The third threat model: the untrusted server itself, which receives every channel that crosses. Where the
    labels cross (the plain split) it reads the whole text with no attack; elsewhere it reads what the
    observer reads, with the public copy of the client layers (it does not hold the client's)."""
    clear = [c for c in channels if c["channel"] in IN_CLEAR and c["captured"]]
    if clear:
        phases = sorted({p for c in clear for p in c["frames"]})
        return (
            "The untrusted server itself reads 100 % of tokens and 100 % of whole documents, with no attack: in the "
            f"{mode} split the labels of the next-token loss cross to it in clear (each document's token ids, in the "
            f"{' and '.join(phases)} frames), so the readers below bound only an observer of the activations and "
            "gradients, not the server. The splits that keep the labels on the client are the U-shape "
            "(`splitleak audit --mode u-shape`) and label-shielded fine-tuning (`--mode label-shielded`)."
        )
    worst = worst_reader([r for r in results if r.get("threat_model", "public") == "public"])
    if worst is None:
        return f"In the {mode} split the labels stay on the client; no reader of the server's channels ran."
    return (
        f"In the {mode} split the labels stay on the client: the untrusted server receives the channels the "
        f"observer reads, and with the public weights its worst reader is {attack_label(worst)} "
        f"({fmt_pct(worst['token_recovery'])} % of tokens, {fmt_pct(worst['doc_recovery'])} % of whole documents)."
    )


def channels_sentence(channels: list[dict[str, Any]]) -> str:
    """What the verdict does not cover: the channels no attack of the audit read, and those read
    without a positive control."""
    missed = not_attacked(channels)
    uncal = [c["channel"] for c in channels if c["status"] == "no positive control"]
    out = f"Channels not attacked: {', '.join(missed)}." if missed else "Every declared channel was attacked."
    if uncal:
        out += f" Attacked without a positive control: {', '.join(uncal)}."
    return out


def verdict_line(results: list[dict[str, Any]], arms, probe_arms, gate, calibration: dict[str, Any]) -> str:
    """The audit's verdict in the words of Politis & Pappas 2026, §3.

    A detection stands on its own (its mis-paired control guards against false positives); an
    "at floor" verdict needs the calibration to have detected an injected leak, or it is no
    evidence of absence and the verdict says UNCALIBRATED."""
    faults = [a.name for a in arms if a.control_verdict == "detected"]
    if faults:
        return (
            f"INSTRUMENT FAULT: the mis-paired negative control of {', '.join(faults)} reads above its floor: given "
            "the traffic of other documents, the attack still reads the documents it is labelled as, so it reaches "
            "the evaluation text by the documents' identity rather than through the traffic; no verdict."
        )
    measured = [a for a in arms if a.control is not None]
    controls = (
        "no mis-paired control detected"
        if len(measured) == len(arms)
        else f"mis-paired controls run for {len(measured)} of {len(arms)} arms, none detected"
        if measured
        else "no negative control run (--control-docs 0)"
    )
    onset = calibration["onsets"].get("token_top1")
    zero = calibration["doses"][0]["token_top1"]
    cal = (
        f"calibration: injected into {calibration['documents']} captured documents, a leak is detected from "
        f"coverage {onset['coverage']:g} × amplitude {onset['amplitude']:g}"
        if onset
        else f"calibration: no injected dose raised token top-1 above its zero-dose reading of {fmt_pct(zero)} %"
    )
    detected = [a for a in probe_arms if a.verdict == "detected"]
    if not detected and onset is None:
        return (
            "UNCALIBRATED: no attack arm reads above the constant baseline, but the token top-1 metric did not "
            "detect even the largest injected leak on this capture, so its silence is no evidence of absence; "
            f"no verdict ({cal})."
        )
    best = max(probe_arms, key=lambda a: a.effect.estimate)
    scored = [r for r in results if r["attack"] != "majority" and r.get("doc_recovery") is not None]
    best_doc = max(scored, key=lambda r: (r["doc_recovery"], r["token_recovery"]))
    gate_words = f"gate G = {100 * gate.G:+.2f} pp {'breaks the gate' if gate.breaks else 'holds the gate'} (+{100 * gate.gate:.2f} pp)"
    if detected:
        return (
            f"LEAKS: {len(detected)} of {len(probe_arms)} attack arms detected above the constant baseline; "
            f"best {best.name} recovers {fmt_pct(best.accuracy)} % of tokens (+{100 * best.effect.estimate:.2f} pp, "
            f"95 % interval [{100 * best.effect.low:+.2f}, {100 * best.effect.high:+.2f}]) and "
            f"{fmt_pct(best_doc['doc_recovery'])} % of whole documents ({attack_label(best_doc)}); {gate_words}; "
            f"{controls}; {cal}."
        )
    return (
        f"AT FLOOR: no attack arm reads above the constant baseline (best {best.name}, "
        f"{100 * best.effect.estimate:+.2f} pp, interval [{100 * best.effect.low:+.2f}, "
        f"{100 * best.effect.high:+.2f}]); {gate_words}; {controls}; {cal}, so a "
        "leak of that size would have been seen."
    )


def _reader_results(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The attacks that read text (token outputs, not controls), in the audit's order."""
    from splitleak.attacks.registry import attack_info

    return [r for r in results if r.get("token_recovery") is not None and not attack_info(r["attack"]).control]


def worst_reader(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The reader that recovers the most: most whole documents, then most tokens."""
    readers = _reader_results(results)
    return max(readers, key=lambda r: (r["doc_recovery"], r["token_recovery"])) if readers else None


def readers_sentence(results: list[dict[str, Any]]) -> str:
    """The worst-case reader under each threat model, the worst of all, and the exact-inversion
    certificate (SipIt without a budget on the trained copy)."""
    parts = []
    for copy, who in THREAT_MODELS.items():
        best = worst_reader([r for r in results if r.get("threat_model", "public") == copy])
        if best is not None:
            parts.append(
                f"{who} ({attack_label(best)}) reads {fmt_pct(best['token_recovery'])} % of tokens and "
                f"{fmt_pct(best['doc_recovery'])} % of whole documents"
            )
    if not parts:
        return ""
    worst = worst_reader(results)
    assert worst is not None
    out = "Worst-case reader: " + "; ".join(parts) + f"; the worst is {attack_label(worst)}."
    checks = [
        r
        for r in results
        if r["attack"] in ("sipit", "sipit-aware")
        and r.get("threat_model") == "trained"
        and r.get("certified_tokens") is not None
    ]
    # under a defence the check that knows it (rounding, clip and noise model) certifies what it can
    cert = max(checks, key=lambda r: r["certified_tokens"]) if checks else None
    if cert is not None:
        budget = cert.get("attack_params", {}).get("budget")
        bound = "the whole vocabulary if needed" if budget == "exhaustive" else f"up to {budget} checks per position"
        how = "SipIt through the trained layers" + (", knowing the defence" if cert["attack"] == "sipit-aware" else "")
        out += (
            f" Exact-inversion check ({how}, {bound}): "
            f"{fmt_pct(cert['certified_tokens'])} % of positions matched an observed activation exactly "
            f"({cert['mean_checks_per_token']:.1f} checks per position on average)"
            + (
                ": the cut is injective on these documents, and the traffic is the text."
                if cert["certified_tokens"] == 1.0
                else "; the others were read as the nearest checked candidate (a defence, a copy that differs from "
                "the weights that produced the traffic"
                + ("" if budget == "exhaustive" else ", or a true token the order ranks beyond the bound")
                + ")."
            )
        )
    return out


def example_documents(
    run_dir: Path,
    doc_ids,
    results: list[dict[str, Any]],
    predictions: dict[str, list[list[int]]],
    knowledge,
    n: int = EXAMPLE_DOCS,
) -> dict[str, Any]:
    """A few evaluation documents token by token: the true text, its annotated spans, and each
    reader's reconstruction with its wrong tokens. The documents shown are those whose token accuracy
    lies closest to each reader's mean (the mean over readers of |document accuracy − mean accuracy|),
    so that they are typical, not picked for show."""
    from splitleak.runs.truth import phase_documents

    readers = _reader_results(results)
    tok = knowledge.client.tokenizer
    if not readers or tok is None:
        return {"documents": [], "how": "no reader of text ran" if not readers else "no tokenizer"}
    by_id = {d.doc_id: d for d in phase_documents(run_dir, "capture")}
    docs = [by_id[int(i)] for i in doc_ids]
    truth = [list(d.token_ids) for d in docs]
    acc = {}
    for r in readers:
        pred = predictions[attack_label(r)]
        acc[attack_label(r)] = [sum(a == b for a, b in zip(pr, tr)) / len(tr) for pr, tr in zip(pred, truth)]
    means = {k: sum(v) / len(v) for k, v in acc.items()}
    spread = [sum(abs(acc[k][i] - means[k]) for k in acc) / len(acc) for i in range(len(docs))]
    chosen = sorted(range(len(docs)), key=lambda i: (spread[i], docs[i].doc_id))[:n]

    def text(ids):
        return [tok.decode([int(t)]) for t in ids]

    shown = []
    for i in chosen:
        d = docs[i]
        spans: list[str | None] = [None] * len(truth[i])
        for s in d.spans:
            for t in range(s.token_start, s.token_end):
                spans[t] = s.label
        readings = []
        for r in readers:
            label = attack_label(r)
            row = predictions[label][i]
            readings.append(
                {
                    "attack": label,
                    "threat_model": r.get("threat_model", "public"),
                    "tokens": text(row),
                    "wrong": [a != b for a, b in zip(row, truth[i])],
                    "accuracy": acc[label][i],
                }
            )
        shown.append({"doc_id": d.doc_id, "tokens": text(truth[i]), "spans": spans, "readings": readings})
    return {
        "documents": shown,
        "how": f"the {len(shown)} of {len(docs)} evaluation documents whose token accuracy lies closest to each "
        "reader's mean (mean over readers of |document accuracy − mean accuracy|)",
        "mean_accuracy": means,
    }
