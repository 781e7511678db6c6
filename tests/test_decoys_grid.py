"""The decoy system in experiment grids: the spec's latent arms, their jobs, their store rows and the
report's decoy section (splitleak.experiments, splitleak.report.grid_latent)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from splitleak.errors import ConfigError

SHIPPED_PROTOCOLS = Path(__file__).resolve().parents[1] / "splitleak" / "audit" / "protocols"

LATENT = """\
name: tiny-latent
protocol: proto.yaml
model: tiny-gpt2
latent:
  - {label: open, split: 0/3, width: 16}
  - {label: fix, split: 0/3, width: 16, output_gradient: clip-noise}
  - {label: naked, split: 0/3, width: 16, sigma: 0, decoys: 0, gauges: false}
victim_seeds: [1, 2, 3]
documents: {n_calib: 16, n_train: 16, n_eval: 8, doc_len: 8}
steps: 16
capture_batch: 4
attacks:
  - {attack: support-partition, params: {rule: [support, norm]}}
  - {attack: latent-probe, params: {views: "real-rows,gradient", models: "mlp", restarts: 1, epochs: 20, threat: trained-codec}}
"""

#: the grid run below adds the dose ladder on the open arm: its nine coverages, the MLP probe
DOSED = "  - {attack: dose-ladder, params: {doses: coverage, models: mlp, epochs: 20}, defences: [open]}\n"


def write(folder: Path, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(SHIPPED_PROTOCOLS / "gate_002.yaml", folder / "proto.yaml")
    path = folder / "spec.yaml"
    path.write_text(text)
    return path


@pytest.mark.unit
def test_latent_arms_expand_into_train_jobs_and_attacks_by_the_mode_they_read(tmp_path):
    from splitleak.experiments import plan_grid
    from splitleak.experiments.jobs import LATENT_DEFENCE
    from splitleak.report import grid_latent

    # the torch-free report keeps its own copy of the word that marks a latent row: they must agree
    assert grid_latent.LATENT_DEFENCE == LATENT_DEFENCE

    mixed = LATENT.replace("model: tiny-gpt2\n", "model: tiny-gpt2\ndepths: [1]\n") + (
        "  - {attack: activation, k: 4}\n  - {attack: adaptive}\n"
    )
    g = plan_grid(write(tmp_path, mixed))
    train = g.of_kind("train")
    # 3 latent arms x 3 seeds, and one depth x 3 seeds
    assert len(train) == 12
    latent = [j for j in train if j.fields["defence_name"] == "latent"]
    assert sorted({j.fields["defence"] for j in latent}) == ["fix", "naked", "open"]
    for j in latent:
        cfg = j.config["train"]
        assert (cfg["latent"]["split_after"], cfg["latent"]["resume_at"], cfg["latent"]["width"]) == (0, 3, 16)
        assert cfg["lr"] == 3e-4 and cfg["all_local_baseline"] is False and cfg["depth"] is None
    fix = next(j for j in latent if j.fields["defence"] == "fix")
    naked = next(j for j in latent if j.fields["defence"] == "naked")
    assert fix.config["train"]["latent"]["output_gradient"] == "clip-noise"
    assert (naked.config["train"]["latent"]["sigma"], naked.config["train"]["latent"]["gauges"]) == (0.0, False)
    by_train: dict[str, set[str]] = {}
    for j in g.of_kind("attack"):
        by_train.setdefault(j.train_key, set()).add(j.fields["attack"])
    # the latent attacks on the latent arms only (2 rules + the battery + the two built for the decoy system),
    # the split's attack on the split only (undefended: nothing is built for it)
    for j in train:
        built = {"decoy-history", "gauge-key-search"}
        want = {"support-partition", "latent-probe", *built} if j in latent else {"activation"}
        assert by_train[j.key] == want, j.summary
    assert len(g.of_kind("attack")) == 9 * 5 + 3
    # the latent jobs' summaries name the arm and leave out the client copy, which they do not read
    assert any(j.summary.endswith("| support-partition rule=norm a0") for j in g.of_kind("attack"))


@pytest.mark.unit
def test_a_named_split_resolves_per_model_and_the_shipped_spec_has_the_papers_sizes(tmp_path):
    from splitleak.experiments import plan_grid

    def split(j):
        return j.config["train"]["latent"]["split_after"], j.config["train"]["latent"]["resume_at"]

    g = plan_grid("decoys", profile="quick")
    # per main train job: 3 partition rules, the probe battery under 3 threat models, decoy-history,
    # gauge-key-search; on the mitigation split what its claims read: the open arm's support partition and the
    # oracle battery; on the open arm the oracle probe of the real rows (002's forward arm); on each of the
    # ladder's five cells the oracle probe of the gradient view
    # and on the open arm the dose ladder (002 Table 4)
    assert g.counts() == {"train": 22, "attack": 6 * 8 + 2 + 6 + 2 + 10 + 2, "reuse": 0}
    ladder = {"open-del12": (14, 28), "open-del8": (18, 28), "open-del6": (20, 28), "open-w96": (15, 28),
              "open-w128": (15, 28)}  # fmt: skip
    trains = [j for j in g.of_kind("train") if j.fields["defence"] not in ladder]
    by_split = {split(j) for j in trains if not j.fields["defence"].endswith("-mitigation")}
    mitigation = {split(j) for j in trains if j.fields["defence"].endswith("-mitigation")}
    assert (by_split, mitigation) == ({(15, 28)}, {(23, 28)})  # SmolLM2's main and mitigation presets
    cells = {j.fields["defence"]: (split(j), j.config["train"]["latent"]["width"]) for j in g.of_kind("train")}
    assert {a: cells[a][0] for a in ladder} == ladder  # the depth ladder at Qwen3's share of the depth
    assert [cells[a][1] for a in ("open", "open-del8", "open-w96", "open-w128")] == [64, 64, 96, 128]
    probes = [j for j in g.of_kind("attack") if j.fields["defence"] in ladder]
    assert len(probes) == 10 and {json.loads(j.fields["params"])["views"] for j in probes} == {"gradient"}
    read = {
        (j.fields["attack"], j.fields["defence"]) for j in g.of_kind("attack") if "mitigation" in j.fields["defence"]
    }
    assert read == {("support-partition", "open-mitigation")} | {
        ("latent-probe", f"{arm}-mitigation") for arm in ("open", "fix", "naked")
    }
    full = plan_grid("decoys")
    assert full.counts() == {"train": 33, "attack": 33 * 8 + 3, "reuse": 0}
    dosed = [j for j in full.of_kind("attack") if j.fields["attack"] == "dose-ladder"]
    assert sorted(j.fields["victim_seed"] for j in dosed) == [48, 49, 50]
    assert {j.fields["defence"] for j in dosed} == {"open"}
    # Qwen3's: 11 and 4 delegated, and the ladder's 12, 8 and 6
    assert {split(j) for j in full.of_kind("train")} == {(14, 26), (21, 26), (13, 26), (17, 26), (19, 26)}
    assert {j.config["train"]["seed"] for j in full.of_kind("train")} == {48, 49, 50}
    utility = plan_grid("decoys", profile="utility")  # the profile's latent list replaces the file's
    assert utility.counts() == {"train": 4, "attack": 12, "reuse": 0}
    assert {j.fields["defence"] for j in utility.of_kind("train")} == {"open", "fix"}


@pytest.mark.unit
@pytest.mark.parametrize(
    "change, words",
    [
        (("  - {label: open, split: 0/3, width: 16}", "  - {label: open, split: 0/3, widht: 16}"), ["widht", "latent mode does not take"]),
        (("label: fix,", "label: open,"), ["'open'", "used twice"]),
        (("label: naked,", "label: latent,"), ["'latent'", "relabel"]),
        (("split: 0/3, width: 16}", "split: sideways, width: 16}"), ["sideways", "tiny-gpt2"]),
        (("split: 0/3, width: 16}", "split: 0/x, width: 16}"), ["0/x", "S/R"]),
        (("width: 16, output", "width: 1, output"), ["fix", "width"]),
    ],
)  # fmt: skip
def test_bad_latent_arms_are_refused_naming_the_arm_and_the_fix(tmp_path, change, words):
    from splitleak.experiments import plan_grid

    text = LATENT.replace(*change)
    assert text != LATENT
    with pytest.raises(ConfigError) as e:
        plan_grid(write(tmp_path, text))
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.unit
def test_an_attack_that_reads_no_mode_of_the_grid_is_refused(tmp_path):
    from splitleak.experiments import plan_grid

    split_only = "\n".join(line for line in LATENT.splitlines() if "{label:" not in line and line != "latent:")
    split_only = split_only.replace("model: tiny-gpt2", "model: tiny-gpt2\ndepths: [1]")
    with pytest.raises(ConfigError) as e:
        plan_grid(write(tmp_path, split_only + "\n"))
    assert "attacks[0] (support-partition) reads latent runs" in str(e.value)
    with pytest.raises(ConfigError) as e:
        plan_grid(write(tmp_path / "b", LATENT + "  - {attack: activation, k: 4}\n"))
    assert "attacks[2] (activation)" in str(e.value) and "depths or placements" in str(e.value)


# ------------------------------------------------------------------ the grid, run


@pytest.fixture(scope="module")
def latent_grid(tmp_path_factory):
    from splitleak.experiments import run_grid

    folder = tmp_path_factory.mktemp("latent-grid")
    spec = write(folder, LATENT + DOSED)
    store = folder / "store"
    run_grid(spec, store=store, workers=1, threads=1, device="cpu")
    return spec, store


@pytest.mark.e2e
def test_the_grid_stores_the_latent_attacks_as_run_attack_scores_them(latent_grid, tmp_path):
    from splitleak.attacks import make_attack_config
    from splitleak.audit.evaluate import run_attack
    from splitleak.experiments import plan_grid, read_results
    from splitleak.experiments.store import ResultsStore

    spec, store = latent_grid
    grid = plan_grid(spec)
    rows = read_results(store, "attack", as_rows=True)
    assert {r["key"] for r in rows} == {j.key for j in grid.of_kind("attack")}
    assert all(r["protocol_hash"] == grid.protocol_hash for r in rows)
    job = next(j for j in grid.of_kind("attack") if j.fields["defence"] == "fix" and '"norm"' in j.fields["params"])
    mine = [r for r in rows if r["key"] == job.key]
    direct = run_attack(
        ResultsStore(store).run_dir(job.train_key), make_attack_config(**job.config["attack"]), out=tmp_path / "R.json"
    )
    assert [r["doc_id"] for r in mine] == [f["frame_id"] for f in direct["per_doc"]]
    assert [r["frame_agreement"] for r in mine] == [f["agreement"] for f in direct["per_doc"]]
    assert json.loads(mine[0]["result_json"])["partition"] == direct["partition"]
    probe = [r for r in rows if r["attack"] == "latent-probe"]
    one = [r for r in probe if r["key"] == probe[0]["key"]]
    # one row per arm and capture frame, and per arm of the shuffled-label twin: (2 + 2) arms x 8 frames
    arms = ["gradient/mlp/0", "real-rows/mlp/0"]
    assert sorted({r["arm"] for r in one}) == arms + ["twin:" + a for a in arms] and len(one) == 32
    train = read_results(store, "train", as_rows=True)
    assert len(train) == 9 and all(t["defence_name"] == "latent" and t["heldout_ce"] > 0 for t in train)


@pytest.mark.e2e
def test_the_decoy_section_reads_the_partition_the_probes_and_the_fixs_cost(latent_grid, tmp_path):
    from splitleak.experiments import read_results
    from splitleak.report.grid import grid_report
    from splitleak.report.grid_latent import latent_summary
    from splitleak.stats import random_effects

    spec, store = latent_grid
    attack = read_results(store, "attack", as_rows=True)
    train = read_results(store, "train", as_rows=True)
    s = latent_summary(attack, train)
    cells = {(c.arm, c.params): c for c in s.partition}
    # open: the zero-support rule partitions every frame exactly (8 frames x 3 seeds)
    assert (cells[("open", "rule=support")].frames_exact, cells[("open", "rule=support")].frames) == (24, 24)
    # the fix: no zero left, every row is called real: agreement = 8 real of 8 + 48 rows
    fix = cells[("fix", "rule=support")]
    assert fix.frames_exact == 0 and fix.agreement == pytest.approx(8 / 56)
    # the naked control has no decoys: nothing to partition, so it has no partition row
    assert not any(c.arm == "naked" for c in s.partition)
    assert any("naked" in n and "no decoy" in n for n in s.notes)
    # the pooled probe arm: DerSimonian-Laird over the three seeds' effects, as stats.random_effects gives it
    naked = next(p for p in s.pooled if p.arm == "naked")
    runs = [r for r in s.probes if r.arm == "naked"]
    assert [r.seed for r in runs] == [1, 2, 3]
    arm = [next(a for a in r.arms if a["arm"] == naked.probe_arm) for r in runs]
    y = [a["paired_effect"] for a in arm]
    v = [((a["paired_high"] - a["paired_low"]) / (2 * 1.959963984540054)) ** 2 for a in arm]
    want = random_effects(y, v, alpha=0.05 / naked.arms_pooled)
    assert (naked.estimate, naked.low, naked.high) == pytest.approx((want.estimate, want.low, want.high))
    assert naked.leave_one_out is not None and naked.leave_one_out[0] <= naked.leave_one_out[1]
    # the naked boundary reads above the defended one on every seed
    for seed in (1, 2, 3):
        by = {r.arm: r.verdict["paired_effect"] for r in s.probes if r.seed == seed}
        assert by["naked"] > by["open"] + 0.05
    # the output gradient's cost: the fix minus the open arm, paired by seed, from the train rows
    ce = {(t["defence"], t["victim_seed"]): t["heldout_ce"] for t in train}
    cost = next(u for u in s.utility if u.arm == "fix").cost
    assert cost is not None and cost["against"] == "open" and cost["seeds"] == [1, 2, 3]
    assert cost["mean"] == pytest.approx(np.mean([ce[("fix", k)] - ce[("open", k)] for k in (1, 2, 3)]))
    assert next(u for u in s.utility if u.arm == "naked").cost is None

    # each run read again under the grid's protocol (gate_002): one mlp restart per view, 1 of the declared 9
    for run in s.probes:
        assert run.protocol is not None and run.protocol["thresholds"]["protocol"] == "gate-002"
        for view in ("real-rows", "gradient"):
            v = run.protocol["by_view"][view]
            assert (v["J"], v["declared_J"], v["matches_declared"]) == (1, 9, False)
            assert v["decision"] == ("breaks" if v["breaks_gate"] else "undecided")
    assert all(u.utility_gate is not None and u.utility_gate["max"] == 0.35 for u in s.utility)

    rep = grid_report(spec, out=tmp_path / "rep", store=store)
    text = " ".join(rep.markdown.read_text().split())
    assert "Read under protocol gate-002" in text and "within the utility gate" in text
    assert "## The decoy system (002)" in text
    assert "4,096 / 4,096 frames exact" in text and "| open | rule=support | 3 | 24 / 24 | 1.000 |" in text
    assert "no main test and no comparison family" in text  # gate_002 has none; the split sections stand aside


@pytest.mark.e2e
def test_the_dose_ladder_job_is_stored_per_dose_and_frame_and_read_back_by_the_report(latent_grid, tmp_path):
    from splitleak.attacks import make_attack_config
    from splitleak.attacks.dose import DOSE_SETS
    from splitleak.audit.evaluate import run_attack
    from splitleak.experiments import plan_grid, read_results
    from splitleak.experiments.store import ResultsStore
    from splitleak.report.grid import grid_report
    from splitleak.report.grid_dose import AXES, dose_name, dose_runs

    spec, store = latent_grid
    rows = read_results(store, "attack", as_rows=True)
    runs = dose_runs(rows)
    assert [(r.arm, r.seed, r.frames) for r in runs] == [("open", s, 8) for s in (1, 2, 3)]
    doses = DOSE_SETS["coverage"]
    for run in runs:
        assert [(d["mode"], d["coverage"], d["amplitude"]) for d in run.doses] == list(doses)
        for d in run.doses:  # each frame holds 8 real rows: the paired effect is the frames' mean difference
            frames = run.frame_delta[dose_name(d["mode"], d["coverage"], d["amplitude"])]
            assert len(frames) == 8 and set(frames) == set(run.frame_delta[dose_name(*doses[0])])
            assert np.mean(list(frames.values())) == pytest.approx(d["token_top1"]["paired_effect"], abs=1e-12)
        res = json.loads(next(r for r in rows if r["key"] == run.key)["result_json"])
        assert res["learnt_from"]["threat"] == "oracle" and res["channels_read"] == ["activations"]
        for metric, by_axis in res["dose"]["onsets"].items():
            for axis in AXES:
                assert run.onset(metric, axis) == by_axis[axis], (metric, axis)
    # the full dose is read on every seed, the zero dose on none
    for run in runs:
        assert run.at("coordinate", 1.0, 1.0)["token_top1"]["verdict"] == "detected"
        assert run.at("coordinate", 0.0, 1.0)["token_top1"]["verdict"] != "detected"
    # the store holds what the job computes when it is run again on its run
    job = next(j for j in plan_grid(spec).of_kind("attack") if j.key == runs[0].key)
    direct = run_attack(ResultsStore(store).run_dir(job.train_key), make_attack_config(**job.config["attack"]))
    assert direct["dose"]["doses"] == runs[0].doses
    text = " ".join(grid_report(spec, out=tmp_path / "rep", store=store).markdown.read_text().split())
    assert "### The instrument's positive control: the dose ladder" in text
    assert "| coverage | tiny-gpt2 open seed 1 (8 frames) | tiny-gpt2 open seed 2 (8 frames) |" in text
