"""An empirical lower bound on ε from a distinguishing game played on the defence's own mechanism (DP auditing:
Jagielski, Ullman & Oprea 2020; Nasr et al. 2023), set beside the ε its declared noise claims.

The game, for each noised channel a defence declares (``NoiseGuarantee``): two neighbouring inputs of one
release, canaries the auditor chooses inside the clip ball (one row, or one document clipped as a whole:
x₀ = −Δ/2·e and x₁ = +Δ/2·e along a unit vector e, so the clip leaves both as they are), with ‖Δ‖ set so
that the declared noise gives the pair μ = ``MU_TARGET`` (or 2C/σ, the most the clip allows). The defence's
own code (``noise_release``) releases x_b for a secret bit b, ``trials`` times in each world, each under a
fresh draw of the auditor's key. The auditor, who knows x₀, x₁ and the mechanism (the informed adversary of
the bound), guesses b by the likelihood ratio of Gaussian noise: b̂ = 1 iff the release lies nearer x₁.

For (ε, δ)-DP every test has FPR + e^ε·FNR ≥ 1 − δ and FNR + e^ε·FPR ≥ 1 − δ (Kairouz, Oh & Viswanath 2015),
so with Clopper–Pearson upper ends FPR⁺ and FNR⁺ at confidence 1 − α:
ε ≥ max(log((1 − δ − FPR⁺)/FNR⁺), log((1 − δ − FNR⁺)/FPR⁺)). The claim for the pair is the declared
mechanism's ε(μ, δ) (``privacy.accounting.epsilon``). A lower bound above the claim is a fault: the
mechanism adds less noise than it declares (or clips less), which no reading of the traffic alone would say.
With n trials per world the lower bound cannot exceed about log(n/3.7); ``MU_TARGET`` = 1 (ours) puts the
claim at ε ≈ 4.4 at δ = 1e-5, under that ceiling at the default 2,000 trials, so a mechanism that adds far
less noise than it declares is caught, and an honest one (optimal test: FPR = FNR = Φ(−μ/2) ≈ 0.31, ε ≈ 0.8)
is not.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from scipy.stats import binomtest

from splitleak.defences import WireContext
from splitleak.privacy.accounting import DELTA, epsilon
from splitleak.privacy.guarantee import NoiseGuarantee

#: the μ the canary pair is given under the declared noise (ours: module docstring)
MU_TARGET = 1.0
#: releases per world (ours)
TRIALS = 2000
#: the width of a canary row (ours: the likelihood-ratio test reads the projection on e; the other coordinates
#: only carry noise, which the test's statistic does not see)
WIDTH = 16
#: the rows of a document-level canary (ours)
DOC_ROWS = 4


@dataclass(frozen=True)
class MechanismAudit:
    """One noised channel's game: the claimed ε of the canary pair beside the measured lower bound."""

    defence: str
    channel: str
    trials: int
    mu_claimed: float
    epsilon_claimed: float
    epsilon_lower: float
    fpr: float
    fnr: float
    alpha: float
    delta: float

    @property
    def fault(self) -> bool:
        return self.epsilon_lower > self.epsilon_claimed + 1e-9

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fault": self.fault}


def epsilon_lower_bound(
    false_pos: int, false_neg: int, trials: int, alpha: float = 0.05, delta: float = DELTA
) -> float:
    """The ε no (ε, δ)-DP mechanism could have with these error counts out of ``trials`` per world, at confidence
    1 − ``alpha`` (Clopper–Pearson upper ends of both rates; module docstring); 0 where the errors say nothing."""
    fpr = binomtest(false_pos, trials).proportion_ci(1 - alpha, method="exact").high
    fnr = binomtest(false_neg, trials).proportion_ci(1 - alpha, method="exact").high
    best = 0.0
    for a, b in ((fpr, fnr), (fnr, fpr)):
        if 1 - delta - a > 0 and b > 0:
            best = max(best, math.log((1 - delta - a) / b))
    return best


def _canary(g: NoiseGuarantee, width: int) -> tuple[torch.Tensor, float]:
    """The unit direction e [rows, width] of the canary pair and ‖Δ‖ (μ_target under the declared noise, at
    most 2C: both canaries within the clip)."""
    rows = DOC_ROWS if g.level == "document" else 1
    e = torch.zeros(rows, width, dtype=torch.float64)
    e[0, 0] = 1.0
    gap = min(MU_TARGET * g.sigma, 2.0 * g.clip * (1 - 1e-6)) if g.sigma > 0 else 2.0 * g.clip * (1 - 1e-6)
    return e, gap


def audit_mechanism(
    defence: Any, g: NoiseGuarantee, trials: int = TRIALS, seed: int = 0, alpha: float = 0.05, delta: float = DELTA
) -> MechanismAudit:
    """The game on one declared channel of ``defence`` (module docstring). Seeded: the auditor's key derives from
    ``seed``, and each release is its own document of that key."""
    e, gap = _canary(g, WIDTH)
    key = hashlib.sha256(f"splitleak dp-audit|{seed}|{g.defence}|{g.channel}".encode()).hexdigest()
    guesses = []
    for world in (0, 1):
        sign = 1.0 if world else -1.0
        x = (sign * gap / 2 * e).expand(trials, *e.shape).to(torch.float32).contiguous()
        ctx = WireContext(seed=seed, phase="audit", step=world, doc_ids=tuple(range(trials)), secret=key)
        out = defence.noise_release(g.channel, x, ctx).double()
        guesses.append((out * e).flatten(1).sum(1) > 0)  # nearer x₁: the projection on e is positive
    false_pos = int(guesses[0].sum())  # world 0 called 1
    false_neg = int((~guesses[1]).sum())  # world 1 called 0
    mu = gap / g.sigma if g.sigma > 0 else math.inf
    claimed = epsilon(mu, delta)[0] if math.isfinite(mu) else math.inf
    return MechanismAudit(
        g.defence, g.channel, trials, mu, claimed, epsilon_lower_bound(false_pos, false_neg, trials, alpha, delta),
        false_pos / trials, false_neg / trials, alpha, delta,
    )  # fmt: skip


def audit_chain(defences: list[Any], trials: int = TRIALS, seed: int = 0) -> list[MechanismAudit]:
    """Every declared noised channel of every defence of a chain, each played on its own."""
    return [audit_mechanism(d, g, trials, seed) for d in defences for g in getattr(d, "noise_guarantees", list)()]
