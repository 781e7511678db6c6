"""The latent mode's attacks run and scored: partition attacks with their mis-paired twins, and the probe
battery with its shuffled-label twin (Politis & Pappas 2026, §3-§5). The scorer here is the only holder
of the client's record of real rows and tokens; the attacks get the traffic, the run's public latent
arguments and, where they learn, frames of their own (``splitleak.attacks.shadow``)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.torch import load_file

from splitleak.attacks.config import AttackConfig
from splitleak.attacks.core import make_attack
from splitleak.attacks.dose import DOSE_NOTE, DoseLadder
from splitleak.attacks.partition import (
    LatentFrame,
    LatentPartition,
    LatentTraffic,
    PartitionAttack,
    load_latent_traffic,
    public_latent,
)
from splitleak.attacks.probes import ProbeBattery
from splitleak.attacks.shadow import make_shadow, shadow_plan
from splitleak.audit.defaults import CONTROL_BOOT
from splitleak.audit.dose_latent import dose_ladder
from splitleak.audit.gate import TWIN_PREFIX, latent_verdict, shipped_thresholds
from splitleak.audit.result_files import write_result
from splitleak.audit.verdicts import control_interval, mispairing
from splitleak.errors import ConfigError
from splitleak.metrics.partition import agreement, score_partition
from splitleak.runs.manifest import read_calibration
from splitleak.runs.truth import load_row_tokens, load_truth
from splitleak.stats import effect_verdict
from splitleak.stats.paired import battery_verdict, score_arms
from splitleak.training.latent import CODEC_FILE


def _latent_result(
    config: AttackConfig,
    attack,
    run_dir: Path,
    manifest: dict[str, Any],
    frames: int,
    seconds: float,
    protocol_hash: str | None,
):
    """The head of a latent-mode attack's RESULT.json (it recovers no text: the token fields are None)."""
    return {
        "protocol_hash": protocol_hash,
        "attack": config.attack,
        "config": config.model_dump(mode="json"),
        "config_hash": config.hash(),
        "attack_params": attack.params(),
        "run": {"dir": str(run_dir), "config_hash": manifest["config_hash"], "config": manifest["config"]},
        "phase": config.phase,
        "channels_read": list(attack.channels_read()),
        "n_frames": frames,
        "seconds": seconds,
        "token_recovery": None,
        "doc_recovery": None,
        "span_recovery": None,
    }


def _written(result: dict[str, Any], per_frame: list, out_path: Path | None, force: bool) -> dict[str, Any]:
    """``result`` written with its per-frame rows where ``out_path`` is given, and returned with them."""
    if out_path is not None:
        write_result(out_path, result, per_frame, force=force)
    result["per_doc"] = per_frame
    return result


def run_partition_attack(
    run_dir: Path,
    doc_dir: Path,
    manifest: dict[str, Any],
    config: AttackConfig,
    out_path: Path | None,
    protocol_hash: str | None = None,
    force: bool = False,
    control_docs: int = 0,
) -> dict[str, Any]:
    """A partition attack on a latent run's frames of ``config.phase``, scored against the client's
    record of real rows, with its mis-paired negative control. The attack is given only what its threat
    model grants: the training-phase frames where it reads what the server saw before, the run's public
    latent arguments, and, where it learns from labelled frames, shadow frames it makes itself from the
    public mechanism and its own (calibration) documents. The client's record reaches the scorer only."""
    attack = make_attack(config.attack, **config.attack_params())
    if not isinstance(attack, LatentPartition):
        raise ConfigError(
            f"attack {config.attack!r} is registered as a partition attack but is not a LatentPartition "
            "(splitleak.attacks.partition); derive it from that class"
        )
    public = (manifest["config"] or {}).get("latent")
    traffic = load_latent_traffic(run_dir, config.phase)
    t0 = time.perf_counter()
    history = shadow = None
    if attack.reads_history() or attack.needs_shadow():
        history = traffic if config.phase == "train" else load_latent_traffic(run_dir, "train")
    if attack.needs_shadow():  # the attacker's own frames: as many training steps as the server saw
        assert history is not None
        plan = shadow_plan(manifest, read_calibration(doc_dir), steps=len(history))
        shadow = make_shadow(plan, seed=config.attack_seed)
    attack.fit(history, public=public, shadow=shadow)
    parts = attack.partition(traffic)
    seconds = time.perf_counter() - t0
    truth = load_truth(doc_dir)  # the scorer's, read after the attack has read what it may
    scored = score_partition([f.frame_id for f in traffic.frames], truth, parts)
    result = _latent_result(config, attack, run_dir, manifest, len(traffic), seconds, protocol_hash) | {
        "partition": scored
    }
    if shadow is not None:
        result["shadow"] = {
            "documents": len(plan.documents), "train_frames": len(shadow.train), "capture_frames": len(shadow.capture),
            "steps": plan.steps,
        }  # fmt: skip
    if attack.report():  # what the attack found on the traffic alone (gauge-key-search: the seed)
        result["attack_summary"] = attack.report()
    if control_docs:  # at least 2 (``mispairing`` refuses fewer)
        result["control"] = partition_control(attack, traffic, parts, truth, control_docs, config.attack_seed)
    per_frame = [
        {"frame_id": f.frame_id, "rows": len(pred), "exact": bool((pred == truth[f.frame_id]).all()),
         "agreement": agreement(pred, truth[f.frame_id]), "predicted": [int(v) for v in pred]}
        for f, (_, pred) in zip(traffic.frames, parts)
    ]  # fmt: skip
    return _written(result, per_frame, out_path, force)


PARTITION_CONTROL = (
    "mis-paired twin: the same fitted attack run on frames whose wires are another frame's (a seeded derangement "
    "among frames of one size), each under the header of the frame it is labelled as; its row agreement with "
    "that frame's record, minus the arm's own reading of the same wires scored against the same record"
)


def partition_control(
    attack: LatentPartition,
    traffic: LatentTraffic,
    parts: list[tuple[np.ndarray, np.ndarray]],
    truth: dict[int, np.ndarray],
    control_docs: int,
    seed: int,
) -> dict[str, Any] | None:
    """The partition attack's mis-paired negative control (``splitleak.audit.verdicts`` for the token
    attacks'): frame ``given[j]``'s four wires are presented as frame ``rows[j]`` (its id and step), and the
    twin's partition is scored against ``rows[j]``'s record, minus the arm's partition of frame ``given[j]``
    scored against the same record. A reader of the wires reads the same rows either way (N = 0 for one that
    reads each frame on its own); one that reaches the client's record by a frame's identity reads the frame
    it is labelled as, and N is detected: an instrument fault. None where fewer than two frames share a size."""
    sizes: dict[int, list[int]] = {}
    for i, f in enumerate(traffic.frames):
        sizes.setdefault(len(f.x), []).append(i)
    units = max(sizes.values(), key=len)
    if len(units) < 2:
        return None
    order, given = mispairing(len(units), None, max(2, min(control_docs, len(units))), seed)
    rows_i, given_i = [units[j] for j in order], [units[j] for j in given]
    frames = traffic.frames
    twin = LatentTraffic(
        traffic.phase,
        [
            LatentFrame(frames[r].frame_id, frames[g].x, frames[g].ret, frames[g].g_out, frames[g].g_in, frames[r].step)
            for r, g in zip(rows_i, given_i)
        ],
        traffic.real_rows,
    )
    twin_parts = attack.partition(twin)
    delta = np.array(
        [
            agreement(tp, truth[frames[r].frame_id]) - agreement(parts[g][1], truth[frames[r].frame_id])
            for (_, tp), r, g in zip(twin_parts, rows_i, given_i)
        ]
    )
    iv = control_interval(delta, n_boot=CONTROL_BOOT, seed=seed)
    return {  # the token attacks' control's fields (``doc_ids``: the frames), so that grids and audits read both
        "type": PARTITION_CONTROL,
        "doc_ids": [int(frames[r].frame_id) for r in rows_i],
        "given_doc_ids": [int(frames[g].frame_id) for g in given_i],
        "per_doc_delta": [float(x) for x in delta],
        "effect": dataclasses.asdict(iv),
        "verdict": effect_verdict(iv),
        "instrument_fault": bool(iv.low > 0),
    }


#: what every report prints beside an oracle reading
ORACLE_NOTE = (
    "oracle: trained on the victim's training frames with the client's record of every row's token and of its "
    "real rows, and read on the record's real rows: an upper bound on what a known-plaintext attacker could "
    "read, never a verdict"
)


def _shadow_side(attack: ProbeBattery, manifest, doc_dir: Path, evaluation: LatentTraffic, seen: int, config):
    """What a shadow battery learns from: the attacker's own frames (through the victim's trained codec
    under ``trained-codec``, read from the client's run as that threat model grants), their tokens and real
    rows from its own record, and per victim frame the rows a wire-only reader takes as real (the classifier
    rule fitted on the same shadow frames; every row where the public arguments send no decoy)."""
    codec = load_file(str(Path(doc_dir) / CODEC_FILE)) if attack.threat == "trained-codec" else None
    plan = shadow_plan(manifest, read_calibration(doc_dir), steps=seen)
    shadow = make_shadow(plan, seed=config.attack_seed, codec=codec)
    frames = LatentTraffic("shadow", shadow.frames, evaluation.real_rows)
    if public_latent(plan.latent).decoys == 0:
        taken = {f.frame_id: np.ones(len(f.x), dtype=bool) for f in evaluation.frames}
        reader = "every row (the public arguments send no decoy)"
    else:
        picker = PartitionAttack(rule="classifier", seed=config.attack_seed).fit(shadow=shadow)
        taken = {f.frame_id: pred for f, (_, pred) in zip(evaluation.frames, picker.partition(evaluation))}
        reader = "the classifier rule fitted on the same shadow frames (top T rows per frame)"
    learnt = {
        "threat": attack.threat, "documents": len(plan.documents), "train_frames": len(shadow.train),
        "capture_frames": len(shadow.capture), "rows_taken_as_real": reader,
    }  # fmt: skip
    return frames, shadow.tokens, shadow.real, taken, learnt


SHUFFLED_CONTROL = (
    "shuffled-label: the tokens of every labelled training row permuted globally once (under the oracle, the "
    "evaluation rows' too), and the whole battery retrained on them"
)


#: frame-bootstrap replicates of the probe battery's intervals (recorded in its result)
PROBE_BOOT = 10_000


def run_probe_attack(
    run_dir: Path,
    doc_dir: Path,
    manifest: dict[str, Any],
    config: AttackConfig,
    out_path: Path | None,
    protocol_hash: str | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """The probe battery on a latent run, scored on the capture pass's real rows against the
    most-frequent-token control (``splitleak.stats.paired``), with its shuffled-label twin (unless
    ``control=False``). What it learns from is its threat model's (``splitleak.attacks.probes``): its own
    shadow frames (``shadow``; ``trained-codec``: through the victim's trained codec), and the rows a
    wire-only partition reader picks in the victim's frames; or, as an upper bound that is never a verdict,
    the victim's training frames with the client's record (``oracle``).

    The job runs without its protocol file, so it reads the battery at the shipped gate_002's gate, α
    and family (``splitleak.audit.gate``), recorded in each verdict; ``protocol_verdict`` is the
    protocol's test (002's nine arms per view). ``splitleak protocol analyse`` and a grid's report read
    the stored per-frame differences again under the protocol they check against (``reread_probes``)."""
    attack = make_attack(config.attack, **config.attack_params())
    if not isinstance(attack, ProbeBattery):
        raise ConfigError(f"attack {config.attack!r} is registered as a probe battery but is not a ProbeBattery")
    if config.phase != "capture":
        raise ConfigError("the probes train on the training frames; they are scored on the capture pass only")
    t0 = time.perf_counter()
    train, evaluation = load_latent_traffic(run_dir, "train"), load_latent_traffic(run_dir, "capture")
    taken: dict[int, np.ndarray] | None = None
    if attack.threat != "oracle":
        train, tokens, real, taken, learnt = _shadow_side(attack, manifest, doc_dir, evaluation, len(train), config)
    truth_real, truth_tokens = load_truth(doc_dir), load_row_tokens(doc_dir)  # the scorer's
    if attack.threat == "oracle":  # the record handed to the battery itself: an upper bound, never a verdict
        tokens, real = truth_tokens, truth_real
        learnt = {"threat": "oracle", "train_frames": len(train), "upper_bound": ORACLE_NOTE}
    every = [f.frame_id for f in train.frames + evaluation.frames]
    th = shipped_thresholds()

    def measure(battery: ProbeBattery) -> dict[str, Any]:
        # the oracle's twin is the paper's (evaluation labels permuted with the training ones); a shadow
        # twin is scored against the true labels, so that a battery that reaches them otherwise is detected
        oracle_twin = battery.shuffle and taken is None
        labels_of = battery.shuffled_tokens(truth_tokens, every) if oracle_twin else truth_tokens
        labels = [np.where(truth_real[f.frame_id], labels_of[f.frame_id], -1) for f in evaluation.frames]
        arms = battery.run(train, evaluation, tokens, real, taken)
        stats, extra = score_arms({a.name: a.predictions for a in arms}, labels, seed=battery.seed, n_boot=PROBE_BOOT)
        const = extra["constant"]
        w, rate = extra["weights"], const["accuracy"]
        by_view = {
            view: battery_verdict(
                [s for s in stats if s.name.startswith(view + "/")], w, rate, alpha=th.alpha, gate=th.gate
            )
            for view in battery.views
        }
        rows = [{**s.as_dict(), "classes": a.classes, "seconds": a.seconds} for s, a in zip(stats, arms)]
        frames = [
            {"arm": s.name, "frame_id": f.frame_id, "paired_delta": float(d), "predicted": [int(t) for t in pred]}
            for s, a in zip(stats, arms)
            for f, d, pred in zip(evaluation.frames, s.frame_delta, a.predictions)
        ]
        verdict = battery_verdict(stats, w, rate, alpha=th.alpha, gate=th.gate)
        return {
            "constant": const,
            "arms": rows,
            "verdict": verdict,
            "by_view": by_view,
            "protocol_verdict": latent_verdict(stats, w, rate, th),
            "bootstrap": {"n_boot": PROBE_BOOT, "seed": battery.seed},
            "_frames": frames,
        }

    measured = measure(attack)
    control = measure(attack.twin()) if attack.control and not attack.shuffle else None
    seconds = time.perf_counter() - t0
    per_frame = measured.pop("_frames")
    if control is not None:  # its per-frame differences too, so that a protocol reads the twin at its own alpha
        per_frame += [{**r, "arm": TWIN_PREFIX + r["arm"]} for r in control.pop("_frames")]
        control["type"] = SHUFFLED_CONTROL
        best = measured["verdict"].get("best_arm")
        twin = next((a for a in control["arms"] if a["arm"] == best), None)
        measured["control_of_best_arm"] = None if twin is None else twin["paired_effect"]
        detected = [view for view, r in control["by_view"].items() if r.get("verdict") == "detected"]
        control["detected_in"] = detected
        measured["instrument_fault"] = bool(detected)  # the twin must read at floor (002, gate_002.yaml)
    result = _latent_result(config, attack, run_dir, manifest, len(evaluation), seconds, protocol_hash) | {
        "n_train_frames": len(train),
        "learnt_from": learnt,
        "probes": {**measured, "negative_control": control},
    }
    return _written(result, per_frame, out_path, force)


def run_dose_attack(
    run_dir: Path,
    doc_dir: Path,
    manifest: dict[str, Any],
    config: AttackConfig,
    out_path: Path | None,
    protocol_hash: str | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """The dose ladder (``splitleak.audit.dose_latent``) on a latent run's capture pass, as a job: a known token
    leak planted with the client's record at each dose of ``doses`` and read by the oracle probe battery. Its
    result holds every dose's readings and the onsets; its rows, per dose and frame, the best arm's paired
    difference over the most-frequent-token control. A positive control of the instrument, never a verdict."""
    attack = make_attack(config.attack, **config.attack_params())
    if not isinstance(attack, DoseLadder):
        raise ConfigError(f"attack {config.attack!r} is registered as a dose ladder but is not a DoseLadder")
    if config.phase != "capture":
        raise ConfigError("the dose ladder's probes train on the training frames; it is read on the capture pass only")
    t0 = time.perf_counter()
    ladder = dose_ladder(
        run_dir,
        doses=attack.dose_points(),
        channel=attack.channel,
        battery=attack.battery(),
        seed=attack.seed,
        n_boot=attack.n_boot,
        thresholds=shipped_thresholds(),
        truth_dir=doc_dir,
    )
    seconds = time.perf_counter() - t0
    frame_ids = ladder["frame_ids"]
    per_frame = [
        {"arm": dose_arm(r), "frame_id": f, "paired_delta": d}
        for r in ladder["doses"]
        for f, d in zip(frame_ids, r.pop("frame_delta"))
    ]
    result = _latent_result(config, attack, run_dir, manifest, len(frame_ids), seconds, protocol_hash) | {
        "learnt_from": {"threat": "oracle", "upper_bound": DOSE_NOTE},
        "dose": ladder,
    }
    return _written(result, per_frame, out_path, force)


def dose_arm(row: dict[str, Any]) -> str:
    """A dose's name in the store's ``arm`` column: its mode, coverage and amplitude, and the arm it read."""
    return f"{row['mode']}/coverage={row['coverage']:g}/amplitude={row['amplitude']:g}/{row['best_arm']}"
