"""The composition of every crossing of one document.

Each crossing of a noised channel is a Gaussian mechanism: a neighbouring document moves the crossing's tensor
by at most the guarantee's sensitivity, and the noise has a public standard deviation. A composition of
Gaussian mechanisms is exactly μ-Gaussian differentially private with μ the root of the sum of the squared
per-crossing μ (Dong, Roth & Su 2022, "Gaussian Differential Privacy", Cor. 3.3), whose trade-off curve
f(α) = Φ(Φ⁻¹(1 − α) − μ) the reconstruction bound reads. ε at a δ is reported from dp-accounting's PLD
accountant (Google's maintained accountant, pessimistic to a stated discretisation) for the composed Gaussian
mechanism while μ ≤ ``PLD_MU_MAX``; above it the PLD's grid grows with μ (tens of seconds at μ = 20, and its
memory with it) for an ε above 30 that says only "no protection", so the exact closed form of μ-GDP gives it
(``epsilon`` says which). The tests check the two against each other, and the PLD's own composition of the
crossings one by one against the composed mechanism.
"""

from __future__ import annotations

import functools
import math
from typing import Iterable

from scipy import optimize, stats

#: the δ at which reports give ε (ours: the usual 1e-5; the bound itself reads the whole trade-off curve)
DELTA = 1e-5
#: the largest composed μ whose ε the PLD accountant computes (ours: about 2 s; ε is then 33 at δ = 1e-5)
PLD_MU_MAX = 5.0


def compose(mus: Iterable[float]) -> float:
    """μ of the composition of Gaussian mechanisms of parameters ``mus`` (exact)."""
    total = 0.0
    for m in mus:
        if math.isinf(m):
            return math.inf
        total += float(m) ** 2
    return math.sqrt(total)


def tradeoff(mu: float, alpha: float) -> float:
    """The least type-II error of any test at type-I error ``alpha`` between the two neighbours: Φ(Φ⁻¹(1−α) − μ)."""
    if math.isinf(mu):
        return 0.0
    return float(stats.norm.cdf(stats.norm.isf(alpha) - mu))  # isf(α) = Φ⁻¹(1 − α), exact at a tiny α


def gdp_delta(mu: float, epsilon: float) -> float:
    """δ(ε) of μ-GDP (Dong, Roth & Su 2022, Cor. 2.13)."""
    if mu == 0:
        return 0.0
    # e^ε Φ(b) in log space: at a large μ, ε is of order μ²/2 and e^ε alone overflows
    tail = math.exp(min(700.0, epsilon + float(stats.norm.logcdf(-epsilon / mu - mu / 2))))
    return float(stats.norm.cdf(-epsilon / mu + mu / 2) - tail)


def gdp_epsilon(mu: float, delta: float = DELTA) -> float:
    """The ε at which μ-GDP is (ε, δ)-DP, from the closed form (0 where μ is 0, inf where μ is)."""
    if mu == 0:
        return 0.0
    if math.isinf(mu):
        return math.inf
    if gdp_delta(mu, 0.0) <= delta:
        return 0.0
    hi = 1.0
    while gdp_delta(mu, hi) > delta:
        hi *= 2.0
    return float(optimize.brentq(lambda e: gdp_delta(mu, e) - delta, 0.0, hi, xtol=1e-10))


def pld_epsilon(noise_multipliers: Iterable[float], delta: float = DELTA) -> float:
    """ε at ``delta`` of the composition of Gaussian mechanisms with the given noise multipliers (noise standard
    deviation over sensitivity, 1/μ each), from dp-accounting's PLD accountant."""
    # lazy: dp-accounting is read only where a report gives an ε
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    zs = [float(z) for z in noise_multipliers]
    if not zs:
        return 0.0
    if any(z == 0 for z in zs):
        return math.inf
    events = [dp_event.GaussianDpEvent(z) for z in zs]
    acc = pld_privacy_accountant.PLDAccountant()
    acc.compose(dp_event.ComposedDpEvent(events))
    return float(acc.get_epsilon(delta))


@functools.lru_cache(maxsize=1024)
def epsilon(mu: float, delta: float = DELTA) -> tuple[float, str]:
    """(ε at ``delta``, the accountant that gave it) of the composed Gaussian mechanism of parameter ``mu``.
    Kept per (μ, δ): the documents of an audit that crossed alike share one μ, and a PLD takes about half a
    second."""
    if mu <= PLD_MU_MAX:
        return pld_epsilon([1.0 / mu] if mu > 0 else [], delta), "dp-accounting PLD"
    return gdp_epsilon(mu, delta), "closed form of Gaussian DP (μ above the PLD's range)"
