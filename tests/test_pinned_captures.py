"""What crosses the wire, pinned: the captures of eight small runs (every defence role, both split
modes, each mixup correction) against numbers recorded when mixup and replica median moved onto the
defence-role interface (the refactor left them bit for bit equal; the pins below allow for the
last float bits another CPU may round differently). A change in what crosses moves these by far
more than the tolerance."""

import pytest

from splitleak.training import make_train_config, run_training
from splitleak.wire import load_capture

pytestmark = pytest.mark.integration

CASES = {
    "plain-none": dict(depth=2, defences=[{"name": "none"}]),
    "plain-quant4-noisy": dict(depth=2, defences=[{"name": "quant4-noisy"}]),
    "plain-clip-dp": dict(depth=2, defences=[{"name": "clip-noise", "args": {"sigma": 0.05}}, {"name": "dp-forward"}]),
    "mixup": dict(depth=2, defences=[{"name": "mixup", "args": {"warmup": 2}}]),
    "mixup-cached-quant8": dict(
        depth=2, defences=[{"name": "mixup", "args": {"warmup": 2, "correction": "cached"}}, {"name": "quant8"}]
    ),
    "mixup-none": dict(depth=2, defences=[{"name": "mixup", "args": {"warmup": 2, "correction": "none"}}]),
    "replica-median": dict(depth=2, defences=[{"name": "replica-median"}]),
    "u-quant8": dict(offload_start=1, offload_length=2, defences=[{"name": "quant8"}]),
}
FIELDS = ("activations", "gradients", "probe_activations", "probe_gradients", "trunk_output", "output_gradients")


def capture_stats(run) -> dict[str, float]:
    """The sum of absolute values of every channel's rows, per phase (float64)."""
    out = {}
    for phase in ("train", "capture"):
        cap = load_capture(run, phase)
        for f in FIELDS:
            t = getattr(cap, f)
            if t is not None:
                out[f"{phase}/{f}"] = float(t.double().abs().sum())
    return out


#: recorded at the defence-role refactor (sums of |value| in float64)
PINNED = {
    "plain-none": {
        "train/activations": 314.8331351656234,
        "train/gradients": 194.33670194393926,
        "capture/activations": 514.5681416975276,
        "capture/gradients": 326.0455301384791,
    },
    "plain-quant4-noisy": {
        "train/activations": 311.99279850069433,
        "train/gradients": 191.02451555989683,
        "capture/activations": 508.5390834668651,
        "capture/gradients": 320.11405404563993,
    },
    "plain-clip-dp": {
        "train/activations": 9812.890549915377,
        "train/gradients": 487.99602714898356,
        "capture/activations": 16404.176948945154,
        "capture/gradients": 819.0436019116678,
    },
    "mixup": {
        "train/activations": 272.70381867620745,
        "train/gradients": 224.9031954192833,
        "train/probe_activations": 211.57719960826216,
        "train/probe_gradients": 130.15827926920247,
        "capture/activations": 412.4913801454386,
        "capture/gradients": 401.77466350108443,
        "capture/probe_activations": 520.7083397107781,
        "capture/probe_gradients": 327.1164372518542,
    },
    "mixup-cached-quant8": {
        "train/activations": 272.6618330475176,
        "train/gradients": 224.92671989486553,
        "capture/activations": 412.16598205879563,
        "capture/gradients": 402.42302801588085,
    },
    "mixup-none": {
        "train/activations": 272.7137621167931,
        "train/gradients": 224.9053494485961,
        "capture/activations": 412.64192546129925,
        "capture/gradients": 401.63442075693456,
    },
    "replica-median": {
        "train/activations": 314.83317213406553,
        "train/gradients": 194.33716587793242,
        "capture/activations": 514.5687588529836,
        "capture/gradients": 326.04593285258306,
    },
    "u-quant8": {
        "train/activations": 296.4426511299098,
        "train/gradients": 205.1168162302929,
        "train/trunk_output": 330.1818585402798,
        "train/output_gradients": 184.11408981967907,
        "capture/activations": 486.1686770580127,
        "capture/gradients": 349.63003620062955,
        "capture/trunk_output": 540.0406497677614,
        "capture/output_gradients": 312.2188356305778,
    },
}


@pytest.mark.parametrize("name", list(CASES))
def test_captures_are_what_they_were(tmp_path, name):
    run_training(
        make_train_config(
            model="tiny-gpt2", n_calib=4, n_train=6, n_eval=10, seed=4, all_local_baseline=False, **CASES[name]
        ),
        tmp_path / "r",
        device="cpu",
    )
    got = capture_stats(tmp_path / "r")
    assert set(got) == set(PINNED[name])
    for key, value in PINNED[name].items():
        assert got[key] == pytest.approx(value, rel=1e-5), key
