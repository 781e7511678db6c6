"""`splitleak audit --mode latent` (splitleak.audit.latent_audit): the decoy system's audit, its verdict words,
its report, its refusals and its resume."""

from __future__ import annotations

import copy
import json

import pytest
from typer.testing import CliRunner

from splitleak.audit.latent_audit import latent_verdict_words
from splitleak.cli import app

#: the tiny audit: 8 steps, 8 capture frames of 8 tokens
TINY = ["--model", "tiny-gpt2", "--steps", "8", "--quiet", "--threads", "1"]


def _record(**change) -> dict:
    """A latent audit record whose readings decide nothing: no exact partition, every view holding, calibrated."""
    part = {"rows": 560, "frames": 8, "frames_exact": 0, "row_agreement": 0.5, "real_row_share": 0.4,
            "control": {"verdict": "at floor", "effect": {"estimate": 0.0}, "fault": False}}  # fmt: skip
    view = {"decision": "holds", "verdict": "at floor", "gate_statistic": 0.004, "paired_effect": -0.01}
    r = {
        "config": {"n_eval": 8, "doc_len": 8},
        "partition": {n: dict(part) for n in ("support", "norm", "classifier")},
        "probes": {"by_view": {v: dict(view) for v in ("forward", "gradient")}, "twin_detected_in": []},
        "dose_ladder": {"onset_token_top1": 0.3},
        "utility": {"passes": True, "text": "within"},
    }
    for path, value in change.items():
        *keys, last = path.split(".")
        at = r
        for k in keys:
            at = at[k]
        at[last] = value
    return r


@pytest.mark.unit
def test_the_verdict_words_follow_what_each_reading_decides():
    assert latent_verdict_words(_record()) == ("HOLDS AT THIS SIZE", [])
    head, parts = latent_verdict_words(_record(**{"partition.support.frames_exact": 8}))
    assert head == "LEAKS" and parts[0].startswith("DECOYS GIVEN AWAY: the support rule") and "8 frames" in parts[0]
    read = _record(**{"probes.by_view.gradient.decision": "breaks", "probes.by_view.gradient.verdict": "detected",
                      "probes.by_view.gradient.gate_statistic": 0.031})  # fmt: skip
    head, parts = latent_verdict_words(read)
    assert head == "LEAKS" and parts == [
        "TOKENS READ: the probes break the +1.0 pp gate on gradient (G up to +3.10 pp), their best arm above the constant"
    ]
    floor = copy.deepcopy(read)
    floor["probes"]["by_view"]["gradient"]["verdict"] = "at floor"
    head, parts = latent_verdict_words(floor)
    assert head == "UNDECIDED AT THIS SIZE" and parts[0].startswith("GATE BROKEN AT FLOOR: on gradient")
    assert "about 64 rows" in parts[0]
    head, parts = latent_verdict_words(_record(**{"dose_ladder.onset_token_top1": None}))
    assert head == "NOT CERTIFIED" and parts[0].startswith("UNCALIBRATED")
    head, parts = latent_verdict_words(_record(**{"probes.twin_detected_in": ["joint"]}))
    assert head == "NOT CERTIFIED" and "INSTRUMENT FAULT" in parts[0] and "shuffled twin on joint" in parts[0]
    fault = _record(**{"partition.norm.control": {"verdict": "detected", "effect": {"estimate": 0.2}, "fault": True}})
    assert "the norm rule's mis-paired twin" in latent_verdict_words(fault)[1][0]
    head, parts = latent_verdict_words(_record(**{"utility": {"passes": False, "text": "over the gate"}}))
    assert head == "HOLDS AT THIS SIZE" and parts == [
        "UTILITY: over the gate; a configuration over the gate is not a passing one"
    ]
    undecided = _record(**{"probes.by_view.forward.decision": "undecided"})
    assert latent_verdict_words(undecided)[0] == "UNDECIDED AT THIS SIZE"


@pytest.mark.unit
@pytest.mark.parametrize(
    "args, words",
    [
        (["--depth", "3"], "--depth do(es) not apply to --mode latent"),
        (["--defence", "mixup"], "--defence do(es) not apply"),
        (["--latent-arg", "width=32"], None),  # with --mode plain: refused below
    ],
)
def test_options_that_do_not_apply_are_refused_before_anything_runs(tmp_path, args, words):
    out = tmp_path / "a"
    if words is None:
        r = CliRunner().invoke(app, ["audit", "--out", str(out), *TINY, *args])
        assert r.exit_code != 0 and "are for --mode latent" in " ".join(r.output.split())
    else:
        r = CliRunner().invoke(app, ["audit", "--mode", "latent", "--out", str(out), *TINY, *args])
        assert r.exit_code != 0 and words in " ".join(r.output.split())
    assert not out.exists()


@pytest.mark.e2e
def test_the_latent_audit_reads_the_open_gradient_as_an_exact_partition_and_resumes(tmp_path):
    out = tmp_path / "latent"
    r = CliRunner().invoke(app, ["audit", "--mode", "latent", "--out", str(out), *TINY, "--n-eval", "8"])
    assert r.exit_code == 0, r.output
    rep = json.loads((out / "report.json").read_text())
    assert rep["mode"] == "latent" and rep["verdict"] == "LEAKS"
    support = rep["partition"]["support"]
    # the open output gradient is zero exactly on the decoys: every frame exact (002 Table 8), its twin at floor
    assert support["frames_exact"] == support["frames"] == 8 and support["row_agreement"] == 1.0
    assert support["control"]["fault"] is False
    assert rep["partition"]["decoy-history"]["frames_exact"] < 8  # fresh decoys repeat no earlier row
    assert rep["probes"]["battery"]["threat"] == "shadow" and rep["probes"]["by_view"]["forward"]["declared_J"] == 9
    assert rep["dose_ladder"]["doses"][-1]["token_top1"]["verdict"] == "detected"  # the full dose is read
    assert "oracle" in rep["dose_ladder"]["note"]
    md = (out / "report.md").read_text()
    assert "## Which rows are real" in md and "| support" in md and "LEAKS" in md
    assert (out / "report.html").read_text().startswith("<!DOCTYPE html>")
    # --resume reuses the run and every reading, and writes the same record
    again = CliRunner().invoke(app, ["audit", "--mode", "latent", "--out", str(out), *TINY, "--n-eval", "8",
                                     "--resume"])  # fmt: skip
    assert again.exit_code == 0 and "the run in" in again.output and "probes reused" in again.output
    assert json.loads((out / "report.json").read_text()) == rep
    # a split audit's --resume does not continue a latent one
    plain = CliRunner().invoke(app, ["audit", "--out", str(out), *TINY, "--resume"])
    assert plain.exit_code != 0 and "holds a latent audit" in " ".join(plain.output.split())
    # compare reads split runs: a latent audit is refused in one line
    c = CliRunner().invoke(app, ["compare", str(out)])
    assert c.exit_code != 0 and "is a latent-mode run" in " ".join(c.output.split())
    # without --resume or --force the folder is refused; a folder the audit did not write is refused with --force
    assert CliRunner().invoke(app, ["audit", "--mode", "latent", "--out", str(out), *TINY]).exit_code != 0
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    r = CliRunner().invoke(app, ["audit", "--mode", "latent", "--out", str(tmp_path / "other"), *TINY, "--force"])
    assert r.exit_code != 0 and "not a latent audit folder" in " ".join(r.output.split())
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


@pytest.mark.unit
def test_the_split_is_a_named_preset_or_s_over_r():
    from splitleak.audit.latent_audit import latent_settings
    from splitleak.errors import ConfigError

    assert latent_settings("smollm2-135m", "main", {"width": 32}) == {"split_after": 15, "resume_at": 28, "width": 32}
    assert latent_settings("tiny-gpt2", "1/3", {}) == {"split_after": 1, "resume_at": 3}
    with pytest.raises(ConfigError, match="S/R with two block indices"):
        latent_settings("tiny-gpt2", "one/3", {})
    with pytest.raises(ConfigError, match="main"):
        latent_settings("tiny-gpt2", "sideways", {})
