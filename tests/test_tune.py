"""`splitleak tune`: the search space each defence declares, the Pareto frontier, the seeded sampler,
bad input, and a tiny tune through the grid machinery (gate, budget, early stop, frontier, resume)."""

import json

import pytest
from typer.testing import CliRunner

from splitleak.cli import app
from splitleak.errors import ConfigError
from splitleak.experiments.tune import (
    Space,
    TrialConfig,
    TuneSettings,
    build_space,
    parse_enqueue,
    searchable_defences,
    trial_params,
)
from splitleak.experiments.tune_study import pareto_front, run_study, tune
from splitleak.experiments.tune_trials import Outcome
from splitleak.report.tune import render_tune

runner = CliRunner()

TINY = dict(n_calib=16, n_train=4, n_eval=16, doc_len=16, steps=2)


# ------------------------------------------------------------------ unit


@pytest.mark.unit
def test_pareto_front_keeps_exactly_the_non_dominated_points():
    pts = [
        (0.00, 1.00),  # 0 the undefended point: cheapest, on the front
        (0.01, 0.50),  # 1 front
        (0.02, 0.60),  # 2 dominated by 1 (costlier and reads more)
        (0.03, 0.00),  # 3 front
        (0.03, 0.00),  # 4 equal to 3: both kept
        (0.05, 0.00),  # 5 dominated by 3 (same recovery, costlier)
        (0.01, 0.70),  # 6 dominated by 1 (same cost, reads more)
        (0.005, 0.20),  # 7 a lower bound only: neither on the front nor dominating 1
    ]
    exact = [True] * 7 + [False]
    assert pareto_front(pts, exact) == [0, 1, 3, 4]
    # were point 7 exact, it would dominate 1 and join the front
    assert pareto_front(pts) == [0, 3, 4, 7]
    assert pareto_front([]) == []
    assert pareto_front([(0.2, 0.3)]) == [0]


@pytest.mark.unit
def test_every_declared_search_range_is_a_valid_argument_and_labelled_ours():
    from splitleak.defences import DEFENCES, build_defence

    names = searchable_defences()
    assert {"none", "quant8", "quant4", "quant4-noisy", "clip-noise", "dp-forward", "mixup"} <= set(names)
    assert "replica-median" not in names  # no search declared: offered only when named
    assert not any("plain" not in DEFENCES[n].split_modes for n in names)
    for n in names:
        for arg, rng in (DEFENCES[n].search or {}).items():
            assert rng.why.startswith("ours"), (n, arg)
            for value in (rng.low, rng.high):  # both ends build the defence
                assert build_defence(n, {arg: value}).args()[arg] == value


@pytest.mark.unit
def test_space_and_bad_input_fail_in_one_line_naming_the_fix():
    space = build_space([1, 2, 9], ["none", "clip-noise", "quant8+dp-forward"], 4, "tiny-gpt2")
    assert space.depths == (1, 2)  # 9 does not fit 4 blocks and is dropped
    assert [Space.label(c) for c in space.chains] == ["none", "clip-noise", "quant8+dp-forward"]
    assert set(space.ranges) == {
        "clip-noise.clip",
        "clip-noise.sigma",
        "dp-forward.clip",
        "dp-forward.noise_multiplier",
    }
    with pytest.raises(ConfigError, match=r"unknown defence 'clip-nois'; known defences: .*clip-noise"):
        build_space([1], ["clip-nois"], 4, "tiny-gpt2")
    with pytest.raises(
        ConfigError, match=r"no depth in \[4, 6\] fits tiny-gpt2 \(4 blocks\); pass --depth between 1 and 3"
    ):
        build_space([4, 6], None, 4, "tiny-gpt2")
    with pytest.raises(ConfigError, match="plain split"):
        build_space([1], ["vmf"], 4, "tiny-gpt2")
    for budget in (0.0, -0.1, float("nan")):
        with pytest.raises(ConfigError, match="--budget must be a number > 0"):
            TuneSettings(model="tiny-gpt2", budget=budget).check()
    with pytest.raises(ConfigError, match="--stop-above must be >= the gate"):
        TuneSettings(model="tiny-gpt2", budget=0.1, stop_above=0.005).check()
    for share in (0.0, 1.5, float("nan")):
        with pytest.raises(ConfigError, match="--bound-below must be a share of tokens in"):
            TuneSettings(model="tiny-gpt2", budget=0.1, bound_below=share).check()
    with pytest.raises(ConfigError, match="unknown tune attack 'vmj'"):
        TuneSettings(model="tiny-gpt2", budget=0.1, attacks=("vmj",)).check()
    assert parse_enqueue("depth=2,defence=clip-noise,sigma=0.5") == trial_params(2, "clip-noise", sigma=0.5)
    assert trial_params(2, "clip-noise", sigma=0.5) == {"depth": 2, "defence": "clip-noise", "clip-noise.sigma": 0.5}
    with pytest.raises(ConfigError, match="give depth= and defence="):
        parse_enqueue("sigma=0.5")


@pytest.mark.integration
def test_the_cli_refuses_bad_input_before_writing(tmp_path):
    out = tmp_path / "t"
    for args, words in (
        (["--budget", "0"], "--budget must be a number > 0"),
        (["--budget", "0.1", "--defence", "nope"], "unknown defence 'nope'"),
        (["--budget", "0.1", "--depth", "4"], "pass --depth between 1 and 3"),
    ):
        res = runner.invoke(app, ["tune", "--out", str(out), "--model", "tiny-gpt2", *args])
        assert res.exit_code == 2, res.output
        assert "error:" in res.output and words in " ".join(res.output.split())
        assert not out.exists()


def _fake(cfg: TrialConfig) -> Outcome:
    """A deterministic stand-in for the grid: noise costs utility and lowers recovery."""
    sigma = next((d["args"].get("sigma", 0.0) for d in cfg.chain if d["name"] == "clip-noise"), 0.0)
    o = Outcome(cfg.depth, cfg.label, [dict(d) for d in cfg.chain])
    o.cost, o.G = 0.01 * sigma * cfg.depth, max(0.0, 0.9 - sigma) - 0.05
    o.worst_token_recovery, o.worst_reader = max(0.0, 0.95 - sigma), "vmi"
    o.within_budget = o.cost <= 0.02
    o.passes = o.G <= 0.01 and o.within_budget
    return o


def _proposals(trials):
    return [(t.params["depth"], t.params["defence"], t.params.get("clip-noise.sigma")) for t in trials]


@pytest.mark.integration
def test_the_seeded_sampler_proposes_the_same_trials_twice(tmp_path):
    space = build_space([1, 2, 3], ["none", "clip-noise"], 4, "tiny-gpt2")
    first = [trial_params(2, "clip-noise", sigma=1.0)]
    # 11 trials: the first after TPE's 10 random start-up trials is its own proposal
    a, ran = run_study(tmp_path / "a", space, _fake, n_trials=11, seed=7, enqueue=first)
    b, _ = run_study(tmp_path / "b", space, _fake, n_trials=11, seed=7, enqueue=first)
    c, _ = run_study(tmp_path / "c", space, _fake, n_trials=6, seed=8, enqueue=first)
    assert ran == 11 and len(a.trials) == 11
    assert _proposals(a.trials) == _proposals(b.trials)
    assert _proposals(a.trials)[0] == (2, "clip-noise", 1.0)  # the enqueued trial comes first
    assert _proposals(a.trials)[1:6] != _proposals(c.trials)[1:]  # another seed, other proposals
    sigmas = [s for _, _, s in _proposals(a.trials) if s is not None]
    assert sigmas and all(0.001 <= s <= 3.0 for s in sigmas)
    # a finished study resumes to nothing; a longer one continues where the shorter stopped
    _, ran = run_study(tmp_path / "a", space, _fake, n_trials=11, seed=7)
    assert ran == 0
    d, _ = run_study(tmp_path / "d", space, _fake, n_trials=5, seed=7, enqueue=first)
    d, ran = run_study(tmp_path / "d", space, _fake, n_trials=11, seed=7)
    assert ran == 6 and _proposals(d.trials) == _proposals(a.trials)


# ------------------------------------------------------------------ end to end


def _store_files(store):
    return sorted(p.relative_to(store).as_posix() for p in store.rglob("*.parquet"))


@pytest.mark.e2e
def test_tiny_tune_gate_budget_frontier_and_resume(tmp_path):
    settings = TuneSettings(
        model="tiny-gpt2", budget=0.05, attacks=("vmi", "activation", "sipit-trained", "adaptive"), **TINY
    )
    strong = trial_params(1, "clip-noise", clip=1.0, sigma=1.0)
    weak = trial_params(1, "clip-noise", clip=1.0, sigma=0.01)
    out = tmp_path / "tune"
    res = tune(
        out, settings, depths=[1], defences=["none", "clip-noise"], n_trials=3, enqueue=[strong, weak], threads=1,
        render=render_tune,
    )  # fmt: skip
    by = {t["number"]: t for t in res.trials}
    assert [(t["depth"], t["defence"]) for t in res.trials] == [
        (1, "none"),
        (1, "clip-noise(sigma=1.0)"),  # canonical labels: clip=1.0 is clip-noise's default
        (1, "clip-noise(sigma=0.01)"),
    ]
    none, s, w = by[0], by[1], by[2]
    # the undefended point reads the text: stopped after vmi, far above the baseline, gate broken
    assert none["cost"] == 0.0 and none["gate_breaks"] and not none["passes"]
    assert none["stopped"] and none["arms"][0]["name"] == "vmi" and none["arms"][0]["effect_low"] > 0.05
    assert none["worst_token_recovery"] > 0.9
    # strong noise: the whole suite ran, every reader near nothing, gate held, within budget -> passes
    # ... the attacks built for clip-noise included, on the trained copy
    built = ["sipit-aware-trained", "activation-aware-trained", "joint-aware-trained", "seed-search-trained"]
    assert s["stopped"] is None and sorted(a["name"] for a in s["arms"]) == sorted(
        ["vmi", "activation", "sipit-trained", *built]
    )
    assert s["G"] <= 0.01 and not s["gate_breaks"] and 0 < s["cost"] <= 0.05 and s["passes"]
    assert s["worst_token_recovery"] < 0.05
    # both sides: the undefended run has no bound; the noised one has one, above what its readers read
    assert none["token_bound"] is None and none["bound_note"].startswith("no formal bound: no defence")
    assert s["worst_token_recovery"] <= s["token_bound"] <= 1 and s["epsilon_doc"] > 0 and s["bound_holds"] is None
    # weak noise: within the budget but read like the undefended run -> fails on the gate
    assert w["within_budget"] and w["gate_breaks"] and not w["passes"] and w["stopped"]
    # sigma=0.01 moves the held-out loss by less than its run-to-run noise: either sign, far below strong's
    # (CI measured -7.4e-05 where this machine measures a small positive cost)
    assert abs(w["cost"]) < s["cost"] / 10
    # utility is against the undefended run of the same depth
    assert s["rel_ppl"] == pytest.approx(s["perplexity"] / s["undefended_perplexity"] - 1)
    assert s["undefended_perplexity"] == pytest.approx(none["perplexity"])
    # frontier: the undefended point (exact: it reads every token) and the strong one; the weak one is dominated
    # only by a lower bound, so it is not on it either
    assert res.passing == [1]
    assert res.frontier == [0, 1]
    record = json.loads((out / "tune.json").read_text())
    assert record["cheapest_passing"] == 1 and record["frontier"] == [0, 1]
    assert [t["on_frontier"] for t in record["trials"]] == [True, True, False]
    md = (out / "tune.md").read_text()
    assert "clip-noise(sigma=1.0)" in md.split("## Every trial")[0] and "does not measure" in md
    for p in ("frontier.png", "frontier.svg", "study.db", "spec.yaml"):
        assert (out / p).stat().st_size > 0
    # one store: the undefended train job at depth 1 is trained once for the three trials
    files = _store_files(out / "store")
    assert sum(f.startswith("train/") for f in files) == 3
    # vmi; the full suite with the three attacks built for clip-noise; vmi
    assert sum(f.startswith("attacks/") for f in files) == 1 + (3 + len(built)) + 1
    assert res.jobs_ran == len(files)

    # resuming the finished tune runs no trial and no job, and writes the same trials
    res2 = runner.invoke(
        app,
        [
            "tune",
            "--out",
            str(out),
            "--model",
            "tiny-gpt2",
            "--budget",
            "0.05",
            "--depth",
            "1",
            "--defence",
            "none",
            "--defence",
            "clip-noise",
            "--n-trials",
            "3",
            "--attacks",
            "vmi,activation,sipit-trained,adaptive",
            *(f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()),
        ],
    )
    assert res2.exit_code == 0, res2.output
    assert "0 trial(s) ran now (0 job(s))" in res2.output and "cheapest passing: trial 1" in res2.output
    assert _store_files(out / "store") == files
    again = json.loads((out / "tune.json").read_text())
    assert [t["G"] for t in again["trials"]] == [t["G"] for t in record["trials"]]
    # other settings in the same folder are refused, naming the fix
    with pytest.raises(ConfigError, match="choose another --out"):
        tune(out, TuneSettings(model="tiny-gpt2", budget=0.1, **TINY), depths=[1], n_trials=3)


@pytest.mark.e2e
def test_bound_below_passes_only_where_no_reader_can_read_more(tmp_path, monkeypatch):
    """--bound-below: two noise levels that both hold the gate against the suite; only the one whose bound (the
    most any reader of its traffic can read of a token) is under the threshold passes, and the other stops after
    its first attack, naming its bound. More noise per clip norm, a lower bound; each bound above what was read."""
    settings = TuneSettings(model="tiny-gpt2", budget=1.0, attacks=("vmi",), bound_below=0.8, **TINY)
    light = trial_params(1, "clip-noise", clip=1.0, sigma=1.0)
    heavy = trial_params(1, "clip-noise", clip=0.1, sigma=3.0)  # 30 times the noise per unit of clip norm
    res = tune(
        tmp_path / "t", settings, depths=[1], defences=["clip-noise"], n_trials=2, enqueue=[light, heavy],
        undefended_first=False, threads=1, render=render_tune,
    )  # fmt: skip
    lt, hv = res.trials
    assert not lt["gate_breaks"] and not hv["gate_breaks"] and lt["within_budget"] and hv["within_budget"]
    # measured on this machine: 100.0 % and 71.5 % (T = 16 tokens, every crossing of both directions composed)
    assert hv["token_bound"] < 0.8 < lt["token_bound"] and hv["token_bound"] < lt["token_bound"] - 0.1
    assert lt["bound_holds"] is False and not lt["passes"] and "the bound is 100.0 %" in lt["stopped"]
    assert hv["bound_holds"] is True and hv["passes"] and res.passing == [1]
    for t in (lt, hv):
        assert t["worst_token_recovery"] <= t["token_bound"] and t["bound_note"].startswith("ε per document")
    md = (tmp_path / "t" / "tune.md").read_text()
    assert "no reader can read more than 80.0 % of its tokens" in md and f"| {100 * hv['token_bound']:.1f} |" in md
    # a defence that declares ten thousand times the noise it adds fails its mechanism's game: the trial is an error
    from dataclasses import replace

    from splitleak.defences.noise import ClipNoise

    declared = ClipNoise.noise_guarantees
    monkeypatch.setattr(ClipNoise, "noise_guarantees",
                        lambda self: [replace(g, sigma=g.sigma * 1e4) for g in declared(self)])  # fmt: skip
    planted = tune(tmp_path / "planted", settings, depths=[1], defences=["clip-noise"], n_trials=1, enqueue=[heavy],
                   undefended_first=False, threads=1)  # fmt: skip
    (trial,) = planted.trials
    assert trial["state"] == "fail" and trial["error"].startswith("instrument fault: the mechanism of clip-noise")
    assert planted.passing == []


@pytest.mark.integration
def test_a_killed_study_resumes_to_the_trials_an_unkilled_one_runs(tmp_path):
    space = build_space([1, 2], ["none", "clip-noise"], 4, "tiny-gpt2")
    whole, _ = run_study(tmp_path / "whole", space, _fake, n_trials=8, seed=3)
    calls = []

    def dies_at_five(cfg):
        calls.append(cfg)
        if len(calls) == 5:
            raise KeyboardInterrupt  # the trial stays RUNNING in the study, as after kill -9
        return _fake(cfg)

    with pytest.raises(KeyboardInterrupt):
        run_study(tmp_path / "killed", space, dies_at_five, n_trials=8, seed=3)
    resumed, ran = run_study(tmp_path / "killed", space, _fake, n_trials=8, seed=3)
    assert ran == 4  # the interrupted trial again, then three more
    from optuna.trial import TrialState

    done = [t for t in resumed.trials if t.state == TrialState.COMPLETE]
    assert [t.state for t in resumed.trials].count(TrialState.FAIL) == 1  # the interrupted one, not reported
    assert _proposals(done) == _proposals(whole.trials)
