"""What crosses the wire, pinned: the captures of eight small runs (every defence role, both split
modes, each mixup correction) against recorded numbers (see PINNED for when; the pins allow for the
last float bits another CPU may round differently). A change in what crosses moves these by far
more than the tolerance."""

import pytest

from splitleak.runs.captures import load_capture
from splitleak.training import make_train_config, run_training

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
#: relative tolerance where one CPU's kernels round differently from another's by whole quantisation levels:
#: 4-bit levels flipped by last-bit differences moved the sums by up to 1.2e-4 between machines; without the
#: 4-bit quantisation and its noise they are 0.8 % away (plain-none's train/activations), 16 times this bound
TOLERANCE = {"plain-quant4-noisy": 5e-4}
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


#: re-pinned when the seeds the server gets became derived one-way from the run seed (splitleak.seeds:
#: the tiny model's init and the server-side defences' key changed); with the two derivations set to
#: the identity, the code of that change reproduced the earlier pins (recorded at the defence-role
#: refactor) exactly. Sums of |value| in float64.
PINNED = {
    "plain-none": {
        "train/activations": 305.8549098145595,
        "train/gradients": 193.47805348419934,
        "capture/activations": 511.8840925693512,
        "capture/gradients": 318.4537872647852,
    },
    # re-pinned on 2026-12-03: the earlier pins (303.3192485757172, 190.5626362496987, 506.27715849503875,
    # 314.42619193252176) disagreed by up to 1.2e-4 relative on this machine kind at landed main d9630c6 too,
    # not only after the change being made; the 4-bit rounding of the noisy returned gradient turns last-bit
    # differences of the kernels into flips of whole levels. On 2026-12-04 an AMD EPYC machine gave
    # 303.3192512 again (the earlier pin to 1e-8): the two values are two CPUs' kernels, so this case is
    # checked to TOLERANCE below. The other cases still agree to 1e-5.
    "plain-quant4-noisy": {
        "train/activations": 303.3370539005846,
        "train/gradients": 190.5721227331087,
        "capture/activations": 506.27650586050004,
        "capture/gradients": 314.46499482821673,
    },
    "plain-clip-dp": {
        "train/activations": 9808.017840429675,
        "train/gradients": 492.920175465355,
        "capture/activations": 16416.297659376345,
        "capture/gradients": 815.7471498644009,
    },
    "mixup": {
        "train/activations": 264.4729271721444,
        "train/gradients": 224.1146155570459,
        "train/probe_activations": 203.8357499697595,
        "train/probe_gradients": 129.26626875331567,
        "capture/activations": 408.62042088786256,
        "capture/gradients": 392.55929924616794,
        "capture/probe_activations": 510.0582879674039,
        "capture/probe_gradients": 323.94394922497304,
    },
    "mixup-cached-quant8": {
        "train/activations": 264.4386485697469,
        "train/gradients": 224.2006677116151,
        "capture/activations": 408.49088201334234,
        "capture/gradients": 392.9562576019671,
    },
    "mixup-none": {
        "train/activations": 264.49252875326783,
        "train/gradients": 224.0895466682705,
        "capture/activations": 408.77800352536724,
        "capture/gradients": 392.4165631288197,
    },
    "replica-median": {
        "train/activations": 305.8551961298217,
        "train/gradients": 193.47828767838655,
        "capture/activations": 511.8841394792835,
        "capture/gradients": 318.4539682159084,
    },
    "u-quant8": {
        "train/activations": 289.3401043304475,
        "train/gradients": 205.48134678596398,
        "train/trunk_output": 322.40015843702713,
        "train/output_gradients": 185.00019033479475,
        "capture/activations": 484.6028867752175,
        "capture/gradients": 342.1019675662392,
        "capture/trunk_output": 542.1018219055841,
        "capture/output_gradients": 306.3117575948381,
    },
}


@pytest.mark.parametrize("name", list(CASES))
def test_captures_are_what_they_were(tmp_path, name):
    run_training(
        make_train_config(
            model="tiny-gpt2",
            n_calib=4,
            n_train=6,
            n_eval=10,
            seed=4,
            all_local_baseline=False,
            draws="derived",  # the pins were recorded with draws keyed by the run seed
            **CASES[name],
        ),
        tmp_path / "r",
        device="cpu",
    )
    got = capture_stats(tmp_path / "r")
    assert set(got) == set(PINNED[name])
    for key, value in PINNED[name].items():
        assert got[key] == pytest.approx(value, rel=TOLERANCE.get(name, 1e-5)), key
