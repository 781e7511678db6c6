import json
import shutil

import pytest
from typer.testing import CliRunner

from splitleak.audit.protocol import (
    check_results,
    file_sha256,
    freeze_protocol,
    load_protocol,
    parse_protocol,
    shipped_protocols,
)
from splitleak.cli import app
from splitleak.errors import ConfigError, IntegrityError

runner = CliRunner()


@pytest.mark.unit
def test_shipped_protocols_parse():
    names = {parse_protocol(p).name for p in shipped_protocols()}
    assert names == {"paper-main", "partial-offloading", "gate-002", "mirage-003"}
    main = parse_protocol([p for p in shipped_protocols() if p.name == "paper_main.yaml"][0])
    assert main.main_test.pass_mark == 0.02 and main.family.size == 47 and len(main.victim_seeds) == 10


@pytest.fixture
def proto(tmp_path):
    src = [p for p in shipped_protocols() if p.name == "gate_002.yaml"][0]
    dst = tmp_path / "gate.yaml"
    shutil.copy(src, dst)
    return dst


@pytest.mark.unit
def test_freeze_records_the_hash_and_load_checks_it(proto):
    with pytest.raises(IntegrityError, match="has not been frozen"):
        load_protocol(proto)
    digest = freeze_protocol(proto)
    assert digest == file_sha256(proto) and len(digest) == 64
    assert json.loads((proto.parent / "gate.yaml.frozen.json").read_text())["sha256"] == digest
    p, h = load_protocol(proto)
    assert h == digest and p.thresholds["gate"] == 0.01
    assert freeze_protocol(proto) == digest  # refreezing an unchanged file is harmless


@pytest.mark.unit
def test_protocol_edited_after_freezing_is_refused_naming_both_hashes(proto):
    old = freeze_protocol(proto)
    proto.write_text(proto.read_text().replace("gate: 0.01", "gate: 0.02"))
    new = file_sha256(proto)
    for call in (load_protocol, freeze_protocol):
        with pytest.raises(IntegrityError) as exc:
            call(proto)
        assert old in str(exc.value) and new in str(exc.value)
    r = runner.invoke(app, ["protocol", "show", str(proto)])
    assert r.exit_code == 2 and old[:16] in r.output.replace("\n", "")


@pytest.mark.unit
def test_results_under_another_protocol_are_refused(proto):
    digest = freeze_protocol(proto)
    good = {"attack": "joint", "config_hash": "a" * 64, "protocol_hash": digest}
    check_results([good], digest)
    bad = {"attack": "vmi", "config_hash": "b" * 64, "protocol_hash": "c" * 64}
    with pytest.raises(IntegrityError, match="vmi .*protocol_hash c+"):
        check_results([good, bad], digest)


@pytest.mark.unit
def test_unknown_protocol_keys_are_refused(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("name: x\nsource: y\nhypotheses: []\nvictim_seeds: [1]\ndocuments: {n_eval: 4}\npass_mark: 0.1\n")
    with pytest.raises(ConfigError, match="pass_mark"):
        parse_protocol(f)


@pytest.mark.integration
def test_attack_result_carries_the_protocol_hash(proto, tmp_path):
    from splitleak.training import make_train_config, run_training

    run = tmp_path / "run"
    run_training(
        make_train_config(model="tiny-gpt2", depth=2, n_calib=4, n_train=4, n_eval=6, all_local_baseline=False),
        run,
        device="cpu",
    )
    digest = freeze_protocol(proto)
    out = tmp_path / "vmi.json"
    r = runner.invoke(
        app, ["attack", str(run), "--attack", "vmi", "--out", str(out), "--protocol", str(proto), "--quiet"]
    )
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    assert res["protocol_hash"] == digest
    check_results([res], digest)
    r = runner.invoke(app, ["protocol", "freeze", str(proto)])
    assert r.exit_code == 0 and digest in r.output
