"""One identity for an attack configuration (``attacks.config.IDENTITY``, derived from AttackConfig) in
every table of results, and attack parameters typed and checked when the configuration is built.

Two results of one attack that differ only in a hyperparameter given through ``params`` (hand-built:
one reads 100 %, the other 0 %) are two configurations everywhere: the store, the pre-registered
analysis (records, selectors, score matrix, ``protocol analyse``), the grid report's analysis records
and its descriptive tables. A selector that matches both is refused, naming them."""

import json
from typing import get_args

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from splitleak.attacks import Attack, Reconstruction, make_attack_config
from splitleak.attacks.config import (
    CONFIG_FIELDS,
    IDENTITY_FIELDS,
    LEGACY_PARAMS,
    PARAM_FIELDS,
    STORED_FIELDS,
    AttackConfig,
    attack_identity,
    canonical_params,
    params_model,
    record_identity,
)
from splitleak.attacks.core import ATTACKS
from splitleak.attacks.registry import AttackInfo, register, unregister
from splitleak.audit.analysis import ATTACK_FIELDS, rows_from_results, score_matrix, select
from splitleak.audit.protocol import SHIPPED, freeze_protocol
from splitleak.cli import app
from splitleak.data import LABELS
from splitleak.errors import ConfigError
from splitleak.experiments.jobs import _attack_fields, _attack_summary
from splitleak.experiments.store import ATTACK_SCHEMA, ResultsStore, attack_rows, read_results
from splitleak.files import config_hash
from splitleak.report.grid import analysis_rows
from splitleak.report.grid_stats import recovery_cells

runner = CliRunner()
SEEDS = (0, 1)
DOCS = range(4)
TOKENS = 8


class Toy(Attack):
    """A control with a hyperparameter nobody has seen (``shift``); it never runs here."""

    name = "toy-shift"

    def __init__(self, shift: int = 0, seed: int = 0):
        self.shift, self.seed = shift, seed

    def reconstruct(self, traffic, progress=None):  # pragma: no cover - the results are hand-built
        return Reconstruction(None)


@pytest.fixture
def toy():
    register(AttackInfo("toy-shift", Toy, "toy: a new hyperparameter", reads=(), control=True))
    yield
    unregister("toy-shift")


def _configs() -> dict[int, AttackConfig]:
    """shift 0 reads every token (100 %), shift 3 none (0 %): two configurations of one attack."""
    return {shift: make_attack_config(attack="toy-shift", params={"shift": shift}) for shift in (0, 3)}


def _correct(shift: int) -> int:
    return TOKENS if shift == 0 else 0


def _run_config(seed: int) -> dict:
    return {"model": "tiny-gpt2", "depth": 1, "defences": [{"name": "none"}], "seed": seed, "data": "x", "data_seed": 0}


# ------------------------------------------------------------------ the schema


@pytest.mark.unit
def test_the_identity_is_derived_from_attack_config_and_used_everywhere():
    fields = set(AttackConfig.model_fields) - {"params"}
    assert set(IDENTITY_FIELDS) == fields | set(PARAM_FIELDS) | {"params"}
    assert set(PARAM_FIELDS) <= set(LEGACY_PARAMS)
    assert ATTACK_FIELDS == IDENTITY_FIELDS  # the analysis's fields and selectors
    assert [f.name for f in STORED_FIELDS] == [n for n in ATTACK_SCHEMA.names if n in IDENTITY_FIELDS]
    assert "attack_seed" not in CONFIG_FIELDS and "params" in CONFIG_FIELDS
    # params are canonical: the same parameters written in another order compare equal
    assert canonical_params({"b": 1, "a": [1, 2]}) == canonical_params('{"a": [1, 2], "b": 1}')
    assert canonical_params({}) is None and canonical_params({"a": None}) is None
    # every parameter without a field of its own lands in params: the legacy top-level ones too
    mixup = make_attack_config(attack="mixup-unmix", k=8, lam=0.6)
    assert attack_identity(mixup)["params"] == '{"lam": 0.6}' and attack_identity(mixup)["k"] == 8
    joint = attack_identity(make_attack_config(attack="joint", k=8, gradient_source="output"))
    assert joint["params"] == '{"gradient_source": "output"}' and joint["readout"] == "gradient"
    assert attack_identity(make_attack_config(attack="vmi", phase="train"))["phase"] == "train"
    # a store row's identity comes from the whole configuration it records, and agrees with its columns
    cfg = make_attack_config(attack="sipit", budget=16, params={"order": "ridge"})
    cols = _attack_fields(cfg.model_dump(mode="json"), "none")
    assert cols["budget"] == "16" and cols["params"] == '{"order": "ridge"}'
    from_cols = record_identity(cols)
    from_config = record_identity({**cols, "attack_config": json.dumps(cfg.model_dump(mode="json"))})
    assert from_cols == from_config == attack_identity(cfg) and from_cols["budget"] == 16


@pytest.mark.unit
def test_rows_written_before_lam_had_a_place_in_params_keep_their_configurations_apart():
    """Stores written before this schema put no ``lam`` (nor ``gradient_source``) in the params column; the
    configuration each row records in ``attack_config`` tells them apart."""
    rows = []
    for lam, correct in ((0.6, TOKENS), (0.75, 0)):
        cfg = make_attack_config(attack="mixup-unmix", k=8, lam=lam).model_dump(mode="json")
        old_columns = {**_attack_fields(cfg, "none"), "params": None}  # the old layout
        for seed in SEEDS:
            for d in DOCS:
                rows.append(_store_like_row(old_columns, cfg, seed, d, correct, key=f"lam{lam}-{seed}"))
    cells = recovery_cells(rows, n_boot=200)
    assert sorted((c.config.params, c.token.estimate) for c in cells) == [
        ('{"lam": 0.6}', 1.0),
        ('{"lam": 0.75}', 0.0),
    ]
    assert {c.config.attack_text() for c in cells} == {"mixup-unmix k=8 lam=0.6", "mixup-unmix k=8 lam=0.75"}


def _store_like_row(columns: dict, cfg: dict, seed: int, doc: int, correct: int, key: str) -> dict:
    return {
        **columns,
        "key": key,
        "kind": "attack",
        "model": "tiny-gpt2",
        "data": "x",
        "defence": "none",
        "defence_name": "none",
        "depth": 1,
        "offload_start": None,
        "offload_length": None,
        "victim_seed": seed,
        "doc_id": doc,
        "token_correct": correct,
        "token_counted": TOKENS,
        "exact": correct == TOKENS,
        "protocol_hash": "h",
        "attack_config": json.dumps(cfg),
        **{f"span_{w}_{lab}": 0 for w in ("hits", "counts") for lab in LABELS},
    }


# ------------------------------------------------------------------ never pooled


def _store(tmp_path, configs: dict[int, AttackConfig]) -> list[dict]:
    """The two configurations' results written to an experiment store as a grid's worker writes them, and
    read back."""
    rs = ResultsStore(tmp_path / "store")
    for shift, cfg in configs.items():
        acfg = cfg.model_dump(mode="json")
        for seed in SEEDS:
            train = {
                "model": "tiny-gpt2",
                "precision": "float32",
                "depth": 1,
                "offload_start": None,
                "offload_length": None,
                "defence": "none",
                "defence_name": "none",
                "victim_seed": seed,
                "data": "x",
                "steps": 2,
                "n_calib": 4,
                "n_train": 4,
                "n_eval": len(DOCS),
                "doc_len": TOKENS,
                "data_seed": 0,
            }
            fields = {**train, **_attack_fields(acfg, "none")}
            key = config_hash({"attack": acfg, "victim_seed": seed})
            job = {"key": key, "kind": "attack", "train_key": f"t{seed}", "reuse_of": None, "fields": fields}
            job["config"] = {"attack": acfg}
            per_doc = [
                {
                    "doc_id": d,
                    "token_correct": _correct(shift),
                    "token_counted": TOKENS,
                    "exact": shift == 0,
                    "span_hits": dict.fromkeys(LABELS, 0),
                    "span_counts": dict.fromkeys(LABELS, 0),
                }
                for d in DOCS
            ]
            result = {"protocol_hash": "h", "run": {"config": _run_config(seed)}, "per_doc": per_doc}
            rs.write_rows("attack", key, attack_rows(job, result, cut=1))
            assert _attack_summary(fields).startswith(f"toy-shift shift={shift} public a0")
    rows = read_results(rs.root, as_rows=True)
    assert isinstance(rows, list) and len(rows) == 2 * len(SEEDS) * len(DOCS)
    return rows


def _results(folder, configs: dict[int, AttackConfig], protocol_hash: str) -> None:
    """The two configurations' results as ``splitleak attack --out`` writes them (RESULT.json beside its
    predictions), for ``protocol analyse``."""
    folder.mkdir(parents=True)
    for shift, cfg in configs.items():
        for seed in SEEDS:
            run = _run_config(seed)
            stem = folder / f"shift{shift}-seed{seed}"
            res = {
                "attack": cfg.attack,
                "config": cfg.model_dump(mode="json"),
                "config_hash": cfg.hash(),
                "run": {"dir": str(folder), "config_hash": config_hash(run), "config": run},
                "protocol_hash": protocol_hash,
                "token_recovery": _correct(shift) / TOKENS,
            }
            stem.with_suffix(".json").write_text(json.dumps(res))
            table = {
                "doc_id": list(DOCS),
                "token_correct": [_correct(shift)] * len(DOCS),
                "token_counted": [TOKENS] * len(DOCS),
                "exact": [shift == 0] * len(DOCS),
            }
            pq.write_table(pa.table(table), stem.with_suffix(".parquet"))


PROTOCOL = """\
name: toy
source: test
hypotheses: [shift 0 reads more than shift 3]
main_test:
  description: shift 0 minus shift 3
  metric: token_recovery
  treatment: {attack: toy-shift, depth: 1, TREATMENT}
  control: {attack: toy-shift, depth: 1, params: {shift: 3}}
  pass_mark: 0.5
  n_boot: 200
victim_seeds: [0, 1]
documents: {n_eval: 4}
"""


@pytest.mark.unit
def test_two_results_that_differ_only_in_a_new_hyperparameter_are_never_pooled(toy, tmp_path):
    configs = _configs()
    assert configs[0].hash() != configs[3].hash()
    store_rows = _store(tmp_path, configs)
    assert {r["params"] for r in store_rows} == {'{"shift": 0}', '{"shift": 3}'}  # the store's column

    # the grid report's descriptive tables: one row each, 100 % and 0 %, not one row at 50 %
    cells = recovery_cells(store_rows, n_boot=200)
    by_text = {c.config.attack_text(): c.token.estimate for c in cells}
    assert by_text == {"toy-shift shift=0": 1.0, "toy-shift shift=3": 0.0}

    # the grid report's analysis records, and the pre-registered analysis's records from results
    _results(tmp_path / "results", configs, "h")
    found = [(p, json.loads(p.read_text())) for p in sorted((tmp_path / "results").glob("*.json"))]
    for rows in (analysis_rows(store_rows), rows_from_results(found)):
        assert len(rows) == 2 * len(SEEDS) * len(DOCS)
        for shift, want in ((0, 1.0), (3, 0.0)):
            for selector in ({"params": {"shift": shift}}, {"params": json.dumps({"shift": shift})}):
                m, seeds, docs = score_matrix(select(rows, {"attack": "toy-shift", **selector}), "token_recovery")
                assert m.shape == (len(SEEDS), len(DOCS)) and (m == want).all(), (shift, selector)
        assert select(rows, {"attack": "toy-shift", "params": None}) == []  # no result without a shift
        both = select(rows, {"attack": "toy-shift"})
        assert len(both) == len(rows)
        with pytest.raises(ConfigError, match="matches 2 different configurations") as err:
            score_matrix(both, "token_recovery")
        assert 'params={"shift": 0}' in str(err.value) and 'params={"shift": 3}' in str(err.value)
        with pytest.raises(ConfigError, match="params"):
            select(rows, {"attack": "toy-shift", "params": "shift=3"})  # neither a mapping nor its JSON


@pytest.mark.unit
def test_protocol_analyse_refuses_an_ambiguous_selector_and_reads_params(toy, tmp_path):
    configs = _configs()
    proto = tmp_path / "toy.yaml"
    proto.write_text(PROTOCOL.replace(", TREATMENT", ""))  # treatment {attack: toy-shift}: both shifts
    digest = freeze_protocol(proto)
    _results(tmp_path / "results", configs, digest)
    r = runner.invoke(app, ["protocol", "analyse", str(proto), str(tmp_path / "results")])
    assert r.exit_code == 2, r.output
    out = " ".join(r.output.split())
    assert "matches 2 different configurations" in out and 'params={"shift": 0}' in out, out
    assert 'params={"shift": 3}' in out

    # naming the hyperparameter picks one configuration: 100 % minus 0 %, exactly
    named = tmp_path / "named"
    named.mkdir()
    proto2 = named / "toy.yaml"
    proto2.write_text(PROTOCOL.replace("TREATMENT", "params: {shift: 0}"))
    digest2 = freeze_protocol(proto2)
    _results(named / "results", configs, digest2)
    out_file = named / "analysis"
    r = runner.invoke(app, ["protocol", "analyse", str(proto2), str(named / "results"), "--out", str(out_file)])
    assert r.exit_code == 0, r.output
    main = json.loads(out_file.with_suffix(".json").read_text())["main"]
    assert main["estimate"] == pytest.approx(1.0) and main["passes"] and main["n_models"] == len(SEEDS)


# ------------------------------------------------------------------ typed parameters, checked early


@pytest.mark.unit
@pytest.mark.parametrize(
    "kw,words",
    [
        ({"attack": "sipit", "budget": -5}, ["'sipit'", "budget=-5", "greater than 0", "'exhaustive'"]),
        ({"attack": "sipit", "params": {"growth": -1}}, ["'sipit'", "growth=-1", "greater than 0"]),
        ({"attack": "sipit", "params": {"order": "bogus"}}, ["'sipit'", "order='bogus'", "'gradient' or 'ridge'"]),
        ({"attack": "sipit", "params": {"tol_rel": "1e-3"}}, ["'sipit'", "tol_rel='1e-3'", "a valid number"]),
        ({"attack": "sipit", "params": {"bogus": 1}}, ["'sipit'", "does not take ['bogus']", "'order'"]),
        ({"attack": "sipit-aware", "params": {"alpha": 1.5}}, ["'sipit-aware'", "alpha=1.5", "less than 1"]),
        ({"attack": "activation", "params": {"width": 0}}, ["'activation'", "width=0", "greater than 0"]),
        ({"attack": "activation", "k": 4, "params": {"width": 8}}, ["'activation'", "width=8", "at most k"]),
        ({"attack": "activation", "params": {"chunk_docs": 0}}, ["'activation'", "chunk_docs=0", "greater than 0"]),
        ({"attack": "mixup-history", "k": 8, "params": {"ratio": 2.0}}, ["'mixup-history'", "ratio=2.0", "less"]),
        ({"attack": "property", "params": {"n_properties": 0}}, ["'property'", "n_properties=0", "greater than 0"]),
        ({"attack": "support-partition", "params": {"tol": -1.0}}, ["'support-partition'", "tol=-1.0", "greater"]),
        ({"attack": "gma-sl", "params": {"batch": 0}}, ["'gma-sl'", "batch=0", "greater than 0"]),
        ({"attack": "seed-search", "budget": 0}, ["'seed-search'", "budget=0", "'exhaustive'"]),
        ({"attack": "refit", "params": {"trim": 2.0}}, ["refit", "trim"]),  # its own check, at configuration
        ({"attack": "joint-adaptive", "params": {"bins": 0}}, ["joint-adaptive", "bins"]),
        ({"attack": "sip-gru", "params": {"epochs": 0}}, ["sip-gru", "epochs"]),
    ],
)
def test_a_bad_attack_parameter_is_refused_when_the_configuration_is_built(kw, words):
    with pytest.raises(ConfigError) as err:
        make_attack_config(**kw)
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.unit
def test_every_registered_attack_has_a_typed_schema_that_takes_its_defaults():
    for name, cls in ATTACKS.items():
        model = params_model(cls)
        assert "seed" in model.model_fields, name
        assert model().model_dump() is not None  # the defaults validate
        make_attack_config(attack=name)
    assert get_args(params_model(ATTACKS["sipit"]).model_fields["order"].annotation) == ("gradient", "ridge")
    ok = make_attack_config(attack="sipit", budget="exhaustive", params={"order": "ridge", "growth": 2, "step": 1})
    assert ok.params == {"budget": "exhaustive", "order": "ridge", "growth": 2, "step": 1}  # values kept as given


SPEC = """\
name: bad-param
protocol: proto.yaml
model: tiny-gpt2
depths: [1]
defences: [none]
victim_seeds: [1]
attack_seeds: [0]
client_copies: [public]
documents: {n_calib: 4, n_train: 4, n_eval: 4, doc_len: 8}
steps: 2
attacks:
  - {attack: activation, k: 4}
  - ENTRY
"""


@pytest.mark.unit
@pytest.mark.parametrize(
    "entry,words",
    [
        ("{attack: sipit, budget: [8, -5]}", ["attacks[1] (sipit)", "budget=-5", "greater than 0"]),
        ("{attack: sipit, params: {order: [gradient, bogus]}}", ["attacks[1] (sipit)", "order='bogus'", "'ridge'"]),
        ("{attack: sipit, params: {growth: -1}}", ["attacks[1] (sipit)", "growth=-1"]),
        ("{attack: activation, k: 8, params: {width: 0}}", ["attacks[1] (activation)", "width=0"]),
        ("{attack: activation, k: 8, params: {wdith: 2}}", ["attacks[1] (activation)", "does not take ['wdith']"]),
    ],
)
def test_experiment_plan_refuses_a_bad_attack_parameter_before_any_job(tmp_path, entry, words):
    (tmp_path / "proto.yaml").write_text((SHIPPED / "paper_main.yaml").read_text())
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.replace("ENTRY", entry))
    r = runner.invoke(app, ["experiment", "plan", str(spec)])
    assert r.exit_code == 2, r.output
    out = " ".join(r.output.split())
    assert all(w in out for w in words), out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["proto.yaml", "spec.yaml"]  # nothing written
    good = SPEC.replace("ENTRY", "{attack: sipit, budget: [8], params: {order: [gradient, ridge]}}")
    spec.write_text(good)
    r = runner.invoke(app, ["experiment", "plan", str(spec)])
    assert r.exit_code == 0 and "3 attack" in r.output, r.output
