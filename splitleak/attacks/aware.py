"""The forward-wire attacks that know the plain split's defences: ``sipit-aware`` and ``activation-aware``
(SipIt and the activation attacker of What Gradients Add §2–3, made to know the defences of its §5).

Kerckhoffs: the attacker knows the chain's mechanism and public arguments (``Knowledge.defences``), not
what it draws fresh per release. So:

- every candidate's recomputed activation passes through the chain's public forward
  (``DefenceChain.public_forward``: rounding at the scale the frame itself reveals, the row clip) before
  it is compared with the observed row;
- the residual is scored under the chain's noise model. The L2 distance ranks a position's candidates by
  their Gaussian likelihood; the beam adds squared distances (the log-likelihood) where noise is added.
  Where the last transform rounds, a candidate is scored by the distance from its (emulated, unrounded) row
  to the observed row's rounding cell (the rows that round to it; zero when every level is equal), ties
  broken by the distance to the dequantised row, and SipIt stops where that is within the copy's relative
  error ``tol_rel`` (every level equal, up to float rounding); where the chain only clips, at the ordinary
  relative tolerance. Rounding is not injective: a coarse scale puts many tokens' rows in one cell (a row
  whose entries all round to zero), so a match counts as ``matched`` only where it was the one candidate
  of its round inside the cell (the others are counted as ambiguous); Where it
  adds noise of std σ nothing is certified: SipIt checks its whole budget and keeps the likeliest
  candidate, and reports whether it is consistent with the noise (||residual||² within the
  (1 − ``alpha``) quantile of σ²·χ²_d) as ``consistent``, not as ``matched`` (a wrong candidate closer
  to the truth than the noise passes that test);
- the ridge map that orders the candidates is fitted on the attacker's calibration activations sent
  through the chain's own forward with the attacker's own draws (``seed``), so that it maps defended rows
  (clipped directions, rounded values, noisy rows) to input embeddings. It replaces the ordinary (clean)
  ridge only where its leave-one-out error on those rows is below the clean map's error on them (in
  sample, so the clean map is favoured): mild rounding costs a small calibration set more than it
  shifts the rows. The gradient-guided order steps on the mismatch after the public forward (straight
  through the rounding).

With no defence acting on the client forward they are ``sipit`` and ``activation``, bit for bit.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import torch
from pydantic import Field, NonNegativeFloat, PositiveFloat, PositiveInt
from scipy.stats import chi2

from splitleak.attacks.base import SHARED_RANKS, Budget, _RidgeAttack
from splitleak.attacks.beam import ActivationBeam
from splitleak.attacks.knowledge import ClientCopy, Knowledge, Traffic
from splitleak.attacks.ridge import RidgeMap, cosine_topk
from splitleak.attacks.search import SearchResult
from splitleak.attacks.sipit import Order, SipIt
from splitleak.defences import DefenceChain
from splitleak.errors import ConfigError

#: the weight of the distance to the dequantised row that breaks ties between candidates inside the rounding
#: cell (ours; far below 1, so that it never outweighs being outside the cell)
TIE_BREAK = 1e-3


class PublicWire:
    """The attacker's model of a run's forward wire: the chain rebuilt from its public record, its draws
    keyed by the attacker's own seed (for simulating the defence on the attacker's own rows)."""

    def __init__(self, chain: DefenceChain, key: str):
        self.chain = chain
        self.key = key

    @classmethod
    def of(cls, knowledge: Knowledge, seed: int) -> "PublicWire | None":
        """The wire of ``knowledge``'s run, or None where no defence acts on the client forward. Refused
        (ConfigError) where the chain's forward cannot be emulated."""
        chain = DefenceChain(knowledge.chain(), seed=seed)
        if not chain.forward_defences():
            return None
        width = knowledge.client.embedding.shape[1]
        chain.public_forward(torch.zeros(1, 1, width), torch.zeros(1, 1, width))  # refuses what it cannot emulate
        return cls(chain, json.dumps(list(knowledge.defences), sort_keys=True) + f"|seed={seed}")

    def simulate(self, x: torch.Tensor, doc_ids) -> torch.Tensor:
        """The chain's forward on the attacker's own rows [n, T, d], with the attacker's draws."""
        return self.chain.forward(x, "attacker", 0, tuple(doc_ids))

    def bind(self, observed: torch.Tensor, client: ClientCopy, alpha: float, ridge: str) -> "BoundWire":
        return BoundWire(self.chain, observed, client, alpha, ridge)


class BoundWire:
    """A ``PublicWire`` bound to one traffic: the distances, tolerances and emulation the searches take
    (``search.sipit``, ``search.beam_search``, ``search.GradientGuidedOrder``)."""

    def __init__(self, chain: DefenceChain, observed: torch.Tensor, client: ClientCopy, alpha: float, ridge: str):
        self.chain = chain
        self.ridge = ridge
        self.obs = observed.to(client.device, client.dtype)
        self.std = chain.forward_noise_std()
        self.spacing = chain.forward_spacing(self.obs)
        self.alpha = alpha

    def _forward(self, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self.chain.public_forward(h, self.obs[rows.to(self.obs.device)])

    def distance(self, h: torch.Tensor, rows: torch.Tensor, t: int) -> torch.Tensor:
        """L2 distance of each emulated candidate h [a, c, d] to the observed row of its document: [a, c].
        Where the wire rounds: the distance of the unrounded emulated row to the observed row's rounding cell,
        plus ``TIE_BREAK`` times its distance to the observed row (module docstring)."""
        idx = rows.to(self.obs.device)
        obs = self.obs[idx, t].unsqueeze(1)
        if self.spacing is None:
            return (self._forward(h, rows) - obs).norm(dim=-1)
        for d in self.chain.forward_defences()[:-1]:  # everything before the rounding
            emulated = d.public_forward(h, self.obs[idx])
            assert emulated is not None  # PublicWire.of refused a chain it cannot emulate
            h = emulated
        off = h - obs
        half = 0.5 * self.spacing[idx].view(-1, 1, 1)
        return (off.abs() - half).clamp_min(0).norm(dim=-1) + TIE_BREAK * off.norm(dim=-1)

    def beam_distance(self, h: torch.Tensor, rows: torch.Tensor, t: int) -> torch.Tensor:
        """What the beam adds over positions: the squared distance (Gaussian log-likelihood) under noise."""
        d = self.distance(h, rows, t)
        return d.pow(2) if self.std > 0 else d

    def emulate(self, out: torch.Tensor, rows: torch.Tensor, t: int) -> torch.Tensor:
        """The public forward with a straight-through gradient (rounding has none of its own)."""
        return out + (self._forward(out, rows) - out).detach()

    def tolerance(self, tol_rel: float) -> torch.Tensor:
        """[n, T]: the residual norm SipIt stops at (a match; none under noise: module docstring)."""
        n, T, _ = self.obs.shape
        if self.std > 0:
            return torch.full((n, T), -1.0, dtype=torch.float64)
        rel = tol_rel * self.obs.double().norm(dim=-1).cpu()
        if self.spacing is not None:  # plus the tie-break's largest share inside the cell
            return rel + TIE_BREAK * (0.5 * self.spacing.double().cpu()).view(n, 1) * self.obs.shape[-1] ** 0.5
        return rel

    def readout(self, res: SearchResult) -> dict[str, Any]:
        """What SipIt's result means under the chain: ``matched`` (a match that tells the token: under
        rounding, the only candidate of its round inside the cell), ``consistent`` under noise (the
        likeliest candidate's residual within the noise test), and the summary."""
        out: dict[str, Any] = {"summary": self.summary()}
        if self.std > 0:
            limit = self.std * float(chi2.ppf(1 - self.alpha, self.obs.shape[-1])) ** 0.5
            out["consistent"] = res.distance.double() <= limit
            out["summary"]["consistent_share"] = float(out["consistent"].float().mean())
        if self.spacing is not None and res.within is not None and res.matched is not None:
            ambiguous = res.matched & (res.within > 1)
            out["matched"] = res.matched & ~ambiguous
            out["summary"]["in_cell_share"] = float(res.matched.float().mean())
            out["summary"]["ambiguous_share"] = float(ambiguous.float().mean())
        return out

    def summary(self) -> dict[str, Any]:
        match = "rounding cell" if self.spacing is not None else "chi-square" if self.std > 0 else "relative"
        return {
            "emulated": [d.name for d in self.chain.forward_defences()],
            "noise_std": self.std,
            "match": match,
            "ridge": self.ridge,
            **({"alpha": self.alpha} if self.std > 0 else {}),
        }


def fit_defended_ridge(knowledge: Knowledge, wire: PublicWire, clean: RidgeMap) -> tuple[RidgeMap, str]:
    """The ridge map for defended rows and which it is: fitted on the calibration documents' activations
    sent through the chain's forward with the attacker's own draws ("defended"), or ``clean`` where that
    does no worse on those rows (module docstring)."""
    client = knowledge.client
    ids = knowledge.calibration_ids()
    x = wire.simulate(client.activations(ids), [d.doc_id for d in knowledge.calibration])
    x = x.reshape(-1, x.shape[-1])
    y = client.embedding[ids.to(client.device)].reshape(-1, x.shape[-1])
    defended = RidgeMap.fit(x, y)
    clean_mse = float((clean(x) - y).double().pow(2).mean())
    return (defended, "defended") if defended.loo_mse < clean_mse else (clean, "clean")


def _check_alpha(name: str, alpha: Any) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
        raise ConfigError(
            f"{name}: alpha (the share of true tokens the noise test may reject) must be in (0, 1), got {alpha!r}"
        )


class _Aware(_RidgeAttack):
    """What the aware attackers share: the ridge fit on defended calibration rows, its own candidate memo,
    the wire bound to the traffic."""

    alpha: float = 1e-3

    def fit(self, knowledge: Knowledge) -> "_Aware":
        _check_alpha(self.name, self.alpha)
        self.wire_ = PublicWire.of(knowledge, self.seed)
        super().fit(knowledge)
        if self.wire_ is None:
            return self
        wire, clean = self.wire_, self.ridge_
        self.ridge_, self.ridge_kind_ = knowledge.memo(
            ("ridge", wire.key), lambda: fit_defended_ridge(knowledge, wire, clean)
        )
        return self

    def activation_candidates(self, traffic: Traffic, k: int) -> torch.Tensor:
        if self.wire_ is None:
            return super().activation_candidates(traffic, k)
        depth = max(k, SHARED_RANKS)
        kn = self.knowledge_
        ranked = kn.memo(
            ("candidates", depth, self.wire_.key),
            lambda: cosine_topk(self.embed_estimate(traffic), kn.client.embedding, depth).cpu(),
            traffic,
        )
        return ranked[..., :k]

    def public_wire(self, traffic: Traffic) -> BoundWire | None:
        if self.wire_ is None:
            return None
        return self.wire_.bind(traffic.activations, self.knowledge_.client, self.alpha, self.ridge_kind_)


class AwareSipIt(_Aware, SipIt):
    """SipIt that knows the defence chain (module docstring); ``alpha``: the level of the noise test."""

    name = "sipit-aware"

    def __init__(
        self,
        budget: Budget = 32,
        tol_rel: NonNegativeFloat = 1e-3,
        round_size: PositiveInt = 16,
        seed: int = 0,
        chunk_docs: PositiveInt | None = None,
        order: Order = "gradient",
        step: PositiveFloat = 0.5,
        growth: PositiveInt | None = None,
        margin: NonNegativeFloat | None = None,
        after_miss: PositiveInt | None = None,
        alpha: Annotated[float, Field(gt=0, lt=1)] = 1e-3,
    ):
        super().__init__(budget, tol_rel, round_size, seed, chunk_docs, order, step, growth, margin, after_miss)
        self.alpha = alpha

    def params(self):
        return {**super().params(), "alpha": self.alpha}


class AwareActivationBeam(_Aware, ActivationBeam):
    """The activation attacker that knows the defence chain (module docstring)."""

    name = "activation-aware"
