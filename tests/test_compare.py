import pytest
from typer.testing import CliRunner

from splitleak.cli import app
from splitleak.errors import SplitleakError
from splitleak.report.compare import compare_runs, leakage_cost_figure, table_rows

runner = CliRunner()
pytestmark = pytest.mark.e2e  # every test here compares whole audits


@pytest.fixture(scope="module")
def audits(tiny_audit):
    """The session's tiny audits (tests/conftest.py), undefended and under two defences."""
    return {d: tiny_audit(d) for d in ("none", "quant4-noisy", "mixup")}


def test_compare_relates_each_defended_run_to_its_undefended_twin(audits):
    runs = compare_runs([audits["none"], audits["quant4-noisy"]])
    none, noisy = runs
    assert none.rel_ppl_change == 0.0
    expected = noisy.metrics["perplexity"] / none.metrics["perplexity"] - 1
    assert noisy.rel_ppl_change == pytest.approx(expected) and noisy.rel_ppl_change != 0
    header, rows = table_rows(runs)
    suite = {
        "majority",
        "vmi",
        "activation k=32",
        "joint k=32",
        "sipit budget=32",
        "sipit budget=32, trained copy",
    }
    # six attacks per audit, one line each; under quant4-noisy also the attacks built for it
    built = {
        "sipit-aware budget=32",
        "sipit-aware budget=32, trained copy",
        "activation-aware k=32",
        "joint-aware k=32",
    }
    assert {r[8] for r in rows if r[1] == "none"} == suite and len([r for r in rows if r[1] == "none"]) == 6
    assert {r[8] for r in rows if r[1] == "quant4-noisy"} == suite | built
    assert {r[8] for r in rows if r[-1] == "yes"} == built and all(r[1] == "quant4-noisy" for r in rows if r[-1])


def test_a_defended_audit_names_the_attacks_built_for_its_defence(audits):
    import json

    noisy = json.loads((audits["quant4-noisy"] / "report.json").read_text())
    none = json.loads((audits["none"] / "report.json").read_text())
    built = [a for a in noisy["attacks"] if a.get("built_for")]
    assert {a["attack"] for a in built} == {"sipit-aware", "activation-aware", "joint-aware"}
    assert all(a["built_for"] == ["quant4-noisy"] for a in built)
    words = noisy["verdict"]
    assert "Attacks built for quant4-noisy" in words and "than the best attack that ignores the defence" in words
    from splitleak.audit.evaluate import attack_label
    from splitleak.metrics import fmt_pct

    for copy in ("public", "trained"):
        mine = [a for a in built if a["threat_model"] == copy]
        best = max(mine, key=lambda a: (a["doc_recovery"], a["token_recovery"]))
        where = " on the public copy" if copy == "public" else ""
        assert f"{attack_label(best)}{where} reads {fmt_pct(best['token_recovery'])} % of tokens" in words
    assert "Attacks built for" not in none["verdict"] and not any(a.get("built_for") for a in none["attacks"])


def test_an_audit_takes_the_all_local_loss_from_a_run_it_trains_anyway(audits):
    """No audit trains the whole model once more: undefended, the split run is the all-local run (ΔU = 0
    exactly, tests/test_experiments.py); defended, the undefended twin is."""
    import json

    none = json.loads((audits["none"] / "report.json").read_text())
    noisy = json.loads((audits["quant4-noisy"] / "report.json").read_text())
    for rep in (none, noisy):
        assert rep["config"]["all_local_baseline"] is False and rep["metrics"]["all_local_ce"] is None
    assert none["utility_baseline"]["delta_u"] == 0.0
    twin_ce = noisy["cost"]["twin_heldout_ce"]
    assert twin_ce == none["metrics"]["heldout_ce"]  # the twin is the undefended run, bit for bit
    assert noisy["utility_baseline"]["all_local_ce"] == twin_ce
    assert noisy["utility_baseline"]["delta_u"] == pytest.approx(noisy["metrics"]["heldout_ce"] - twin_ce)
    assert noisy["utility_baseline"]["delta_u"] != 0
    assert "ΔU = L_split − L_all-local" in (audits["quant4-noisy"] / "report.md").read_text()


def test_a_mixup_audit_attacks_the_probe_rows(audits):
    runs = compare_runs([audits["none"], audits["mixup"]])
    header, rows = table_rows(runs)
    mixup_rows = {r[8]: r for r in rows if r[1].startswith("mixup")}
    assert "mixup-unmix k=32" in mixup_rows
    import json

    report = json.loads((audits["mixup"] / "report.json").read_text())
    channels = {c["channel"]: c for c in report["channels"]}
    assert channels["probe-activations"]["read_by"] == ["mixup-unmix k=32"]
    assert channels["probe-activations"]["status"] == "no positive control"
    unmix = next(a for a in report["attacks"] if a["attack"] == "mixup-unmix")
    plain = next(
        a for a in json.loads((audits["none"] / "report.json").read_text())["attacks"] if a["attack"] == "activation"
    )
    assert unmix["token_recovery"] >= plain["token_recovery"] - 0.01


def test_compare_cli_writes_png_and_svg(audits, tmp_path):
    r = runner.invoke(
        app, ["compare", str(audits["none"]), str(audits["quant4-noisy"]), "--figure", str(tmp_path / "f")]
    )
    assert r.exit_code == 0, r.output
    png, svg = tmp_path / "f.png", tmp_path / "f.svg"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "quant4-noisy, depth 2" in svg.read_text()
    # both sides: each audit's upper side as its verdict says it (no guarantee under either chain here)
    said = " ".join(r.output.split())
    for name in ("none", "quant4-noisy"):
        assert f"upper side: {audits[name]}: Upper side: no formal bound" in said


def test_compare_without_a_baseline_cannot_plot(audits, tmp_path):
    with pytest.raises(SplitleakError, match="undefended run"):
        leakage_cost_figure(compare_runs([audits["quant4-noisy"]]), tmp_path / "f")
    r = runner.invoke(app, ["compare", str(tmp_path)])
    assert r.exit_code == 2 and "neither a finished run" in " ".join(r.output.split())


def test_compare_derives_an_audits_delta_u_from_its_verified_runs_not_from_its_report(audits, tmp_path):
    """An audit's ΔU (no all-local run of its own: the undefended twin's held-out loss) is recomputed from the
    runs, each verified: an edited report.json changes nothing, an edited twin makes the utility unverified."""
    import json
    import shutil

    src = audits["quant4-noisy"]
    report = json.loads((src / "report.json").read_text())
    twin_ce = json.loads((src / "twin" / "metrics.json").read_text())["heldout_ce"]
    (clean,) = compare_runs([src])
    assert clean.unverified is None
    assert clean.metrics["delta_u"] == pytest.approx(clean.metrics["heldout_ce"] - twin_ce) != 0
    assert clean.metrics["delta_u"] == pytest.approx(report["utility_baseline"]["delta_u"])

    edited = tmp_path / "edited-report"
    shutil.copytree(src, edited)
    report["utility_baseline"]["delta_u"] = -9.99
    (edited / "report.json").write_text(json.dumps(report))
    (r,) = compare_runs([edited])
    assert r.unverified is None and r.metrics["delta_u"] == pytest.approx(clean.metrics["delta_u"])

    twin = tmp_path / "edited-twin"
    shutil.copytree(src, twin)
    m = json.loads((twin / "twin" / "metrics.json").read_text())
    (twin / "twin" / "metrics.json").write_text(json.dumps({**m, "heldout_ce": 0.123}))
    (r,) = compare_runs([twin])
    assert r.unverified is not None and "twin" in r.unverified
    header, rows = table_rows([r])
    assert not any("0.123" in cell for row in rows for cell in row)
