"""`splitleak audit`: train and capture on embedded defaults, attack the captured traffic under both
threat models (the public copy of the client layers and the client's trained layers, with the
exact-inversion check on the latter), report.

Layout of the output folder: ``run/`` is the verifiable run directory (see ``splitleak.runs``),
``attacks/`` one RESULT.json + Parquet per attack, ``calibration/`` the injected-leak dose ladder
(``splitleak.audit.calibrate``), ``report.json`` the summary; ``splitleak.report.audit`` renders it as
``report.md`` and ``report.html``.

The audit runs in stages (``splitleak.audit.stages``): the run, the attacks of ``splitleak.audit.plan``,
the scoring of each attack arm's token top-1 accuracy as a paired effect over the constant baseline
(``splitleak.audit.verdicts``), the injected-leak calibration that token top-1 must pass before its
silence may read "at floor", the undefended twin, and the report. What it measured is turned into
words by the ``words`` it is given (``splitleak.report.audit_prose.audit_words``, which the CLI passes),
so that the measuring stage never imports the report stage.
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
from splitleak.audit.bounds import audit_bound
from splitleak.audit.calibrate import CalibrationResult, calibrate, read_calibration
from splitleak.audit.channels import channel_table, run_declaration
from splitleak.audit.defaults import AUDIT_EPOCHS, AUDIT_N_EVAL, AUDIT_N_TRAIN
from splitleak.audit.evaluate import attack_label, run_attack
from splitleak.audit.examples import example_documents
from splitleak.audit.gate import GateThresholds, audit_utility, gate_record, shipped_thresholds
from splitleak.audit.passes import whole_traffic_stage
from splitleak.audit.plan import AUDIT_MODES, CERTIFY_CHECKS, DEFAULT_DEPTH, audit_attacks, check_certify, split_fields
from splitleak.audit.stages import START_AGAIN, AuditStages, finished_attack
from splitleak.audit.utility import split_baseline, utility_baseline
from splitleak.audit.verdicts import CONTROL_DOCS, arm_effects, arm_gate, recovery_intervals
from splitleak.data import N_CALIB
from splitleak.errors import ConfigError, SplitleakError
from splitleak.files import json_default
from splitleak.models import PRESETS, load_model
from splitleak.progress import Progress
from splitleak.runs.captures import load_capture
from splitleak.runs.journal import read_run_json
from splitleak.runs.manifest import find_session
from splitleak.runs.store import is_run_dir, refuse_clobber
from splitleak.runs.truth import eval_token_ids
from splitleak.runs.verify import VerifyResult, verify_run
from splitleak.seeds import model_init_seed
from splitleak.stats import frame_weights
from splitleak.training import DefenceConfig, RunResult, make_train_config, run_training
from splitleak.training.config import TrainConfig, adaptive_attacks_of

#: the calibration the audit runs before it may give a verdict on token top-1
CALIBRATION_ATTACK = "vmi"
CALIBRATION_COVERAGES = (0.02, 0.06, 0.10, 0.30, 1.0)
CALIBRATION_DOCS = 64
#: bootstrap replicates of the per-arm intervals
ARM_BOOT = 10_000
#: the channels the audit's injected-leak calibration doses (its positive control)
CALIBRATED_CHANNELS = ("activations",)


@dataclass
class AuditResult:
    out: Path
    run: RunResult
    capture: dict[str, Any]
    summary: str
    attacks: list[dict[str, Any]]
    verdict: str
    utility_baseline: dict[str, Any] | None = None  # the all-local loss and ΔU, and where they come from


@dataclass(frozen=True)
class AuditSetting:
    """What the audit's words (``Words``) read beyond its report record: the settings as they were asked for."""

    model: str
    preset: bool  # the model is a preset of ``splitleak.models``
    depth: int
    data: str
    cfg: TrainConfig  # the run's configuration (its defences, for the attacks built for them)


#: the audit's words: its report record and setting -> ``verdict_parts``, ``summary`` and ``threat_models``
#: (``splitleak.report.audit_prose.audit_words``)
Words = Callable[[dict[str, Any], AuditSetting], dict[str, Any]]


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
    {"run", "twin", "attacks", "passes", "calibration", "report.json", "report.md", "report.html", "stages.json"}
)


def check_audit_out(
    out: Path, force: bool, resume: bool = False, entries: frozenset[str] = AUDIT_ENTRIES, what: str = "an audit folder"
) -> bool:
    """Refuse an ``--out`` that the audit must not write into (one line): one that exists and is not
    empty without ``force`` or ``resume``; with either, a link (whatever it leads to) or a folder that is
    not an audit folder splitleak wrote (its run, or only what an audit writes). True when ``out`` is to
    be deleted (``force``); ``resume`` keeps it, for ``AuditStages.prior`` to check what it holds."""
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
    ours = out.is_dir() and names <= entries and (not (out / "run").exists() or is_run_dir(out / "run"))
    if ours and resume and what == "an audit folder" and _latent_report(out):
        raise SplitleakError(f"{out} holds a latent audit; continue it with `splitleak audit --mode latent --resume`")
    if not ours:
        raise SplitleakError(
            f"{out} is not {what} (it holds {', '.join(sorted(names - entries)[:3]) or 'a run that splitleak did not write'}, "
            f"which an audit never writes), and {'--force deletes' if force else '--resume continues'} only what "
            "splitleak wrote; choose another --out"
        )
    return force


def _latent_report(out: Path) -> bool:
    """Whether ``out`` holds a latent audit's record (``splitleak.audit.latent_audit``)."""
    try:
        return json.loads((out / "report.json").read_text()).get("mode") == "latent"
    except (OSError, ValueError, AttributeError):
        return False


def run_audit(
    out: str | Path,
    *,
    model: str,
    words: Words,
    model_path: str | None = None,
    depth: int | None = None,
    defences: list[dict[str, Any]] | None = None,
    data: str = "synthetic-pii",
    data_path: str | None = None,
    seed: int = 0,
    steps: int | None = None,
    epochs: int | None = None,
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
    """Train and capture, verify, attack with ``AUDIT_ATTACKS`` (``splitleak.audit.plan``), calibrate, and
    write the report, its sentences written by ``words`` (``splitleak.report.audit_prose.audit_words``).

    ``control_docs``: documents of each arm's mis-paired negative control (``splitleak.audit.verdicts``;
    0 runs none, and the verdict then says the controls were not run).

    ``epochs``: passes over the ``n_train`` training documents (default ``AUDIT_EPOCHS``), or ``steps`` (not
    both). Under a noise defence the training traffic of every pass is read too (``splitleak.audit.passes``).

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
    check_options(certify, mode, control_docs, server_capture, connect)  # before anything is trained or written
    steps = audit_steps(steps, epochs, n_train)
    lm = load_model(model, seed=model_init_seed(seed), model_path=model_path)
    depth = _audit_depth(depth, lm.info["n_blocks"], model, say)
    defended = any(d["name"] != "none" for d in defences or [])
    cfg = make_train_config(
        model=model, model_path=model_path, **split_fields(mode, depth, lm.info["n_blocks"]),
        defences=defences or [{"name": "none"}], data=data, data_path=data_path, seed=seed, steps=steps, draws=draws,
        n_calib=n_calib, n_train=n_train, n_eval=n_eval,
        # the all-local run only where nothing else gives it (utility_baseline): without a defence the plain
        # and label-shielded split runs reproduce it (SPLIT_BASELINE), with one the undefended twin does
        all_local_baseline=(defended and not twin) or split_baseline(mode) == "other",
    )  # fmt: skip
    settings = {
        "config": cfg.as_dict(), "twin": bool(twin and defended), "certify": certify, "control_docs": control_docs,
        "connect": connect, "server_capture": None if server_capture is None else str(server_capture),
    }  # fmt: skip
    if clear:
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    if resume and prior is None:
        say(f"resume: {out} holds no audit yet; starting it")
    stages = AuditStages.begin(out, settings, prior)
    setting = AuditSetting(model, bool(PRESETS.get(model)), depth, data, cfg)
    audit = _Audit(
        out, stages, setting, words, defended, seed, device, threads, progress, say, twin and defended,
        {"connect": connect, "tls_dir": tls_dir}, server_capture, certify, control_docs, mode,
    )  # fmt: skip
    try:
        return _audit_stages(audit, lm)
    except BaseException as exc:  # an error or an interrupt: the record says where it stopped (a kill, nothing)
        try:
            stages.stopped(stages.data.pop("current", "run"), exc)
        except OSError:  # a full disk: the record stays as the last finished stage left it
            pass
        raise


def check_options(
    certify: int | str, mode: str, control_docs: int, server_capture: str | Path | None, connect: str | None
) -> None:
    """Refuse, in one line and before anything is trained or written, options the audit cannot run with."""
    check_certify(certify)
    if mode == "latent":
        raise ConfigError(
            "the latent audit is splitleak.audit.latent_audit.run_latent_audit (`splitleak audit --mode latent`)"
        )
    if mode not in AUDIT_MODES:
        raise ConfigError(f"unknown --mode {mode!r}; the audit runs in {', '.join(AUDIT_MODES)} (and latent)")
    if control_docs and control_docs < 2:
        raise ConfigError(f"--control-docs takes 0 (no controls) or at least 2 documents, got {control_docs}")
    if server_capture is not None and connect is None:
        raise ConfigError("--server-capture is the capture folder of the server that --connect names; pass both")


def audit_steps(steps: int | None, epochs: int | None, n_train: int) -> int:
    """The audit's training steps: ``steps``, or ``epochs`` passes (default ``AUDIT_EPOCHS``) over the documents."""
    if steps is not None and epochs is not None:
        raise ConfigError("--steps and --epochs both set the training steps; pass one")
    if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1):
        raise ConfigError(f"--epochs takes a number of passes over the training documents (>= 1), got {epochs!r}")
    return steps if steps is not None else n_train * (epochs or AUDIT_EPOCHS)


def _audit_depth(depth: int | None, n_blocks: int, model: str, say: Callable[[str], None]) -> int:
    """The cut: ``depth`` as asked, else ``DEFAULT_DEPTH`` where the model has more blocks, else half of them."""
    if depth is not None:
        return depth
    depth = min(DEFAULT_DEPTH, n_blocks // 2) if n_blocks <= DEFAULT_DEPTH else DEFAULT_DEPTH
    if depth != DEFAULT_DEPTH:
        say(f"depth: {depth} ({model} has only {n_blocks} blocks; the default depth {DEFAULT_DEPTH} does not fit)")
    return depth


@dataclass
class _Audit:
    """One audit's settings and what its stages share, as ``run_audit`` resolved them."""

    out: Path
    stages: AuditStages
    setting: AuditSetting
    words: Words
    defended: bool
    seed: int
    device: str
    threads: int | None
    progress: Progress | None
    say: Callable[[str], None]
    twin: bool  # train the undefended twin (a defence, and twin asked for)
    deployed: dict[str, Any]  # connect and tls_dir, for run_training
    server_capture: str | Path | None
    certify: int | str
    control_docs: int
    mode: str
    # the model is loaded once: training, the twin and each attacker's copy start from clones of the
    # pristine weights (load_knowledge checks them against the run's fingerprint)
    pristine: Any = None

    @property
    def cfg(self) -> TrainConfig:
        return self.setting.cfg


@dataclass
class _Traffic:
    """What the attacks read: the traffic, the folder it came from, and the server's session (or None)."""

    traffic: Any
    folder: Path
    session: Path | None


def _audit_stages(a: _Audit, lm) -> AuditResult:
    """``run_audit``'s stages, each skipped where ``a.stages`` records it finished (its files verified)."""
    out, a.pristine = a.out, lm.clone()
    if _stage_to_train(a.stages, out, "run", a.cfg, "the audit's run", a.say):
        run_training(
            a.cfg, out / "run", device=a.device, threads=a.threads, progress=a.progress, lm=lm,
            pristine=a.pristine.clone, **a.deployed,
        )  # fmt: skip
    ver = _finish_stage(a.stages, out, "run", a.cfg, "the audit's run")
    del lm  # the trained weights; the attacker holds its own copy
    # the metrics as the run recorded them (the same whether trained now or by the audit a kill stopped)
    run = RunResult(out / "run", read_run_json(out / "run", "metrics.json"), a.cfg)
    cap = capture_summary(out / "run")
    # the label-shielded readers fit on the pretrained Top as well (GMA-SL, 003 §3)
    knowledges = {
        "public": load_knowledge(out / "run", "public", lm=a.pristine.clone(), with_top=a.mode == "label-shielded")
    }
    seen = _traffic(a)
    th = shipped_thresholds()  # the audit runs on embedded defaults: the shipped gate_002's gate, α and utility gate
    results, predictions, controls = _attack_stages(a, knowledges, seen, th)
    whole = whole_traffic_stage(a, knowledges["public"], seen, adaptive_attacks_of(a.cfg))  # every pass, at once
    truth = eval_token_ids(out / "run", seen.traffic.doc_ids)
    bound = audit_bound(
        seen.folder, a.cfg.defences, a.mode, a.cfg.draws, seen.traffic.doc_ids, truth, a.pristine.model
    )  # the upper side: what no reader of this traffic can read
    examples = example_documents(out / "run", seen.traffic.doc_ids, results, predictions, knowledges["public"])
    base, arms = arm_effects(predictions, truth, controls=controls, n_boot=ARM_BOOT, alpha=th.alpha, seed=a.seed)
    weights = frame_weights(len(truth), ARM_BOOT, np.random.default_rng([a.seed, 0x9EC]))
    for res in results:
        res["intervals"] = recovery_intervals(predictions[attack_label(res)], truth, weights)
    probe_arms = [arm for arm in arms if not arm.name.startswith("majority")]
    gate = arm_gate(probe_arms, base, th.alpha, th.gate)
    cal = _calibration_stage(a, knowledges, seen.traffic, th)
    for res in results:
        res["arm"] = next(arm for arm in arms if arm.name == attack_label(res)).as_dict()
    cost = _twin_stage(a, run.metrics) if a.twin else None
    baseline = utility_baseline(run.metrics, cost, defended=a.defended, split=split_baseline(a.mode))
    verdicts = {
        "constant_baseline": {"token_id": base.token_id, "rate": base.rate},
        "gate": {
            "G": gate.G,
            "breaks": gate.breaks,
            "alpha_bonf": gate.alpha_bonf,
            "gate": gate.gate,
            "arms": [arm.name for arm in probe_arms],
            **gate_record(th, [arm.name for arm in probe_arms]),
        },
        "calibration": {
            "attack": CALIBRATION_ATTACK,
            "onsets": cal.onsets,
            "documents": cal.record["documents"],
            "zero_dose": {k: cal.record["doses"][0][k] for k in cal.onsets},
        },
        "utility_gate": audit_utility(baseline, th, a.defended),
    }
    report: dict[str, Any] = {
        "config": a.cfg.as_dict(),
        "config_hash": a.cfg.hash(),
        "metrics": run.metrics,
        "capture": cap,
        "verify": ver.message,
        "attacks": results,
        "verdicts": verdicts,
        "bound": bound,
        "whole_traffic": whole,
        "cost": cost,
        "utility_baseline": baseline,
        "channels": channel_table(out / "run", results, calibrated=CALIBRATED_CHANNELS),
        "mode": a.mode,
        "examples": examples,
        "channel_notes": list(run_declaration(out / "run").notes),
        "deployment": None
        if a.deployed["connect"] is None
        else {
            "server": a.deployed["connect"],
            "traffic": str(seen.folder),
            "recorded_by": "server" if seen.session else "client",
        },
        "torch_threads": torch.get_num_threads(),
    }
    _write_report(a, report)
    return AuditResult(out, run, cap, report["summary"], results, report["verdict"], baseline)


def _write_report(a: _Audit, report: dict[str, Any]) -> None:
    """Add the audit's words to its record (``verdict``, ``verdict_parts``, ``summary``, ``threat_models``),
    write it as ``report.json`` and record the audit complete."""
    said = a.words(report, a.setting)
    report.update(
        verdict=" ".join(said["verdict_parts"]),
        verdict_parts=said["verdict_parts"],
        summary=said["summary"],
        threat_models=said["threat_models"],
    )
    a.stages.data["current"] = "report"
    (a.out / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True, default=json_default) + "\n")
    a.stages.data.pop("current", None)
    a.stages.complete()


def _traffic(a: _Audit) -> _Traffic:
    """The traffic the attacks read: the client's record, or the server's capture (``server_capture``) once
    it is shown to be what crossed."""
    folder, session = a.out / "run", None
    if a.server_capture is not None:
        session = find_session(a.server_capture, a.out / "run")
        sv = verify_run(session)
        if not sv.ok:
            raise SplitleakError(f"the server's capture {session} does not verify: {sv.message}")
        folder = session
        a.say(f"traffic: the server's capture {session} (the same frames as the client's record)")
    return _Traffic(load_traffic(folder), folder, session)


def _attack_stages(
    a: _Audit, knowledges: dict[str, Any], seen: _Traffic, th: GateThresholds
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """One stage per planned attack (run now, or its result read back where a stopped audit finished it):
    each result with its threat model and the defences it is built for, and per attack label its
    predictions and its mis-paired control's per-document differences."""
    adaptive = adaptive_attacks_of(a.cfg)
    planned = audit_attacks(seen.traffic, a.certify, adaptive, a.mode)
    stems = [name if copy == "public" else f"{name}-{copy}" for name, _, copy in planned]
    a.stages.plan([{"stem": s, "attack": n, "params": p, "copy": c} for s, (n, p, c) in zip(stems, planned)])
    attacks = a.out / "attacks"
    unplanned = sorted(
        p.name for p in attacks.glob("*") if not p.name.startswith(".") and p.stem not in stems
    ) if attacks.is_dir() else []  # fmt: skip
    if unplanned:
        raise SplitleakError(
            f"{attacks} holds {', '.join(unplanned[:3])}, no attack of this audit; move it out, or {START_AGAIN}"
        )
    results, predictions, controls = [], {}, {}
    for stem, (name, params, copy) in zip(stems, planned):
        res = _attack_stage(
            a,
            stem,
            make_attack_config(attack=name, client_copy=copy, attack_seed=a.seed, params=params),
            knowledges,
            seen,
            th,
        )
        predictions[attack_label(res)] = [row["predicted"] for row in res.pop("per_doc")]
        if "control" in res:
            controls[attack_label(res)] = res["control"]["per_doc_delta"]
        res["threat_model"] = copy
        if name in adaptive:
            res["built_for"] = list(adaptive[name])
        results.append(res)
    return results, predictions, controls


def _attack_stage(
    a: _Audit, stem: str, acfg, knowledges: dict[str, Any], seen: _Traffic, th: GateThresholds
) -> dict[str, Any]:
    """The attack of stage ``stem``: run and written to ``attacks/STEM.json``, or reused where it finished;
    returned as written (the same whether run now or resumed)."""
    path = a.out / "attacks" / f"{stem}.json"
    a.stages.data["current"] = f"attack {stem}"
    if a.stages.done(f"attack:{stem}"):
        res = finished_attack(path, acfg, a.cfg.hash())
        a.say(f"resume: attack {stem} ({path.name} as recorded)")
        return res
    a.stages.clear_files(f"attacks/{stem}.json", f"attacks/{stem}.parquet")
    copy = acfg.client_copy
    if copy not in knowledges:
        knowledges[copy] = load_knowledge(a.out / "run", copy, lm=a.pristine.clone())
    run_attack(
        seen.folder,
        acfg,
        out=path,
        knowledge=knowledges[copy],
        traffic=seen.traffic,
        progress=a.progress,
        documents=a.out / "run" if seen.session is not None else None,
        control_docs=a.control_docs,
        protocol_hash=th.protocol_hash,  # `protocol analyse gate_002.yaml OUT/attacks` reads them
    )
    a.stages.finish(f"attack:{stem}", [f"attacks/{stem}.json", f"attacks/{stem}.parquet"])
    return finished_attack(path, acfg, a.cfg.hash())


def _calibration_stage(a: _Audit, knowledges: dict[str, Any], traffic, th: GateThresholds) -> CalibrationResult:
    """The injected-leak dose ladder on the capture (``splitleak.audit.calibrate``), run or reused; read back
    as written."""
    out = a.out
    a.stages.data["current"] = "calibration"
    if a.stages.done("calibration"):
        a.say(f"resume: the calibration ({out / 'calibration' / 'calibration.json'} as recorded)")
    else:
        a.stages.clear_files("calibration")
        if "trained" not in knowledges:  # every attack on the trained copy was resumed: the membership frames need it
            knowledges["trained"] = load_knowledge(out / "run", "trained", lm=a.pristine.clone())
        calibrate(
            out / "run",
            CALIBRATION_ATTACK,
            gate=th.gate,
            out=out / "calibration",
            coverages=CALIBRATION_COVERAGES,
            n_docs=min(CALIBRATION_DOCS, len(traffic)),
            seed=a.seed,
            progress=a.progress,
            knowledge=knowledges["public"],
            traffic=traffic,
            trained=knowledges.get("trained"),
        )
        a.stages.finish("calibration", ["calibration/calibration.json"])
    return CalibrationResult(out / "calibration", read_calibration(out / "calibration"))


def _twin_stage(a: _Audit, m: dict[str, Any]) -> dict[str, Any]:
    """The undefended twin (same model, split, data and seed), trained or reused, and the cost of the
    defence against it."""
    out = a.out
    twin_cfg = a.cfg.model_copy(update={"defences": (DefenceConfig(name="none"),), "all_local_baseline": False})
    if _stage_to_train(a.stages, out, "twin", twin_cfg, "the audit's undefended twin", a.say):
        a.say("training the undefended twin (same model, split, data and seed) for the cost of the defence")
        run_training(
            twin_cfg, out / "twin", device=a.device, threads=a.threads, progress=a.progress, lm=a.pristine.clone(),
            **a.deployed,
        )  # fmt: skip
    _finish_stage(a.stages, out, "twin", twin_cfg, "the audit's undefended twin")
    tm = read_run_json(out / "twin", "metrics.json")
    measured = m["perplexity"] is not None and tm["perplexity"] is not None
    return {
        "twin_dir": "twin",
        "twin_config_hash": twin_cfg.hash(),
        "twin_heldout_ce": tm["heldout_ce"],
        "twin_perplexity": tm["perplexity"],
        "rel_ppl_change": m["perplexity"] / tm["perplexity"] - 1.0 if measured else None,
        "ce_change": m["heldout_ce"] - tm["heldout_ce"] if measured else None,
    }


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
