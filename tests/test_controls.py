"""Negative controls that can fail: an attack planted to read the evaluation text by the documents'
identity (as a pipeline bug would let it) is caught by its mis-paired twin, in `attack`, in the audit
and in a grid; attacks that read only the traffic read their control at floor."""

import json
import shutil
import textwrap

import pytest
import torch

from splitleak.attacks import make_attack_config
from splitleak.audit.evaluate import run_attack

#: a plug-in module (``SPLITLEAK_PLUGINS``), so that a grid's worker processes register it too
PLANTED = textwrap.dedent(
    """
    from pathlib import Path

    import torch

    from splitleak.attacks import Attack, Reconstruction
    from splitleak.runs.truth import phase_documents
    from splitleak.attacks.registry import AttackInfo, register


    class ReadsTheText(Attack):
        \"\"\"Planted: the true tokens of the documents the traffic is labelled with, read from every run's
        record under ``root`` (what an attack must never reach). ``share``: the fraction of positions it
        copies; the others it reads as token 0.\"\"\"

        name = "reads-the-text"

        def __init__(self, root: str = ".", share: float = 1.0, seed: int = 0):
            self.root, self.share, self.seed = root, share, seed

        def params(self):
            return {"root": self.root, "share": self.share, "seed": self.seed}

        def reconstruct(self, traffic, progress=None):
            text = {}
            for docs in Path(self.root).rglob("documents.json"):
                for d in phase_documents(docs.parent, "capture"):
                    text[d.doc_id] = list(d.token_ids)
            out = torch.tensor([text[i] for i in traffic.doc_ids])
            keep = torch.rand(out.shape, generator=torch.Generator().manual_seed(self.seed)) < self.share
            return Reconstruction(torch.where(keep, out, torch.zeros_like(out)))


    register(AttackInfo("reads-the-text", ReadsTheText, "planted: reads the evaluation text", reads=()))
    """
)


@pytest.fixture
def planted(plant):
    return plant("planted_reader", PLANTED, "reads-the-text")


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 3])
def test_the_control_catches_a_reader_of_the_text_and_not_readers_of_the_traffic(planted, shared_run, seed):
    run = shared_run(model="tiny-gpt2", depth=2, n_calib=16, n_train=4, n_eval=24, seed=0, all_local_baseline=False)
    cheat = run_attack(
        run,
        make_attack_config(attack="reads-the-text", attack_seed=seed, params={"root": str(run.parent)}),
        control_docs=16,
    )
    c = cheat["control"]
    assert cheat["token_recovery"] == 1.0  # the arm alone looks like a perfect attack
    assert c["verdict"] == "detected" and c["effect"]["low"] > 0.5, c
    assert c["twin_token_recovery"] == 1.0 and c["floor_token_recovery"] < 0.5
    assert len(c["doc_ids"]) >= 16 and all(a != b for a, b in zip(c["doc_ids"], c["given_doc_ids"]))
    # a partial reader of the text is caught too
    part = run_attack(
        run,
        make_attack_config(attack="reads-the-text", attack_seed=seed, params={"root": str(run.parent), "share": 0.3}),
        control_docs=16,
    )
    assert part["control"]["verdict"] == "detected" and part["control"]["effect"]["estimate"] > 0.15
    for name, params in (("vmi", {}), ("activation", {"k": 4})):  # readers of the traffic, one row at a time
        res = run_attack(run, make_attack_config(attack=name, attack_seed=seed, params=params), control_docs=16)
        assert res["control"]["verdict"] == "at floor", (name, res["control"])
        assert res["control"]["per_doc_delta"] == [0.0] * len(res["control"]["doc_ids"]), name
    # no control unless asked; a single document cannot be mis-paired
    assert "control" not in run_attack(run, make_attack_config(attack="vmi"))


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 3])
def test_a_twin_of_every_document_reads_the_arms_search_and_still_catches_candidates_from_the_ids(
    shared_run, seed, monkeypatch
):
    """A twin over every document holds the arm's rows in the arm's order: the beam search and SipIt's search,
    functions of the activations (and candidates) alone, are served from the arm's (``Knowledge.memo_content``),
    so each runs once for the arm and its twin, and an honest reader's twin differs by exactly 0. A beam reader
    whose candidates come from the true tokens of the ids it is given searches its twin's candidates afresh,
    and is caught."""
    import splitleak.attacks.beam as beam
    import splitleak.attacks.sipit as sipit_mod
    from splitleak.attacks import load_knowledge, load_traffic
    from splitleak.attacks.beam import ActivationBeam
    from splitleak.audit.evaluate import controlled_read, mispaired_control
    from splitleak.runs.truth import phase_documents

    run = shared_run(model="tiny-gpt2", depth=2, n_calib=16, n_train=4, n_eval=12, seed=0, all_local_baseline=False)
    calls = {"beam": 0, "sipit": 0}
    for mod, name in ((beam, "beam_search"), (sipit_mod, "sipit")):
        real = getattr(mod, name)

        def counting(*a, _real=real, _name=name, **k):
            calls["beam" if _name == "beam_search" else "sipit"] += 1
            return _real(*a, **k)

        monkeypatch.setattr(mod, name, counting)
    for name, params, what in (("activation", {"k": 4}, "beam"), ("sipit", {"budget": 8}, "sipit")):
        before = calls[what]
        res = run_attack(run, make_attack_config(attack=name, attack_seed=seed, params=params), control_docs=12)
        assert len(res["control"]["doc_ids"]) == 12 and res["control"]["per_doc_delta"] == [0.0] * 12, name
        assert calls[what] - before == 1, (name, calls)  # the arm's search; the twin read it
    monkeypatch.undo()

    truth = {d.doc_id: list(d.token_ids) for d in phase_documents(run, "capture")}

    class CandidatesFromTheIds(ActivationBeam):
        def candidates(self, traffic):  # every candidate the true token of the id: the search can only read it
            cand = super().candidates(traffic)
            return torch.tensor([truth[i] for i in traffic.doc_ids]).unsqueeze(-1).expand_as(cand).contiguous()

    cheat = CandidatesFromTheIds(k=4).fit(load_knowledge(run, "public"))
    traffic = load_traffic(run)
    arm = controlled_read(cheat.reconstruct(traffic))
    docs = list(phase_documents(run, "capture"))
    config = make_attack_config(attack="activation", attack_seed=seed, params={"k": 4})
    control = mispaired_control(cheat, traffic, arm, docs, 12, config, None)
    # served the arm's search, its twin would read the arm's documents and sit at floor
    assert control["verdict"] == "detected" and control["twin_token_recovery"] == 1.0, control
    assert control["floor_token_recovery"] < 0.5, control


@pytest.mark.e2e
def test_the_audit_refuses_a_verdict_when_an_arm_reads_the_text(planted, tmp_path, monkeypatch):
    import splitleak.audit.plan as audit_plan
    import splitleak.audit.run as audit_run
    from splitleak.report.audit import write_audit_report
    from splitleak.report.audit_prose import audit_words

    out = tmp_path / "audit"
    monkeypatch.setattr(
        audit_plan,
        "AUDIT_ATTACKS",
        (("majority", {}, "public"), ("vmi", {}, "public"), ("reads-the-text", {"root": str(out)}, "public")),
    )
    res = audit_run.run_audit(
        out,
        model="tiny-gpt2",
        words=audit_words,
        depth=2,
        n_calib=16,
        n_train=6,
        n_eval=24,
        seed=1,
        epochs=1,
        say=lambda _: None,
    )
    assert res.verdict.startswith("INSTRUMENT FAULT: the mis-paired negative control of reads-the-text reads"), (
        res.verdict
    )
    report = json.loads((out / "report.json").read_text())
    arms = {a["attack"]: a["arm"] for a in report["attacks"]}
    assert arms["reads-the-text"]["control_verdict"] == "detected"
    assert arms["vmi"]["control_verdict"] == "at floor" and arms["vmi"]["control"]["estimate"] == 0.0
    assert arms["majority"]["control"]["estimate"] == 0.0  # the same guess for every document
    write_audit_report(out)
    md = (out / "report.md").read_text()
    assert "INSTRUMENT FAULT" in md and "mis-paired N (pp)" in md


@pytest.mark.unit
def test_control_docs_is_checked_before_anything_runs(tmp_path):
    from splitleak.audit.run import run_audit
    from splitleak.errors import ConfigError
    from splitleak.report.audit_prose import audit_words

    with pytest.raises(ConfigError, match="--control-docs"):
        run_audit(tmp_path / "a", model="tiny-gpt2", words=audit_words, control_docs=1, say=lambda _: None)
    assert not (tmp_path / "a").exists()


TINY_GRID = """\
name: planted
protocol: proto.yaml
model: tiny-gpt2
depths: [2]
defences: [none]
victim_seeds: [1]
attack_seeds: [0]
client_copies: [public]
documents: {n_calib: 8, n_train: 4, n_eval: 20, doc_len: 8}
steps: 2
attacks:
  - {attack: vmi}
  - {attack: reads-the-text, params: {root: STORE}}
"""


@pytest.mark.e2e
def test_a_grid_report_names_the_fault_of_a_reader_of_the_text(planted, tmp_path):
    from splitleak.audit.protocol import SHIPPED
    from splitleak.experiments import run_grid
    from splitleak.report.grid import grid_report

    store = tmp_path / "store"
    shutil.copy(SHIPPED / "paper_main.yaml", tmp_path / "proto.yaml")
    spec = tmp_path / "planted.yaml"
    spec.write_text(TINY_GRID.replace("STORE", str(store)))
    res = run_grid(spec, store=store, workers=1, threads=1, device="cpu")  # a worker process: the plug-in loads there
    assert not res.failures, res.failures
    rep = grid_report(spec, out=tmp_path / "rep", store=store)
    assert [c["row"]["attack"] for c in rep.control_faults] == ["reads-the-text"]
    assert rep.control_faults[0]["effect"]["low"] > 0.5
    text = " ".join(rep.markdown.read_text().split())
    assert "## Negative controls" in text and "**INSTRUMENT FAULT**: the negative control of 1 job" in text
    assert "| vmi | public | 1 | 0 | 0.00 | 0.00 |" in text  # the reader of the traffic at floor
    assert "Not to be read" in text


@pytest.mark.e2e
def test_the_audit_names_the_server_as_a_reader_and_runs_where_the_labels_stay_home(tmp_path):
    from splitleak.audit.run import run_audit
    from splitleak.report.audit import write_audit_report
    from splitleak.report.audit_prose import audit_words

    small = dict(
        model="tiny-gpt2",
        words=audit_words,
        depth=1,
        n_calib=16,
        n_train=4,
        n_eval=12,
        seed=2,
        epochs=1,
        say=lambda _: None,
    )
    u = run_audit(tmp_path / "u", mode="u-shape", **small)
    report = json.loads((tmp_path / "u" / "report.json").read_text())
    assert report["config"]["offload_start"] == 1 and report["config"]["offload_length"] == 2  # 4 blocks: 1 | 2 | 1
    channels = {c["channel"] for c in report["channels"]}
    assert "labels" not in channels and {"trunk-output", "output-gradient"} <= channels
    assert "In the u-shape split the labels stay on the client" in u.verdict
    assert "reads 100 % of tokens and 100 % of whole documents, with no attack" not in u.verdict
    # without the identity that spares it in the plain split, the all-local baseline is trained
    assert report["utility_baseline"]["source"] == "the all-local baseline run"
    write_audit_report(tmp_path / "u")
    assert "U-shape (blocks 1–2 on the server" in (tmp_path / "u" / "report.md").read_text()
    with pytest.raises(Exception, match="the latent audit is splitleak.audit.latent_audit.run_latent_audit"):
        run_audit(tmp_path / "x", mode="latent", **small)
    with pytest.raises(Exception, match="unknown --mode 'sideways'"):
        run_audit(tmp_path / "x", mode="sideways", **small)
    with pytest.raises(Exception, match="pass a smaller --depth"):
        run_audit(tmp_path / "y", mode="label-shielded", **{**small, "depth": 3})


@pytest.mark.e2e
def test_a_label_shielded_audit_adds_the_reader_of_the_labels(tmp_path):
    import splitleak.audit.plan as audit_plan
    import splitleak.audit.run as audit_run
    from splitleak.report.audit_prose import audit_words

    # the audit's own GMA-SL (audit_plan.SHIELDED_READER: a uniform start, stopped once the labels hold)
    assert audit_plan.MODE_ATTACKS["label-shielded"] == (("gma-sl", audit_plan.SHIELDED_READER, "public"),)
    res = audit_run.run_audit(
        tmp_path / "s",
        mode="label-shielded",
        model="tiny-gpt2",
        words=audit_words,
        depth=1,
        n_calib=16,
        n_train=4,
        n_eval=12,
        seed=3,
        epochs=1,
        say=lambda _: None,
    )
    report = json.loads((tmp_path / "s" / "report.json").read_text())
    assert report["config"]["shielded"] == {"bottom": 1, "top": 2, "train": "all", "answer_only": False}
    gma = next(a for a in report["attacks"] if a["attack"] == "gma-sl")
    assert gma["config"]["params"] == audit_plan.SHIELDED_READER, gma["config"]
    # undefended, the pretrained Top explains the output gradient: nearly every label comes back
    assert gma["label_recovery"] > 0.9 and gma["arm"]["control_verdict"] in ("at floor", "below floor")
    assert "In the label-shielded split the labels stay on the client" in res.verdict
    assert not any(c["channel"] == "labels" for c in report["channels"])
    # undefended, the label-shielded split is the all-local run to float rounding (tests/test_shielded.py): no
    # all-local run is trained for ΔU, and the report says where its all-local loss comes from
    base = report["utility_baseline"]
    assert res.run.metrics["all_local_ce"] is None and not (res.run.run_dir / "all_local.json").exists()
    assert base["all_local_ce"] == res.run.metrics["heldout_ce"] and base["delta_u"] == 0.0
    assert "to float rounding" in base["source"]


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_grid_of_noisy_controls_flags_only_the_reader_of_the_text(seed):
    """Attacks whose reading varies with the batch (a seeded start per chunk) give controls that scatter about 0;
    over hundreds of jobs some would read above floor at 5 % each, so the grid's family is Bonferroni-corrected.
    The reader of the text stands out at any family size."""
    import numpy as np

    from splitleak.audit.verdicts import control_p_value
    from splitleak.report.grid_controls import job_controls

    rng = np.random.default_rng(seed)

    def row(key, delta):
        control = {"per_doc_delta": [float(x) for x in delta], "effect": {"estimate": float(np.mean(delta))}}
        return {
            "key": key,
            "attack": "gma-sl",
            "client_copy": "public",
            "result_json": json.dumps({"control": control}),
        }

    rows = [row(f"n{i}", rng.normal(0, 0.05, 16)) for i in range(400)]
    rows.append(row("cheat", rng.normal(0.6, 0.1, 16)))
    rows += [dict(rows[0])]  # a second row (document) of the same job counts once
    controls = job_controls(rows)
    assert len(controls) == 401
    assert [c["row"]["key"] for c in controls if c["fault"]] == ["cheat"]
    unadjusted = sum(c["p"] < 0.05 for c in controls if c["row"]["key"] != "cheat")
    assert unadjusted > 5  # what an uncorrected 5 % test would have flagged among the noisy ones
    assert control_p_value([0.0] * 16) == 1.0 and control_p_value([0.25] * 16) == 0.0


@pytest.mark.e2e
def test_a_tune_trial_whose_reader_reads_the_text_is_an_instrument_fault(planted, tmp_path, monkeypatch):
    """In `tune`, a trial whose attack reaches the evaluation text (the planted reader, reading every run under
    the working folder) fails as an instrument fault and places nothing on the frontier; with an attack of the
    traffic the same trial completes."""
    import splitleak.experiments.tune as tune_module
    from splitleak.experiments.tune import TuneSettings
    from splitleak.experiments.tune_study import tune

    suite = tune_module.attack_suite()  # the tune's fixed suite, with the planted reader offered beside it
    monkeypatch.setattr(
        tune_module,
        "attack_suite",
        lambda: {**suite, "reads-the-text": {"attack": "reads-the-text", "client_copy": "public"}},
    )
    monkeypatch.chdir(tmp_path)
    tiny = dict(model="tiny-gpt2", budget=0.05, n_calib=16, n_train=4, n_eval=16, doc_len=16, steps=2)
    res = tune(tmp_path / "cheat", TuneSettings(attacks=("reads-the-text",), **tiny), depths=[1], n_trials=1)
    (trial,) = res.trials
    assert trial["error"] is not None and trial["error"].startswith("instrument fault"), trial
    assert "reads-the-text" in trial["error"] and res.passing == [] and res.frontier == []
    honest = tune(tmp_path / "honest", TuneSettings(attacks=("vmi",), **tiny), depths=[1], n_trials=1)
    assert honest.trials[0]["error"] is None and honest.trials[0]["arms"][0]["control_verdict"] == "at floor"


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1])
def test_the_grids_control_family_is_read_at_the_protocols_alpha(seed):
    """The level of the grid's control family is the frozen protocol's: its thresholds.alpha, else its main
    test's; a protocol at a looser level flags a borderline job that the shipped level does not."""
    import numpy as np

    from splitleak.audit.protocol import SHIPPED, load_protocol
    from splitleak.audit.verdicts import control_p_value
    from splitleak.report.grid_controls import control_alpha, job_controls

    gate, _ = load_protocol(SHIPPED / "gate_002.yaml")
    main, _ = load_protocol(SHIPPED / "paper_main.yaml")
    assert control_alpha(gate) == (0.05, "protocol gate-002's thresholds.alpha")
    assert control_alpha(main)[1] == "protocol paper-main's main test"
    loose = gate.model_copy(update={"thresholds": {**gate.thresholds, "alpha": 0.5}})
    assert control_alpha(loose)[0] == 0.5

    rng = np.random.default_rng(seed)
    z = rng.normal(size=16)
    z = (z - z.mean()) / z.std(ddof=1)
    borderline = 0.028 + 0.05 * z  # t = 0.028 / (0.05 / 4) = 2.24 on 15 degrees of freedom: p = 0.02 on any seed
    rows = [
        {"key": f"n{i}", "attack": "vmi", "client_copy": "public",
         "result_json": json.dumps({"control": {"per_doc_delta": list(d), "effect": {"estimate": float(np.mean(d))}}})}
        for i, d in enumerate([rng.normal(0, 0.05, 16) for _ in range(9)] + [borderline])
    ]  # fmt: skip
    p = control_p_value(borderline)
    assert 0.05 / 10 < p < 0.5 / 10, p
    assert [c["row"]["key"] for c in job_controls(rows, control_alpha(loose)[0]) if c["fault"]][-1:] == ["n9"]
    assert "n9" not in [c["row"]["key"] for c in job_controls(rows, control_alpha(gate)[0]) if c["fault"]]


#: the label family's planted reader: the true labels from the record, behind tokens that read nothing
PLANTED_LABELS = textwrap.dedent(
    """
    from pathlib import Path

    import torch

    from splitleak.attacks import Attack, Reconstruction
    from splitleak.runs.truth import phase_documents
    from splitleak.attacks.registry import AttackInfo, register


    class ReadsTheLabels(Attack):
        \"\"\"Planted: the labels (targets 1..T-1) of the documents the traffic is labelled with, read from every
        run's record under ``root``; its tokens are all token 0, so only its labels cheat.\"\"\"

        name = "reads-the-labels"

        def __init__(self, root: str = ".", seed: int = 0):
            self.root, self.seed = root, seed

        def params(self):
            return {"root": self.root, "seed": self.seed}

        def reconstruct(self, traffic, progress=None):
            text = {}
            for docs in Path(self.root).rglob("documents.json"):
                for d in phase_documents(docs.parent, "capture"):
                    text[d.doc_id] = list(d.token_ids)
            truth = torch.tensor([text[i] for i in traffic.doc_ids])
            return Reconstruction(torch.zeros_like(truth), {"labels": truth[:, 1:]})


    register(
        AttackInfo(
            "reads-the-labels", ReadsTheLabels, "planted: reads the labels", reads=(), modes=("label-shielded",)
        )
    )
    """
)


@pytest.mark.e2e
def test_a_reader_of_the_labels_is_caught_by_the_label_familys_control(plant, tmp_path, monkeypatch):
    """The label family's mis-paired control compares the labels an attack read, not only its tokens: a planted
    reader whose tokens read nothing but whose labels come from the record is detected, in ``attack`` and in
    the audit's verdict; GMA-SL, which reads the traffic, is not."""
    import splitleak.audit.plan as audit_plan
    import splitleak.audit.run as audit_run
    from splitleak.report.audit_prose import audit_words

    plant("planted_labels", PLANTED_LABELS, "reads-the-labels")
    out = tmp_path / "s"
    monkeypatch.setattr(
        audit_plan,
        "MODE_ATTACKS",
        {"label-shielded": (("gma-sl", {"steps": 20}, "public"), ("reads-the-labels", {"root": str(out)}, "public"))},
    )
    res = audit_run.run_audit(
        out,
        mode="label-shielded",
        model="tiny-gpt2",
        words=audit_words,
        depth=1,
        n_calib=16,
        n_train=4,
        n_eval=12,
        seed=3,
        epochs=1,
        say=lambda _: None,
    )
    assert res.verdict.startswith("INSTRUMENT FAULT: the mis-paired negative control of reads-the-labels"), res.verdict
    report = json.loads((out / "report.json").read_text())
    arms = {a["attack"]: a for a in report["attacks"]}
    planted = arms["reads-the-labels"]
    assert planted["label_recovery"] == 1.0 and planted["token_recovery"] < 0.5  # only the labels cheat
    assert planted["arm"]["control_verdict"] == "detected"
    assert arms["gma-sl"]["arm"]["control_verdict"] in ("at floor", "below floor")
    # the same in `attack`: the control is the label family's, not the tokens'
    direct = run_attack(
        out / "run",
        make_attack_config(attack="reads-the-labels", params={"root": str(out)}),
        control_docs=8,
    )
    c = direct["control"]
    assert c["verdict"] == "detected" and c["twin_token_recovery"] > 0.9 and c["floor_token_recovery"] < 0.5, c


@pytest.mark.unit
def test_the_grids_banner_names_a_probe_battery_whose_shuffled_twin_reads_above_floor():
    from splitleak.report.grid_controls import _controls_table, _fault_text, control_faults, job_controls

    def probe(key, detected):
        twin = {"type": "shuffled-label", "detected_in": detected}
        result = {"probes": {"negative_control": twin, "control_of_best_arm": 0.3 if detected else 0.0}}
        return {"key": key, "attack": "latent-probe", "client_copy": "public", "result_json": json.dumps(result)}

    token = {"per_doc_delta": [0.0] * 8, "doc_ids": list(range(8)), "effect": {"estimate": 0.0, "high": 0.01}}
    rows = [
        probe("p1", ["gradient", "joint"]),
        probe("p2", []),
        {"key": "t1", "attack": "vmi", "client_copy": "public", "result_json": json.dumps({"control": token})},
    ]
    controls = job_controls(rows)
    assert [c["row"]["key"] for c in controls] == ["t1", "p1", "p2"]
    faults = control_faults(rows)
    assert [c["row"]["key"] for c in faults] == ["p1"]
    assert "shuffled-label twin reads above floor in gradient, joint" in _fault_text(faults[0])
    table = _controls_table(controls)
    assert ["latent-probe (shuffled-label twin, best arm)", "public", "2", "1", "+15.00", "n/a"] in table.rows
    assert ["vmi", "public", "1", "0", "0.00", "+1.00"] in table.rows


TINY_LABEL_GRID = """\
name: planted-labels
protocol: proto.yaml
models: [tiny-gpt2]
shielded:
  - {label: none, bottom: 1, top: 1}
victim_seeds: [1]
attack_seeds: [0]
documents: {n_calib: 8, n_train: 4, n_eval: 20, doc_len: 32}
steps: 2
lr: 1.0e-3
data: {source: instructions}
attacks:
  - {attack: reads-the-labels, params: {root: STORE}}
"""


@pytest.mark.e2e
def test_a_grid_report_names_the_fault_of_a_reader_of_the_labels(plant, tmp_path):
    """The label family in a grid: the planted reader of the labels is the grid's instrument fault."""
    from splitleak.audit.protocol import SHIPPED
    from splitleak.experiments import run_grid
    from splitleak.report.grid import grid_report

    plant("planted_labels", PLANTED_LABELS, "reads-the-labels")
    store = tmp_path / "store"
    shutil.copy(SHIPPED / "mirage_003.yaml", tmp_path / "proto.yaml")
    spec = tmp_path / "planted.yaml"
    spec.write_text(TINY_LABEL_GRID.replace("STORE", str(store)))
    res = run_grid(spec, store=store, workers=1, threads=1, device="cpu")  # a worker process: the plug-in loads there
    assert not res.failures, res.failures
    rep = grid_report(spec, out=tmp_path / "rep", store=store)
    assert [c["row"]["attack"] for c in rep.control_faults] == ["reads-the-labels"]
    assert "**INSTRUMENT FAULT**: the negative control of 1 job" in " ".join(rep.markdown.read_text().split())
