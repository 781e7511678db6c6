"""Statistics for reporting leakage: crossed (models x documents) and hierarchical
(seeds x frames) bootstrap intervals, Wilson score bounds and the gate statistic G
(Politis & Pappas (2026) Eq. 1), Bonferroni splits, DerSimonian-Laird random effects, and the partial
R^2 permutation test of What Gradients Add §5.

Every random function takes ``seed`` (an int or a ``numpy.random.Generator``) and never
touches global random state; bad input raises ``ConfigError`` or ``DataError``."""

from __future__ import annotations

from splitleak.metrics import roc_auc
from splitleak.stats.binomial import (
    GateResult,
    bonferroni_alpha,
    effect_verdict,
    gate_statistic,
    gate_verdict,
    passes_lower_bound,
    wilson_interval,
    wilson_upper,
)
from splitleak.stats.bootstrap import (
    Interval,
    crossed_bootstrap_ci,
    crossed_replicates,
    frame_weights,
    hierarchical_bootstrap_ci,
    hierarchical_replicates,
    paired_difference_ci,
    ratio_bootstrap_ci,
)
from splitleak.stats.meta import RandomEffects, leave_one_out, random_effects
from splitleak.stats.regression import HeldoutRMSE, PartialR2, heldout_rmse, partial_r2_test, permute_within_groups

__all__ = [
    "Interval",
    "GateResult",
    "RandomEffects",
    "PartialR2",
    "crossed_bootstrap_ci",
    "crossed_replicates",
    "paired_difference_ci",
    "ratio_bootstrap_ci",
    "frame_weights",
    "hierarchical_bootstrap_ci",
    "hierarchical_replicates",
    "bonferroni_alpha",
    "passes_lower_bound",
    "wilson_interval",
    "wilson_upper",
    "gate_statistic",
    "effect_verdict",
    "gate_verdict",
    "random_effects",
    "leave_one_out",
    "partial_r2_test",
    "heldout_rmse",
    "HeldoutRMSE",
    "permute_within_groups",
    "roc_auc",
]
