"""Property-based fuzzing of what `splitleak attack` and `splitleak experiment plan` read (issue 17).

Each example damages one file of a finished tiny run (truncate, flip, insert or delete bytes, empty it,
put a directory or a link out of the run in its place) or one key or value of a spec, and runs the
command in-process. The property: it exits non-zero with the project's one-line error (no traceback),
or succeeds on content that is still valid; it writes nothing into the run, nothing beside it, and no
result file when it fails. With ``--no-verify`` the readers themselves are what stands between the
damage and a traceback."""

from __future__ import annotations

import hashlib
import re
import shutil
import tempfile
from pathlib import Path

import pytest
from damage import OPS, damage, digests, fuzz, one_line_error
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from splitleak.cli import app
from splitleak.training import make_train_config, run_training

RUN_FILES = (
    "manifest.json",
    "journal.jsonl",
    "documents.json",
    "metrics.json",
    "training.json",
    "client_layers.safetensors",
    "wire/capture-00000.safetensors",
    "wire/capture-ledger.json",
)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("fuzz") / "run"
    run_training(make_train_config(model="tiny-gpt2", depth=1, n_calib=8, n_train=2, n_eval=4, doc_len=16), run)
    return run


@pytest.mark.integration
@fuzz(80)
@given(
    rel=st.sampled_from(RUN_FILES),
    op=st.sampled_from(OPS),
    at=st.floats(0, 1),
    byte=st.integers(0, 255),
    verify=st.booleans(),
    copy=st.sampled_from(["public", "trained"]),
)
def test_attack_on_a_damaged_run_fails_in_one_line_and_touches_nothing(pristine, rel, op, at, byte, verify, copy):
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        run, outside = tmp / "run", tmp / "outside"
        shutil.copytree(pristine, run)
        outside.mkdir()
        damage(run / rel, op, at, byte, outside)
        before_run, before_outside = digests(run), digests(outside)
        out = tmp / "result.json"
        args = ["attack", str(run), "--attack", "vmi", "--copy", copy, "--out", str(out), "--quiet", "--threads", "1"]
        result = CliRunner().invoke(app, args + ([] if verify else ["--no-verify"]))
        if result.exit_code == 0:
            # content that still parses (a character of a document's text, a file the attack does not read),
            # and only without verify; never a file it reads taken from outside the run
            assert not verify and out.is_file(), result.output
            read = {"manifest.json", "journal.jsonl", "documents.json", "wire/capture-00000.safetensors"}
            assert not (
                op == "link-out" and (rel in read or (rel == "client_layers.safetensors" and copy == "trained"))
            )
        else:
            one_line_error(result)
            assert not out.exists()
            if verify:  # the journal check comes first and names the run
                assert "does not verify" in result.output or "journal" in result.output
        assert digests(run) == before_run and digests(outside) == before_outside
        assert sorted(p.name for p in tmp.iterdir()) == sorted(
            ["run", "outside"] + (["result.json", "result.parquet"] if result.exit_code == 0 else [])
        )


@pytest.mark.integration
@pytest.mark.parametrize(
    "rel, change, words",
    [
        ("manifest.json", lambda b: b[:40], "manifest.json is not valid JSON (line"),
        ("manifest.json", lambda b: b.replace(b'"split"', b'"splot"', 1), "manifest.json: field split: Field required"),
        (
            "documents.json",
            lambda b: b.replace(b'"token_ids"', b'"tokens"', 1),
            "documents.json: DocumentSets JSON is missing or mistypes a field (KeyError",
        ),
        ("documents.json", lambda b: b"[]", "documents.json holds a JSON list, not an object"),
        ("wire/capture-00000.safetensors", lambda b: b[:-1] + bytes([b[-1] ^ 1]), "does not match its recorded sha256"),
        ("journal.jsonl", lambda b: b + b"garbage\n", "journal.jsonl has a line that is not JSON"),
    ],
)
def test_without_verify_the_readers_name_the_damaged_file(pristine, tmp_path, rel, change, words):
    run = tmp_path / "run"
    shutil.copytree(pristine, run)
    (run / rel).write_bytes(change((run / rel).read_bytes()))
    args = ["attack", str(run), "--attack", "vmi", "--out", str(tmp_path / "r.json"), "--quiet"]
    verified = CliRunner().invoke(app, args)
    one_line_error(verified)
    assert "does not verify" in " ".join(verified.output.split())
    unverified = CliRunner().invoke(app, args + ["--no-verify"])
    one_line_error(unverified)
    assert words in " ".join(unverified.output.split()).replace("/ ", "/")


SPEC = """\
name: fuzz
protocol: shipped:mirage_003
models: [tiny-gpt2]
shielded:
  - {label: none, bottom: 1, top: 1}
  - {label: mirage, bottom: 1, top: 1, chain: {name: mirage, args: {m: 10}}}
victim_seeds: [0, 1]
documents: {n_calib: 8, n_train: 8, n_eval: 8, doc_len: 32}
steps: 8
data: {source: instructions}
attacks:
  - {attack: gma-sl, params: {steps: 50}}
"""


@pytest.mark.unit
@fuzz(60)
@given(at=st.floats(0, 1), op=st.sampled_from(["truncate", "flip", "insert", "delete"]), byte=st.integers(0, 127))
def test_a_damaged_spec_is_planned_or_refused_in_one_line(at, op, byte):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.yaml"
        path.write_text(SPEC)
        damage(path, op, at, byte, Path(tmp))
        result = CliRunner().invoke(app, ["experiment", "plan", str(path)])
        if result.exit_code != 0:
            one_line_error(result)
        assert sorted(p.name for p in Path(tmp).iterdir()) == ["fuzz.yaml"]  # planning writes nothing


# ------------------------------------------------------------------ results, protocols, calibration

PROTOCOL = (
    "name: mini\nsource: test\nhypotheses: [activation beats the majority control]\n"
    "main_test:\n  description: activation minus majority\n  metric: token_recovery\n"
    "  treatment: {attack: activation, k: 4, depth: 1}\n  control: {attack: majority, depth: 1}\n"
    "  pass_mark: 0.0\n  n_boot: 200\n"
    "victim_seeds: [0, 1]\ndocuments: {n_eval: 6}\n"
)
ANALYSIS_FILES = (
    "results/activation0.json",
    "results/activation0.parquet",
    "results/majority1.json",
    "results/majority1.parquet",
    "mini.yaml",
    "mini.yaml.frozen.json",
)
FILE_OPS = ("truncate", "flip", "insert", "delete", "empty", "directory")


@pytest.fixture(scope="module")
def analysed(tmp_path_factory) -> tuple[Path, object]:
    """A frozen protocol, four attack results under it (two runs × activation and majority), and the
    clean analysis's CLI result."""
    root = tmp_path_factory.mktemp("analysed")
    (root / "mini.yaml").write_text(PROTOCOL)
    runner = CliRunner()
    assert runner.invoke(app, ["protocol", "freeze", str(root / "mini.yaml")]).exit_code == 0
    for seed in (0, 1):
        cfg = make_train_config(
            model="tiny-gpt2", depth=1, n_calib=8, n_train=2, n_eval=6, doc_len=16, seed=seed, all_local_baseline=False
        )
        run_training(cfg, root / f"run{seed}", device="cpu")
        for attack, extra in (("activation", ["--k", "4"]), ("majority", [])):
            out = root / "results" / f"{attack}{seed}.json"
            args = ["attack", str(root / f"run{seed}"), "--attack", attack, *extra, "--quiet", "--threads", "1"]
            r = runner.invoke(app, args + ["--protocol", str(root / "mini.yaml"), "--out", str(out)])
            assert r.exit_code == 0, r.output
    clean = runner.invoke(app, ["protocol", "analyse", str(root / "mini.yaml"), str(root / "results")])
    assert clean.exit_code in (0, 1) and "Main test" in clean.output, clean.output
    return root, clean


def _analyse(root: Path):
    return CliRunner().invoke(app, ["protocol", "analyse", str(root / "mini.yaml"), str(root / "results")])


@pytest.mark.integration
@fuzz(60)
@given(rel=st.sampled_from(ANALYSIS_FILES), op=st.sampled_from(FILE_OPS), at=st.floats(0, 1), byte=st.integers(0, 255))
def test_a_damaged_result_or_protocol_is_analysed_as_before_or_refused_in_one_line(analysed, rel, op, at, byte):
    pristine_root, clean = analysed
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "a"
        shutil.copytree(pristine_root / "results", root / "results")
        for name in ("mini.yaml", "mini.yaml.frozen.json"):
            shutil.copy(pristine_root / name, root / name)
        damage(root / rel, op, at, byte, Path(tmp))
        before = digests(root)
        result = _analyse(root)
        if result.exit_code == 2:
            one_line_error(result)
        else:
            # the damage left every number the analysis reads as it was (a digit of "seconds", a space), or
            # made the file no attack result at all, which the output then names as skipped
            flat = "".join(result.output.split())
            assert result.exit_code == clean.exit_code, result.output
            assert flat == "".join(clean.output.split()) or f"skipped{root / rel}:" in flat, result.output
        assert digests(root) == before


@pytest.mark.integration
@pytest.mark.parametrize(
    "rel, change, words",
    [
        ("results/activation0.json", lambda b: b[:30], "activation0.json is not valid JSON (line"),
        (
            "results/activation0.json",
            lambda b: b.replace(b'false,\n    "k": 4', b'false,\n    "k": 5', 1),
            "config_hash does not match",
        ),
        (
            "results/activation0.json",
            lambda b: b.replace(b'"depth": 1', b'"depth": 2', 1),
            "run.config_hash does not match the run's config",
        ),
        (
            "results/activation0.json",
            lambda b: b.replace(b'"run": {', b'"run": [{', 1),
            "activation0.json is not valid",
        ),
        ("results/activation0.parquet", lambda b: b[:-9] + bytes([b[-9] ^ 1]) + b[-8:], "activation0.parquet"),
        ("mini.yaml.frozen.json", lambda b: b.replace(b'"sha256": "', b'"sha256": "x', 1), "sha256 is not 64 hex"),
        ("mini.yaml", lambda b: b.replace(b"pass_mark: 0.0", b"pass_mark: 0.1"), "was edited after freezing"),
    ],
)
def test_the_analysis_names_the_damaged_file(analysed, tmp_path, rel, change, words):
    pristine_root, _ = analysed
    root = tmp_path / "a"
    shutil.copytree(pristine_root / "results", root / "results")
    for name in ("mini.yaml", "mini.yaml.frozen.json"):
        shutil.copy(pristine_root / name, root / name)
    (root / rel).write_bytes(change((root / rel).read_bytes()))
    result = _analyse(root)
    one_line_error(result)
    assert words in " ".join(result.output.split()).replace("/ ", "/"), result.output


@pytest.mark.unit
@fuzz(40)
@given(at=st.floats(0, 1), op=st.sampled_from(["truncate", "flip", "insert", "delete"]), byte=st.integers(0, 127))
def test_a_damaged_protocol_is_frozen_or_refused_in_one_line(at, op, byte):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mini.yaml"
        path.write_text(PROTOCOL)
        damage(path, op, at, byte, Path(tmp))
        text = path.read_bytes()
        result = CliRunner().invoke(app, ["protocol", "freeze", str(path)])
        assert path.read_bytes() == text
        if result.exit_code == 0:  # still a valid protocol: frozen with its hash
            assert hashlib.sha256(text).hexdigest() in result.output
            assert sorted(p.name for p in Path(tmp).iterdir()) == ["mini.yaml", "mini.yaml.frozen.json"]
        else:
            one_line_error(result)
            assert sorted(p.name for p in Path(tmp).iterdir()) == ["mini.yaml"]


# ------------------------------------------------------------------ server sessions: frame messages


def _frame_message(seed: int, labels: bool) -> tuple[bytes, object]:
    import torch

    from splitleak.wire.frames import Frame, encode
    from splitleak.wire.transport import frame_header, pack

    g = torch.Generator().manual_seed(seed)
    frame = Frame(
        kind="forward",
        step=3,
        doc_ids=(7, 9),
        tensor=torch.randn(2, 5, 8, generator=g),
        mask=torch.ones(2, 5, dtype=torch.long),
        phase="train",
        labels=torch.randint(0, 50, (2, 5), generator=g) if labels else None,
    )
    blob = encode(frame)
    return pack(frame_header(frame, blob, seq=0), blob), frame


@pytest.mark.unit
@fuzz(300)
@given(
    seed=st.integers(0, 3),
    labels=st.booleans(),
    op=st.sampled_from(["truncate", "flip", "insert", "delete", "nan"]),
    at=st.floats(0, 1),
    byte=st.integers(0, 255),
)
def test_a_damaged_frame_message_is_refused_in_one_line_or_received_within_the_limits(seed, labels, op, at, byte):
    """What a session's receiver does with each message (``unpack``, then ``receive_frame``: the limits before
    any allocation, the decode, the envelope against the frame, finite values): every damaged message is
    refused with the project's error in one line, or received as a frame within the handshake's limits whose
    envelope and contents agree."""
    import math

    import torch

    from splitleak.errors import SplitleakError
    from splitleak.wire.transport import Limits, receive_frame, unpack

    message, frame = _frame_message(seed, labels)
    i = min(len(message) - 1, int(at * len(message)))
    if op == "nan":  # a NaN written over one float of the tensor, in place: only the finiteness check can see it
        import json

        data = bytearray(message)
        body = 8 + int.from_bytes(data[4:8], "little")  # the envelope's header, then the frame's safetensors
        st_len = int.from_bytes(data[body : body + 8], "little")
        start = body + 8 + st_len + json.loads(data[body + 8 : body + 8 + st_len])["tensor"]["data_offsets"][0]
        k = start + 4 * min(79, int(at * 80))
        data[k : k + 4] = bytes.fromhex("0000c07f")  # float32 NaN, little-endian
        message = bytes(data)
    else:
        message = {
            "truncate": message[:i],
            "flip": message[:i] + bytes([message[i] ^ (byte or 1)]) + message[i + 1 :],
            "insert": message[:i] + bytes([byte]) + message[i:],
            "delete": message[:i] + message[i + 1 :],
        }[op]
    limits = Limits(width=8, max_tokens=5, max_rows=2, float_dtype="F32")
    try:
        header, payload = unpack(message)
        got = receive_frame(header, payload, limits, ("forward", "backward-top"))
    except SplitleakError as exc:
        assert "\n" not in str(exc) and str(exc)
        assert op != "nan" or "NaN" in str(exc) or "decode" in str(exc)
        return
    assert op != "nan", "a NaN frame was received"
    assert got.kind in ("forward", "backward-top") and tuple(got.tensor.shape) == (2, 5, 8)
    assert bool(torch.isfinite(got.tensor).all()) and math.prod(got.mask.shape) == 10
    assert [got.kind, got.step, got.phase, list(got.doc_ids)] == [
        header["kind"],
        header["step"],
        header["phase"],
        header["doc_ids"],
    ]


# ------------------------------------------------------------------ calibration records


@pytest.fixture(scope="module")
def calibrated(pristine, tmp_path_factory) -> Path:
    from splitleak.audit.calibrate import calibrate

    out = tmp_path_factory.mktemp("calibrated") / "cal"
    calibrate(pristine, "vmi", out=out, coverages=[0.0, 0.5], n_boot=200, seed=1)
    return out


@pytest.mark.integration
@fuzz(30)
@given(op=st.sampled_from(FILE_OPS), at=st.floats(0, 1), byte=st.integers(0, 255))
def test_a_damaged_calibration_record_is_rendered_or_refused_in_one_line(calibrated, op, at, byte):
    """The calibration report's reader: a damaged ``calibration.json`` renders (its content still holds every
    field the report reads, of its type) or is refused with the project's error in one line naming it; the
    record is never changed, and a refused one writes no report."""
    from splitleak.errors import SplitleakError
    from splitleak.report.calibration import write_calibration_report

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cal"
        out.mkdir()
        shutil.copy(calibrated / "calibration.json", out / "calibration.json")
        damage(out / "calibration.json", op, at, byte, Path(tmp))
        before = digests(out)
        try:
            written = write_calibration_report(out)
        except SplitleakError as exc:
            assert "\n" not in str(exc) and "calibration.json" in str(exc)
            assert digests(out) == before
        else:
            assert {p.name for p in written} >= {"calibration.md", "calibration.html"}
            assert {k: v for k, v in digests(out).items() if k == "calibration.json"} == {
                "calibration.json": before["calibration.json"]
            }


@pytest.mark.integration
@pytest.mark.parametrize(
    "change, words",
    [
        (lambda b: b[:100], "calibration.json is not valid JSON (line"),
        (lambda b: b.replace(b'"doses": [', b'"dozes": [', 1), "field doses: Field required"),
        (
            lambda b: re.sub(rb'"token_top1": (\d)', rb'"token_top1": -\1', b, count=1),
            "token_top1: Input should be greater",
        ),
        (
            lambda b: re.sub(rb'"gate_breaks": [a-z]+', b'"gate_breaks": "no"', b, count=1),
            "gate_breaks: Input should be a valid boolean",
        ),
        (lambda b: b.replace(b'"membership_auc": {', b'"membership_aux": {', 1), "effects.membership_auc missing"),
    ],
)
def test_the_calibration_reader_names_what_is_wrong(calibrated, tmp_path, change, words):
    from splitleak.errors import IntegrityError
    from splitleak.report.calibration import write_calibration_report

    out = tmp_path / "cal"
    out.mkdir()
    (out / "calibration.json").write_bytes(change((calibrated / "calibration.json").read_bytes()))
    with pytest.raises(IntegrityError) as exc:
        write_calibration_report(out)
    assert words in str(exc.value) and "rerun `splitleak calibrate`" in str(exc.value)
    assert sorted(p.name for p in out.iterdir()) == ["calibration.json"]


# ------------------------------------------------------------------ tensors that disagree, under a forged journal


def _forge(run: Path, rel: str) -> None:
    """Rewrite the journal's hash chain around ``rel``'s new bytes, as one who altered it would: every
    digest and link of the journal then matches, and only the readers' own checks can tell."""
    import json

    from splitleak.files import canonical_json, sha256_bytes
    from splitleak.runs.journal import GENESIS

    new = sha256_bytes((run / rel).read_bytes())
    prev, out = GENESIS, []
    for raw in (run / "journal.jsonl").read_bytes().splitlines():
        entry = json.loads(raw)
        if rel in entry["files"]:
            entry["files"][rel] = new
        entry["prev"] = prev
        line = canonical_json(entry)
        prev = sha256_bytes(line + b"\n")
        out.append(line)
    (run / "journal.jsonl").write_bytes(b"\n".join(out) + b"\n")


def _alter(path: Path, change) -> None:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(path, "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    change(tensors, torch)
    save_file(tensors, path, metadata=meta)


def _first_float(tensors: dict, suffix: str = "/tensor") -> str:
    return sorted(k for k in tensors if k.endswith(suffix))[0]


def _nan(t, torch):
    t[_first_float(t)][0, 3, 5] = float("nan")


def _inf_everywhere(t, torch):
    k = _first_float(t)
    t[k] = torch.full_like(t[k], float("inf"))


def _narrow(t, torch):
    k = _first_float(t)
    t[k] = t[k][..., :-4].contiguous()


def _half(t, torch):
    k = _first_float(t)
    t[k] = t[k].half()


def _layer_shape(t, torch):
    k = sorted(k for k in t if k.endswith(".bias"))[0]
    t[k] = t[k][:-1].contiguous()


@pytest.mark.integration
@pytest.mark.parametrize(
    "rel, change, unverified",
    [
        ("wire/capture-00000.safetensors", _nan, "hold NaN or Inf, which never cross"),
        ("wire/capture-00000.safetensors", _inf_everywhere, "hold NaN or Inf, which never cross"),
        ("wire/capture-00000.safetensors", _narrow, "but the client-layer copy has width"),
        ("wire/capture-00000.safetensors", _half, None),  # a float16 copy of the same frame is still traffic
        ("client_layers.safetensors", _layer_shape, "client_layers.safetensors does not fit the model tiny-gpt2"),
    ],
)
def test_tensors_that_disagree_under_a_forged_journal_are_refused_in_one_line(
    pristine, tmp_path, rel, change, unverified
):
    """Shapes and dtypes that disagree with the manifest, and NaN/Inf, written with a journal forged to match:
    the journal check passes, so what refuses them is the ledger of what crossed (with verify) and the readers
    themselves (without)."""
    run = tmp_path / "run"
    shutil.copytree(pristine, run)
    _alter(run / rel, change)
    _forge(run, rel)
    args = ["attack", str(run), "--attack", "vmi", "--copy", "trained", "--quiet", "--out"]
    verified = CliRunner().invoke(app, [*args, str(tmp_path / "v.json")])
    one_line_error(verified)
    flat = " ".join(verified.output.split())
    if rel.startswith("wire/"):  # the frames no longer re-encode to the bytes the ledger says crossed
        assert "does not verify" in flat and "does not re-encode to the bytes that crossed" in flat, flat
    else:  # the client's own layers never cross: no ledger vouches for them, the reader checks their shapes
        assert unverified in flat.replace("/ ", "/"), flat
    assert not (tmp_path / "v.json").exists()
    plain = CliRunner().invoke(app, [*args, str(tmp_path / "u.json"), "--no-verify"])
    if unverified is None:
        assert plain.exit_code == 0 and (tmp_path / "u.json").is_file(), plain.output
    else:
        one_line_error(plain)
        assert unverified in " ".join(plain.output.split()).replace("/ ", "/")
