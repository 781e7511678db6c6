"""Verdicts from the frozen protocol (splitleak.audit.gate): the gate, α, the arm family J and the utility
gate are read from the protocol the results are checked against, and an edited (re-frozen) copy of the
protocol changes the verdict; the unedited one reproduces the verdict the hard-coded values gave."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from splitleak.audit.gate import (
    DEFAULT_PROTOCOL,
    audit_utility,
    latent_verdict,
    reread_probes,
    resolve_thresholds,
    shipped_thresholds,
    thresholds_of,
)
from splitleak.audit.protocol import (
    SHIPPED,
    file_sha256,
    freeze_protocol,
    load_protocol,
    read_frozen_record,
    shipped_protocols,
)
from splitleak.errors import IntegrityError
from splitleak.stats.paired import battery_verdict, score_arms

runner = CliRunner()
VIEWS = ("gradient", "forward")
FAMILY = ("mlp", "features", "graph")
N_BOOT = 400


def battery(models=FAMILY, restarts=3, read=0.3, seed=0, frames=40, rows=16):
    """A hand-built probe battery: the gradient view's arms name a share ``read`` of the rows right (and
    guess the rest from the label frequencies); the forward view's only guess."""
    rng = np.random.default_rng(seed)
    p = [0.3] + [0.1] * 7
    labels = [rng.choice(8, size=rows, p=p) for _ in range(frames)]
    arms = {}
    for view in VIEWS:
        for model in models:
            for r in range(restarts):
                share = read if view == "gradient" else 0.0
                arms[f"{view}/{model}/{r}"] = [
                    np.where(rng.random(rows) < share, y, rng.choice(8, size=rows, p=p)) for y in labels
                ]
    stats, extra = score_arms(arms, labels, seed=seed, n_boot=N_BOOT)
    probes = {
        "constant": extra["constant"],
        "arms": [s.as_dict() for s in stats],
        "bootstrap": {"n_boot": N_BOOT, "seed": seed},
    }
    frame_rows = [
        {"arm": s.name, "frame_id": 100 + i, "paired_delta": float(d)}
        for s in stats
        for i, d in enumerate(s.frame_delta)
    ]
    return stats, extra, probes, frame_rows


def edited_copy(folder: Path, name: str, *edits: tuple[str, str]) -> Path:
    """A copy of the shipped gate_002.yaml with ``edits`` applied, frozen as the code requires."""
    folder.mkdir(parents=True, exist_ok=True)
    dst = folder / name
    text = DEFAULT_PROTOCOL.read_text()
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    dst.write_text(text)
    freeze_protocol(dst)
    return dst


def thresholds(path: Path):
    proto, digest = load_protocol(path)
    th = thresholds_of(proto, digest)
    assert th is not None
    return th


# ------------------------------------------------------------------ where the thresholds come from


@pytest.mark.unit
def test_the_defaults_are_the_shipped_frozen_gate_002s_and_a_protocol_without_a_gate_says_whose_it_reads():
    th = shipped_thresholds()
    assert (th.gate, th.alpha, th.arms, th.utility_ce_increase_max) == (0.01, 0.05, 9, 0.35)
    assert th.protocol == "gate-002" and th.note == ""
    assert th.protocol_hash == read_frozen_record(DEFAULT_PROTOCOL) == file_sha256(DEFAULT_PROTOCOL)
    main = SHIPPED / "paper_main.yaml"
    proto, digest = load_protocol(main)
    assert thresholds_of(proto, digest) is None
    fallback = resolve_thresholds(proto, digest)
    assert fallback.gate == th.gate and fallback.protocol_hash == th.protocol_hash
    assert "paper-main declares no gate" in fallback.note


@pytest.mark.unit
def test_the_audits_utility_gate_fails_a_costly_defence_and_says_so():
    th = shipped_thresholds()
    over = audit_utility({"delta_u": 0.5}, th, defended=True)
    assert over["passes"] is False and "not a passing configuration" in over["sentence"]
    assert "gate-002" in over["sentence"] and "0.35" in over["sentence"]
    within = audit_utility({"delta_u": 0.2}, th, defended=True)
    assert within["passes"] is True and within["sentence"] == ""
    unmeasured = audit_utility({"delta_u": None}, th, defended=True)
    assert unmeasured["passes"] is None and "cannot be called passing" in unmeasured["sentence"]
    assert audit_utility({"delta_u": 0.0}, th, defended=False)["sentence"] == ""


# ------------------------------------------------------------------ the latent battery


@pytest.mark.unit
def test_the_unedited_protocol_reproduces_todays_per_view_verdict():
    stats, extra, probes, frame_rows = battery()
    w, rate = extra["weights"], extra["constant"]["accuracy"]
    v = latent_verdict(stats, w, rate, shipped_thresholds())
    for view in VIEWS:
        # what the hard-coded gate (0.01) and α (0.05) gave over the view's arms, before the protocol was read
        today = battery_verdict([s for s in stats if s.name.startswith(view + "/")], w, rate, alpha=0.05, gate=0.01)
        mine = v["by_view"][view]
        for key in (
            "verdict",
            "best_arm",
            "paired_effect",
            "paired_low",
            "paired_high",
            "gate_statistic",
            "breaks_gate",
        ):
            assert mine[key] == today[key], (view, key)
        assert mine["J"] == 9 == mine["declared_J"] and mine["matches_declared"] is True
    assert v["views_breaking_gate"] == ["gradient"] and v["privacy_holds"] is False and v["passes"] is False
    assert v["by_view"]["forward"]["decision"] == "holds"
    assert "breaks the gate in gradient" in v["verdict"]
    # read again from the stored per-frame differences (in any order): the same verdict
    again = reread_probes(probes, list(reversed(frame_rows)), 0, shipped_thresholds())
    assert again["by_view"] == v["by_view"] and again["verdict"] == v["verdict"]


@pytest.mark.unit
def test_the_deep_probe_lies_outside_the_family_and_j_counts_the_arms_compared():
    stats, extra, _, _ = battery(models=(*FAMILY, "deep"))
    v = latent_verdict(stats, extra["weights"], extra["constant"]["accuracy"], shipped_thresholds())
    assert sorted(v["outside_family"]) == sorted(f"{view}/deep/{r}" for view in VIEWS for r in range(3))
    for view in VIEWS:
        r = v["by_view"][view]
        assert r["J"] == 9 and len(r["arms_compared"]) == 9 and not any("/deep/" in a for a in r["arms_compared"])
    assert v["J"] == 9
    # the battery-wide reading compares every eligible arm and says so: J = 24, not the declared 9
    wide = battery_verdict(stats, extra["weights"], extra["constant"]["accuracy"], alpha=0.05, gate=0.01, declared=9)
    assert wide["J"] == 24 and wide["matches_declared"] is False
    assert "declares J = 9, 24 measured" in wide["family_correction"]


@pytest.mark.unit
def test_a_battery_with_fewer_restarts_decides_only_what_its_arms_can_decide():
    stats, extra, _, _ = battery(restarts=2)
    v = latent_verdict(stats, extra["weights"], extra["constant"]["accuracy"], shipped_thresholds())
    grad, fwd = v["by_view"]["gradient"], v["by_view"]["forward"]
    assert grad["J"] == fwd["J"] == 6 and grad["declared_J"] == 9 and grad["matches_declared"] is False
    assert "declares J = 9, 6 measured: not the protocol's family" in grad["family_correction"]
    # six arms that break the gate: the nine would too (G only rises with J); six that hold it decide nothing
    assert grad["decision"] == "breaks" and fwd["decision"] == "undecided"
    assert v["privacy_holds"] is False
    calm, extra2, _, _ = battery(restarts=2, read=0.0)
    quiet = latent_verdict(calm, extra2["weights"], extra2["constant"]["accuracy"], shipped_thresholds())
    assert quiet["privacy_holds"] is None and quiet["passes"] is None and quiet["verdict"].startswith("undecided")


@pytest.mark.unit
def test_an_edited_copy_of_the_protocol_changes_the_verdict(tmp_path):
    stats, extra, _, _ = battery()
    w, rate = extra["weights"], extra["constant"]["accuracy"]
    util = {"ce_increase": 0.1}

    def read(path):
        th = thresholds(path)
        from splitleak.audit.gate import utility_gate

        return th, latent_verdict(stats, w, rate, th, utility_gate(util["ce_increase"], th, "the pretrained model"))

    same = edited_copy(tmp_path / "same", "gate.yaml")
    th0, v0 = read(same)
    assert th0.protocol_hash == shipped_thresholds().protocol_hash  # an unedited copy hashes the same
    assert v0["privacy_holds"] is False and v0["passes"] is False

    # the gate raised to +50 pp: the same battery holds it, and the run passes both gates
    loose = edited_copy(tmp_path / "loose", "gate.yaml", ("gate: 0.01", "gate: 0.5"))
    th1, v1 = read(loose)
    assert th1.gate == 0.5 and th1.protocol_hash != th0.protocol_hash
    assert v1["privacy_holds"] is True and v1["passes"] is True
    assert v1["by_view"]["gradient"]["gate_statistic"] == v0["by_view"]["gradient"]["gate_statistic"]
    assert v1["thresholds"]["protocol_hash"] == th1.protocol_hash

    # the utility gate tightened below the run's 0.1 nats: no longer a passing configuration
    tight = edited_copy(
        tmp_path / "tight", "gate.yaml", ("gate: 0.01", "gate: 0.5"), ("utility_ce_increase_max: 0.35", "utility_ce_increase_max: 0.05")
    )  # fmt: skip
    _, v2 = read(tight)
    assert v2["privacy_holds"] is True and v2["passes"] is False
    assert "over the utility gate of 0.05 nats" in v2["verdict"] and "not a passing configuration" in v2["verdict"]

    # J declared as 6: the nine arms measured are not the protocol's family, their break is undecided
    six = edited_copy(tmp_path / "six", "gate.yaml", ("arms: 9", "arms: 6"))
    _, v3 = read(six)
    grad = v3["by_view"]["gradient"]
    assert grad["J"] == 9 and grad["declared_J"] == 6 and grad["decision"] == "undecided"
    assert v3["privacy_holds"] is None and "undecided" in v3["verdict"]

    # α is read too: a stricter family-wise level widens every bound, so G rises
    strict = edited_copy(tmp_path / "strict", "gate.yaml", ("alpha: 0.05", "alpha: 0.001"))
    _, v4 = read(strict)
    assert v4["by_view"]["gradient"]["gate_statistic"] > v0["by_view"]["gradient"]["gate_statistic"]
    assert v4["by_view"]["gradient"]["alpha"] == 0.001

    # an edit after freezing is refused, never read
    same.write_text(same.read_text().replace("gate: 0.01", "gate: 0.02"))
    with pytest.raises(IntegrityError, match="edited after"):
        thresholds(same)


# ------------------------------------------------------------------ protocol analyse


def write_battery_result(
    folder: Path,
    digest: str,
    read: float = 0.3,
    twin_read: float = 0.0,
    twin_frames: bool = True,
    threat: str | None = "shadow",
) -> Path:
    """A probe-battery RESULT.json and its per-frame predictions, as ``run_probe_attack`` writes them,
    under the protocol hash ``digest``; the run directory holds its metrics (0.1 nats over pretrained), recorded
    in its journal and closed complete (the gate reads the metrics of a run that verifies only). Its
    shuffled-label twin's gradient view reads a share ``twin_read`` of the rows; ``twin_frames``: its per-frame
    differences are kept beside the battery's (as today), else only its verdict (as results written before).
    ``threat``: the battery's threat model (None: a result written before threat models, an oracle's)."""
    from splitleak.audit.evaluate import write_result
    from splitleak.audit.gate import TWIN_PREFIX
    from splitleak.files import config_hash
    from splitleak.runs.store import RunStore

    stats, extra, probes, frame_rows = battery(read=read)
    twin_stats, _, twin_probes, twin_rows = battery(read=twin_read, seed=1)
    if twin_frames:
        frame_rows = frame_rows + [{**r, "arm": TWIN_PREFIX + r["arm"]} for r in twin_rows]
    run = folder / "run"
    store = RunStore.create(run)
    store.add_json(
        "metrics", "metrics.json", {"heldout_ce": 3.1, "pretrained_ce": 3.0, "ce_increase_over_pretrained": 0.1}
    )
    store.close(True)
    cfg = {"attack": "latent-probe", "params": {"restarts": 3}}
    run_cfg = {"model": "tiny-gpt2", "seed": 7, "latent": {"split_after": 0, "resume_at": 3, "output_gradient": "open"}}
    twin = {**twin_probes, "verdict": {"verdict": "at floor"}, "type": "shuffled"}
    result = {
        "protocol_hash": digest,
        "attack": "latent-probe",
        "config": cfg,
        "config_hash": config_hash(cfg),
        "attack_params": {"seed": 0} if threat is None else {"seed": 0, "threat": threat},
        "run": {"dir": str(run), "config_hash": config_hash(run_cfg), "config": run_cfg},
        "n_frames": 40,
        "token_recovery": None,
        "probes": {**probes, "negative_control": twin},
    }
    out = folder / "R.json"
    write_result(out, result, frame_rows)
    return out


@pytest.mark.unit
def test_protocol_analyse_reads_a_battery_under_the_protocol_given_and_its_edited_copy(tmp_path):
    from splitleak.cli import app

    proto = edited_copy(tmp_path / "p", "gate.yaml")
    digest = load_protocol(proto)[1]
    res = write_battery_result(tmp_path / "a", digest)
    r = runner.invoke(app, ["protocol", "analyse", str(proto), str(res), "--out", str(tmp_path / "an")])
    assert r.exit_code == 1, r.output  # the gradient view breaks the gate: the protocol's test fails
    a = json.loads((tmp_path / "an.json").read_text())
    g = a["gate"][0]
    assert a["gate_thresholds"]["gate"] == 0.01 and a["gate_thresholds"]["protocol_hash"] == digest
    assert g["by_view"]["gradient"]["J"] == 9 and g["privacy_holds"] is False
    assert g["utility"]["passes"] is True and g["negative_control"]["verdict"] == "at floor"
    assert a["notes"] == []  # gate, A and N all read
    md = (tmp_path / "an.md").read_text()
    assert "breaks the gate in gradient" in md and "## Gate" in md

    loose = edited_copy(tmp_path / "q", "gate.yaml", ("gate: 0.01", "gate: 0.5"))
    loose_digest = load_protocol(loose)[1]
    # results written under the unedited protocol are refused by the edited one
    r = runner.invoke(app, ["protocol", "analyse", str(loose), str(res)])
    assert r.exit_code != 0 and loose_digest[:12] in r.output.replace("\n", "")
    res2 = write_battery_result(tmp_path / "b", loose_digest)
    r = runner.invoke(app, ["protocol", "analyse", str(loose), str(res2), "--out", str(tmp_path / "an2")])
    assert r.exit_code == 0, r.output
    g2 = json.loads((tmp_path / "an2.json").read_text())["gate"][0]
    assert g2["privacy_holds"] is True and g2["passes"] is True
    assert g2["by_view"]["gradient"]["gate_statistic"] == g["by_view"]["gradient"]["gate_statistic"]


@pytest.mark.unit
@pytest.mark.parametrize("twin_frames", [True, False])
def test_a_detected_shuffled_twin_turns_protocol_analyse_red(tmp_path, twin_frames):
    """002 declares that the shuffled-label twin must read at floor: a twin that reads detected is an
    instrument fault, whatever the battery's own arms read (here they hold the gate under a loose gate), and
    protocol analyse exits non-zero and says so; the same battery with its twin at floor passes."""
    from splitleak.cli import app

    loose = edited_copy(tmp_path / "p", "gate.yaml", ("gate: 0.01", "gate: 0.5"))
    digest = load_protocol(loose)[1]
    bad = write_battery_result(tmp_path / "bad", digest, read=0.0, twin_read=0.6, twin_frames=twin_frames)
    if not twin_frames:  # a result written before the twin's frames were kept: the verdict its job read
        res = json.loads(bad.read_text())
        res["probes"]["negative_control"]["verdict"] = {"verdict": "detected"}
        res["probes"]["negative_control"]["by_view"] = {"gradient": {"verdict": "detected"}}
        bad.write_text(json.dumps(res))
    r = runner.invoke(app, ["protocol", "analyse", str(loose), str(bad), "--out", str(tmp_path / "an")])
    assert r.exit_code == 1, r.output
    g = json.loads((tmp_path / "an.json").read_text())["gate"][0]
    assert g["privacy_holds"] is True and g["passes"] is False and g["instrument_fault"] is True
    assert g["negative_control"]["verdict"] == "detected" and g["negative_control"]["detected_in"] == ["gradient"]
    assert ("protocol's alpha" in g["negative_control"]["read_at"]) is twin_frames
    assert g["verdict"].startswith("INSTRUMENT FAULT") and "INSTRUMENT FAULT" in (tmp_path / "an.md").read_text()
    good = write_battery_result(tmp_path / "good", digest, read=0.0, twin_read=0.0, twin_frames=twin_frames)
    r = runner.invoke(app, ["protocol", "analyse", str(loose), str(good), "--out", str(tmp_path / "ok")])
    assert r.exit_code == 0, r.output
    g = json.loads((tmp_path / "ok.json").read_text())["gate"][0]
    assert g["passes"] is True and g["instrument_fault"] is False and g["negative_control"]["detected_in"] == []


@pytest.mark.unit
@pytest.mark.parametrize("threat", ["oracle", None])
def test_an_oracle_battery_is_an_upper_bound_and_never_a_verdict(tmp_path, threat):
    """A battery trained and read with the client's record (the oracle threat model, and every result written
    before threat models existed) breaks the gate here, but gives no verdict: no pass, no fail, and it says
    why; the same battery under the shadow threat model fails the protocol."""
    from splitleak.cli import app

    proto = edited_copy(tmp_path / "p", "gate.yaml")
    digest = load_protocol(proto)[1]
    res = write_battery_result(tmp_path / "o", digest, threat=threat)
    r = runner.invoke(app, ["protocol", "analyse", str(proto), str(res), "--out", str(tmp_path / "an")])
    assert r.exit_code == 0, r.output
    g = json.loads((tmp_path / "an.json").read_text())["gate"][0]
    assert g["threat"] == "oracle" and g["passes"] is None and g["privacy_holds"] is None
    assert g["verdict"].startswith("ORACLE, an upper bound") and "breaks the gate in gradient" in g["verdict"]
    shadow = write_battery_result(tmp_path / "s", digest, threat="shadow")
    assert runner.invoke(app, ["protocol", "analyse", str(proto), str(shadow)]).exit_code == 1
    # no verdict, but a detected twin is still an instrument fault, and fails the analysis
    faulty = write_battery_result(tmp_path / "f", digest, read=0.0, twin_read=0.6, threat=threat)
    assert runner.invoke(app, ["protocol", "analyse", str(proto), str(faulty)]).exit_code == 1


@pytest.mark.unit
def test_every_shipped_protocol_is_handled_and_says_what_it_did_not_evaluate():
    from splitleak.audit.analysis import analyse

    names = set()
    for path in shipped_protocols():
        proto, digest = load_protocol(path)
        a = analyse(proto, digest, [], [], [])
        names.add(proto.name)
        if proto.name == "gate-002":
            assert a.gate_thresholds is not None and a.gate_thresholds["arms"] == 9
            assert len(a.notes) == 3 and all("no probe-battery result" in n for n in a.notes)
        elif proto.name == "mirage-003":
            assert a.gate_thresholds is None and len(a.notes) == 5
            assert all("label-shielded section" in n for n in a.notes)
        elif proto.name == "partial-offloading":
            assert len(a.notes) == 4 and all("property-inference" in n for n in a.notes)
        else:
            assert a.main is not None and a.main.missing and a.notes == []
    assert names == {"gate-002", "mirage-003", "paper-main", "partial-offloading"}


@pytest.mark.integration
def test_protocol_analyse_reads_the_gate_over_a_split_runs_attacks(tmp_path, shared_run):
    from splitleak.attacks import make_attack_config
    from splitleak.audit.analysis import analyse, find_results, rows_from_results, run_rows_from_results
    from splitleak.audit.evaluate import run_attack
    from splitleak.audit.gate_results import gate_inputs
    from splitleak.audit.verdicts import arm_effects, arm_gate
    from splitleak.runs.truth import eval_token_ids

    run = shared_run(model="tiny-gpt2", depth=2, n_calib=4, n_train=6, n_eval=12, seed=0, all_local_baseline=False)

    def analysed(proto: Path, folder: Path):
        digest = load_protocol(proto)[1]
        preds = {}
        for name in ("vmi", "backward-only", "majority"):  # majority is a control: no arm of the gate
            res = run_attack(run, make_attack_config(attack=name), out=folder / f"{name}.json", protocol_hash=digest)
            if name != "majority":
                preds[name] = np.array([d["predicted"] for d in sorted(res["per_doc"], key=lambda d: d["doc_id"])])
            ids = sorted(d["doc_id"] for d in res["per_doc"])
        found = find_results([folder])
        a = analyse(*load_protocol(proto), rows_from_results(found), run_rows_from_results(found), gate_inputs(found))
        return a, preds, ids

    a, preds, ids = analysed(edited_copy(tmp_path / "p", "gate.yaml"), tmp_path / "r0")
    (g,) = a.gate
    base, arms = arm_effects(preds, eval_token_ids(run, ids))
    ref = arm_gate(arms, base, 0.05, 0.01)  # the audit's gate with the values it hard-coded
    assert g["kind"] == "split attacks" and g["J"] == 2 and g["declared_J"] == 9
    assert g["gate_statistic"] == pytest.approx(ref.G) and g["breaks_gate"] == ref.breaks
    assert g["utility"]["passes"] is True  # undefended: its own reference
    assert 0.01 < ref.G < 0.99
    loose, _, _ = analysed(edited_copy(tmp_path / "q", "gate.yaml", ("gate: 0.01", "gate: 0.99")), tmp_path / "r1")
    assert loose.gate[0]["gate_statistic"] == pytest.approx(ref.G) and loose.gate[0]["breaks_gate"] is False


# ------------------------------------------------------------------ the grid report's decoy section


def store_rows(arms: dict[str, float], ce: dict[str, float], seeds=(1, 2), threat: str | None = "shadow"):
    """Hand-built store rows of a latent grid: per latent arm and seed, a probe job's per-(arm, frame) rows
    and its train row (held-out CE ``3.0 + ce[arm]`` over a pretrained 3.0); ``threat``: the batteries'
    threat model (None: results written before threat models, the oracle's)."""
    attack, train = [], []
    for arm, read in arms.items():
        for seed in seeds:
            stats, extra, probes, frame_rows = battery(read=read, seed=seed)
            verdict = battery_verdict(stats, extra["weights"], extra["constant"]["accuracy"], alpha=0.05, gate=0.01)
            result = {
                "attack_params": {"seed": seed} if threat is None else {"seed": seed, "threat": threat},
                "probes": {**probes, "verdict": verdict, "negative_control": None},
            }
            base = {
                "key": f"a-{arm}-{seed}", "kind": "attack", "attack": "latent-probe", "defence_name": "latent",
                "defence": arm, "model": "m", "victim_seed": seed, "params": None, "train_key": f"t-{arm}-{seed}",
                "result_json": json.dumps(result),
            }  # fmt: skip
            attack += [
                {**base, "arm": f["arm"], "doc_id": f["frame_id"], "paired_delta": f["paired_delta"]}
                for f in frame_rows
            ]
            train.append(
                {
                    "key": f"t-{arm}-{seed}", "defence_name": "latent", "model": "m", "defence": arm, "victim_seed": seed,
                    "heldout_ce": 3.0 + ce[arm], "pretrained_ce": 3.0, "metrics_json": "{}", "steps": 16,
                    "train_config": json.dumps({"latent": {"output_gradient": "open" if arm == "open" else "clip-noise"}}),
                }
            )  # fmt: skip
    return attack, train


@pytest.mark.unit
def test_the_decoy_section_reads_the_grids_protocol_and_its_utility_gate(tmp_path):
    from splitleak.report.document import Document, render_markdown
    from splitleak.report.grid_latent import arm_passes, latent_section, latent_summary

    attack, train = store_rows({"open": 0.3, "fix": 0.0}, {"open": 0.1, "fix": 0.2})
    s = latent_summary(attack, train, shipped_thresholds())
    by = {(r.arm, r.seed): r for r in s.probes}
    assert all(by[("open", k)].protocol["privacy_holds"] is False for k in (1, 2))
    assert all(by[("fix", k)].protocol["privacy_holds"] is True for k in (1, 2))
    assert by[("fix", 1)].protocol["utility"]["ce_increase"] == pytest.approx(0.2)
    verdicts = {a["arm"]: a for a in arm_passes(s)}
    assert verdicts["open"]["passes"] is False and verdicts["open"]["seeds_breaking_gate"] == 2
    assert verdicts["fix"]["passes"] is True and verdicts["fix"]["seeds_within_utility"] == 2
    assert {u.arm: u.utility_gate["passes"] for u in s.utility} == {"open": True, "fix": True}

    # the same store under a copy whose utility gate is tightened to 0.15 nats: the fix no longer passes
    tight = thresholds(
        edited_copy(tmp_path, "tight.yaml", ("utility_ce_increase_max: 0.35", "utility_ce_increase_max: 0.15"))
    )
    t = latent_summary(attack, train, tight)
    verdicts = {a["arm"]: a for a in arm_passes(t)}
    assert verdicts["fix"]["passes"] is False and verdicts["fix"]["seeds_holding_gate"] == 2
    assert "not a passing configuration" in next(r for r in t.probes if r.arm == "fix").protocol["verdict"]
    doc = Document("x")
    latent_section(doc, attack, train, tight)
    text = " ".join(render_markdown(doc).split())
    assert tight.protocol_hash[:12] in text and "utility gate ≤ 0.15 nats" in text
    assert "| m | fix | defaults | 2 | 2 | 0 | 0 | no |" in text

    # an oracle battery (or one written before threat models) is an upper bound: no arm passes or fails on it
    for threat in ("oracle", None):
        attack, train = store_rows({"open": 0.3, "fix": 0.0}, {"open": 0.1, "fix": 0.2}, threat=threat)
        o = latent_summary(attack, train, shipped_thresholds())
        verdicts = {a["arm"]: a for a in arm_passes(o)}
        assert all(v["oracle"] and v["passes"] is None for v in verdicts.values()), verdicts
        assert verdicts["open"]["seeds_breaking_gate"] == 2  # what it read is still shown
        doc = Document("y")
        latent_section(doc, attack, train)
        assert "no verdict (oracle: an upper bound)" in render_markdown(doc)


@pytest.mark.unit
@pytest.mark.parametrize(
    "edit, words",
    [
        (("  alpha: 0.05\n", ""), "no thresholds.alpha"),
        (("alpha: 0.05", "alpha: 1.5"), "strictly between 0 and 1"),
        (("arms: 9", "arms: 0"), "positive integer J"),
    ],
)
def test_a_protocol_whose_gate_cannot_be_read_is_refused(tmp_path, edit, words):
    from splitleak.errors import ConfigError

    with pytest.raises(ConfigError, match=words):
        thresholds(edited_copy(tmp_path, "bad.yaml", edit))


# ------------------------------------------------------------------ utility read only from a run that verifies (issue 33)


def _edit_metrics(run: Path, **fields) -> None:
    m = json.loads((run / "metrics.json").read_text())
    m.update(fields)
    (run / "metrics.json").write_text(json.dumps(m))  # NaN is written as NaN, which json reads back


@pytest.mark.unit
@pytest.mark.parametrize("value", [0.123, float("nan")])
def test_protocol_analyse_marks_the_utility_of_a_battery_run_whose_metrics_were_edited(tmp_path, value):
    from splitleak.cli import app

    loose = edited_copy(tmp_path / "q", "gate.yaml", ("gate: 0.01", "gate: 0.5"))
    res = write_battery_result(tmp_path / "b", load_protocol(loose)[1])
    out = tmp_path / "an"
    r = runner.invoke(app, ["protocol", "analyse", str(loose), str(res), "--out", str(out)])
    assert r.exit_code == 0, r.output
    g = json.loads(out.with_suffix(".json").read_text())["gate"][0]
    assert g["utility"]["passes"] is True and g["passes"] is True and "unverified" not in g["utility"]
    _edit_metrics(tmp_path / "b" / "run", ce_increase_over_pretrained=value, heldout_ce=3.0 + value)
    r = runner.invoke(app, ["protocol", "analyse", str(loose), str(res), "--out", str(out)])
    g = json.loads(out.with_suffix(".json").read_text())["gate"][0]
    assert "metrics.json" in g["utility"]["unverified"] and "content differs" in g["utility"]["unverified"]
    assert g["utility"]["ce_increase"] is None and g["utility"]["passes"] is None  # never read as measured
    assert g["passes"] is None and g["privacy_holds"] is True  # the configuration cannot be called passing
    assert "utility unverified" in g["verdict"] and "utility unverified" in out.with_suffix(".md").read_text()


@pytest.mark.integration
@pytest.mark.parametrize("value", [0.123, float("nan")])
def test_the_split_gate_and_the_delta_u_rows_read_no_edited_metrics(tmp_path, shared_run, value):
    import shutil

    from splitleak.audit.analysis import run_rows_from_results
    from splitleak.audit.gate_results import split_utility
    from splitleak.errors import IntegrityError

    run = tmp_path / "run"
    shutil.copytree(
        shared_run(model="tiny-gpt2", depth=2, n_calib=4, n_train=6, n_eval=12, seed=0, all_local_baseline=False), run
    )
    cfg = json.loads((run / "manifest.json").read_text())["config"]
    defended = {**cfg, "defences": [{"name": "quant8", "args": {}}]}  # a defended run's ΔU is read from its metrics
    th = shipped_thresholds()
    intact = split_utility(run, defended, th)
    assert "unverified" not in intact and intact["ce_increase"] is None  # no all-local run: ΔU not measured
    found = [(tmp_path / "R.json", {"attack": "pi", "config_hash": "0" * 64, "leakage_index": 0.2,
                                    "run": {"dir": str(run), "config": cfg}})]  # fmt: skip
    assert run_rows_from_results(found)[0]["delta_u"] is None

    _edit_metrics(run, delta_u=value, heldout_ce=value)
    u = split_utility(run, defended, th)
    assert u["ce_increase"] is None and u["passes"] is None and "metrics.json" in u["unverified"]
    assert "utility unverified" in u["text"]
    with pytest.raises(IntegrityError, match="does not verify") as exc:
        run_rows_from_results(found)
    assert "\n" not in str(exc.value) and "splitleak verify" in str(exc.value) and "metrics.json" in str(exc.value)
