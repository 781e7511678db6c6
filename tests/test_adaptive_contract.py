"""The contract of every declared adaptive attack: on a positive control it reads differently from the plain
attack it adds its knowledge of the defence to (``AttackInfo.adapts``). For each defence and each attack it
declares as built for it (``Defence.adaptive_attacks``), both are run on the same defended traffic; the two
readings must differ in substance (tokens, candidates, certified matches, labels), not merely in a summary
that names the chain. Where a defence's default strength changes nothing on the tiny model, the
configuration below says what makes it bite. That an aware attack told of no defence is its plain attack bit
for bit is tested beside each (tests/test_aware.py, test_joint_aware.py, test_gma_aware.py)."""

import dataclasses

import pytest
import torch

from splitleak.attacks import load_knowledge, load_traffic
from splitleak.attacks.core import make_attack
from splitleak.attacks.registry import attack_info
from splitleak.defences import DEFENCES, build_defence

#: per defence, the configuration and the split of its positive control (ours: where the defaults leave the
#: tiny model's rows as they were, a stronger setting); every registered defence that names an attack is here
PLAIN = dict(model="tiny-gpt2", depth=3, n_calib=2, n_train=8, n_eval=8, all_local_baseline=False, draws="derived")
SHIELDED = dict(
    model="tiny-gpt2", n_calib=4, n_train=6, n_eval=6, doc_len=32, lr=1e-3, data="instructions", capture_batch=3
)
CONTROLS = [
    ("quant8", {}, "loud"),
    ("quant4", {}, "loud"),
    ("quant4-noisy", {}, "loud"),
    ("clip-noise", {"clip": 0.1, "sigma": 0.5}, "plain"),
    ("dp-forward", {"clip": 0.1, "noise_multiplier": 0.5}, "plain"),
    ("mixup", {"lambda": 0.5, "warmup": 3}, "plain"),
    ("mixup", {"lambda": 0.5, "warmup": 3, "correction": "cached"}, "plain"),
    ("scale-blind", {}, "shielded"),
    ("mirage", {}, "shielded"),
    ("seq-dp", {"clip": 0.01, "noise_multiplier": 0.1}, "shielded"),
    ("grad-prune", {"ratio": 0.98}, "shielded"),
    ("grad-dropout", {"p": 0.8}, "shielded"),
]
#: per attack, the parameters it runs with here (small, as the tests of each attack use)
PARAMS = {
    "sipit-aware": {"budget": 32},
    "activation-aware": {"k": 32},
    "joint-aware": {"k": 32},
    "seed-search": {"budget": 32},
    "mixup-unmix": {"k": 32},
    "mixup-history": {"k": 32},
    "gma-sl-aware": {"steps": 150},
    "crossings-aware": {"k": 32},
    "joint-crossings": {"k": 32},
    "gma-sl-crossings": {"steps": 50},
    "sipit": {"budget": 32},
    "activation": {"k": 32},
    "joint": {"k": 32},
    "gma-sl": {"steps": 150},
}

#: the readers of a document's repeated crossings, and the passes their positive control trains
PASSES = {"crossings-aware": 3, "joint-crossings": 3, "gma-sl-crossings": 3}


def _pairs():
    out = []
    for i, (name, args, setting) in enumerate(CONTROLS):
        mode = "label-shielded" if setting == "shielded" else "plain"
        out += [
            pytest.param(i, attack, id=f"{name}{i}-{attack}")
            for attack in build_defence(name, args).adaptive_attacks(mode)
        ]
    return out


@pytest.mark.unit
def test_every_defence_that_names_an_attack_has_a_positive_control_here():
    named = {n for n, cls in DEFENCES.items() if cls.adaptive}
    assert named == {c[0] for c in CONTROLS}, named ^ {c[0] for c in CONTROLS}
    adaptive = {p.values[1] for p in _pairs()}
    assert adaptive | {attack_info(a).adapts for a in adaptive} == set(PARAMS)
    assert all(attack_info(a).adaptive and attack_info(a).adapts for a in adaptive)


def _substance(rec) -> dict[str, torch.Tensor]:
    x = rec.extra
    out = {"tokens": rec.tokens} if rec.tokens is not None else {}
    for key in ("candidates", "matched", "labels"):
        if key in x and isinstance(x[key], torch.Tensor):
            out[key] = x[key]
    return out


def _loud(traffic, knowledge):
    """Rounding bites where one row sets a document's scale: the clean rows scaled up at position 0 (as
    SmolLM2's first position is: about 40 times the median row at depth 6) so that the other rows keep under
    one level, then rounded as the chain rounds them."""
    from splitleak.defences import DefenceChain

    chain = DefenceChain(knowledge.chain(), seed=0)
    levels = 2 ** (chain.defences[0].n_bits - 1) - 1
    act, grad = traffic.activations.clone(), traffic.gradients.clone()
    act[:, 0] *= 6.0 * levels
    grad[:, 0] *= 2.0 * levels
    ids = traffic.doc_ids
    return traffic.replace(
        activations=chain.forward(act, "capture", 0, ids), gradients=chain.backward(grad, "capture", 0, ids)
    )


@pytest.mark.integration
@pytest.mark.parametrize("control, attack", _pairs())
def test_knowing_the_defence_changes_what_its_adaptive_attack_reads(shared_run, control, attack):
    defence, args, setting = CONTROLS[control]
    spec = [{"name": defence, "args": args}]
    if setting == "shielded":
        passes = {"steps": PASSES[attack] * SHIELDED["n_train"]} if attack in PASSES else {}
        run = shared_run(**SHIELDED, **passes, shielded={"bottom": 1, "top": 1}, defences=spec, seed=0, data_seed=0)
    elif setting == "loud":
        run = shared_run(**PLAIN, seed=0, data_seed=0)  # clean traffic, rounded here at a loud row's scale
    elif attack in PASSES:  # a reader of every crossing: its control is the training traffic of several passes
        run = shared_run(**{**PLAIN, "steps": PASSES[attack] * PLAIN["n_train"]}, defences=spec, seed=0, data_seed=0)
    else:
        run = shared_run(**PLAIN, defences=spec, seed=0, data_seed=0)
    known = load_knowledge(run, "public", with_top=setting == "shielded")
    traffic = load_traffic(run, phase="train" if attack in PASSES else "capture")
    if attack in PASSES:  # every crossing of two documents: enough to differ, and GMA-SL matches each frame alone
        keep = set(list(dict.fromkeys(traffic.doc_ids))[:2])
        traffic = traffic.subset([i for i, d in enumerate(traffic.doc_ids) if d in keep])
    if setting == "loud":
        known = dataclasses.replace(known, defences=tuple(spec))
        traffic = _loud(traffic, known)
    plain = attack_info(attack).adapts
    a = _substance(make_attack(attack, **PARAMS[attack]).fit(known).reconstruct(traffic))
    # a reader of every crossing is compared with its one-crossing reader at its own settings: only the combining differs
    b = _substance(make_attack(plain, **PARAMS[attack if attack in PASSES else plain]).fit(known).reconstruct(traffic))
    assert a, attack
    assert any(k not in b or not torch.equal(a[k], b[k]) for k in a), f"{attack} reads {defence} as {plain} does"
