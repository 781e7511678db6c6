"""`splitleak experiment report`: the grid report recomputed from a results store.

Most tests build a small synthetic store (3 victim seeds x 20 documents x 2 attack seeds) with the
store's own schemas, so every number in the report can be recomputed by hand here."""

import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from splitleak.audit.protocol import SHIPPED, freeze_protocol
from splitleak.data import LABELS
from splitleak.errors import IntegrityError
from splitleak.experiments.store import ResultsStore
from splitleak.metrics import fmt_pct
from splitleak.report.grid import analysis_rows, offload_run_rows, store_report
from splitleak.stats import crossed_bootstrap_ci

SEEDS = (11, 22, 33)
DOCS = 20
ATTACK_SEEDS = (0, 1)
SECTIONS = (
    "Negative controls",
    "Main test and comparison family",
    "Token, whole-document and span recovery",
    "Gradient perturbations",
    "Leakage against utility cost",
    "Attack × condition heatmap",
    "Partial offloading",
    "The upper side: what no reader can read",  # its rows say what they lack: these stores are written by hand
)


def _protocol(tmp: Path, name: str = "paper_main.yaml") -> tuple[Path, str]:
    p = tmp / name
    shutil.copy(SHIPPED / name, p)
    return p, freeze_protocol(p)


def _train_row(key, seed, defence, ppl, depth=6, start=None, length=None, delta_u=0.0, all_local=None):
    return {
        "key": key,
        "kind": "train",
        "model": "tiny-gpt2",
        "precision": "float32",
        "depth": depth,
        "offload_start": start,
        "offload_length": length,
        "cut": depth or max(1, start or 0),
        "defence": defence,
        "defence_name": defence.split("(")[0],
        "victim_seed": seed,
        "data": "synthetic-pii",
        "steps": 4,
        "n_calib": 8,
        "n_train": 8,
        "n_eval": DOCS,
        "doc_len": 32,
        "u_shape": depth is None,
        "heldout_ce": float(np.log(ppl)),
        "perplexity": ppl,
        "all_local_ce": None,
        "all_local_perplexity": all_local,
        "delta_u": delta_u,
    }


def _attack_rows(
    rng, key, train, phash, attack, seed_a, p_correct, p_exact, k=32, copy="public", noise=None, bits=None
):
    rows = []
    for d in range(DOCS):
        exact = rng.random() < p_exact
        correct = 32 if exact else int(rng.binomial(31, p_correct))
        row = {
            "key": key,
            "kind": "attack",
            "train_key": train["key"],
            "protocol_hash": phash,
            **{
                f: train[f]
                for f in (
                    "model",
                    "precision",
                    "depth",
                    "offload_start",
                    "offload_length",
                    "cut",
                    "defence",
                    "defence_name",
                    "victim_seed",
                    "data",
                    "steps",
                    "n_calib",
                    "n_train",
                    "n_eval",
                    "doc_len",
                )
            },
            "attack": attack,
            "k": k,
            "budget": None,
            "client_copy": copy,
            "attack_seed": seed_a,
            "perturbation": "none"
            if noise is None and bits is None
            else (f"noise={noise:g}" if noise else f"bits={bits}"),
            "gradient_noise": noise,
            "gradient_bits": bits,
            "inference": False,
            "readout": "gradient" if attack in ("joint", "shuffled-gradient", "backward-only") else None,
            "doc_id": 100 + d,
            "token_correct": correct,
            "token_counted": 32,
            "exact": exact,
        }
        for lab in LABELS:
            n = int(rng.integers(0, 3))
            row[f"span_counts_{lab}"] = n
            row[f"span_hits_{lab}"] = int(rng.integers(0, n + 1)) if not exact else n
        rows.append(row)
    return rows


def _build(tmp: Path, joint_p: float, act_p: float, *, foreign: bool = False):
    """A store with an undefended and a mixup-defended train job per seed at depth 6; joint and
    activation (k = 32, public) on the undefended ones, activation on the defended ones."""
    proto, phash = _protocol(tmp)
    rng = np.random.default_rng(7)
    rs = ResultsStore(tmp / "store")
    ppl_none, ppl_mix = (10.0, 20.0, 40.0), (13.0, 22.0, 40.0)  # relative changes 30 %, 10 %, 0 %
    everything = []
    for i, seed in enumerate(SEEDS):
        none = _train_row(f"t-none-{seed}", seed, "none", ppl_none[i])
        mix = _train_row(f"t-mix-{seed}", seed, "mixup(lambda=0.75)", ppl_mix[i], delta_u=0.1 * (i + 1))
        rs.write_rows("train", none["key"], [none])
        rs.write_rows("train", mix["key"], [mix])
        for a in ATTACK_SEEDS:
            for attack, p, train in (("joint", joint_p, none), ("activation", act_p, none), ("activation", 0.3, mix)):
                key = f"a-{attack}-{train['key']}-{a}"
                rows = _attack_rows(rng, key, train, phash, attack, a, p, p / 4)
                rs.write_rows("attack", key, rows)
                everything += rows
            key = f"a-joint-noise-{seed}-{a}"
            rows = _attack_rows(rng, key, none, phash, "joint", a, joint_p * 0.9, 0.1, noise=0.1)
            rs.write_rows("attack", key, rows)
            everything += rows
    if foreign:
        rows = _attack_rows(rng, "a-foreign-0123456789ab", none, "f" * 64, "joint", 5, 0.5, 0.1)
        rs.write_rows("attack", "a-foreign-0123456789ab", rows)
    return rs.root, proto, everything


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A large joint-over-activation gain (about 40 points); the report written once."""
    tmp = tmp_path_factory.mktemp("big")
    store, proto, rows = _build(tmp, joint_p=0.9, act_p=0.5)
    rep = store_report(store, proto, out=tmp / "out", n_boot=2000, date="2026-01-01")
    return rep, rows, proto


def _cell(md: str, row_start: str, col: int) -> str:
    """The cell of the first Markdown table row beginning with ``row_start`` (columns from 0)."""
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and " | ".join(cells).startswith(row_start):
            return cells[col]
    raise AssertionError(f"no row starting {row_start!r}")


def _kv(md: str, key: str) -> str:
    """The value of the first ``- **key**: value`` line."""
    for line in md.splitlines():
        if line.startswith(f"- **{key}**: "):
            return line[len(f"- **{key}**: ") :]
    raise AssertionError(f"no line for {key!r}")


def _matrix(rows, fn):
    seeds = sorted({r["victim_seed"] for r in rows})
    docs = sorted({r["doc_id"] for r in rows})
    m = np.zeros((len(seeds), len(docs)))
    n = np.zeros_like(m)
    for r in rows:
        i, j = seeds.index(r["victim_seed"]), docs.index(r["doc_id"])
        m[i, j] += fn(r)
        n[i, j] += 1
    return m / n


@pytest.mark.integration
def test_recovery_tables_show_the_pooled_rates_computed_by_hand(big):
    rep, rows, _ = big
    md = rep.markdown.read_text()
    joint = [r for r in rows if r["attack"] == "joint" and r["gradient_noise"] is None]
    assert len(joint) == len(SEEDS) * len(ATTACK_SEEDS) * DOCS
    pooled = sum(r["token_correct"] for r in joint) / sum(r["token_counted"] for r in joint)
    m = _matrix(joint, lambda r: r["token_correct"] / r["token_counted"])
    assert fmt_pct(pooled) == fmt_pct(m.mean())  # 32 tokens per document: pooled = mean of document rates
    iv = crossed_bootstrap_ci(m, n_boot=2000, seed=0)
    token_cell = _cell(md, "none | joint k=32 |", 2)
    assert token_cell == f"{fmt_pct(pooled)} [{fmt_pct(iv.low)}, {fmt_pct(iv.high)}]"
    assert iv.low < pooled < iv.high
    # whole-document recovery: the share of exact documents, pooled the same way
    doc_rate = sum(bool(r["exact"]) for r in joint) / len(joint)
    doc_section = md.split("### Whole-document recovery")[1]
    assert _cell(doc_section, "none | joint k=32 |", 2).startswith(fmt_pct(doc_rate) + " [")
    # span recovery per class: spans recovered over spans present
    for j, lab in enumerate(LABELS):
        rate = sum(r[f"span_hits_{lab}"] for r in joint) / sum(r[f"span_counts_{lab}"] for r in joint)
        span_section = md.split("### Span recovery by class")[1]
        assert _cell(span_section, "none | joint k=32 | L=6 | public", 4 + j).startswith(fmt_pct(rate) + " [")
    # the two attacks differ as built (about 90 % against 50 %)
    act = _cell(md, "none | activation k=32 |", 2)
    assert float(act.split()[0]) < 60 < float(token_cell.split()[0])


@pytest.mark.integration
def test_relative_perplexity_change_is_per_seed_against_the_undefended_twin(big):
    rep, rows, _ = big
    md = rep.markdown.read_text().split("## Leakage against utility cost")[1]
    # (13/10 - 1 + 22/20 - 1 + 40/40 - 1) / 3 = 13.33 %, not the ratio of mean perplexities (7.14 %)
    assert _cell(md, "L=6 | mixup(lambda=0.75) |", 5) == "+13.33"
    assert _cell(md, "L=6 | none |", 5) == "0.00"
    assert _cell(md, "L=6 | mixup(lambda=0.75) |", 6) == "+0.2000"  # ΔU mean of 0.1, 0.2, 0.3
    # leakage pools the configuration run against both defences: activation k=32, public
    mixed = [r for r in rows if r["defence_name"] == "mixup"]
    rate = sum(r["token_correct"] for r in mixed) / sum(r["token_counted"] for r in mixed)
    assert _cell(md, "L=6 | mixup(lambda=0.75) |", 7) == fmt_pct(rate)
    act = [r for r in rows if r["defence_name"] == "none" and r["attack"] == "activation"]
    assert _cell(md, "L=6 | none |", 7) == fmt_pct(sum(r["token_correct"] for r in act) / (32 * len(act)))


@pytest.mark.integration
def test_main_test_passes_for_a_large_difference_and_fails_for_a_small_one(big, tmp_path):
    rep, rows, _ = big
    assert rep.analysis.main.passes and rep.analysis.main.estimate > 0.3
    md = rep.markdown.read_text()
    assert _kv(md, "result") == "**PASS**"
    joint = _matrix(
        [r for r in rows if r["attack"] == "joint" and r["gradient_noise"] is None and r["defence"] == "none"],
        lambda r: r["token_correct"] / 32,
    )
    act = _matrix(
        [r for r in rows if r["attack"] == "activation" and r["defence"] == "none"], lambda r: r["token_correct"] / 32
    )
    assert _kv(md, "difference, treatment − control (pp)") == "+" + fmt_pct(joint.mean() - act.mean())
    assert "overridden to 2,000" in md and "100,000" in md  # the override is said, with the protocol's count
    # a gain of well under the 2-point pass mark fails
    small = tmp_path / "small"
    small.mkdir()
    store, proto, _ = _build(small, joint_p=0.505, act_p=0.5)
    rep2 = store_report(store, proto, out=small / "out", n_boot=2000)
    assert not rep2.analysis.main.passes
    assert _kv(rep2.markdown.read_text(), "result") == "**FAIL**"
    # the family: 47 comparisons, the one with data (joint vs activation elsewhere) missing here
    assert len(rep.analysis.family) == 47 and rep.analysis.family_passes is False


@pytest.mark.integration
def test_results_under_a_foreign_protocol_hash_are_refused_by_name(tmp_path):
    store, proto, _ = _build(tmp_path, joint_p=0.9, act_p=0.5, foreign=True)
    with pytest.raises(IntegrityError, match=r"joint k=32 public a5 \(a-foreign-01\): protocol_hash f{64}"):
        store_report(store, proto, out=tmp_path / "out", n_boot=100)
    assert not (tmp_path / "out" / "report.md").exists()  # refused before anything is written


@pytest.mark.integration
def test_html_is_self_contained_with_every_section_and_figures_as_png_and_svg(big):
    rep, _, _ = big
    html = rep.html.read_text()
    assert 'src="http' not in html and "<script" not in html and "<link" not in html and "url(" not in html
    imgs = re.findall(r'<img [^>]*src="([^"]+)"', html)
    assert imgs and all(s.startswith("data:image/png;base64,") for s in imgs)
    for title in SECTIONS:
        assert f">{title}</h2>" in html
    assert html.count('<li><a href="#') == len(SECTIONS)  # the table of contents links every section
    md = rep.markdown.read_text()
    for title in SECTIONS:
        assert f"## {title}" in md
    assert "records no training configuration" in md.split("## The upper side")[1]
    stems = {p.stem for p in rep.figures}
    assert stems == {"gradient-perturbations", "leakage-cost", "heatmap"}
    for stem in stems:
        png, svg = rep.out / f"{stem}.png", rep.out / f"{stem}.svg"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5_000
        assert svg.read_text().lstrip().startswith("<?xml") and "<svg" in svg.read_text()
        assert f"]({stem}.png)" in md
    assert len(imgs) == len(stems)
    # no partial-offloading runs in this store: the section says why in one line
    assert "Omitted: the store holds no partial-offloading runs" in md


@pytest.mark.unit
def test_adapter_converts_store_rows_for_the_analysis():
    row = {
        "key": "k1",
        "kind": "attack",
        "attack": "sipit",
        "k": None,
        "budget": "32",
        "client_copy": "trained",
        "attack_seed": 1,
        "gradient_noise": None,
        "gradient_bits": None,
        "inference": None,
        "model": "m",
        "depth": 3,
        "offload_start": None,
        "offload_length": None,
        "defence": "mixup(lambda=0.75)",
        "defence_name": "mixup",
        "data": "d",
        "victim_seed": 11,
        "doc_id": 4,
        "token_correct": 5,
        "token_counted": 8,
        "exact": False,
        "protocol_hash": "h",
    }
    prop = {**row, "key": "k2", "attack": "property", "budget": "exhaustive", "token_counted": None}
    out = analysis_rows([row, prop, {**row, "key": "k3", "budget": "exhaustive"}])
    assert [r["budget"] for r in out] == [32, "exhaustive"]  # property rows carry no token scores
    assert out[0]["defence"] == "mixup" and out[0]["inference"] is False and out[0]["config_hash"] == "k1"


@pytest.mark.integration
def test_partial_offloading_section_means_and_variance_tests(tmp_path):
    proto, phash = _protocol(tmp_path, "partial_offloading.yaml")
    rs = ResultsStore(tmp_path / "store")
    rng = np.random.default_rng(3)
    expect: dict[tuple, list[float]] = {}
    for seed in (11, 22, 33, 77, 88):
        for s in (2, 4):
            for b in (0, 1, 2):
                for d in ("quant8", "quant4-noisy"):
                    du = 0.01 * s + 0.05 * b + 0.002 * rng.standard_normal()  # the start matters
                    t = _train_row(
                        f"t-{seed}-{s}-{b}-{d}",
                        seed,
                        d,
                        12.0,
                        depth=None,
                        start=b,
                        length=s,
                        delta_u=du,
                        all_local=10.0,
                    )
                    rs.write_rows("train", t["key"], [t])
                    li = 0.2 + 0.1 * b + 0.01 * rng.standard_normal()
                    expect.setdefault((d, s, b), []).append(du)
                    a = {
                        "key": f"p-{t['key']}",
                        "kind": "attack",
                        "train_key": t["key"],
                        "protocol_hash": phash,
                        **{
                            f: t[f]
                            for f in (
                                "model",
                                "depth",
                                "offload_start",
                                "offload_length",
                                "defence",
                                "defence_name",
                                "victim_seed",
                                "data",
                            )
                        },
                        "attack": "property",
                        "client_copy": "public",
                        "attack_seed": 17,
                        "doc_id": 0,
                        "leakage_index": li,
                        "vmi_token_recovery": 0.4,
                        "majority_token_recovery": 0.1,
                    }
                    rs.write_rows("attack", a["key"], [a, {**a, "doc_id": 1}])
    rows = ResultsStore(rs.root)
    from splitleak.experiments import read_results

    runs = offload_run_rows(
        read_results(rows.root, "attack", as_rows=True), read_results(rows.root, "train", as_rows=True), phash
    )
    assert len(runs) == 5 * 2 * 3 * 2 and all(abs(r["vmi_excess"] - 0.3) < 1e-12 for r in runs)
    rep = store_report(rs.root, proto, out=tmp_path / "out", n_boot=200)
    md = rep.markdown.read_text().split("## Partial offloading")[1]
    mean = float(np.mean(expect[("quant8", 4, 1)]))
    assert _cell(md, "quant8 | 4 | 1 |", 4) == f"{mean:+.4f}"
    po = {(e["defence"], e["outcome"]): e for e in rep.analysis.partial_offloading}
    assert set(po) == {(d, o) for d in ("quant8", "quant4-noisy") for o in ("delta_u", "leakage_index")}
    e = po[("quant8", "delta_u")]
    assert e["passes"] and e["partial_r2"] > 0.9
    assert (
        _cell(md, "quant8 | delta_u |", 3) == f"{e['partial_r2']:.4f}"
        and _cell(md, "quant8 | delta_u |", 6) == "**PASS**"
    )
    assert e["heldout"]["test_seeds"] == [77, 88]
    assert "RMSE, with start" in md
    # no per-token attack: the recovery sections say why; the cost table uses the all-local twin
    full = rep.markdown.read_text()
    assert "Omitted: the store holds no attack results with per-token scores" in full
    cost = full.split("## Leakage against utility cost")[1]
    assert _cell(cost, "s=4 b=1 | quant8 |", 4) == "10.00 (all-local twin)"  # no undefended run in this grid
    assert _cell(cost, "s=4 b=1 | quant8 |", 5) == "+20.00"  # perplexity 12 against 10


@pytest.mark.unit
def test_recovery_with_documents_nested_in_seeds_uses_the_hierarchical_bootstrap():
    from splitleak.report.grid_stats import recovery_cells

    rows = []
    for i, seed in enumerate(SEEDS):  # each seed its own documents, 10 per seed; seed i gets i + 1 more tokens right
        for d in range(10):
            rows.append(
                {
                    "key": f"a{seed}",
                    "kind": "attack",
                    "train_key": "t",
                    "model": "m",
                    "data": "x",
                    "defence": "none",
                    "attack": "activation",
                    "k": 8,
                    "budget": None,
                    "gradient_noise": None,
                    "gradient_bits": None,
                    "inference": False,
                    "depth": 2,
                    "offload_start": None,
                    "offload_length": None,
                    "client_copy": "public",
                    "attack_seed": 0,
                    "victim_seed": seed,
                    "doc_id": 100 * i + d,
                    "token_correct": 20 + i + (d % 2),
                    "token_counted": 32,
                    "exact": False,
                    **{f"span_{w}_{lab}": 0 for w in ("hits", "counts") for lab in LABELS},
                }
            )
    (cell,) = recovery_cells(rows, n_boot=500)
    assert not cell.crossed and cell.n_docs == 30 and cell.n_seeds == 3
    per_seed = [np.mean([(20 + i + d % 2) / 32 for d in range(10)]) for i in range(3)]
    assert cell.token.estimate == pytest.approx(np.mean(per_seed))
    assert cell.token.low < cell.token.estimate < cell.token.high
    assert all(v is None for v in cell.spans.values())  # no spans present: no rate


SPEC = """\
name: tiny-report
protocol: protocol.yaml
models: [tiny-gpt2]
depths: [2]
victim_seeds: [11]
attack_seeds: [0]
client_copies: [public]
documents: {n_calib: 8, n_train: 4, n_eval: 8, doc_len: 16}
steps: 2
all_local_baseline: false
data: {source: synthetic-pii}
attacks:
  - {attack: activation, k: 8}
  - {attack: joint, k: 8}
"""

PROTOCOL = """\
name: tiny-report
source: "test"
hypotheses: ["the joint attacker beats the activation-only attacker"]
main_test:
  description: "joint minus activation-only token recovery at depth 2, public copy, k = 8"
  treatment: {attack: joint, k: 8, client_copy: public, depth: 2}
  control: {attack: activation, k: 8, client_copy: public, depth: 2}
  pass_mark: 0.02
  n_boot: 1000
victim_seeds: [11]
documents: {n_calib: 8, n_train: 4, n_eval: 8, doc_len: 16}
"""


@pytest.mark.e2e
def test_cli_reports_a_real_tiny_grid(tmp_path):
    """End to end: one tiny train job and two attacks run by the grid runner, then the report command."""
    from typer.testing import CliRunner

    from splitleak.cli import app

    (tmp_path / "spec.yaml").write_text(SPEC)
    (tmp_path / "protocol.yaml").write_text(PROTOCOL)
    spec, store, out = str(tmp_path / "spec.yaml"), str(tmp_path / "store"), tmp_path / "rep"
    runner = CliRunner()
    r = runner.invoke(
        app,
        ["experiment", "run", spec, "--store", store, "--workers", "1", "--threads", "1", "--device", "cpu", "--quiet"],
    )
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["experiment", "report", spec, "--store", store, "--out", str(out), "--n-boot", "300"])
    assert r.exit_code == 0, r.output
    assert str(out / "report.md") in r.output and str(out / "report.html") in r.output
    md = (out / "report.md").read_text()
    assert "tiny-report" in md and "- **spec SHA-256**: `" in md and "overridden to 300" in md
    assert _kv(md, "result") in ("**PASS**", "**FAIL**")
    assert re.search(r"\| all +\| +3 \| +0 \| +0 \| +0 \| +3 \|", md)  # 3 jobs done, none running, failed, pending
    for attack in ("activation k=8", "joint k=8"):
        assert re.search(rf"\| none +\| {attack} +\| +\d+\.\d\d \[", md)
    assert (out / "heatmap.png").is_file() and (out / "heatmap.svg").is_file()
    # the grid trained no defence and perturbed no gradient: those sections say so in one line
    assert "Omitted: the grid trained no defence" in md and "Omitted: the store holds no joint-attacker result" in md


@pytest.mark.unit
def test_tables_name_a_non_default_gradient_readout():
    from splitleak.report.grid_stats import Config

    base = {
        "model": "m",
        "data": "d",
        "defence": "none",
        "attack": "joint",
        "k": 32,
        "budget": None,
        "gradient_noise": None,
        "gradient_bits": None,
        "inference": False,
    }
    assert Config.of({**base, "readout": "gradient"}).attack_text() == "joint k=32"
    # the pseudo-label map, named or recorded before read-outs existed, is a row of its own
    assert Config.of({**base, "readout": "pseudo-map"}).attack_text() == "joint k=32 readout=pseudo-map"
    assert Config.of({**base, "readout": None}) == Config.of({**base, "readout": "pseudo-map"})
    assert Config.of({**base, "attack": "activation", "readout": None}).attack_text() == "activation k=32"
