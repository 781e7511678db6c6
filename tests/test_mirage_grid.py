"""The Gradient Mirage grid (003): label-shielded arms in experiment specs, the report's section with its
privacy–utility figure, and the paper's claims of shape (a)–(e) checked on the tiny model over 8
documents (``mirage.yaml``'s ``tiny`` profile) and, in the checker itself, on cells built by hand. The claims
read each arm's strongest label reader (GMA-SL, or gma-sl-aware, which knows the chain's public arguments)."""

from __future__ import annotations

import json

import pytest

from splitleak.errors import ConfigError
from splitleak.experiments import load_spec, plan_grid
from splitleak.report.grid_shielded import ArmCell, shape_claims

# ------------------------------------------------------------------ specs with label-shielded arms


@pytest.mark.unit
def test_the_shipped_mirage_spec_plans_one_train_job_per_arm_and_seed():
    full = plan_grid("mirage")
    # 23 arms x 2 seeds; gma-sl and gma-sl-aware on all but top-only (which sends no gradient to match), BiSR(b+f),
    # BiSR(f) and BiSR(b) by cosine on 2
    assert full.counts() == {"train": 46, "attack": 2 * 44 + 12, "reuse": 0}
    answer = next(j for j in full.of_kind("train") if j.fields["defence"] == "none-answer-only")
    assert answer.config["train"]["shielded"]["answer_only"] is True
    extreme = [j for j in full.of_kind("train") if j.fields["defence"].startswith("mirage-frozen-m")]
    assert sorted(j.config["train"]["defences"][0]["args"]["m"] for j in extreme) == sorted(
        2 * [4000, 10000, 25000, 50000, 100000]
    )
    assert {j.config["train"]["shielded"]["train"] for j in extreme} == {"trunk-frozen"}
    quick = plan_grid("mirage", profile="quick")  # the extreme m arms for their utility only: no attack reads them
    assert quick.counts() == {"train": 22, "attack": 24, "reuse": 0}  # sas and vmf alone: read for what they send
    cosine = [j for j in quick.of_kind("attack") if j.fields["attack"] == "bisr-b"]
    assert sorted(j.fields["defence"] for j in cosine) == ["mirage", "none"]
    assert {json.loads(j.fields["params"])["b_distance"] for j in cosine} == {"cos"}
    read = {j.fields["defence"] for j in quick.of_kind("attack")}
    assert "none-answer-only" in read and not any(d.startswith("mirage-frozen") for d in read)
    assert not read & {"sas", "vmf"} and {"sas", "vmf"} <= {j.fields["defence"] for j in quick.of_kind("train")}
    aware = [j for j in full.of_kind("attack") if j.fields["attack"] == "gma-sl-aware"]
    assert {j.train_key for j in aware} == {
        j.train_key for j in full.of_kind("attack") if j.fields["attack"] == "gma-sl"
    }
    top_only = {j.key for j in full.of_kind("train") if j.fields["defence"] == "top-only"}
    assert len(top_only) == 2 and not [j for j in full.of_kind("attack") if j.train_key in top_only]
    tiny = plan_grid("mirage", profile="tiny")
    trains = tiny.of_kind("train")
    assert len(trains) == 11 and {j.fields["defence_name"] for j in trains} == {"label-shielded"}
    frozen = next(j for j in trains if j.fields["defence"] == "mirage-frozen")
    cfg = frozen.config["train"]
    assert cfg["shielded"] == {"bottom": 1, "top": 1, "train": "trunk-frozen", "answer_only": False}
    assert [d["name"] for d in cfg["defences"]] == ["mirage"] and cfg["lr"] == 1e-3
    m1 = next(j for j in trains if j.fields["defence"] == "mirage-m1")
    assert m1.config["train"]["defences"][0]["args"] == {"m": 1}
    assert {j.fields["attack"] for j in tiny.of_kind("attack")} == {"gma-sl", "gma-sl-aware"}
    assert "label-shielded mirage-frozen seed 0" in frozen.summary


def _spec(tmp_path, body: str):
    p = tmp_path / "s.yaml"
    p.write_text(
        "protocol: shipped:mirage_003\nmodels: [tiny-gpt2]\nvictim_seeds: [0]\ndata: {source: instructions}\n" + body
    )
    return p


@pytest.mark.unit
@pytest.mark.parametrize(
    "body, words",
    [
        ("shielded: [{label: a}, {label: a, chain: mirage}]\n", "the arm label 'a' is used twice"),
        ("shielded: [{label: a, train: sometimes}]\n", "shielded.0.train"),
        ("shielded: [{label: a, chian: mirage}]\n", "unknown key 'shielded.0.chian'"),
        ("shielded: [{label: label-shielded}]\n", "relabel the arm"),
        (
            "depths: [1]\ndefences: [mirage]\n",
            "for label-shielded runs only, not for a plain split (depths); put it in a shielded arm's chain",
        ),
        ("shielded: [{label: a}]\nattacks: [{attack: support-partition}]\n", "reads latent runs and no train job"),
        ("depths: [1]\nattacks: [{attack: gma-sl}]\n", "reads label-shielded runs and no train job"),
    ],
)
def test_bad_shielded_specs_are_refused_naming_the_problem(tmp_path, body, words):
    with pytest.raises(ConfigError) as err:
        plan_grid(load_spec(_spec(tmp_path, body)))
    assert words in " ".join(str(err.value).split())


@pytest.mark.unit
def test_label_shielded_attacks_go_to_the_shielded_arms_and_split_attacks_to_both(tmp_path):
    spec = _spec(
        tmp_path,
        "depths: [1]\nshielded: [{label: a, bottom: 1, top: 1}, {label: b, bottom: 1, top: 1, chain: sas}]\n"
        "attacks: [{attack: gma-sl}, {attack: vmi}, {attack: bisr-f, defences: [b]}]\n",
    )
    grid = plan_grid(load_spec(spec))
    where = {(j.fields["attack"], j.fields["defence"]) for j in grid.of_kind("attack")}
    assert where == {("gma-sl", "a"), ("gma-sl", "b"), ("vmi", "none"), ("vmi", "a"), ("vmi", "b"), ("bisr-f", "b")}


# ------------------------------------------------------------------ the claim checker


def _cell(arm, chain="none", args=None, train="all", ce=5.0, labels=0.9, rouge=0.8):
    ch = [{"name": chain, "args": args or {}}]
    return ArmCell(
        "m", arm, ch, train, [0], ce, None, None, None, {"gma-sl": {"label_recovery": labels, "rougeL_f": rouge}}
    )


def _paper_shaped():
    return [
        _cell("none", labels=0.95, rouge=0.9),
        _cell("mirage", "mirage", labels=0.2, rouge=0.1, ce=5.05),
        _cell("grad-prune", "grad-prune", labels=0.7, rouge=0.5, ce=5.1),
        _cell("seq-dp", "seq-dp", labels=0.05, rouge=0.0, ce=6.0),  # private, but its utility is not comparable
        _cell("m1", "mirage", {"m": 1}, labels=0.6),
        _cell("m100", "mirage", {"m": 100}, labels=0.25),
        _cell("m10000", "mirage", {"m": 10000}, labels=0.18),
        _cell("r0", "mirage", {"r": 0}, labels=0.3),
        _cell("r0.9", "mirage", {"r": 0.9}, labels=0.35),
        _cell("frozen", "mirage", train="trunk-frozen", ce=5.1),
    ]


@pytest.mark.unit
def test_the_claims_hold_on_numbers_shaped_like_the_papers_and_each_fails_when_its_number_moves():
    verdict = lambda cells: {c.name: c.holds for c in shape_claims(cells)}  # noqa: E731
    assert verdict(_paper_shaped()) == dict.fromkeys("abcde", True)
    moved = {
        "a": ("none", {"gma-sl": {"label_recovery": 0.4, "rougeL_f": 0.9}}),
        "b": ("grad-prune", {"gma-sl": {"label_recovery": 0.25, "rougeL_f": 0.5}}),  # within 0.1 of mirage
        "c": ("m10000", {"gma-sl": {"label_recovery": 0.05, "rougeL_f": 0.0}}),  # still falling: no plateau
        "d": ("r0", {"gma-sl": {"label_recovery": 0.15, "rougeL_f": 0.1}}),  # r = 0 reads least
    }
    for claim, (arm, attacks) in moved.items():
        cells = _paper_shaped()
        next(c for c in cells if c.arm == arm).attacks = attacks
        assert verdict(cells) == {**dict.fromkeys("abcde", True), claim: False}, claim
    cells = _paper_shaped()
    next(c for c in cells if c.arm == "frozen").heldout_ce = 5.0  # freezing the Trunk now does better
    assert verdict(cells)["e"] is False
    # without the arms a claim needs, it is not checked rather than passed
    assert verdict([_cell("none")]) == {"a": True, "b": None, "c": None, "d": None, "e": None}
    # a protocol's threshold replaces ours
    assert {c.name: c.holds for c in shape_claims(_paper_shaped(), {"most_labels": 0.99})}["a"] is False


@pytest.mark.unit
def test_the_answer_only_and_extreme_m_arms_never_stand_in_for_the_claims_arms():
    """An answer-only undefended arm is not claim (a)'s undefended arm, and a frozen Trunk at an extreme m is not
    claim (e)'s frozen twin of the default mirage, wherever they come in the cells."""
    verdict = lambda cells: {c.name: c.holds for c in shape_claims(cells)}  # noqa: E731
    answer = _cell("none-answer-only", labels=0.2)  # would fail (a) if it were read as the undefended arm
    answer.answer_only = True
    extreme = _cell("frozen-m100000", "mirage", {"m": 100000}, train="trunk-frozen", ce=4.0)  # would fail (e)
    assert verdict([answer, extreme, *_paper_shaped()]) == dict.fromkeys("abcde", True)
    answer.answer_only = False  # the same cell as a full-supervision arm, first: (a) reads it, and fails
    assert verdict([answer, *_paper_shaped()])["a"] is False


@pytest.mark.unit
def test_the_claims_read_each_arm_on_its_strongest_label_reader():
    verdict = lambda cells: {c.name: c.holds for c in shape_claims(cells)}  # noqa: E731
    cells = _paper_shaped()
    mirage = next(c for c in cells if c.arm == "mirage")
    # a reader that knows the chain reads mirage as well as pruning: (b) no longer holds
    mirage.attacks["gma-sl-aware"] = {"label_recovery": 0.65, "rougeL_f": 0.45}
    assert mirage.strongest() == 0.65 and mirage.strongest("rougeL_f") == 0.45
    assert mirage.strongest_reader() == "gma-sl-aware" and mirage.reads() == 0.2  # GMA-SL's own reading stands
    claims = {c.name: c for c in shape_claims(cells)}
    assert claims["b"].holds is False and "65.0 % labels (gma-sl-aware)" in claims["b"].evidence
    # a weaker second reader changes nothing
    cells = _paper_shaped()
    for c in cells:
        c.attacks["gma-sl-aware"] = {k: 0.5 * v for k, v in c.attacks["gma-sl"].items()}
    assert verdict(cells) == dict.fromkeys("abcde", True)
    # an aware reader flat in m (it fits the scale) breaks (c): no fall from the smallest m to the largest
    cells = _paper_shaped()
    for c in cells:
        if c.chain_names == "mirage" and c.arg("mirage", "r", 1 / 7) == pytest.approx(1 / 7):
            c.attacks["gma-sl-aware"] = {"label_recovery": 0.6, "rougeL_f": 0.5}
    assert verdict(cells)["c"] is False
    # only the aware reader: the claims still read (no reader is required by name)
    cells = _paper_shaped()
    for c in cells:
        c.attacks = {"gma-sl-aware": c.attacks["gma-sl"]}
    assert verdict(cells) == dict.fromkeys("abcde", True)


# ------------------------------------------------------------------ the tiny grid, end to end


@pytest.mark.e2e  # a whole grid run through the runner and its report (the tier of the other grids)
@pytest.mark.parametrize("seed", [0, 1])
def test_the_tiny_grid_reads_the_claims_of_shape_on_eight_documents(tmp_path, seed):
    from splitleak.experiments import read_results, run_grid
    from splitleak.report.grid import grid_report
    from splitleak.report.grid_shielded import shielded_summary

    over = [f"victim_seeds=[{seed}]", f"documents.seed={seed}"]
    store = tmp_path / "store"
    # one torch thread: under `make test` the other xdist worker holds the second core, and two threads on a
    # shared core spin (measured on a busy machine: one seed took 447 s of CPU with threads=2, both 101 s with 1)
    done = run_grid("mirage", profile="tiny", overrides=over, store=store, workers=1, threads=1)
    assert not done.failures
    cells = {
        c.arm: c
        for c in shielded_summary(
            read_results(store, "attack", as_rows=True), read_results(store, "train", as_rows=True)
        )
    }
    assert len(cells) == 11 and all(len(c.seeds) == 1 for c in cells.values())
    claims = {c.name: c for c in shape_claims(list(cells.values()))}
    # (a) undefended, the pretrained Top explains the output gradient: nearly every label comes back
    assert cells["none"].reads() > 0.9 and claims["a"].holds
    # (b) GMA-SL reads Gradient Mirage far below pruning and dropout at comparable utility; the reader that
    # divides the public m out reads much more of it (measured 60-62 % against GMA-SL's 35-36 %: sas's dropped
    # targets are what stays hidden), still below pruning and dropout, so (b) is checked on it; seq-dp reads
    # nothing but costs more than the margin (0.25 nats), so it is not a comparable baseline
    assert claims["b"].holds is not None, claims["b"].evidence
    for base in ("grad-prune", "grad-dropout"):
        assert cells["mirage"].reads() < cells[base].reads() - 0.3
        assert cells["mirage"].strongest() < cells[base].strongest()
    assert cells["mirage"].reads("gma-sl-aware") > cells["mirage"].reads() + 0.15
    assert cells["seq-dp"].heldout_ce > cells["none"].heldout_ce + 0.25
    # (c) GMA-SL's reading falls as m grows: l2 matching cannot follow a gradient scaled by 10^4; the aware
    # reader divides the public m out and reads about as much at every m, so on the strongest reader (c)
    # does not hold; the trunk's Adam does not see the scale, so the held-out loss stays where it was
    m = {k: cells[k].reads() for k in ("mirage-m1", "mirage-m10", "mirage", "mirage-m10000")}
    assert m["mirage-m1"] > m["mirage"] + 0.15 and m["mirage"] > m["mirage-m10000"] + 0.15, m
    aware = {k: cells[k].reads("gma-sl-aware") for k in m}
    assert max(aware.values()) - min(aware.values()) < 0.15 and aware["mirage-m10000"] > 0.5, aware
    assert claims["c"].holds is False
    ces = [cells[k].heldout_ce for k in m]
    assert max(ces) - min(ces) < 0.02
    # (e) on the tiny model both keep training: each below the undefended arm's loss plus 0.2 nats
    for arm in ("mirage", "mirage-frozen"):
        assert cells[arm].heldout_ce < cells["none"].heldout_ce + 0.2
    # the gradient the client sent under mirage is mostly noise against the raw one; undefended it is the raw one
    assert cells["mirage"].asnr < 0.01 and cells["none"].asnr is None and cells["none"].recall10 == 1.0

    rep = grid_report("mirage", profile="tiny", overrides=over, store=store, out=tmp_path / "report")
    text = rep.markdown.read_text()
    assert "## Label-shielded fine-tuning and Gradient Mirage (003)" in text
    assert (tmp_path / "report" / "privacy-utility.png").stat().st_size > 10_000
    assert (tmp_path / "report" / "privacy-utility.svg").is_file()
    for name, claim in claims.items():
        verdict = {True: "holds", False: "does not hold", None: "not checked"}[claim.holds]
        assert f"| {name} " in text and verdict in text
    html = rep.html.read_text()
    assert "data:image/png;base64," in html and "privacy-utility" in html
    row = json.loads(
        next(
            r for r in read_results(store, "attack", as_rows=True) if r["defence"] == "none" and r["attack"] == "gma-sl"
        )["result_json"]
    )
    assert row["label_recovery"] == cells["none"].reads()
    # both sides name the label-shielded arms too; seq-dp's noise is keyed by the run seed here (derived draws, so
    # that the grid replays), so none has a bound, and the report says why
    by = {b["defence"]: b for b in rep.bounds}
    assert {"mirage", "seq-dp", "grad-prune"} <= set(by) and "none" not in by
    assert "keyed by the run seed" in by["seq-dp"]["why"] and not by["seq-dp"]["bound"]["bounded"]
    assert by["mirage"]["why"] == "no defence of the chain adds noise with a formal guarantee"
    assert "## The upper side: what no reader can read" in text
