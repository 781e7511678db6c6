"""The tap is the wire: every frame that crosses, in every split mode and under every defence, is in
the capture — nothing missing, nothing extra — and every crossing is a declared channel."""

import dataclasses
import hashlib
import json

import pytest
import torch

from splitleak.attacks import load_traffic
from splitleak.errors import IntegrityError, UndeclaredChannelError
from splitleak.runs.verify import verify_run
from splitleak.runs.wire import check_wire, read_wire
from splitleak.training import make_train_config, run_training
from splitleak.wire import InProcessChannel, encode
from splitleak.wire.tap import WireRecorder

pytestmark = pytest.mark.integration

SMALL = dict(model="tiny-gpt2", n_calib=4, n_train=6, n_eval=20, seed=2, all_local_baseline=False)
MODES = {"plain": dict(depth=2), "u-shape": dict(offload_start=1, offload_length=2)}
DEFENCES = {
    "none": [{"name": "none"}],
    "quant8": [{"name": "quant8"}],
    "clip-noise": [{"name": "clip-noise", "args": {"sigma": 0.05}}],
    "quant4-noisy": [{"name": "quant4-noisy"}],
    "mixup": [{"name": "mixup", "args": {"warmup": 2}}],
    "mixup-cached": [{"name": "mixup", "args": {"warmup": 2, "correction": "cached"}}, {"name": "quant8"}],
    "replica-median": [{"name": "replica-median"}],
}
PLAIN_ONLY = ("mixup", "mixup-cached", "replica-median")


@pytest.fixture
def wire_log(monkeypatch):
    """What crossed, seen from inside the channel itself: every encoded blob's digest, independent
    of the tap and of the channel's ledger."""
    crossed = []
    original = InProcessChannel._cross

    def spy(self, frame):
        crossed.append(
            (frame.phase, self.link, frame.kind, hashlib.sha256(encode(frame)).hexdigest(), frame.tensor.shape[0])
        )
        return original(self, frame)

    monkeypatch.setattr(InProcessChannel, "_cross", spy)
    return crossed


@pytest.mark.parametrize(
    "mode,defence", [(m, d) for m in MODES for d in DEFENCES if not (m == "u-shape" and d in PLAIN_ONLY)]
)
def test_capture_holds_exactly_what_crossed(tmp_path, wire_log, mode, defence):
    cfg = make_train_config(**SMALL, **MODES[mode], defences=DEFENCES[defence])
    run_training(cfg, tmp_path / "r", device="cpu")
    for phase in ("train", "capture"):
        assert check_wire(tmp_path / "r", phase)["frames"] == sum(1 for c in wire_log if c[0] == phase)
        stored = sorted(
            (
                r.frame.phase,
                r.header["link"],
                r.frame.kind,
                hashlib.sha256(encode(r.frame)).hexdigest(),
                r.frame.tensor.shape[0],
            )
            for r in read_wire(tmp_path / "r", phase)
        )
        assert stored == sorted(c for c in wire_log if c[0] == phase)
    kinds = {c[2] for c in wire_log}
    expected = {"forward", "backward"} | ({"forward-return", "backward-top"} if mode == "u-shape" else set())
    assert kinds == expected
    links = {c[1] for c in wire_log}
    assert links == ({"replica-0", "replica-1", "replica-2"} if defence == "replica-median" else {"main"})
    n_train_frames = sum(1 for c in wire_log if c[0] == "train")
    assert n_train_frames == 6 * len(expected) * len(links)  # one exchange per training step and link


@pytest.mark.parametrize("damage", ["drop-kind", "drop-row", "drop-frame"])
def test_a_tap_that_misses_something_fails_the_check(tmp_path, monkeypatch, damage):
    original = WireRecorder.__call__
    state = {"n": 0}

    def lossy(self, crossing):
        f = crossing.frame
        if damage == "drop-kind" and f.kind == "backward-top":
            return
        if damage == "drop-frame" and f.kind == "backward":
            state["n"] += 1
            if state["n"] == 3:
                return
        if damage == "drop-row" and f.kind == "forward" and f.tensor.shape[0] > 1:
            f = dataclasses.replace(
                f, tensor=f.tensor[:-1], mask=f.mask[:-1], doc_ids=f.doc_ids[:-1], labels=f.labels[:-1], meta={}
            )
            crossing = dataclasses.replace(crossing, frame=f)
        return original(self, crossing)

    monkeypatch.setattr(WireRecorder, "__call__", lossy)
    cfg = make_train_config(
        **SMALL,
        **MODES["u-shape" if damage == "drop-kind" else "plain"],
        defences=DEFENCES["mixup" if damage == "drop-row" else "none"],
    )
    run_training(cfg, tmp_path / "r", device="cpu")
    phase = "capture" if damage == "drop-row" else "train"
    with pytest.raises(IntegrityError, match="not in the capture|does not re-encode"):
        check_wire(tmp_path / "r", phase)
    # every file still matches its journal hash, yet `splitleak verify` refuses the run
    assert verify_run(tmp_path / "r").ok
    from typer.testing import CliRunner

    from splitleak.cli import app

    r = CliRunner().invoke(app, ["verify", str(tmp_path / "r")])
    assert r.exit_code == 1 and "FAILED" in r.output


def test_an_undeclared_crossing_fails_the_run_with_the_channel_named(tmp_path, monkeypatch):
    """A server that sends the loss back in the frame metadata (as splitleak once did) is refused."""
    from splitleak.training.roles import ServerRole

    original = ServerRole.handle

    def chatty(self, frame):
        reply = original(self, frame)
        if self.last_losses is not None:
            reply.meta = {"loss": self.last_losses}
        return reply

    monkeypatch.setattr(ServerRole, "handle", chatty)
    with pytest.raises(UndeclaredChannelError, match="meta:loss"):
        run_training(make_train_config(**SMALL, depth=2), tmp_path / "r", device="cpu")
    v = verify_run(tmp_path / "r")  # what was written before stays verifiable, and says it failed
    assert v.ok and v.status == "failed"


def test_no_loss_value_crosses_and_the_loss_is_logged_where_it_is_computed(shared_run):
    for mode in MODES:
        run = shared_run(**SMALL, **MODES[mode])
        for phase in ("train", "capture"):
            assert all(r.frame.meta == {} for r in read_wire(run, phase))
        losses = json.loads((run / "training.json").read_text())["losses"]
        assert len(losses) == 6 and all(2.0 < v < 10.0 for v in losses)


def test_u_shape_traffic_carries_the_second_crossing(shared_run):
    run = shared_run(**SMALL, **MODES["u-shape"])
    tr = load_traffic(run)
    assert tr.trunk_output.shape == tr.activations.shape == tr.output_gradients.shape == (20, 32, 64)
    assert not torch.equal(tr.trunk_output, tr.activations)
    assert float(tr.output_gradients.abs().sum()) > 0 and tr.steps == (-1,) * 20
    train = load_traffic(run, phase="train")
    assert train.steps == tuple(range(6)) and train.activations.shape == (6, 32, 64)
    order = json.loads((run / "training.json").read_text())["doc_ids"]
    assert list(train.doc_ids) == order


@pytest.mark.parametrize("seed", [0, 5])
def test_mixup_decoys_only_come_from_earlier_steps(tmp_path, seed):
    cfg = make_train_config(
        **{**SMALL, "seed": seed, "n_train": 8}, depth=2, defences=[{"name": "mixup", "args": {"warmup": 3}}]
    )
    run_training(cfg, tmp_path / "r", device="cpu")
    draws = json.loads((tmp_path / "r" / "client" / "mixup_decoys.json").read_text())
    train = [d for d in draws if d["phase"] == "train"]
    assert [d["step"] for d in train] == list(range(3, 8))  # the warm-up steps are not mixed
    order = json.loads((tmp_path / "r" / "training.json").read_text())["doc_ids"]
    for d in train:
        assert all(src_step < d["step"] for src_step, _, _ in d["sources"])
        assert all(order[src_step] == src_doc for src_step, src_doc, _ in d["sources"])
        assert len({tuple(s) for s in d["sources"]}) == 32  # without replacement
    capture = [d for d in draws if d["phase"] == "capture"]
    assert len(capture) == 20 and all(0 <= s[0] < 8 for d in capture for s in d["sources"])
    # the warm-up steps crossed unmixed and without probe rows; the others with them
    frames = [r for r in read_wire(tmp_path / "r", "train") if r.frame.kind == "forward"]
    assert [r.frame.tensor.shape[0] for r in frames] == [1, 1, 1, 2, 2, 2, 2, 2]
    assert [r.frame.meta.get("probe_rows", 0) for r in frames] == [0, 0, 0, 1, 1, 1, 1, 1]
    tr = load_traffic(tmp_path / "r", phase="train")
    assert tr.probe_present.tolist() == [False] * 3 + [True] * 5
    assert not any(i < 0 for i in tr.doc_ids)  # probe ids are not documents
