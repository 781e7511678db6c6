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
    assert [r["attack"] for r in whole["readers"]] == ["activation-aware", "crossings-aware"]
    one, every = (r["tokens"] for r in whole["readers"])
    assert every["estimate"] > one["estimate"] and whole["gain"]["estimate"] > 0
    # the capture's readers do not run the reader of every crossing: the evaluation documents crossed once
    assert "crossings-aware" not in {a["attack"] for a in report["attacks"]}
    assert sorted(p.name for p in (out / "passes").iterdir()) == [
        "train-activation-aware.json", "train-activation-aware.parquet",
        "train-crossings-aware.json", "train-crossings-aware.parquet",
    ]  # fmt: skip
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
    assert "## The whole training traffic" in (out / "report.md").read_text()
