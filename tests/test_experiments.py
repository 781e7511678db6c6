"""Experiment grids: specs, expansion into keyed jobs, the local and Ray executors, the results
store, resume after SIGKILL, failure isolation and status. Runs on tiny-gpt2 with a few documents."""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from damage import damaged, fuzz
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from splitleak.audit.protocol import SHIPPED
from splitleak.cli import app
from splitleak.errors import ConfigError

runner = CliRunner()
REPO = Path(__file__).resolve().parents[1]

TINY = """\
name: tiny
protocol: proto.yaml
model: tiny-gpt2
depths: [1, 2]
defences: [none]
victim_seeds: [1]
attack_seeds: [0]
client_copies: [public, trained]
documents: {n_calib: 4, n_train: 4, n_eval: 4, doc_len: 8}
steps: 2
attacks:
  - {attack: activation, k: 4, inference: true}
  - {attack: joint, k: 4, client_copy: public, perturbations: [none, {gradient_bits: 8}]}
  - {attack: property, client_copy: public}
  - {attack: sipit, budget: 8, client_copy: trained}
"""
# per train job: activation x 2 copies (+ 2 reused for inference), joint x 2 perturbations,
# property, sipit = 6 attack jobs and 2 reuse jobs; 2 depths -> 2 train, 12 attack, 4 reuse.
TINY_COUNTS = {"train": 2, "attack": 12, "reuse": 4}

# columns that must agree between two runs of the same grid (timings and paths excluded)
ATTACK_SCORES = [
    "key",
    "kind",
    "train_key",
    "reuse_of",
    "protocol_hash",
    "doc_id",
    "token_correct",
    "token_counted",
    "exact",
    "span_hits_name",
    "span_counts_name",
    "span_hits_number",
    "span_counts_number",
    "predicted",
    "property_score",
    "leakage_index",
    "vmi_token_recovery",
    "majority_token_recovery",
    "attack_config",
    "job_config",
    "train_config",
    "cut",
]
TRAIN_SCORES = [
    "key",
    "heldout_ce",
    "perplexity",
    "all_local_ce",
    "delta_u",
    "pretrained_ce",
    "wire_bytes_client_to_server",
    "wire_bytes_server_to_client",
    "train_config",
    "job_config",
    "cut",
]


def write_spec(folder: Path, text: str = TINY, name: str = "tiny.yaml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    proto = folder / "proto.yaml"
    if not proto.exists():
        shutil.copy(SHIPPED / "paper_main.yaml", proto)  # a copy: freezing it must not touch the package
    path = folder / name
    path.write_text(text)
    return path


def scores(store, kind="attack"):
    from splitleak.experiments import read_results

    cols = ATTACK_SCORES if kind == "attack" else TRAIN_SCORES
    return read_results(store, kind).select(cols).to_pylist()


# ------------------------------------------------------------------ specs


@pytest.mark.unit
def test_unknown_keys_are_refused_naming_key_file_and_layer(tmp_path):
    from splitleak.experiments import load_spec

    spec = write_spec(tmp_path, TINY + "depthz: [3]\n")
    with pytest.raises(ConfigError) as e:
        load_spec(spec)
    assert "'depthz'" in str(e.value) and str(spec) in str(e.value) and "known keys here" in str(e.value)

    spec = write_spec(
        tmp_path,
        TINY.replace("{attack: property, client_copy: public}", "{attack: property, client_copy: public, kk: 3}"),
    )
    with pytest.raises(ConfigError, match=r"unknown key 'attacks\.2\.kk'"):
        load_spec(spec)

    spec = write_spec(tmp_path, TINY + "profiles:\n  quick: {documents: {n_evall: 2}}\n")
    with pytest.raises(ConfigError, match=r"'documents\.n_evall' \(from profile 'quick'\)"):
        load_spec(spec, profile="quick")
    load_spec(spec)  # the base alone is valid

    with pytest.raises(ConfigError, match=r"'stepz' \(from --override\)"):
        load_spec(write_spec(tmp_path, name="plain.yaml"), overrides=["stepz=3"])
    with pytest.raises(ConfigError, match="no profile 'fast'; the spec defines: quick"):
        load_spec(spec, profile="fast")
    with pytest.raises(ConfigError, match="not KEY=VALUE"):
        load_spec(spec, overrides=["steps"])


@pytest.mark.unit
def test_profile_and_override_precedence(tmp_path):
    from splitleak.experiments import load_spec

    text = TINY.replace("model: tiny-gpt2", "models: [tiny-gpt2, smollm2-135m]") + (
        "profiles:\n  quick: {documents: {n_eval: 6}, victim_seeds: [5, 6]}\n  full: {steps: 3}\n"
    )
    spec = write_spec(tmp_path, text)
    s = load_spec(spec).spec  # default profile: full
    assert (s.steps, s.documents.n_eval, s.victim_seeds) == (3, 4, [1])
    s = load_spec(spec, profile="quick").spec  # a profile merges into mappings: n_calib stays
    assert (s.steps, s.documents.n_eval, s.documents.n_calib, s.victim_seeds) == (2, 6, 4, [5, 6])
    s = load_spec(spec, profile="quick", overrides=["documents.n_eval=8", "victim_seeds=[7]", "steps=5"]).spec
    assert (s.steps, s.documents.n_eval, s.victim_seeds) == (5, 8, [7])
    assert load_spec(spec, profile="base").spec.steps == 2  # the file's keys alone
    assert load_spec(spec).spec.models == ["tiny-gpt2", "smollm2-135m"]
    assert load_spec(spec, overrides=["model=smollm2-135m"]).spec.models == ["smollm2-135m"]
    assert load_spec(spec, overrides=["attacks.0.k=[2, 3]"]).spec.attacks[0].k == [2, 3]
    assert load_spec(spec, overrides=["data.source=text"]).spec.data.source == "text"


@pytest.mark.unit
def test_shipped_specs_expand_to_the_papers_sizes():
    from splitleak.experiments import plan_grid

    g = plan_grid("paper_main", profile="full")
    assert g.counts() == {"train": 60, "attack": 3440, "reuse": 480}
    assert g.loaded.protocol_path == (SHIPPED / "paper_main.yaml").resolve()
    attack = g.of_kind("attack")
    configs = {
        (j.fields["attack"], j.fields["k"], j.fields["budget"], j.fields["perturbation"], j.fields["defence_name"])
        for j in attack
    }
    # What Gradients Add's 40: 28 undefended + 6 x 2 defended; and mixup-unmix at three k against mixup (beyond that paper)
    assert len(configs) == 28 + 12 + 3
    assert sum(1 for c in configs if c[4] == "none") == 28
    assert {c for c in configs if c[0] == "mixup-unmix"} == {
        ("mixup-unmix", k, None, "none", "mixup") for k in (8, 16, 32)
    }
    assert {(j.fields["depth"], j.fields["client_copy"]) for j in attack} == {
        (3, "public"),
        (3, "trained"),
        (6, "public"),
        (6, "trained"),
    }
    reused = {(j.fields["attack"], j.fields["k"], j.fields["budget"]) for j in g.of_kind("reuse")}
    assert reused == {
        ("activation", 8, None),
        ("activation", 16, None),
        ("activation", 32, None),
        ("sipit", None, "32"),
        ("sipit", None, "64"),
        ("sipit", None, "128"),
    }
    assert {j.fields["defence_name"] for j in g.of_kind("reuse")} == {"none"}
    assert plan_grid("paper_main", profile="quick").counts() == {"train": 6, "attack": 172, "reuse": 24}
    tiny = plan_grid("paper_main", profile="quick", overrides=["model=tiny-gpt2"])
    assert {j.fields["model"] for j in tiny.jobs} == {"tiny-gpt2"}

    p = plan_grid("partial_offloading", profile="full")
    assert p.counts() == {"train": 384, "attack": 384, "reuse": 0}
    one = plan_grid("partial_offloading", overrides=["model=gpt2"])
    assert one.counts()["train"] == 3 * 4 * 2 * 8  # lengths x starts x defences x victim seeds
    assert {(j.fields["offload_length"], j.fields["offload_start"]) for j in one.of_kind("train")} == {
        (s, b) for s in (2, 4, 6) for b in range(4)
    }
    assert {j.fields["attack"] for j in one.of_kind("attack")} == {"property"}
    qwen = plan_grid("partial_offloading", overrides=["model=qwen3-0.6b"])
    assert {j.config["train"]["precision"] for j in qwen.jobs if j.kind == "train"} == {"float64"}
    assert plan_grid("partial_offloading", profile="quick").counts() == {"train": 72, "attack": 72, "reuse": 0}


@pytest.mark.unit
def test_pilot_profiles_hold_exactly_the_cells_the_protocols_tests_compare():
    """`family` runs every cell that the main test and its 47 comparisons read and nothing else;
    `main-test` runs the main test's two cells; `server-6` its attacks at depth 24."""
    from splitleak.audit.protocol import parse_protocol
    from splitleak.experiments import plan_grid

    proto = parse_protocol(SHIPPED / "paper_main.yaml")
    comps = proto.family.expand(proto.main_test)
    assert len(comps) == 47

    def cell(d):
        return (d["attack"], d.get("k"), d["depth"], d["client_copy"])

    def cells(profile):
        g = plan_grid("paper_main", profile=profile)
        return g, {cell(j.fields) for j in g.of_kind("attack")}

    wanted = {cell(c.treatment) for c in comps} | {cell(c.control) for c in comps}
    main = {cell(proto.main_test.treatment), cell(proto.main_test.control)}
    g, have = cells("family")
    assert have == wanted | main and len(have) == 13 * 2 * 2
    assert g.counts() == {"train": 8, "attack": 416, "reuse": 0}
    assert {j.fields["victim_seed"] for j in g.jobs} == {11, 22, 33, 44}
    g, have = cells("main-test")
    assert have == main and g.counts() == {"train": 4, "attack": 16, "reuse": 0}
    # server-6: the main test's attacks with 6 blocks on the server, with both read-outs
    g = plan_grid("paper_main", profile="server-6")
    assert g.counts() == {"train": 4, "attack": 20, "reuse": 0}
    assert {(j.fields["attack"], j.fields["k"], j.fields["readout"]) for j in g.of_kind("attack")} == {
        ("activation", 32, None),
        ("joint", 32, "gradient"),
        ("joint", 32, "pseudo-map"),
        ("backward-only", None, "gradient"),
        ("backward-only", None, "pseudo-map"),
    }
    assert {j.fields["depth"] for j in g.jobs} == {24}


GRID = """\
name: grid
protocol: proto.yaml
model: tiny-gpt2
depths: [1, 2]
placements: {lengths: [1], starts: [0, 1]}
defences: [none, [{name: quant8}]]
victim_seeds: [1, 2]
attack_seeds: [0, 1]
client_copies: [public, trained]
documents: {n_calib: 4, n_train: 4, n_eval: 4, doc_len: 8}
attacks:
  - {attack: activation, k: [4, 8], inference: true}
  - {attack: joint, k: 4, client_copy: public, perturbations: [none, {gradient_bits: 8}]}
  - {attack: property, attack_seeds: [3], defences: [quant8]}
"""


@pytest.mark.unit
def test_expansion_counts_keys_and_dependencies(tmp_path):
    from splitleak.experiments import plan_grid

    spec = write_spec(tmp_path, GRID)
    g = plan_grid(spec)
    # train: 4 splits (2 depths + 1 length x 2 starts) x 2 defences x 2 seeds = 16
    # attack per train job: activation 2 k x 2 copies x 2 seeds = 8; joint 2 perturbations x 1 copy x 2 seeds = 4;
    #   property (quant8 only) 2 copies x 1 seed = 2  ->  8 x 12 + 8 x 14 = 208
    # reuse: the 8 activation jobs of every train job = 128
    assert g.counts() == {"train": 16, "attack": 208, "reuse": 128}
    assert len({j.key for j in g.jobs}) == len(g.jobs)
    trains = {j.key: j for j in g.of_kind("train")}
    for j in g.of_kind("attack"):
        t = trains[j.train_key]
        assert j.config["train_key"] == t.key
        assert all(
            j.fields[f] == t.fields[f] for f in ("depth", "offload_start", "offload_length", "defence", "victim_seed")
        )
    by_key = g.by_key
    for r in g.of_kind("reuse"):
        src = by_key[r.reuse_of]
        assert src.kind == "attack" and src.fields["attack"] == "activation" and r.fields["inference"] is True
        assert {**src.config["attack"], "inference": True} == r.config["attack"]
        assert r.train_key == src.train_key
    # stable across expansions, and every field moves the keys it should
    assert [j.key for j in plan_grid(spec).jobs] == [j.key for j in g.jobs]
    g2 = plan_grid(spec, overrides=["documents.n_eval=5"])
    assert not {j.key for j in g2.jobs} & {j.key for j in g.jobs}
    g3 = plan_grid(spec, overrides=["attacks.1.k=5"])
    assert set(trains) == {j.key for j in g3.of_kind("train")}
    changed = {j.key for j in g.of_kind("attack")} - {j.key for j in g3.of_kind("attack")}
    assert len(changed) == 16 * 4  # only the joint jobs
    # the twins' documents: the default stays out of the keys (a store keeps them); another value moves the attack
    # jobs' keys only, and reaches the worker in each attack job's configuration
    g4 = plan_grid(spec, overrides=["control_docs=16"])
    assert [j.key for j in g4.jobs] == [j.key for j in g.jobs]
    g5 = plan_grid(spec, overrides=["control_docs=4"])
    assert {j.key for j in g5.of_kind("train")} == set(trains)
    assert not {j.key for j in g5.of_kind("attack")} & {j.key for j in g.of_kind("attack")}
    assert {j.config["control_docs"] for j in g5.of_kind("attack")} == {4}
    with pytest.raises(ConfigError, match="control_docs"):
        plan_grid(spec, overrides=["control_docs=1"])
    # one document draw for every victim seed (000: the same evaluation documents for all models)
    assert {j.config["train"]["data_seed"] for j in g.of_kind("train")} == {0}
    assert not {j.key for j in plan_grid(spec, overrides=["documents.seed=3"]).jobs} & {j.key for j in g.jobs}
    g4 = plan_grid(spec, overrides=["lr=1e-4"])
    assert not {j.key for j in g4.jobs} & {j.key for j in g.jobs}  # attack keys include the train key
    (tmp_path / "proto.yaml").write_text((tmp_path / "proto.yaml").read_text() + "\n# edited\n")
    g5 = plan_grid(spec)
    assert {j.key for j in g5.of_kind("train")} == set(trains)  # the protocol does not change training
    assert not {j.key for j in g5.of_kind("attack")} & {j.key for j in g.of_kind("attack")}


@pytest.mark.unit
def test_a_readout_list_expands_into_one_attack_job_each(tmp_path):
    from splitleak.experiments import plan_grid

    spec = write_spec(tmp_path, TINY)
    g = plan_grid(spec)
    both = plan_grid(spec, overrides=["attacks.1.readout=[gradient, pseudo-map]"])
    joint = [j for j in g.of_kind("attack") if j.fields["attack"] == "joint"]
    joint2 = [j for j in both.of_kind("attack") if j.fields["attack"] == "joint"]
    assert len(joint2) == 2 * len(joint) == 8
    assert {j.fields["readout"] for j in joint} == {"gradient"}
    assert sorted(j.fields["readout"] for j in joint2) == ["gradient"] * 4 + ["pseudo-map"] * 4
    # the default read-out is the same job whether the spec names it or not; the other is new
    assert {j.key for j in joint} < {j.key for j in joint2}
    assert all("readout pseudo-map" in j.summary for j in joint2 if j.fields["readout"] == "pseudo-map")
    assert all("readout" not in j.summary for j in joint)
    others = [j for j in g.of_kind("attack") if j.fields["attack"] != "joint"]
    assert all(j.fields["readout"] is None and "readout" not in j.config["attack"] for j in others)


@pytest.mark.unit
def test_an_adaptive_entry_expands_into_the_attacks_built_for_each_chain(tmp_path):
    from splitleak.experiments import plan_grid

    text = TINY.replace("depths: [1, 2]", "depths: [2]").replace(
        "defences: [none]",
        "defences: [none, quant8, {name: clip-noise, args: {where: forward}}, {name: mixup, args: {correction: none}}]",
    )
    text = text.split("attacks:")[0] + (
        "attacks:\n  - {attack: adaptive, k: 4, budget: 8, client_copy: public}\n"
        "  - {attack: sipit-aware, budget: 8, client_copy: public}\n"
    )
    g = plan_grid(write_spec(tmp_path, text))
    by_chain: dict[str, set[tuple]] = {}
    for j in g.of_kind("attack"):
        f = j.fields
        by_chain.setdefault(f["defence"], set()).add((f["attack"], f["k"], f["budget"]))
    assert by_chain["none"] == {("sipit-aware", None, "8")}  # the explicit entry only: nothing is built for none
    assert by_chain["quant8"] == {("sipit-aware", None, "8"), ("activation-aware", 4, None), ("joint-aware", 4, None)}
    assert by_chain["clip-noise(where=forward)"] == by_chain["quant8"] | {("seed-search", None, "8")}
    assert by_chain["mixup(correction=none)"] == {("sipit-aware", None, "8"), ("mixup-history", 4, None)}
    # the sipit-aware job that both entries name is one job
    assert len(g.of_kind("attack")) == 1 + 3 + 4 + 2
    assert len({j.key for j in g.of_kind("attack")}) == len(g.of_kind("attack"))


@pytest.mark.unit
@pytest.mark.parametrize(
    "change,words",
    [
        (("{attack: property, client_copy: public}", "{attack: propertyy}"), "unknown attack 'propertyy'"),
        (("defences: [none]", "defences: [mixupp]"), "unknown defence 'mixupp'"),
        (("protocol: proto.yaml", "protocol: nowhere.yaml"), "protocol file 'nowhere.yaml' does not exist"),
        (("{attack: property, client_copy: public}", "{attack: joint, k: 4, inference: true}"), "inference traffic"),
        (("{attack: property, client_copy: public}", "{attack: sipit, k: 4}"), "does not take ['k']"),
        (("{attack: property, client_copy: public}", "{attack: activation, k: 4, defences: [mixp]}"), "'mixp'"),
        (("{attack: property, client_copy: public}", "{attack: activation, k: 4}"), "listed twice"),
        (
            ("defences: [none]", "defences: [mixup]\nplacements: {lengths: [1], starts: [0]}"),
            "implemented for plain runs only",
        ),
        (("depths: [1, 2]", "depths: [0]"), "every depth must be >= 1"),
        (
            ("{attack: property, client_copy: public}", "{attack: activation, k: 5, readout: gradient}"),
            "reads no gradient",
        ),
        (("{attack: property, client_copy: public}", "{attack: joint, k: 5, readout: [psychic]}"), "readout"),
    ],
)
def test_bad_spec_fails_before_anything_is_written(tmp_path, change, words):
    spec = write_spec(tmp_path, TINY.replace(*change))
    store = tmp_path / "store"
    r = runner.invoke(app, ["experiment", "run", str(spec), "--store", str(store), "--quiet"])
    assert r.exit_code == 2, r.output
    assert words in r.output.replace("\n", " ")
    assert not store.exists() and not (tmp_path / "proto.yaml.frozen.json").exists()


@pytest.mark.unit
def test_flop_counter_counts_a_tiny_forward_pass_exactly():
    """2 FLOPs per multiply-add of every matrix product (GPT-2's Conv1D addmm, the tied LM head)
    and torch's attention formula for the CPU attention kernel (4 b h s^2 d_head per layer)."""
    import torch

    from splitleak.experiments.worker import _flop_counter
    from splitleak.models import load_model

    for seed, (b, t) in [(0, (3, 16)), (1, (2, 8))]:
        model = load_model("tiny-gpt2", seed=seed).model.eval()
        c = model.config
        d, n_layer, vocab = c.n_embd, c.n_layer, c.vocab_size
        inner = c.n_inner or 4 * d
        ids = torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad(), _flop_counter() as counter:
            model(ids)
        matmul = 2 * b * t * (n_layer * (3 * d * d + d * d + 2 * d * inner) + d * vocab)
        attention = n_layer * 4 * b * t * t * d
        assert counter.get_total_flops() == matmul + attention
        assert (
            counter.get_flop_counts()["Global"][torch.ops.aten._scaled_dot_product_flash_attention_for_cpu] == attention
        )


@pytest.mark.integration
def test_worker_counts_job_flops_only_when_asked_and_without_changing_results(tmp_path, monkeypatch):
    import torch

    from splitleak.experiments import plan_grid, read_results
    from splitleak.experiments.worker import FLOPS_ENV, execute_job

    spec = write_spec(tmp_path / "spec")
    g = plan_grid(spec)
    train = g.of_kind("train")[0]
    joint = next(j for j in g.of_kind("attack") if j.train_key == train.key and j.fields["attack"] == "joint")
    flops = tmp_path / "flops"
    results = {}
    threads = torch.get_num_threads()  # execute_job sets this process's torch threads
    try:
        for counted in (False, True):
            store = tmp_path / f"store-{counted}"
            if counted:
                monkeypatch.setenv(FLOPS_ENV, str(flops))
            else:
                monkeypatch.delenv(FLOPS_ENV, raising=False)
            for job in (train, joint):  # the train job's server returns gradients through autograd.grad
                r = execute_job(job.to_dict(), str(store), device="cpu", threads=1)
                assert r["status"] == "done", r
            results[counted] = scores(store)
            assert counted or not flops.exists()
    finally:
        torch.set_num_threads(threads)
    assert results[True] == results[False]  # counting observes, it does not change the computation
    recs = {p.stem: json.loads(p.read_text()) for p in flops.glob("*.json")}
    assert set(recs) == {train.key, joint.key}
    for rec in recs.values():
        assert rec["flops"] == sum(rec["by_op"].values()) > 0 and rec["seconds"] > 0
        assert "aten._scaled_dot_product_flash_attention_for_cpu" in rec["by_op"]
    # training runs the model forward and backward over its documents; the attack only forward
    assert "aten._scaled_dot_product_flash_attention_for_cpu_backward" in recs[train.key]["by_op"]
    assert read_results(tmp_path / "store-True", "failed").num_rows == 0


@pytest.mark.unit
def test_missing_ray_names_the_extra_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    spec = write_spec(tmp_path)
    r = runner.invoke(app, ["experiment", "run", str(spec), "--store", str(tmp_path / "s"), "--executor", "ray"])
    assert r.exit_code == 2 and "pip install 'splitleak[ray]'" in r.output.replace("\n", " ")
    assert not (tmp_path / "s").exists()


@pytest.mark.unit
def test_missing_spec_names_the_shipped_ones(tmp_path):
    r = runner.invoke(app, ["experiment", "run", "paper_mian", "--store", str(tmp_path / "s")])
    assert r.exit_code == 2 and "paper_main" in r.output and "partial_offloading" in r.output
    assert not (tmp_path / "s").exists()


# ------------------------------------------------------------------ a real grid


@pytest.fixture(scope="module")
def tiny_grid(tmp_path_factory):
    """The tiny grid run once through the CLI with the local executor (2 workers x 1 thread)."""
    folder = tmp_path_factory.mktemp("grid")
    spec = write_spec(folder)
    store = folder / "store"
    r = runner.invoke(
        app,
        ["experiment", "run", str(spec), "--store", str(store), "--workers", "2", "--threads", "1", "--device", "cpu"],
    )
    assert r.exit_code == 0, r.output
    return spec, store, r.output


@pytest.mark.e2e
def test_grid_store_has_one_row_per_job_and_document(tiny_grid):
    from splitleak.experiments import plan_grid, read_results

    spec, store, out = tiny_grid
    assert "14 job(s) ran, 4 reused" in out and "[18/18]" in out  # plain log: one line per job
    assert (spec.parent / "proto.yaml.frozen.json").is_file()  # frozen at run start
    g = plan_grid(spec)
    assert g.counts() == TINY_COUNTS
    rows = read_results(store).to_pylist()
    by_key: dict[str, list] = {}
    for r in rows:
        by_key.setdefault(r["key"], []).append(r["doc_id"])
    expected = {j.key for j in g.jobs if j.kind != "train"}
    assert set(by_key) == expected
    eval_ids = {
        d["doc_id"]
        for d in json.loads((store / "runs" / g.of_kind("train")[0].key[:16] / "documents.json").read_text())[
            "evaluation"
        ]
    }
    assert len(eval_ids) == 4
    for key, docs in by_key.items():
        assert sorted(docs) == sorted(eval_ids), key  # each document exactly once per job
    train = read_results(store, "train").to_pylist()
    assert sorted(r["key"] for r in train) == sorted(j.key for j in g.of_kind("train"))
    assert read_results(store, "failed").num_rows == 0
    assert all(r["protocol_hash"] == g.protocol_hash for r in rows)
    for t in train:  # no defence: the split run reproduces its all-local twin (What Gradients Add §5 all-local runs)
        assert t["delta_u"] == 0.0 and t["all_local_ce"] == t["heldout_ce"]
        assert t["wire_bytes_client_to_server"] > 0
    assert not list((store / "claims").glob("*.json"))
    from splitleak.runs.verify import verify_run

    for j in g.of_kind("train"):
        assert verify_run(store / "runs" / j.key[:16]).ok


@pytest.mark.e2e
def test_grid_scores_equal_run_attack_on_the_same_run(tiny_grid):
    from splitleak.attacks import make_attack_config
    from splitleak.audit.evaluate import run_attack
    from splitleak.experiments import plan_grid, read_results

    spec, store, _ = tiny_grid
    g = plan_grid(spec)
    rows = read_results(store).to_pylist()
    for job in g.of_kind("attack") + g.of_kind("reuse"):
        run_dir = store / "runs" / job.train_key[:16]
        res = run_attack(
            run_dir, make_attack_config(**job.config["attack"]), device="cpu", protocol_hash=g.protocol_hash
        )
        mine = {r["doc_id"]: r for r in rows if r["key"] == job.key}
        assert len(mine) == len(res["per_doc"]) == 4
        for d in res["per_doc"]:
            r = mine[d["doc_id"]]
            if job.fields["attack"] == "property":
                assert r["property_score"] == d["score"] and r["leakage_index"] == res["leakage_index"]
            else:
                assert (r["token_correct"], r["token_counted"], r["exact"], r["predicted"]) == (
                    d["token_correct"],
                    d["token_counted"],
                    d["exact"],
                    d["predicted"],
                )
                assert r["span_hits_name"] == d["span_hits"]["name"]
        if job.kind == "reuse":  # the reused measurement equals running the inference attack itself
            src = {r["doc_id"]: r["predicted"] for r in rows if r["key"] == job.reuse_of}
            assert {k: v["predicted"] for k, v in mine.items()} == src
            assert all(r["inference"] and r["reuse_of"] == job.reuse_of for r in mine.values())


@pytest.mark.e2e
def test_status_counts_done_running_failed_pending(tiny_grid, tmp_path):
    from splitleak.experiments import plan_grid
    from splitleak.experiments.store import ResultsStore

    spec, store, _ = tiny_grid
    r = runner.invoke(app, ["experiment", "status", str(spec), "--store", str(store)])
    assert r.exit_code == 0, r.output
    assert "│ all    │   18 │       0 │      0 │       0 │    18 │" in r.output

    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    g = plan_grid(spec)
    a = [j.key for j in g.of_kind("attack")]
    rs = ResultsStore(copy)
    for k in a[:4]:
        rs.remove("attack", k)
    rs.claim(a[0])  # this process: alive -> running
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (copy / "claims" / f"{a[1]}.json").write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename}))
    rs.record_failure(g.by_key[a[2]].to_dict(), "boom: injected", "RuntimeError")
    r = runner.invoke(app, ["experiment", "status", str(spec), "--store", str(copy)])
    assert r.exit_code == 0, r.output
    assert "│ attack │    8 │       1 │      1 │       2 │    12 │" in r.output
    assert f"failed   {a[2][:12]}" in r.output and "RuntimeError: boom: injected" in r.output
    assert f"running  {a[0][:12]}" in r.output


@pytest.mark.e2e
def test_sigkill_then_resume_gives_each_job_once_and_the_clean_results(tiny_grid, tmp_path):
    from splitleak.experiments import grid_status, plan_grid, read_results

    clean_spec, clean_store, _ = tiny_grid
    spec = write_spec(tmp_path)
    store = tmp_path / "store"
    cmd = [
        sys.executable,
        "-m",
        "splitleak.cli",
        "experiment",
        "run",
        str(spec),
        "--store",
        str(store),
        "--workers",
        "1",
        "--threads",
        "1",
        "--device",
        "cpu",
        "--quiet",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}

    def start():
        return subprocess.Popen(
            cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )

    def kill_when(proc, ready, timeout=120):
        t0 = time.monotonic()
        try:
            while not ready():
                assert proc.poll() is None, "the run ended before it could be killed"
                assert time.monotonic() - t0 < timeout
                time.sleep(0.02)
            proc.send_signal(signal.SIGKILL)  # the driver only: its workers must not outlive it
            proc.wait()
            # every claim, read after the kill and again until no new one appears: a worker may claim a job
            # between the readiness check and the kill, or before PR_SET_PDEATHSIG reaches it
            seen: set[int] = set()
            while True:
                claims = (
                    [json.loads(p.read_text()) for p in (store / "claims").glob("*.json")]
                    if (store / "claims").is_dir()
                    else []
                )
                fresh = [c for c in claims if c["pid"] not in seen]
                if not fresh:
                    break
                seen.update(c["pid"] for c in fresh)
                for c in fresh:  # PR_SET_PDEATHSIG takes the workers down with the driver
                    for _ in range(200):
                        try:
                            os.kill(c["pid"], 0)
                        except ProcessLookupError:
                            break
                        time.sleep(0.05)
                    else:
                        pytest.fail(f"worker {c['pid']} outlived the killed driver")
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def n_done(sub):
        d = store / sub
        return len(list(d.glob("*.parquet"))) if d.is_dir() else 0

    # 1: killed while the first train job is writing its run directory
    kill_when(start(), lambda: any((store / "runs").glob("*/manifest.json")) if (store / "runs").is_dir() else False)
    assert n_done("train") == 0 and n_done("attacks") == 0
    # 2: killed after some attack results landed
    kill_when(start(), lambda: n_done("attacks") >= 3)
    assert n_done("attacks") < sum(TINY_COUNTS[k] for k in ("attack", "reuse"))
    # the claims and the lock left by the killed driver are stale: pending, not running
    assert grid_status(spec, store=store).totals()["running"] == 0
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr

    g = plan_grid(spec)
    assert g.protocol_hash == plan_grid(clean_spec).protocol_hash
    rows = read_results(store).to_pylist()
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["key"]] = counts.get(row["key"], 0) + 1
    assert counts == {j.key: 4 for j in g.jobs if j.kind != "train"}
    assert sorted(r["key"] for r in read_results(store, "train").to_pylist()) == sorted(
        j.key for j in g.of_kind("train")
    )
    assert scores(store) == scores(clean_store)
    assert scores(store, "train") == scores(clean_store, "train")
    assert read_results(store, "failed").num_rows == 0
    assert not list(store.rglob(".*.tmp")) and not list((store / "claims").glob("*.json"))


FAILING = """\
name: failing
protocol: proto.yaml
model: tiny-gpt2
depths: [2, 9]
defences: [none, [{name: clip-noise, args: {sigma: 1.0e+39}}]]
victim_seeds: [1]
documents: {n_calib: 4, n_train: 4, n_eval: 4, doc_len: 8}
steps: 2
attacks:
  - {attack: activation, k: 4, inference: true}
"""


@pytest.mark.e2e
def test_failed_jobs_are_recorded_and_do_not_stop_the_others(tmp_path):
    from splitleak.experiments import plan_grid, read_results

    # genuinely failing configurations: depth 9 does not fit tiny-gpt2's 4 blocks, and clip-noise
    # with sigma 1e39 turns the activations into inf, which the server refuses as non-finite
    spec = write_spec(tmp_path, FAILING)
    store = tmp_path / "store"
    r = runner.invoke(
        app, ["experiment", "run", str(spec), "--store", str(store), "--workers", "2", "--threads", "1", "--quiet"]
    )
    assert r.exit_code == 1, r.output
    g = plan_grid(spec)
    good = next(j for j in g.of_kind("train") if j.fields["depth"] == 2 and j.fields["defence"] == "none")
    nan = next(j for j in g.of_kind("train") if j.fields["depth"] == 2 and j.fields["defence"] != "none")
    failed = {row["key"]: row for row in read_results(store, "failed").to_pylist()}
    assert failed[nan.key]["error_type"] == "NonFiniteError" and "non-finite" in failed[nan.key]["error"]
    for j in g.of_kind("train"):
        if j.fields["depth"] == 9:
            assert failed[j.key]["error_type"] == "ConfigError" and "out of range" in failed[j.key]["error"]
    assert len(failed) == 9  # 3 train jobs, their 3 attack jobs and 3 reuse jobs
    for j in g.jobs:
        if j.kind != "train" and j.train_key != good.key:
            assert failed[j.key]["error_type"] == "skipped"
            assert j.train_key[:12] in failed[j.key]["error"] or j.reuse_of[:12] in failed[j.key]["error"]
    assert {row["key"] for row in read_results(store).to_pylist()} == {
        j.key for j in g.jobs if j.kind != "train" and j.train_key == good.key
    }
    assert [row["key"] for row in read_results(store, "train").to_pylist()] == [good.key]
    assert nan.key[:12] in r.output and "NonFiniteError" in r.output and nan.summary in r.output
    st = runner.invoke(app, ["experiment", "status", str(spec), "--store", str(store)])
    assert "│ all    │    3 │       0 │      9 │       0 │    12 │" in st.output
    assert "NonFiniteError" in st.output


@pytest.mark.skipif(
    importlib.util.find_spec("ray") is None,
    reason="ray is not installed (pip install 'splitleak[ray]'); the Ray executor is not tested",
)
@pytest.mark.e2e
@pytest.mark.xdist_group("ray")  # one worker: a local ray.init may join the cluster of the other test
def test_ray_executor_gives_the_local_results(tiny_grid, tmp_path):
    from splitleak.experiments import run_grid

    spec, clean_store, _ = tiny_grid
    store = tmp_path / "store"
    res = run_grid(spec, executor="ray", workers=2, threads=1, store=store, device="cpu")
    assert not importlib.import_module("ray").is_initialized()  # the driver shut down the instance it started
    assert res.ok and res.ran == 14 and res.reused == 4
    assert scores(store) == scores(clean_store)
    assert scores(store, "train") == scores(clean_store, "train")


@pytest.mark.skipif(
    importlib.util.find_spec("ray") is None,
    reason="ray is not installed (pip install 'splitleak[ray]'); the Ray executor is not tested",
)
@pytest.mark.e2e
@pytest.mark.xdist_group("ray")  # one worker: a local ray.init may join the cluster of the other test
def test_ray_executor_joins_a_running_cluster_and_spreads_jobs_over_its_nodes(tiny_grid, tmp_path):
    """`--address`: a cluster of a head without CPUs and two worker nodes (ray.cluster_utils runs
    them as separate raylets on this machine); every job must run on a worker node, both are used,
    and the results equal the local executor's. Where network namespaces can be made, the cluster test of
    tests/test_ray_cluster.py checks all of this on nodes that share no network, PID or file namespace with the
    driver (and that the cluster outlives a driver: it runs a second grid on it), so this one is skipped there."""
    import ray
    from ray.cluster_utils import Cluster
    from test_ray_cluster import _why_not_permitted  # lazy: that module imports this one

    from splitleak.experiments import run_grid

    if _why_not_permitted() is None:
        pytest.skip("tests/test_ray_cluster.py runs this grid on a namespace cluster here")

    spec, clean_store, _ = tiny_grid
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
        cluster.wait_for_nodes()
        store = tmp_path / "store"
        res = run_grid(spec, executor="ray", threads=1, address=cluster.address, store=store, device="cpu")
        assert not ray.is_initialized()  # the driver left the cluster it joined ...
        ray.init(address=cluster.address)
        assert sum(n["Alive"] for n in ray.nodes()) == 3  # ... and the cluster is still up
        ray.shutdown()
        assert res.ok and res.ran == 14 and res.reused == 4
        ids = {w.node_id[:12] for w in workers}
        seen = {n.split("Ray node ")[1].rstrip(")") for n in res.nodes}
        assert seen == ids and sum(res.nodes.values()) == 14, res.nodes
        assert scores(store) == scores(clean_store)
        assert scores(store, "train") == scores(clean_store, "train")
    finally:
        cluster.shutdown()


@pytest.mark.unit
def test_clear_stale_removes_claims_of_dead_workers_and_half_written_files(tmp_path):
    """A worker killed while writing its claim leaves a temporary file in claims/; the next driver
    removes it with the dead workers' claims, and keeps a live worker's claim."""
    from splitleak.experiments.store import ResultsStore

    rs = ResultsStore(tmp_path / "store")
    rs.claim("live")  # this process: alive
    (rs.root / "claims" / "dead.json").write_text(json.dumps({"pid": 2**22 + 12345, "host": os.uname().nodename}))
    half = rs.root / "claims" / ".dead.json.4242.tmp"
    half.write_text('{"pid": 42')
    rs.clear_stale()
    assert sorted(p.name for p in (rs.root / "claims").iterdir()) == ["live.json"]


STORE_OPS = ("truncate", "flip", "insert", "delete", "empty", "swap")


@pytest.mark.e2e
@fuzz(60)
@given(
    kind=st.sampled_from(["attack", "train"]),
    which=st.integers(0, 10**6),
    op=st.sampled_from(STORE_OPS),
    at=st.floats(0, 1),
    byte=st.integers(0, 255),
)
def test_a_damaged_store_row_file_reads_as_written_or_is_refused_naming_it(tiny_grid, kind, which, op, at, byte):
    """Parquet store rows (issue 17): a damaged row file is read back exactly as written or refused in one
    line that names it and says how to redo the job; the store is left as it was."""
    import tempfile

    from splitleak.errors import IntegrityError
    from splitleak.experiments import read_results

    _, clean_store, _ = tiny_grid
    sub = {"attack": "attacks", "train": "train"}[kind]
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        shutil.copytree(clean_store, store)
        files = sorted((store / sub).glob("*.parquet"))
        path = files[which % len(files)]
        data = path.read_bytes()
        # "swap": another job's rows under this job's name
        bad = files[(which + 1) % len(files)].read_bytes() if op == "swap" else damaged(data, op, at, byte)
        path.write_bytes(bad)
        before = {p: p.read_bytes() for p in store.rglob("*") if p.is_file()}
        try:
            rows = read_results(store, kind, as_rows=True)
        except IntegrityError as exc:
            msg = str(exc)
            assert "\n" not in msg and str(path) in msg
            assert "delete it and run `splitleak experiment run`" in msg
        else:
            assert bad == data or rows == read_results(clean_store, kind, as_rows=True)
        assert {p: p.read_bytes() for p in store.rglob("*") if p.is_file()} == before


@pytest.mark.e2e
def test_the_grid_report_names_a_damaged_row_file(tiny_grid, tmp_path):
    spec, clean_store, _ = tiny_grid
    store = tmp_path / "store"
    shutil.copytree(clean_store, store)
    victim = sorted((store / "attacks").glob("*.parquet"))[0]
    victim.write_bytes(victim.read_bytes()[:-20])
    r = runner.invoke(app, ["experiment", "report", str(spec), "--store", str(store), "--out", str(tmp_path / "rep")])
    assert r.exit_code == 2 and r.output.lstrip().startswith("error:") and "Traceback" not in r.output
    flat = "".join(r.output.split())
    assert str(victim) in flat and "deleteitandrun`splitleakexperimentrun`" in flat
    assert not (tmp_path / "rep").exists() or not any((tmp_path / "rep").iterdir())


@pytest.mark.e2e
def test_a_killed_worker_s_job_runs_again_once_and_is_recorded_as_retried(tiny_grid, tmp_path):
    """Issue 17: SIGKILL the worker process (not the driver) while it runs an attack job. The driver sees the
    dead worker, records the attempt as retried, runs the job again on a new worker, and finishes the grid
    with every job once and the clean grid's scores."""
    from splitleak.experiments import plan_grid, read_results

    clean_spec, clean_store, _ = tiny_grid
    spec = write_spec(tmp_path)
    store = tmp_path / "store"
    g = plan_grid(spec)
    attack_keys = {j.key for j in g.of_kind("attack")}
    cmd = [sys.executable, "-m", "splitleak.cli", "experiment", "run", str(spec), "--store", str(store)]
    cmd += ["--workers", "1", "--threads", "1", "--device", "cpu", "--quiet"]
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    killed = None
    try:
        t0 = time.monotonic()
        while killed is None:
            assert proc.poll() is None, "the grid ended before a worker could be killed"
            assert time.monotonic() - t0 < 120, "no attack job was claimed within 120 s"
            for p in (store / "claims").glob("*.json") if (store / "claims").is_dir() else []:
                if p.stem in attack_keys:
                    try:
                        killed = json.loads(p.read_text())["pid"]
                    except (FileNotFoundError, json.JSONDecodeError):
                        continue
                    os.kill(killed, signal.SIGKILL)
                    break
            time.sleep(0.01)
        out, _ = proc.communicate(timeout=300)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert killed != proc.pid
    assert proc.returncode == 0, out
    retried = read_results(store, "retried", as_rows=True)
    assert len(retried) == 1 and retried[0]["attempt"] == 1 and retried[0]["key"] in {j.key for j in g.jobs}
    assert "died" in retried[0]["error"]
    assert "1 attempt(s) ran again after their worker died" in " ".join(out.split())
    counts: dict[str, int] = {}
    for row in read_results(store).to_pylist():
        counts[row["key"]] = counts.get(row["key"], 0) + 1
    assert counts == {j.key: 4 for j in g.jobs if j.kind != "train"}
    assert scores(store) == scores(clean_store) and scores(store, "train") == scores(clean_store, "train")
    assert read_results(store, "failed").num_rows == 0
