"""Vanilla model inversion (What Gradients Add §3.1 step 1) and the majority control."""

from __future__ import annotations

import numpy as np
import torch

from splitleak.attacks.base import Attack, Reconstruction, _RidgeAttack
from splitleak.errors import ConfigError


class VMI(_RidgeAttack):
    """Vanilla model inversion with the ridge fit: each activation -> nearest token by cosine."""

    name = "vmi"

    def reconstruct(self, traffic, progress=None):
        self._check(traffic)
        return Reconstruction(self.activation_candidates(traffic, 1)[..., 0])


class Majority(Attack):
    """Control: the calibration documents' most frequent token at each position (ties: lower id)."""

    name = "majority"

    def fit(self, knowledge):
        super().fit(knowledge)
        ids = knowledge.calibration_ids().numpy()
        self.tokens_ = torch.tensor(
            [int(np.bincount(ids[:, t]).argmax()) for t in range(ids.shape[1])], dtype=torch.long
        )
        return self

    def reconstruct(self, traffic, progress=None):
        self._check(traffic)
        n, T = traffic.activations.shape[:2]
        if T > len(self.tokens_):
            raise ConfigError(
                f"majority control: documents have {T} tokens but calibration documents only {len(self.tokens_)}"
            )
        return Reconstruction(self.tokens_[:T].repeat(n, 1))
