"""The audit reads the whole training traffic under a noise defence (splitleak.audit.passes): every pass, one
crossing at a time and all at once, beside the bound over the same crossings."""

import json

import pytest
from typer.testing import CliRunner

from splitleak.cli import app

NOISE = [{"name": "clip-noise", "args": {"clip": 0.1, "sigma": 0.3, "where": "both"}}]


@pytest.mark.unit
def test_epochs_and_steps_are_one_choice_and_epochs_must_be_a_count(tmp_path):
    runner = CliRunner()
    for extra, said in [
        (["--steps", "4", "--epochs", "2"], "--steps and --epochs both set the training steps; pass one"),
        (["--epochs", "0"], "--epochs takes a number of passes over the training documents (>= 1), got 0"),
    ]:
        r = runner.invoke(app, ["audit", "--model", "tiny-gpt2", "--out", str(tmp_path / "a"), "--quiet", *extra])
        out = " ".join(r.output.split())
        assert r.exit_code == 2 and said in out and "Traceback" not in out, out
        assert not (tmp_path / "a").exists()


@pytest.mark.e2e
def test_a_noise_audit_reads_every_pass_beside_the_bound_over_them(tmp_path):
    from splitleak.audit.run import run_audit
    from splitleak.report.audit import write_audit_report
    from splitleak.report.audit_prose import audit_words

    out = tmp_path / "audit"
    options = dict(
        model="tiny-gpt2", words=audit_words, defences=NOISE, n_calib=4, n_train=4, n_eval=8, epochs=3, seed=0,
        draws="os", device="cpu", threads=1, certify=8, control_docs=2, twin=False, say=lambda _: None,
    )  # fmt: skip
    run_audit(out, **options)
    report = json.loads((out / "report.json").read_text())
    # a resume reuses the whole-traffic readings as written (passes/ is the audit's own), and a changed one is refused
    written = {p.name: p.stat().st_mtime_ns for p in (out / "passes").iterdir()}
    run_audit(out, resume=True, **options)
    assert json.loads((out / "report.json").read_text())["whole_traffic"] == report["whole_traffic"]
    assert {p.name: p.stat().st_mtime_ns for p in (out / "passes").iterdir()} == written  # nothing ran again
    whole = report["whole_traffic"]
    assert whole["epochs"] == 3 and whole["steps"] == 12 and whole["documents"] == 4
    assert whole["crossings"] == {"min": 3, "max": 3}
    # clip-noise on both wires: the reader of every crossing of the activations, and of the returned gradients,
    # each beside the reader of one crossing it adapts
    names = ["activation-aware", "crossings-aware", "joint-aware", "joint-crossings"]
    assert [r["attack"] for r in whole["readers"]] == names
    one, every = (r["tokens"] for r in whole["readers"][:2])
    assert every["estimate"] > one["estimate"] and whole["gain"]["estimate"] > 0
    assert [(g["reader"], g["against"]) for g in whole["gains"]] == [
        (whole["readers"][1]["label"], whole["readers"][0]["label"]),
        (whole["readers"][3]["label"], whole["readers"][2]["label"]),
    ]
    # the capture's readers do not run the readers of every crossing: the evaluation documents crossed once
    assert not {"crossings-aware", "joint-crossings"} & {a["attack"] for a in report["attacks"]}
    assert sorted(p.name for p in (out / "passes").iterdir()) == sorted(
        f"train-{n}{twin}.{ext}" for n in names for twin in ("", "-twin") for ext in ("json", "parquet")
    )
    # each reader's mis-paired twin over every pass: four documents, each labelled as another, read at floor
    for r in whole["readers"]:
        assert (
            sorted(r["control"]["doc_ids"]) == sorted(r["control"]["given_doc_ids"])
            and len(r["control"]["doc_ids"]) == 4
        )
        assert all(d != g for d, g in zip(r["control"]["doc_ids"], r["control"]["given_doc_ids"]))
        assert r["control"]["verdict"] != "detected"
    assert whole["control_faults"] == []
    # the bound composes every pass: the training documents' ε is above the evaluation documents' (one crossing)
    bound = whole["bound"]
    assert bound["crossings_max"] == 3 * report["bound"]["crossings_max"]  # each channel of a document, per pass
    assert bound["epsilon_doc_max"] > report["bound"]["epsilon_doc_max"]  # (both token bounds are 100 % here)
    assert every["low"] <= bound["token_bound"] and not whole["fault"]
    # the mechanism's game reads no document: played once, in the audit's own bound, where it holds
    assert "mechanism_audit" not in bound and [m["fault"] for m in report["bound"]["mechanism_audit"]] == [False, False]
    said = " ".join(report["verdict_parts"])
    assert "Over the whole training traffic (3 passes, 4 documents crossing 3–3 times)" in said
    assert f"no reader can read more than {100 * bound['token_bound']:.2f}"[:40] in said
    write_audit_report(out)
    md = (out / "report.md").read_text()
    assert "## The whole training traffic" in md and "mis-paired N" in md


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
def test_the_whole_traffic_control_holds_a_reader_of_the_traffic_and_catches_a_reader_of_the_text(
    shared_run, monkeypatch, seed
):
    """The mis-paired twin over every pass (``passes.mispaired_documents``): each document's crossings, together,
    labelled as another's. crossings-aware reads it at floor; a planted reader that takes the training tokens
    from the run's own record by the documents' ids reads the documents it is labelled as, and is detected."""
    import torch

    from splitleak.attacks import load_traffic, make_attack_config
    from splitleak.attacks.base import Reconstruction
    from splitleak.attacks.crossings import CrossingsAware
    from splitleak.audit.evaluate import run_attack
    from splitleak.audit.passes import document_control, mispaired_documents
    from splitleak.runs.truth import eval_token_ids

    spec = [{"name": "clip-noise", "args": {"clip": 0.1, "sigma": 0.3, "where": "forward"}}]
    run = shared_run(model="tiny-gpt2", depth=2, n_calib=8, n_train=4, n_eval=6, all_local_baseline=False,
                     draws="derived", steps=12, seed=seed, defences=spec)  # fmt: skip
    traffic = load_traffic(run, phase="train")
    rows, given, twin = mispaired_documents(traffic, seed)
    docs = list(dict.fromkeys(int(d) for d in traffic.doc_ids))
    assert len(twin) == len(traffic) == 12 and all(r != g for r, g in zip(rows, given))
    # a document's three crossings stay together: the twin's rows of one label are one document's, all of them
    for r, g in zip(rows, given):
        picked = [i for i, d in enumerate(twin.doc_ids) if d == docs[r]]
        assert torch.equal(
            twin.activations[picked], traffic.activations[[i for i, d in enumerate(traffic.doc_ids) if d == docs[g]]]
        )
    truth = eval_token_ids(run, docs, phase="train")
    cfg = make_attack_config(attack="crossings-aware", attack_seed=seed, params={"k": 4}, phase="train")

    def control():
        arm = run_attack(run, cfg, traffic=traffic, verify=False, control_docs=0)["per_doc"]
        mis = run_attack(run, cfg, traffic=twin, verify=False, control_docs=0)["per_doc"]
        return document_control(arm, mis, docs, truth, rows, given, "tokens", seed)

    honest = control()
    assert honest["verdict"] != "detected" and abs(honest["effect"]["estimate"]) < 0.2

    def reads_the_truth(self, traffic, progress=None):  # planted: the training tokens from the run's own record
        record = json.loads((run / "documents.json").read_text())["train"]
        text = {d["doc_id"]: d["token_ids"] for d in record}
        return Reconstruction(torch.tensor([text[i] for i in traffic.doc_ids]))

    monkeypatch.setattr(CrossingsAware, "reconstruct", reads_the_truth)
    planted = control()
    # measured: +100 pp and +80 pp [+41, +100] (two documents of seed 1 share many tokens position by position)
    assert planted["verdict"] == "detected" and planted["effect"]["estimate"] > 0.5 and planted["effect"]["low"] > 0.3
