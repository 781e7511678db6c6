import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from splitleak.cli import app, parse_defences
from splitleak.errors import ConfigError

runner = CliRunner()
SMALL = ["--n-calib", "4", "--n-train", "6", "--n-eval", "10"]


@pytest.mark.unit
def test_help_on_every_command():
    for cmd in ([], ["models"], ["defences"], ["attacks"], ["train"], ["verify"], ["audit"]):
        r = runner.invoke(app, cmd + ["--help"])
        assert r.exit_code == 0 and "Usage" in r.output


#: packages that cost seconds to import (torch, transformers, scipy's submodules) or are optional (ray): the CLI
#: imports them inside the commands that need them (``# lazy:``), never to start or to print help
HEAVY = ("torch", "transformers", "ray", "optuna", "matplotlib", "pyarrow", "scipy")


def loaded_by(*commands: list[str]) -> list[str]:
    """The ``HEAVY`` packages a fresh interpreter holds after running ``splitleak COMMAND`` for each command
    in turn (through ``splitleak.cli.main``, as the console script does)."""
    code = (
        "import sys\n"
        "from splitleak.cli import main\n"
        f"for cmd in {[list(c) for c in commands]!r}:\n"
        "    sys.argv = ['splitleak', *cmd]\n"
        "    try:\n"
        "        main()\n"
        "    except SystemExit as exc:\n"
        "        assert not exc.code, (cmd, exc.code)\n"
        f"print('LOADED', *(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1].split()[1:]


@pytest.mark.unit
def test_help_loads_no_heavy_package():
    """``splitleak --help`` and the help of commands that load their stack only when they run start in well
    under a second: before, ``serve``'s limits came from ``wire.transport`` and every start loaded torch."""
    helps = ([], ["serve"], ["tls", "init"], ["experiment", "run"], ["verify"], ["protocol", "analyse"], ["models"])
    assert loaded_by(*([*cmd, "--help"] for cmd in helps)) == []


@pytest.mark.integration
def test_models_loads_torch_but_no_model_stack():
    """``splitleak models`` reads the presets (their module imports torch: its precisions are torch dtypes) and
    the local caches, and loads none of transformers, scipy, pyarrow, optuna, matplotlib or ray."""
    assert loaded_by(["models"]) == ["torch"]


@pytest.mark.unit
def test_models_lists_presets_with_availability():
    r = runner.invoke(app, ["models"])
    assert r.exit_code == 0
    for name in ("tiny-gpt2", "smollm2-135m", "gpt2", "qwen3-0.6b"):
        assert name in r.output


@pytest.mark.integration
def test_train_then_verify_then_refuse_overwrite(tmp_path):
    out = tmp_path / "run"
    args = [
        "train",
        "--model",
        "tiny-gpt2",
        "--depth",
        "2",
        "--defence",
        "quant8",
        "--seed",
        "3",
        "--out",
        str(out),
        "--quiet",
        "--threads",
        "1",
        "--device",
        "cpu",
        *SMALL,
    ]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    m = json.loads((out / "metrics.json").read_text())
    assert {"heldout_ce", "perplexity", "all_local_ce", "delta_u"} <= set(m)
    assert json.loads((out / "manifest.json").read_text())["defences"] == [{"name": "quant8", "args": {}}]
    assert runner.invoke(app, ["verify", str(out)]).exit_code == 0
    before = (out / "journal.jsonl").read_bytes()
    r = runner.invoke(app, args)
    assert r.exit_code == 2 and "--force" in r.output
    assert (out / "journal.jsonl").read_bytes() == before
    r = runner.invoke(app, args + ["--force"])
    assert r.exit_code == 0


@pytest.mark.unit
@pytest.mark.parametrize(
    "extra,words",
    [
        (["--depth", "2", "--defence", "mixupp"], "unknown defence 'mixupp'"),
        (["--depth", "7"], "out of range"),
        ([], "--depth"),
        (["--depth", "2", "--data", "books"], "books"),
        (["--depth", "2", "--precision", "half"], "precision"),
        (["--depth", "2", "--device", "tpu"], "unknown device"),
    ],
)
def test_bad_input_gets_a_clear_error_and_writes_nothing(tmp_path, extra, words):
    out = tmp_path / "run"
    r = runner.invoke(app, ["train", "--model", "tiny-gpt2", "--out", str(out), "--quiet", *SMALL, *extra])
    assert r.exit_code == 2, r.output
    assert words in r.output.replace("\n", " ")
    assert not out.exists()


@pytest.mark.unit
def test_missing_model_names_offline_preset(tmp_path):
    r = runner.invoke(app, ["train", "--model", "gpt2", "--depth", "3", "--out", str(tmp_path / "r"), "--quiet"])
    assert r.exit_code == 2 and "smollm2-135m" in r.output.replace("\n", " ")


@pytest.mark.unit
def test_defence_argument_forms():
    assert parse_defences(["quant4-noisy"], ["clip=2.0"]) == [{"name": "quant4-noisy", "args": {"clip": 2.0}}]
    assert parse_defences(["quant8", "quant4-noisy:noise=0.2"], ["quant4-noisy.clip=0.5"]) == [
        {"name": "quant8", "args": {}},
        {"name": "quant4-noisy", "args": {"noise": 0.2, "clip": 0.5}},
    ]
    with pytest.raises(ConfigError, match="ambiguous"):
        parse_defences(["quant8", "quant4"], ["clip=1"])


@pytest.mark.e2e
def test_audit_on_tiny_model(tmp_path):
    out = tmp_path / "audit"
    r = runner.invoke(app, ["audit", "--model", "tiny-gpt2", "--out", str(out), "--quiet", "--epochs", "1", *SMALL])
    assert r.exit_code == 0, r.output
    assert "depth: 2" in r.output and "verified" in r.output and "LEAKS" in r.output
    report = json.loads((out / "report.json").read_text())
    assert report["capture"]["documents"] == 10 and report["capture"]["width"] == 64
    by_name = {(a["attack"], a["threat_model"]): a for a in report["attacks"]}
    public = {"majority", "vmi", "activation", "joint", "sipit"}
    assert set(by_name) == {(a, "public") for a in public} | {("sipit", "trained")}
    # on the tiny model at depth 2 the activation attacker beats the majority control by far
    assert by_name["activation", "public"]["token_recovery"] > by_name["majority", "public"]["token_recovery"] + 0.5
    # the exact-inversion check: through the trained layers every observed activation is matched
    # exactly; through the public copy after training, none is
    cert = by_name["sipit", "trained"]
    assert cert["attack_params"]["budget"] == 32 and cert["certified_tokens"] == 1.0
    assert cert["token_recovery"] == 1.0 and by_name["sipit", "public"]["certified_tokens"] < 0.5
    assert "Worst-case reader:" in report["verdict"] and "the cut is injective on these documents" in report["verdict"]
    assert (out / "attacks" / "sipit-trained.parquet").is_file() and (out / "attacks" / "sipit.parquet").is_file()
    shown = report["examples"]["documents"]
    assert len(shown) == 3 and all(len(d["readings"]) == 5 for d in shown)  # every reader but the control
    md = (out / "report.md").read_text()
    assert re.search(r"^\| activation k=32 +\|", md, re.M) and all(p in md for p in report["verdict_parts"])
    assert " ".join(report["verdict_parts"]) == report["verdict"] and len(report["verdict_parts"]) == 5
    assert report["verdict_parts"][1].startswith("Upper side: no formal bound (no defence of the chain adds noise")
    # verdict words: the activation arms are detected, every mis-paired control reads at floor, the gate breaks
    arms = {a["attack"]: a["arm"] for a in report["attacks"]}
    assert arms["activation"]["verdict"] == "detected" and arms["activation"]["effect"]["low"] > 0.3
    assert all(a["control_verdict"] == "at floor" for a in arms.values()), arms
    assert "no mis-paired control detected" in report["verdict"]
    assert report["verdicts"]["gate"]["breaks"] and report["verdict"].startswith("LEAKS")
    # the gate, α and the utility gate are the shipped gate_002 protocol's, read from it and recorded with its hash
    from splitleak.audit.gate import shipped_thresholds

    g = report["verdicts"]["gate"]
    assert (g["gate"], g["alpha"], g["J"], g["declared_J"]) == (0.01, 0.05, 5, 9)
    assert g["thresholds"]["protocol_hash"] == shipped_thresholds().protocol_hash
    assert report["verdicts"]["utility_gate"]["passes"] is True  # undefended: its own reference, ΔU = 0
    assert (out / "calibration" / "calibration.json").is_file()
    assert (out / "attacks" / "joint.parquet").is_file()
    # every reading carries the interval its 10 documents give, around the reading itself
    for a in report["attacks"]:
        tok, doc = a["intervals"]["tokens"], a["intervals"]["documents"]
        eps = 1e-9  # a bootstrap mean of ones sums to 1 within rounding
        assert tok["low"] - eps <= a["token_recovery"] <= tok["high"] + eps
        assert doc["low"] - eps <= a["doc_recovery"] <= doc["high"] + eps
        assert tok["estimate"] == pytest.approx(a["token_recovery"]) and a["intervals"]["n_docs"] == 10
    vmi_docs = by_name["vmi", "public"]["intervals"]["documents"]
    assert vmi_docs["high"] - vmi_docs["low"] > 0.2  # ten documents pin little: the report must say so
    assert "With 10 documents they are at most ±" in md and "`--n-eval 40` halves them" in md
    # every declared channel with its status; the verdict names the ones no attack read
    channels = {c["channel"]: c for c in report["channels"]}
    assert channels["activations"]["status"] == "measured"  # attacked, and the calibration doses it
    assert channels["gradient"]["status"] == "no positive control"
    assert {"joint k=32"} <= set(channels["gradient"]["read_by"])
    assert channels["labels"]["status"] == "in clear" and channels["timing"]["status"] == "not captured"
    assert "Channels not attacked: row-ids, shapes, timing." in report["verdict"]
    # the third reader: the server receives the labels, the text itself
    assert (
        "The untrusted server itself reads 100 % of tokens and 100 % of whole documents, with no attack"
        in (report["verdict"])
    )
    assert report["threat_models"]["server"].startswith("the untrusted server itself") and report["mode"] == "plain"
    assert "## Channels (Politis & Pappas 2026, §3)" in md
    assert re.search(r"^\| labels +\| main +\| client->server +\|", md, re.M)
    page = (out / "report.html").read_text()
    assert "client-&gt;server" in page  # escaped in HTML
    # self-contained: nothing loaded from elsewhere, no script; every section present and linked
    assert "<script" not in page and "<link" not in page and "url(" not in page and 'src="http' not in page
    assert all(s.startswith("data:image/png;base64,") for s in re.findall(r'<img [^>]*src="([^"]+)"', page))
    sections = ["Who reads what", "Channels (Politis &amp; Pappas 2026, §3)", "Your text coming back",
                "Recovery by span class", "Verdict words (Politis &amp; Pappas 2026, §3)", "What no reader can read",
                "Instrument calibration (Politis &amp; Pappas 2026, §4)", "Utility"]  # fmt: skip
    assert re.findall(r"<h2 [^>]*>(.*?)</h2>", page) == sections
    assert page.count('<table class="recon">') == 3 and page.index("Worst-case reader") < page.index("Who reads")
    assert runner.invoke(app, ["verify", str(out / "run")]).exit_code == 0


@pytest.mark.integration
def test_train_from_yaml_with_composed_defences(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "model: tiny-gpt2\ndepth: 2\nseed: 2\nn_calib: 4\nn_train: 6\nn_eval: 10\n"
        "defences:\n  - name: quant8\n  - name: clip-noise\n    args: {clip: 2.0, sigma: 0.05, where: backward}\n"
    )
    out = tmp_path / "run"
    r = runner.invoke(app, ["train", "--config", str(cfg), "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    m = json.loads((out / "manifest.json").read_text())
    assert m["defences"] == [
        {"name": "quant8", "args": {}},
        {"name": "clip-noise", "args": {"clip": 2.0, "sigma": 0.05, "where": "backward"}},
    ]
    r = runner.invoke(app, ["train", "--config", str(cfg), "--depth", "3", "--out", str(tmp_path / "x"), "--quiet"])
    assert r.exit_code == 2 and "--depth" in r.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: tiny-gpt2\ndepth: 2\ndefense: [quant8]\n")
    r = runner.invoke(app, ["train", "--config", str(bad), "--out", str(tmp_path / "y"), "--quiet"])
    assert r.exit_code == 2 and "defense" in r.output and not (tmp_path / "y").exists()


@pytest.mark.unit
def test_resume_takes_its_configuration_from_the_run_it_continues(tmp_path):
    base = ["train", "--out", str(tmp_path / "new"), "--resume", str(tmp_path / "old")]
    r = runner.invoke(app, [*base, "--config", str(tmp_path / "c.yaml")])
    assert r.exit_code == 2 and "drop --config" in r.output
    r = runner.invoke(app, [*base, "--depth", "2", "--seed", "3"])
    assert r.exit_code == 2 and "--resume" in r.output and "--depth, --seed were both given" in r.output
    assert not (tmp_path / "new").exists()


@pytest.mark.e2e
def test_audit_certify_runs_the_whole_exact_inversion_check_and_refuses_a_bad_bound(tmp_path):
    bad = runner.invoke(app, ["audit", "--model", "tiny-gpt2", "--out", str(tmp_path / "bad"), "--certify", "many"])
    assert bad.exit_code == 2 and "--certify" in bad.output and not (tmp_path / "bad").exists()
    out = tmp_path / "audit"
    r = runner.invoke(
        app,
        [
            "audit",
            "--model",
            "tiny-gpt2",
            "--out",
            str(out),
            "--quiet",
            "--certify",
            "exhaustive",
            "--epochs",
            "1",
            *SMALL,
        ],
    )
    assert r.exit_code == 0, r.output
    report = json.loads((out / "report.json").read_text())
    cert = next(a for a in report["attacks"] if a["threat_model"] == "trained")
    assert cert["attack_params"]["budget"] == "exhaustive" and cert["certified_tokens"] == 1.0
    assert "the whole vocabulary if needed" in report["verdict"]


@pytest.mark.unit
@pytest.mark.parametrize("length", [120, 230])
def test_an_error_is_one_line_however_long_its_paths(tmp_path, length):
    # rich wrapped errors at the console width (160 off a terminal): a word split over two lines made a test
    # that looks for it pass or fail with the length of pytest's temporary folder
    spec = tmp_path / ("s" * length + ".yaml")
    r = runner.invoke(app, ["experiment", "run", str(spec)])
    assert r.exit_code == 2
    assert r.output.startswith("error: ") and r.output.count("\n") == 1 and len(r.output) > 2 * length
    assert f"'{spec}' not found" in r.output


@pytest.mark.unit
@pytest.mark.parametrize(
    "nodes", [{"10.0.0.2 (Ray node aaaa)": 14}, {"10.0.0.2 (Ray node aaaa)": 9, "10.0.0.3 (Ray node bbbb)": 5}]
)
def test_experiment_run_names_every_node_that_ran_jobs_even_one(tmp_path, monkeypatch, nodes):
    # a Ray grid whose second node died before any of its jobs finished ran everything on one node: the
    # line was left out then, and the cluster test read "no jobs ran anywhere"
    import splitleak.experiments as experiments

    store = tmp_path / ("d" * 150) / "store"
    fake = SimpleNamespace(
        grid=SimpleNamespace(jobs=[None] * 14), ran=14, reused=0, done_before=0, failures=[], retried=1,
        seconds=3.0, store=store, nodes=nodes,
    )  # fmt: skip
    monkeypatch.setattr(experiments, "run_grid", lambda *a, **k: fake)
    r = runner.invoke(app, ["experiment", "run", "tiny.yaml", "--quiet"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert len(lines) == 2 and lines[0].startswith("14 job(s) ran") and lines[0].endswith(f"store {store}")
    assert lines[1] == "jobs per node: " + ", ".join(f"{n}: {c}" for n, c in sorted(nodes.items()))
    fake.nodes = {}  # the local executor names no node
    r = runner.invoke(app, ["experiment", "run", "tiny.yaml", "--quiet"])
    assert r.exit_code == 0 and "jobs per node" not in r.output and r.output.count("\n") == 1, r.output
