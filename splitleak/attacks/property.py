"""Property inference from the returned gradient (What Gradients Add §5)."""

from __future__ import annotations

import numpy as np
from pydantic import PositiveInt

from splitleak.attacks.base import Attack, Reconstruction


def choose_property_tokens(calibration_ids: np.ndarray, n: int = 3) -> list[int]:
    """What Gradients Add §5: the n token ids whose share of calibration documents containing them is closest to
    one half, ties broken by lower id."""
    present: dict[int, int] = {}
    for row in calibration_ids:
        for tok in set(int(x) for x in row):
            present[tok] = present.get(tok, 0) + 1
    m = len(calibration_ids)
    ranked = sorted(present, key=lambda tok: (abs(present[tok] / m - 0.5), tok))
    return ranked[:n]


class PropertyInference(Attack):
    """What Gradients Add §5: per document, the sum over positions of the norm of the gradient returned at the
    observation point (channel ``gradient``) is one score, used to guess the presence of each of
    three property tokens (scored by ROC AUC)."""

    name = "property"
    uses_gradients = True

    def __init__(self, n_properties: PositiveInt = 3, seed: int = 0):
        self.n_properties = n_properties
        self.seed = seed

    def params(self):
        return {"n_properties": self.n_properties, "seed": self.seed}

    def fit(self, knowledge):
        super().fit(knowledge)
        self.property_tokens_ = choose_property_tokens(knowledge.calibration_ids().numpy(), self.n_properties)
        return self

    def reconstruct(self, traffic, progress=None):
        self._check(traffic)
        score = traffic.gradients.double().norm(dim=-1).sum(dim=-1)
        return Reconstruction(None, {"scores": score.numpy(), "property_tokens": self.property_tokens_})
