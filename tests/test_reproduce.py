"""``splitleak reproduce`` on the tiny model: claims files, plan, verdicts, power, report, resume."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import yaml

from splitleak.errors import ConfigError, IntegrityError

TINY_SPEC = """\
name: tiny-reproduction
protocol: proto.yaml
model: tiny-gpt2
depths: [2, 3]
defences: [none]
victim_seeds: [1, 2]
attack_seeds: [0]
client_copies: [public]
documents: {n_calib: 8, n_train: 4, n_eval: 12, doc_len: 8}
steps: 2
attacks:
  - {attack: activation, k: [4]}
  - {attack: joint, k: [4]}
profiles:
  quick: {}
  full: {}
"""


def _claims(spec, level=0.5, tolerance=0.05, k=4):
    arm = {"k": k, "depth": 2, "client_copy": "public", "defence": "none"}
    return {
        "paper": "900",
        "title": "a tiny paper",
        "version": 1,
        "source": "this test",
        "analogues": [{"name": "deeper", "base": str(spec), "spec": str(spec), "map": {"depth": {2: 3}}}],
        "claims": [
            {
                "id": "gain",
                "wording": "the gradient adds tokens",
                "where": "§1",
                "paper": {"estimate": 0.03, "low": 0.02, "high": 0.04, "unit": "pp"},
                "statistic": {
                    "kind": "difference",
                    "metric": "token_recovery",
                    "treatment": {"attack": "joint", **arm},
                    "control": {"attack": "activation", **arm},
                },
                "agreement": {"rule": "pass-mark", "pass_mark": 0.0},
                "spec": str(spec),
            },
            {
                "id": "level",
                "wording": "activations give half the tokens",
                "where": "§2",
                "paper": {"estimate": level, "unit": "%"},
                "statistic": {
                    "kind": "level",
                    "metric": "token_recovery",
                    "treatment": {"attack": "activation", **arm},
                },
                "agreement": {"rule": "tolerance", "tolerance": tolerance, "ours": True},
                "spec": str(spec),
            },
            {
                "id": "words",
                "wording": "a claim no reader measures",
                "where": "§3",
                "paper": {"estimate": None, "unit": "words"},
                "statistic": {"kind": "other", "metric": "mood", "form": "prose"},
                "agreement": {"rule": "sign", "direction": "above"},
                "spec": str(spec),
            },
        ],
    }


@pytest.fixture
def tiny(tmp_path):
    from splitleak.audit.protocol import SHIPPED

    shutil.copy(SHIPPED / "paper_main.yaml", tmp_path / "proto.yaml")
    spec = tmp_path / "tiny.yaml"
    spec.write_text(TINY_SPEC)

    def write(name="claims.yaml", **kw):
        path = tmp_path / name
        path.write_text(yaml.safe_dump(_claims(spec, **kw)))
        return path

    return tmp_path, write


@pytest.mark.unit
def test_the_shipped_claims_parse_and_hash_as_recorded():
    from splitleak.reproduce.claims import PAPERS, load_claims

    for paper in PAPERS:
        f, digest = load_claims(paper)
        assert f.paper == paper and len(f.claims) >= 20 and len(digest) == 64
        assert all(c.spec in ("paper_main", "partial_offloading", "decoys", "mirage") for c in f.claims)


@pytest.mark.unit
def test_a_shipped_claims_file_edited_without_a_new_version_is_refused(tmp_path, monkeypatch):
    import splitleak.reproduce.claims as claims

    folder = tmp_path / "claims"
    shutil.copytree(claims.SHIPPED_CLAIMS, folder)
    monkeypatch.setattr(claims, "SHIPPED_CLAIMS", folder)
    monkeypatch.setattr(claims, "HASHES_FILE", folder / "CLAIMS.sha256.json")
    v = claims.load_claims("000")[0].version
    text = (folder / "000.yaml").read_text().replace("estimate: 0.0317", "estimate: 0.0318", 1)
    (folder / "000.yaml").write_text(text)
    with pytest.raises(IntegrityError, match=f"000.yaml \\(version {v}\\) hashes to .* records"):
        claims.load_claims("000")
    (folder / "000.yaml").write_text(text.replace(f"version: {v}", f"version: {v + 1}", 1))
    claims.record_hash("000")  # a new version is recorded beside the old ones
    assert claims.load_claims("000")[0].version == v + 1
    assert set(json.loads((folder / "CLAIMS.sha256.json").read_text())["000.yaml"]) >= {str(v), str(v + 1)}


@pytest.mark.unit
def test_a_bad_claim_is_refused_naming_it(tmp_path):
    from splitleak.reproduce.claims import parse_claims

    data = _claims("x")
    data["claims"][0]["paper"] = {"estimate": 0.05, "low": 0.02, "high": 0.04, "unit": "pp"}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="estimate 0.05 lies outside"):
        parse_claims(tmp_path / "c.yaml")
    data = _claims("x")
    data["claims"][1]["agreement"] = {"rule": "tolerance"}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="rule tolerance needs tolerance"):
        parse_claims(tmp_path / "c.yaml")


@pytest.mark.unit
@pytest.mark.parametrize("effect, sd, n", [(0.03, 0.1, 50), (0.01, 0.2, 300), (0.2, 1.0, 10), (0.0317, 0.05, 2560)])
def test_the_power_column_equals_statsmodels(effect, sd, n):
    from statsmodels.stats.power import TTestPower

    from splitleak.stats.power import detectable_effect, paired_power, units_needed

    tp = TTestPower()
    assert paired_power(effect, sd, n) == pytest.approx(tp.power(effect_size=effect / sd, nobs=n, alpha=0.05), abs=1e-9)
    assert detectable_effect(sd, n) == pytest.approx(tp.solve_power(nobs=n, alpha=0.05, power=0.8) * sd, rel=1e-5)
    needed = tp.solve_power(effect_size=effect / sd, alpha=0.05, power=0.8)
    assert units_needed(effect, sd) == int(-(-needed // 1))  # the continuous count, rounded up


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1])
def test_the_seeds_t_interval_equals_statsmodels(seed):
    """The per-seed readers' Student's t interval (``stats.power.t_half_width``) is statsmodels' over the same units;
    one unit has none."""
    from statsmodels.stats.weightstats import DescrStatsW

    from splitleak.stats.power import t_half_width

    x = np.random.default_rng(seed).normal(0.02, 0.01, size=3 + seed)
    low, high = DescrStatsW(x).tconfint_mean(alpha=0.05)
    assert (x.mean() - t_half_width(x), x.mean() + t_half_width(x)) == pytest.approx((low, high), rel=1e-12)
    assert t_half_width(x, 0.01) > t_half_width(x)
    assert np.isnan(t_half_width(x[:1])) and t_half_width([0.3, 0.3, 0.3]) == 0.0


@pytest.mark.unit
def test_a_claim_whose_jobs_are_missing_fails_at_plan(tiny):
    from typer.testing import CliRunner

    from splitleak.cli import app

    folder, write = tiny
    good = write()
    r = CliRunner().invoke(app, ["reproduce", "--claims", str(good), "--plan"])
    assert r.exit_code == 0, r.output
    assert "gain: 4 job(s)" in r.output and "words: no reader of this statistic is built yet (prose)" in r.output
    bad = write("bad.yaml", k=64)  # no job of the spec runs k = 64
    r = CliRunner().invoke(app, ["reproduce", "--claims", str(bad), "--plan"])
    assert r.exit_code == 2 and "2 claim(s) name jobs their spec does not plan" in " ".join(r.output.split())
    assert "gain (spec" in r.output and "level (spec" in r.output
    # a spec whose claims no reader measures is planned, not run
    from splitleak.reproduce.claims import parse_claims
    from splitleak.reproduce.plan import plan_reproduction

    only = yaml.safe_load(good.read_text())
    only["claims"] = [c for c in only["claims"] if c["id"] == "words"]
    (folder / "words.yaml").write_text(yaml.safe_dump(only))
    p = plan_reproduction([parse_claims(folder / "words.yaml")], "quick")
    assert list(p.grids) == [str(folder / "tiny.yaml")] and p.needed() == []


@pytest.mark.e2e
def test_a_tiny_reproduction_judges_its_claims_from_the_store_and_resumes(tiny):
    from splitleak.audit.analysis import compare, score_matrix, select
    from splitleak.experiments import read_results
    from splitleak.reproduce.run import reproduce
    from splitleak.stats.bootstrap import crossed_bootstrap_ci

    folder, write = tiny
    out = folder / "out"
    claims = write()
    rep = reproduce([], out, profile="quick", claims=[claims], n_boot=2000, run_grid_kwargs={"workers": 1})
    got = {j.claim.id: j for j in rep.judgements["900"]}
    assert got["words"].verdict == "not run" and "prose" in got["words"].reason
    rows = read_results(out / "stores" / "tiny", "attack", as_rows=True)
    arm = {"k": 4, "depth": 2, "client_copy": "public", "defence": "none"}
    c = compare(rows, {"attack": "joint", **arm}, {"attack": "activation", **arm}, metric="token_recovery",
                alpha=0.05, mark=0.0, n_boot=2000, seed=0)  # fmt: skip
    m = got["gain"].ours
    assert m is not None and (m.estimate, m.low, m.high) == (c.estimate, c.low, c.high)  # the analysis of the store
    level = got["level"].ours
    mat, _, _ = score_matrix(select(rows, {"attack": "activation", **arm}), "token_recovery")
    iv = crossed_bootstrap_ci(mat, n_boot=2000, seed=0)
    assert (level.estimate, level.low, level.high) == (iv.estimate, iv.low, iv.high)
    assert level.docs == 12 and len(level.seeds) == 2 and np.isclose(level.units.mean(), level.estimate)
    assert got["gain"].detectable is not None and got["gain"].needed is not None
    report = json.loads((out / "report.json").read_text())
    assert {c["id"]: c["verdict"] for c in report["papers"]["900"]["claims"]} == {k: j.verdict for k, j in got.items()}
    md = (out / "report.md").read_text()
    assert re.search(r"\|\s+900 \|\s+3 \|", md) and "## 900: a tiny paper" in md
    # editing the paper's number changes that row's verdict; the store is read again, nothing runs
    near = write(level=round(level.estimate, 4), tolerance=0.5)
    again = reproduce([], out, profile="quick", claims=[near], n_boot=2000, resume=True, run_grid_kwargs={"workers": 1})
    assert again.ran == {str(folder / "tiny.yaml"): 0}
    assert {j.claim.id: j.verdict for j in again.judgements["900"]}["level"] == "agrees"
    far = write(level=min(1.0, level.high + 0.3) if level.high < 0.6 else 0.0, tolerance=0.01)
    third = reproduce([], out, profile="quick", claims=[far], n_boot=2000, resume=True, run_grid_kwargs={"workers": 1})
    assert {j.claim.id: j.verdict for j in third.judgements["900"]}["level"] == "disagrees"
    with pytest.raises(ConfigError, match="holds a reproduction already; pass --resume"):
        reproduce([], out, profile="quick", claims=[far], run_grid_kwargs={"workers": 1})
    _families_and_ratios_read_the_same_store(rows, got["gain"], arm)
    _positions_read_against_the_runs_documents(out / "stores" / "tiny", rows, got["gain"], arm)
    _priced_from_the_measured_seconds(out, rep.plan)
    # the analogue column is the same claim read at the mapped depth, from the same store
    from splitleak.reproduce.claims import Claim
    from splitleak.reproduce.run import judge_claim

    deeper = got["gain"].analogues["deeper"]
    st = got["gain"].claim.statistic
    at3 = Claim(**{**got["gain"].claim.model_dump(), "statistic": {**st.model_dump(), "treatment": {**st.treatment, "depth": 3},
                                                                   "control": {**st.control, "depth": 3}}})  # fmt: skip
    direct = judge_claim(at3, rows, [], 2000)
    assert (deeper.ours.estimate, deeper.ours.low, deeper.verdict) == (
        direct.ours.estimate,
        direct.ours.low,
        direct.verdict,
    )
    words = next(j for j in rep.judgements["900"] if j.claim.id == "words")
    assert words.analogues == {} and set(got["level"].analogues) == {"deeper"}  # no arm to translate: none
    assert (out / "claims-900.png").is_file() and "claims-900.png" in md  # the paper's number beside ours
    from splitleak.reproduce.report import figure_points

    placed = figure_points(rep.judgements["900"])
    assert [p[0] for p in placed["differences (pp)"]] == ["gain"] and [p[0] for p in placed["levels (%)"]] == ["level"]
    assert placed["differences (pp)"][0][3] == pytest.approx((100 * m.estimate, 100 * m.low, 100 * m.high))
    header = next(line for line in md.splitlines() if line.startswith("| claim "))
    assert [c.strip() for c in header.strip("|").split("|")][6] == "deeper"  # its column, after the verdict's why
    assert "Analogue 'deeper'" in md


def _priced_from_the_measured_seconds(out, plan):
    """The full profile priced from the quick run: the projection of the store's measured job seconds
    (experiments.cost.project; here the same jobs, so each configuration's measured seconds stand for both victim
    seeds' jobs), times the threads each job ran with."""
    from splitleak.experiments import read_results
    from splitleak.experiments.cost import project
    from splitleak.reproduce.plan import price

    (spec,) = plan.needed()
    threads = json.loads((out / "reproduction.json").read_text())["execution"]["threads"]
    store = out / "stores" / "tiny"
    proj = project(spec, "quick", plan.overrides[spec], store)
    assert proj["missing"] == 0 and proj["doc_ratio"] == 1 and proj["step_ratio"] == 1
    train = sorted(r["seconds"] for r in read_results(store, "train", as_rows=True))
    assert min(train) * len(train) <= proj["train_s"] <= max(train) * len(train)  # one run's seconds per seed
    # each attack job stands on a measured job of its configuration: its seconds and its twin's
    from splitleak.experiments.cost import signature

    by_sig: dict = {}
    for r in {r["key"]: r for r in read_results(store, "attack", as_rows=True)}.values():
        twin = (json.loads(r["result_json"]).get("control") or {}).get("seconds", 0.0)
        by_sig.setdefault(signature(r), []).append(r["seconds"] + twin)
    low = sum(len(v) * min(v) for v in by_sig.values())
    high = sum(len(v) * max(v) for v in by_sig.values())
    assert low - 1e-9 <= proj["attack_s"] <= high + 1e-9 and proj["attack_measured"] == sum(map(len, by_sig.values()))
    (row,) = price(plan, out)
    assert row.spec == spec and row.unmeasured == 0 and row.unit == "core-hours" and row.threads == threads
    assert row.hours == pytest.approx((proj["attack_s"] + proj["train_s"]) * threads / 3600, rel=1e-12)
    with pytest.raises(ConfigError, match="holds no reproduction"):
        price(plan, out / "stores")


def _positions_read_against_the_runs_documents(store, rows, gain, arm):
    """Each row's positions, set against its run's documents in the store: they count what the row counts; the
    first-token level and the gross share equal the same numbers computed here from the predictions and the
    documents; a row whose reading does not match its run is refused, naming it."""
    from splitleak.errors import DataError
    from splitleak.experiments.store import ResultsStore
    from splitleak.reproduce.claims import Claim
    from splitleak.reproduce.positions import with_positions
    from splitleak.reproduce.run import judge_claim
    from splitleak.runs.truth import eval_token_ids

    pos = with_positions(rows, store)
    assert all(r["correct"] is not None and sum(r["correct"]) == r["token_correct"] for r in pos)
    truth = {
        (r["key"], r["doc_id"]): eval_token_ids(ResultsStore(store).run_dir(r["train_key"]), [r["doc_id"]])[0]
        for r in pos
    }
    picked = {
        a: [r for r in pos if r["attack"] == a and r["depth"] == 2 and r["k"] == 4] for a in ("joint", "activation")
    }
    base = gain.claim.model_dump()
    first = {**base["statistic"], "kind": "level", "metric": "first_token_recovery", "control": None}
    j = judge_claim(
        Claim(**{**base, "statistic": first, "agreement": {"rule": "tolerance", "tolerance": 0.5}}), pos, [], 2000
    )
    want = np.mean([r["predicted"][0] == truth[r["key"], r["doc_id"]][0] for r in picked["joint"]])
    assert j.ours is not None and j.ours.estimate == pytest.approx(want) and j.ours.docs == 12
    assert "no reading per position" in judge_claim(Claim(**{**base, "statistic": first}), rows, [], 2000).reason
    gross = {**base["statistic"], "kind": "share", "form": "gross"}
    g = judge_claim(
        Claim(**{**base, "statistic": gross, "agreement": {"rule": "tolerance", "tolerance": 0.5}}), pos, [], 2000
    )
    act = {(r["victim_seed"], r["doc_id"]): np.array(r["correct"]) for r in picked["activation"]}
    num = sum(int((~act[r["victim_seed"], r["doc_id"]] & np.array(r["correct"])).sum()) for r in picked["joint"])
    den = sum(int((~a).sum()) for a in act.values())
    if den:
        assert g.ours is not None and g.ours.estimate == pytest.approx(num / den)
    else:
        assert g.verdict == "not run" and "no miss" in g.reason
    bad = [dict(r) for r in rows]
    bad[0]["token_correct"] = (bad[0]["token_correct"] + 1) % (len(bad[0]["predicted"]) + 1)  # not what it read
    with pytest.raises(DataError, match="is not the run it read"):
        with_positions(bad, store)


def _families_and_ratios_read_the_same_store(rows, gain, arm):
    """A family's member is the plain claim's reading; a member the store lacks keeps the family from agreeing;
    Bonferroni widens each member's interval; a ratio is the ratio of the paired means, resampled together."""
    from splitleak.audit.analysis import paired_matrices
    from splitleak.reproduce.claims import Claim
    from splitleak.reproduce.run import judge_claim
    from splitleak.stats.bootstrap import crossed_replicates

    base = gain.claim.model_dump()
    fixed = {k: v for k, v in arm.items() if k != "k"}
    fam = {"kind": "family", "member": "difference", "metric": "token_recovery", "over": {"k": [4, 8]},
           "treatment": {"attack": "joint", **fixed}, "control": {"attack": "activation"}}  # fmt: skip
    loose = {"rule": "sign", "direction": "above"} if gain.ours.low > 0 else {"rule": "sign", "direction": "below"}
    j = judge_claim(Claim(**{**base, "statistic": fam, "agreement": loose}), rows, [], 2000)
    first, missing = j.members
    assert (first.ours.estimate, first.ours.low, first.ours.high) == (gain.ours.estimate, gain.ours.low, gain.ours.high)
    assert missing.verdict == "not run" and first.verdict in ("agrees", "underpowered")
    assert j.verdict == "underpowered" and "1 not run of 2 configurations" in j.reason  # never agrees on half
    only = judge_claim(Claim(**{**base, "statistic": {**fam, "over": {"k": [4]}}, "agreement": loose}), rows, [], 2000)
    assert only.verdict == first.verdict  # the same member alone decides
    wide = judge_claim(Claim(**{**base, "statistic": {**fam, "over": {"k": [4]}, "bonferroni": 20}}), rows, [], 2000)
    w = wide.members[0].ours
    assert (
        w.low <= first.ours.low and w.high >= first.ours.high and (w.high - w.low) > (first.ours.high - first.ours.low)
    )
    assert "alpha 0.0025: Bonferroni over 20" in wide.reason
    ratio = {**gain.claim.statistic.model_dump(), "kind": "ratio"}
    r = judge_claim(Claim(**{**base, "statistic": ratio, "agreement": {"rule": "tolerance", "tolerance": 0.1}}),
                    rows, [], 2000).ours  # fmt: skip
    a, b, _, _ = paired_matrices(rows, ratio["treatment"], ratio["control"], "token_recovery")
    reps = crossed_replicates(a, 2000, 0) / crossed_replicates(b, 2000, 0)
    assert r.estimate == pytest.approx(a.mean() / b.mean(), rel=1e-12)
    assert (r.low, r.high) == pytest.approx(tuple(np.quantile(reps, [0.025, 0.975])), rel=1e-12)


@pytest.mark.unit
def test_metrics_recorded_once_per_job_or_run_are_read_per_victim_seed():
    """label_recovery (a label attack's result) and heldout_ce (a run's) are paired by victim seed, with
    Student's t over the seeds; the strongest reader is read beside the paper's."""
    from scipy import stats

    from splitleak.reproduce.claims import Claim
    from splitleak.reproduce.run import judge_claim

    got = {("gma-sl", "mirage"): [0.30, 0.34, 0.26], ("gma-sl", "none"): [0.80, 0.78, 0.82]}
    got |= {("gma-sl-aware", "mirage"): [0.60, 0.66, 0.62], ("gma-sl-aware", "none"): [0.81, 0.79, 0.83]}
    rows = [
        {"key": f"{a}-{d}-{s}-{doc}", "attack": a, "defence": d, "victim_seed": s, "doc_id": doc,
         "result_json": json.dumps({"label_recovery": v})}
        for (a, d), vals in got.items() for s, v in zip((1, 2, 3), vals) for doc in range(4)
    ]  # fmt: skip
    train = [
        {"key": f"t-{d}-{s}", "defence": d, "victim_seed": s, "heldout_ce": ce}
        for d, ces in (("mirage", [2.2, 2.31, 2.24]), ("none", [2.0, 2.1, 2.05]))
        for s, ce in zip((1, 2, 3), ces)
    ]
    claim = Claim(
        id="b", wording="w", where="§4", spec="mirage", stronger={"attack": "gma-sl-aware"},
        paper={"estimate": None, "unit": "share"},
        statistic={"kind": "difference", "metric": "label_recovery", "treatment": {"attack": "gma-sl", "defence": "mirage"},
                   "control": {"attack": "gma-sl", "defence": "none"}},
        agreement={"rule": "qualitative", "direction": "below", "threshold": -0.1},
    )  # fmt: skip
    j = judge_claim(claim, rows, train)
    diffs = [t - c for t, c in zip(got[("gma-sl", "mirage")], got[("gma-sl", "none")])]
    half = stats.t.isf(0.025, 2) * np.std(diffs, ddof=1) / np.sqrt(3)
    assert j.ours is not None and j.ours.unit == "victim seeds" and j.ours.seeds == [1, 2, 3]
    assert j.ours.estimate == pytest.approx(np.mean(diffs)) and j.ours.low == pytest.approx(np.mean(diffs) - half)
    assert j.verdict == "agrees"  # far below the threshold
    assert j.stronger is not None and j.stronger.ours is not None
    assert j.stronger.ours.estimate == pytest.approx(np.mean([-0.21, -0.13, -0.21]))
    ce = claim.model_copy(
        update={
            "stronger": None,
            "statistic": claim.statistic.model_copy(
                update={"metric": "heldout_ce", "treatment": {"attack": None, "defence": "mirage"},
                        "control": {"attack": None, "defence": "none"}}
            ),
            "agreement": claim.agreement.model_copy(update={"direction": "above", "threshold": 0.0}),
        }
    )  # fmt: skip
    u = judge_claim(ce, rows, train)
    assert u.ours is not None and u.ours.estimate == pytest.approx(0.2) and u.verdict == "agrees"
    one = judge_claim(claim, [r for r in rows if r["victim_seed"] == 1], train)
    assert one.verdict == "underpowered" and "one victim seed" in one.reason


@pytest.mark.unit
def test_label_recovery_recorded_per_document_is_read_over_documents_with_an_interval_from_one_seed():
    """A label attack that records each document's label recovery (``label_recovery_per_doc``) is read as token
    recovery is: (victim seeds x documents), the paired difference by the crossed bootstrap, so one victim seed
    has an interval; a store whose rows lack it falls back to the per-seed reading (none from one seed)."""
    from splitleak.reproduce.claims import Claim
    from splitleak.reproduce.run import judge_claim
    from splitleak.stats import paired_difference_ci

    rng = np.random.default_rng(5)
    per = {("gma-sl", "mirage"): rng.uniform(0.1, 0.4, 8), ("gma-sl", "none"): rng.uniform(0.7, 0.95, 8)}
    rows = [
        {"key": f"{a}-{d}-1", "attack": a, "defence": d, "victim_seed": 1, "doc_id": doc, "attack_seed": 0,
         "data_seed": 0, "result_json": json.dumps({"label_recovery": float(v.mean()),
                                                    "label_recovery_per_doc": [[i, float(x)] for i, x in enumerate(v)]})}
        for (a, d), v in per.items() for doc in range(8)
    ]  # fmt: skip
    claim = Claim(
        id="b", wording="w", where="§4", spec="mirage", paper={"estimate": None, "unit": "share"},
        statistic={"kind": "difference", "metric": "label_recovery", "treatment": {"attack": "gma-sl", "defence": "mirage"},
                   "control": {"attack": "gma-sl", "defence": "none"}},
        agreement={"rule": "qualitative", "direction": "below", "threshold": -0.1},
    )  # fmt: skip
    j = judge_claim(claim, rows, [])
    a, b = per[("gma-sl", "mirage")][None, :], per[("gma-sl", "none")][None, :]
    want = paired_difference_ci(a, b, n_boot=10_000, seed=0)
    assert j.ours is not None and j.ours.seeds == [1] and j.ours.estimate == pytest.approx(float((a - b).mean()))
    assert j.ours.low < j.ours.estimate < j.ours.high and j.ours.high < -0.1
    assert (j.ours.low, j.ours.high) == pytest.approx((want.low, want.high), abs=0.02)
    assert j.verdict == "agrees"
    old = [
        {**r, "result_json": json.dumps({"label_recovery": json.loads(r["result_json"])["label_recovery"]})}
        for r in rows
    ]
    assert judge_claim(claim, old, []).verdict == "underpowered"


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1])
def test_a_share_of_the_controls_misses_is_the_net_correction_with_a_paired_interval(seed):
    """``kind: share`` (000's errors the gradient corrects): mean(treatment - control) / mean(1 - control) over
    the documents and victim seeds both arms read, its interval the crossed bootstrap of that ratio; editing the
    paper's number moves the verdict; a control that reads every token leaves nothing to correct."""
    from splitleak.audit.analysis import DEFAULT_READOUT
    from splitleak.reproduce.claims import Claim
    from splitleak.reproduce.run import judge_claim
    from splitleak.stats.bootstrap import paired_ratio_ci

    rng = np.random.default_rng(seed)
    act = rng.integers(14, 26, size=(2, 24))  # tokens right of 32, per victim seed and document
    joint = np.minimum(act + rng.integers(0, 9, size=act.shape), 32)
    rows = [
        {"key": f"{a}-{s}", "attack": a, "defence": "none", "victim_seed": s, "doc_id": d, "attack_seed": 0,
         "data_seed": 0, "token_correct": int(m[s, d]), "token_counted": 32, "readout": DEFAULT_READOUT}
        for a, m in (("joint", joint), ("activation", act)) for s in range(2) for d in range(24)
    ]  # fmt: skip

    def claim(estimate):
        return Claim(
            id="errors-corrected", wording="w", where="§4.2", spec="paper_main",
            paper={"estimate": estimate, "unit": "share"},
            statistic={"kind": "share", "metric": "token_recovery", "treatment": {"attack": "joint"},
                       "control": {"attack": "activation"}},
            agreement={"rule": "tolerance", "tolerance": 0.1, "ours": True},
        )  # fmt: skip

    a, b = joint / 32, act / 32
    want = float((a - b).mean() / (1 - b).mean())
    iv = paired_ratio_ci(a - b, 1 - b, n_boot=20_000, seed=0)
    j = judge_claim(claim(round(want, 2)), rows, [])
    assert j.ours is not None and j.ours.estimate == pytest.approx(want)
    assert (j.ours.low, j.ours.high) == pytest.approx((iv.low, iv.high), abs=0.01) and j.ours.low < want < j.ours.high
    assert j.verdict in ("agrees", "underpowered") and j.detectable is None  # no paired t-test for a ratio
    assert judge_claim(claim(want + 0.5), rows, []).verdict == "disagrees"
    every = [{**r, "token_correct": 32} if r["attack"] == "activation" else r for r in rows]
    assert judge_claim(claim(0.55), every, []).verdict == "not run"

    # a ratio whose control reads 0 on every document was measured and is undefined: underpowered, never not run
    ratio = claim(2.75).model_copy(update={"statistic": claim(2.75).statistic.model_copy(update={"kind": "ratio"})})
    nothing = [{**r, "token_correct": 0} if r["attack"] == "activation" else r for r in rows]
    j = judge_claim(ratio, nothing, [])
    assert j.verdict == "underpowered" and "reads 0 on every one of its 24 documents" in j.reason
    assert "a positive reading over 0" in j.reason and j.ours is not None and j.ours.estimate == np.inf
    both = [{**r, "token_correct": 0} for r in rows]
    assert "(0/0)" in judge_claim(ratio, both, []).reason
    read = judge_claim(ratio, rows, []).ours
    assert read is not None and read.estimate == pytest.approx(a.mean() / b.mean())  # a control above 0: the ratio


@pytest.mark.unit
def test_the_decoy_claims_are_read_from_the_grid_reports_latent_summary():
    """002's claims read the grid report's own summary: a partition's row agreement with its Wilson interval
    over the rows, a probe's best non-degenerate arm of the named view per seed, the mean over seeds with
    Student's t; a claim the reader cannot read says why."""
    from types import SimpleNamespace

    from scipy import stats

    from splitleak.report.grid_latent import PartitionCell, ProbeRun
    from splitleak.reproduce.claims import Claim
    from splitleak.reproduce.run import judge_claim
    from splitleak.stats.binomial import wilson_interval

    def run(seed, arm, threat, effects):
        arms = [
            {"arm": name, "paired_effect": e, "paired_low": e - 0.01, "paired_high": e + 0.01, "degenerate": d}
            for name, e, d in effects
        ]
        return ProbeRun("smollm2-135m", arm, "defaults", seed, {}, None, None, 0.04, arms, None, threat)

    summary = SimpleNamespace(
        partition=[PartitionCell("smollm2-135m", "fix", "rule=support", [1, 2], 64, 0, 0.4, [None], rows=2048)],
        probes=[
            run(1, "open", "oracle", [("gradient/mlp/0", 0.010, False), ("gradient/deep/0", 0.5, True),
                                      ("forward/mlp/0", 0.3, False)]),
            run(2, "open", "oracle", [("gradient/mlp/0", 0.014, False), ("gradient/deep/0", 0.012, False)]),
            run(1, "open", "shadow", [("gradient/mlp/0", -0.02, False)]),
        ],
    )  # fmt: skip

    def claim(kind, treatment, control=None, rule=None):
        return Claim(
            id="c", wording="w", where="§5", spec="decoys", paper={"estimate": 0.0092, "low": 0.0074, "high": 0.0109,
            "unit": "pp"}, statistic={"kind": kind, "metric": "m", "treatment": treatment, "control": control},
            agreement=rule or {"rule": "same-sign-overlap"},
        )  # fmt: skip

    part = judge_claim(
        claim("level", {"attack": "support-partition", "rule": "support", "arm": "fix"}), [], [], latent=summary
    )
    iv = wilson_interval(round(0.4 * 2048), 2048)
    assert part.ours is not None and (part.ours.estimate, part.ours.low, part.ours.high) == (0.4, iv.low, iv.high)
    constant = {"predictor": "most-frequent-token constant baseline"}
    grad = judge_claim(
        claim("difference", {"attack": "latent-probe", "view": "gradient", "arm": "open", "threat": "oracle"}, constant),
        [], [], latent=summary,
    )  # fmt: skip
    half = stats.t.isf(0.025, 1) * np.std([0.010, 0.014], ddof=1) / np.sqrt(2)
    assert grad.ours is not None and grad.ours.estimate == pytest.approx(0.012)  # the degenerate 0.5 is left out
    assert grad.ours.low == pytest.approx(0.012 - half) and grad.verdict == "underpowered"  # two seeds, wide
    shadow = judge_claim(
        claim("difference", {"attack": "latent-probe", "view": "gradient", "arm": "open", "threat": "shadow"}, constant),
        [], [], latent=summary,
    )  # fmt: skip
    assert shadow.ours is not None and (shadow.ours.low, shadow.ours.high) == (-0.03, -0.01)  # one seed: its own
    assert shadow.verdict == "disagrees"
    split = judge_claim(claim("level", {"attack": "support-partition", "split": "mitigation"}), [], [], latent=summary)
    assert split.verdict == "not run" and "split" in split.reason
    # the shuffled-label twin of the best gradient arm of each seed (not the twin's own best arm)
    for r, twins in zip(
        summary.probes[:2],
        [
            [("gradient/mlp/0", 0.0004), ("gradient/deep/0", 0.3)],
            [("gradient/mlp/0", -0.0006), ("gradient/deep/0", 0.0002)],
        ],
    ):
        r.twin_arms = [
            {"arm": a, "paired_effect": e, "paired_low": e - 0.01, "paired_high": e + 0.01} for a, e in twins
        ]
    twin = {
        "attack": "latent-probe",
        "view": "gradient",
        "arm": "open",
        "threat": "oracle",
        "control": "shuffled-label",
    }
    tol = {"rule": "tolerance", "tolerance": 0.0008}
    got = judge_claim(claim("level", twin, rule=tol), [], [], latent=summary)
    assert got.ours is not None and list(got.ours.units) == pytest.approx([0.0004, -0.0006])
    assert got.ours.estimate == pytest.approx(-0.0001)
    summary.probes[1].twin_arms = None  # a seed whose battery ran no twin is left out
    one = judge_claim(claim("level", twin, rule=tol), [], [], latent=summary)
    assert one.ours is not None and list(one.ours.units) == pytest.approx([0.0004])
    bad = judge_claim(claim("level", {**twin, "control": "mis-paired"}, rule=tol), [], [], latent=summary)
    assert bad.verdict == "not run" and "not the shuffled-label twin" in bad.reason


@pytest.mark.unit
def test_an_interval_of_no_width_is_not_read_as_certainty():
    """Eight documents none of which is rebuilt give a bootstrap interval [0, 0]; the level is read with its
    Wilson interval over the documents instead, and a difference no document moves is underpowered."""
    from splitleak.reproduce.claims import Claim
    from splitleak.reproduce.run import judge_claim
    from splitleak.stats.binomial import wilson_interval

    base = {"model": "m", "depth": 6, "client_copy": "public", "defence": "none", "victim_seed": 1, "data_seed": 0}
    rows = [
        {**base, "key": f"{a}", "attack": a, "k": 32, "doc_id": d, "exact": False, "token_correct": 5,
         "token_counted": 8, "readout": "gradient" if a == "joint" else None}
        for a in ("activation", "joint") for d in range(8)
    ]  # fmt: skip
    arm = {"k": 32, "depth": 6, "client_copy": "public", "defence": "none"}
    level = Claim(
        id="l", wording="w", where="§4", spec="s", paper={"estimate": 0.1371, "unit": "%"},
        statistic={"kind": "level", "metric": "doc_recovery", "treatment": {"attack": "activation", **arm}},
        agreement={"rule": "tolerance", "tolerance": 0.05},
    )  # fmt: skip
    j = judge_claim(level, rows, [], n_boot=200)
    w = wilson_interval(0, 8)
    assert j.ours is not None and (j.ours.low, j.ours.high) == (w.low, w.high) and j.verdict == "underpowered"
    diff = level.model_copy(
        update={"statistic": level.statistic.model_copy(update={"kind": "difference", "treatment": {"attack": "joint",
                **arm}, "control": {"attack": "activation", **arm}})}
    )  # fmt: skip
    d = judge_claim(diff, rows, [], n_boot=200)
    assert d.verdict == "underpowered" and "no unit differs" in d.reason


@pytest.mark.unit
def test_a_resume_may_add_papers_but_never_change_the_profile_overrides_or_data(tmp_path):
    from splitleak.reproduce.run import RECORD, _record, recorded_papers

    out = tmp_path / "out"
    first = {"papers": ["000"], "specs": ["paper_main"], "profile": "quick", "overrides": [], "data": "/d"}
    _record(out, first, resume=False)
    assert recorded_papers(out) == ["000"] and recorded_papers(tmp_path / "none") == []
    with pytest.raises(ConfigError, match="pass --resume"):
        _record(out, first, resume=False)
    _record(out, {**first, "papers": ["003"], "specs": ["mirage"]}, resume=True)  # 003 added
    rec = json.loads((out / RECORD).read_text())
    assert rec["papers"] == ["000", "003"] and rec["specs"] == ["mirage", "paper_main"]
    for key, value in (("profile", "full"), ("overrides", ["steps=4"]), ("data", "/elsewhere")):
        with pytest.raises(ConfigError, match="same profile, overrides and data only"):
            _record(out, {**first, key: value}, resume=True)
    assert json.loads((out / RECORD).read_text()) == rec  # a refused resume writes nothing


@pytest.mark.unit
def test_data_reaches_only_the_specs_that_read_a_folder(tmp_path):
    from splitleak.reproduce.plan import spec_overrides

    data = tmp_path / "wiki"
    data.mkdir()
    assert spec_overrides("paper_main", "quick", [], str(data)) == [f"data.path={data.resolve()}"]
    assert spec_overrides("mirage", "quick", [], str(data)) == []  # it generates its instruction texts
    assert spec_overrides("paper_main", "quick", ["steps=4"], None) == ["steps=4"]


@pytest.mark.unit
def test_a_family_expands_to_the_papers_configurations():
    from splitleak.reproduce.claims import load_claims

    claims = {c.id: c.statistic for c in load_claims("000")[0].claims}
    fam = claims["family-47"].members()
    assert len(fam) == 47 and len({m.model_dump_json() for m in fam}) == 47  # 4 x 3 x 4 less the main test
    main = {"attack": "activation", "depth": 6, "client_copy": "public", "k": 32}
    assert not any(m.control and all(m.control.get(k) == v for k, v in main.items()) for m in fam)
    back = [m for m in fam if m.control["attack"] == "backward-only"]
    assert len(back) == 12 and all(m.control["k"] is None and m.treatment["attack"] == "joint" for m in back)
    assert sorted(m.treatment["k"] for m in back) == [8] * 4 + [16] * 4 + [32] * 4  # joint at each k against it
    assert all(m.treatment["depth"] == m.control["depth"] and m.kind == "difference" for m in fam)
    mix = claims["mixup-token-range"].members()
    assert len(mix) == 24 and all(m.control is None and m.treatment["defence"] == "mixup" for m in mix)
    rep = claims["replica-median-token"].members()
    assert len(rep) == 24
    for m in rep:  # each condition against itself undefended
        assert {**m.treatment, "defence": "none"} == m.control


@pytest.mark.unit
def test_equivalence_agrees_inside_its_tolerance_and_disagrees_outside():
    from splitleak.reproduce.claims import Claim
    from splitleak.reproduce.judge import Measured, judge

    claim = Claim(
        id="flat", wording="w", where="§", paper={"estimate": None, "unit": "nats"}, spec="x",
        statistic={"kind": "difference", "metric": "heldout_ce", "treatment": {"defence": "a"},
                   "control": {"defence": "b"}},
        agreement={"rule": "equivalence", "tolerance": 0.25, "ours": True},
    )  # fmt: skip

    def m(est, lo, hi):
        return Measured(est, lo, hi, np.array([lo, hi]), [1, 2], 0, ["m"])

    assert judge(claim, m(0.05, -0.1, 0.2)).verdict == "agrees"
    assert judge(claim, m(0.4, 0.3, 0.5)).verdict == "disagrees"
    assert judge(claim, m(-0.3, -0.27, -0.26)).verdict == "disagrees"
    assert judge(claim, m(0.1, -0.1, 0.3)).verdict == "underpowered"
    assert judge(claim, m(0.0, 0.0, 0.0)).verdict == "agrees"  # the arms read alike on every unit
    assert judge(claim, m(0.3, 0.3, 0.3)).verdict == "disagrees"  # alike, but outside


@pytest.mark.unit
def test_an_analogue_translates_every_selected_field_and_leaves_other_specs_alone():
    from splitleak.reproduce.claims import Analogue, load_claims

    files = load_claims("000")[0]
    a = files.analogues[0]
    assert (a.base, a.spec, a.map) == ("paper_main", "paper_main_server", {"depth": {3: 21, 6: 24}})
    claims = {c.id: c for c in files.claims}
    main = a.of(claims["main-test"])
    assert main.spec == "paper_main_server" and main.statistic.treatment["depth"] == 24
    assert main.statistic.control["depth"] == 24 and main.statistic.treatment["k"] == 32
    fam = a.of(claims["family-47"]).statistic
    assert fam.over["depth"] == [21, 24] and fam.exclude[0]["treatment"]["depth"] == 24
    assert {m.treatment["depth"] for m in fam.members()} == {21, 24} and len(fam.members()) == 47
    other = Analogue(name="x", base="decoys", spec="decoys", map={"depth": {3: 21}})
    assert other.of(claims["main-test"]) is None  # not its base
    none = Analogue(name="y", base="paper_main", spec="paper_main_server", map={"steps": {1: 2}})
    assert none.of(claims["main-test"]) is None  # it selects nothing the map translates


@pytest.mark.e2e
def test_a_killed_reproduction_resumes_and_runs_nothing_it_finished(tiny):
    """``splitleak reproduce`` killed (SIGKILL, its whole process group) once some of its jobs are stored: the resume
    keeps every stored row file as it was, byte for byte, and runs only the jobs that were not finished."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from served import child_env

    from splitleak.reproduce.run import reproduce

    folder, write = tiny
    claims, out = write(), folder / "out"
    cmd = [sys.executable, "-m", "splitleak.cli", "reproduce", "--claims", str(claims), "--out", str(out)]
    cmd += ["--profile", "quick", "--workers", "1", "--n-boot", "2000"]
    proc = subprocess.Popen(
        cmd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    store = out / "stores" / "tiny"
    try:
        t0 = time.monotonic()
        while not list((store / "attacks").glob("*.parquet")) if (store / "attacks").is_dir() else True:
            assert proc.poll() is None, (
                "the reproduction ended before it could be killed: " + proc.stdout.read().decode()
            )
            assert time.monotonic() - t0 < 240, "no attack job finished within 240 s"
            time.sleep(0.05)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=60)
    kept = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in store.glob("*/*.parquet")}
    assert kept
    rep = reproduce([], out, profile="quick", claims=[claims], resume=True, n_boot=2000, run_grid_kwargs={"workers": 1})
    (spec,) = rep.ran
    total = len(rep.plan.grids[spec].jobs)
    assert rep.ran[spec] == total - len(kept), (rep.ran, total, len(kept))
    assert all((p.read_bytes(), p.stat().st_mtime_ns) == v for p, v in kept.items())  # nothing finished ran again
    assert {j.claim.id for j in rep.judgements["900"]} == {"gain", "level", "words"}
