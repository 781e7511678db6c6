"""The shape every attack has (scikit-learn's): parameters in ``__init__`` and nothing else happens
there; ``fit(knowledge)`` learns from what the observer holds; ``reconstruct(traffic)`` returns token
ids per document (or, for property inference, one score per document). Every random draw comes from
``numpy.random.default_rng`` / ``torch.Generator`` seeded with the attack seed. What each attack is
(the channels it reads, its output, whether it is a control) lives in ``attacks.registry``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, Union

import torch
from pydantic import Field, PositiveInt

from splitleak.attacks.knowledge import Knowledge, Traffic
from splitleak.attacks.registry import attack_info
from splitleak.attacks.ridge import RidgeMap, cosine_topk
from splitleak.errors import ConfigError
from splitleak.progress import Progress

#: ranges attack parameters declare in their ``__init__`` signatures (besides pydantic's ``PositiveInt``,
#: ``NonNegativeFloat`` and the like); ``attacks.config.params_model`` reads each signature into a typed schema,
#: checked when a configuration is built, so that a grid refuses a bad value before its first job
Candidates = Annotated[int, Field(ge=2)]  # candidates per position (k)
Budget = Union[PositiveInt, Literal["exhaustive"]]  # checks per position, or the whole vocabulary
Share = Annotated[float, Field(gt=0, le=1)]  # a share or a mixing weight in (0, 1]


@dataclass
class Reconstruction:
    tokens: torch.Tensor | None  # [n, T] long, or None for attacks that infer properties
    extra: dict[str, Any] = field(default_factory=dict)


class Attack:
    name: ClassVar[str] = ""
    uses_gradients: ClassVar[bool] = False

    def channels_read(self) -> tuple[str, ...]:
        """The channels (``splitleak.wire.declare``) this configured attack reads; by default all
        that its registry entry (``attacks.registry``) says it can read."""
        return attack_info(self.name).reads

    def __init__(self, seed: int = 0):
        self.seed = seed

    def params(self) -> dict[str, Any]:
        return {"seed": self.seed}

    def fit(self, knowledge: Knowledge) -> "Attack":
        self.knowledge_ = knowledge
        return self

    def reconstruct(self, traffic: Traffic, progress: Progress | None = None) -> Reconstruction:
        raise NotImplementedError

    def _check(self, traffic: Traffic) -> None:
        if not hasattr(self, "knowledge_"):
            raise ConfigError(f"{self.name}: call fit(knowledge) before reconstruct(traffic)")
        if self.uses_gradients and traffic.gradients is None:
            raise ConfigError(f"{self.name} needs the returned gradients, but the traffic holds activations only")
        d = self.knowledge_.client.embedding.shape[1]
        if traffic.activations.shape[-1] != d:
            raise ConfigError(
                f"the captured activations have width {traffic.activations.shape[-1]} but the client-layer copy "
                f"has width {d}; the run and the model do not match"
            )


class _RidgeAttack(Attack):
    """Fits the ridge map from activations to the input embedding of their token (What Gradients Add §3.1 step 1)."""

    def fit(self, knowledge: Knowledge) -> "_RidgeAttack":
        super().fit(knowledge)
        self.ridge_ = knowledge.memo("ridge", lambda: fit_ridge(knowledge))
        return self

    def embed_estimate(self, traffic: Traffic) -> torch.Tensor:
        act = traffic.activations.to(self.knowledge_.client.device, self.knowledge_.client.dtype)
        return self.ridge_(act)

    def public_wire(self, traffic: Traffic) -> Any:
        """How the searches compare recomputed activations with this traffic (``attacks.aware``: through the
        defence chain's public forward, under its noise model); None: as they are (undefended)."""
        return None

    def activation_candidates(self, traffic: Traffic, k: int) -> torch.Tensor:
        """The k tokens nearest the ridge estimate by cosine, per position, best first: [n, T, k]. The
        ranked list is computed once per knowledge and traffic, to at least ``SHARED_RANKS`` ranks, and
        shared by the attacks of a suite (VMI reads rank 1, the beam attackers 32)."""
        depth = max(k, SHARED_RANKS)
        kn = self.knowledge_
        ranked = kn.memo(
            ("candidates", depth),
            lambda: cosine_topk(self.embed_estimate(traffic), kn.client.embedding, depth).cpu(),
            traffic,
        )
        return ranked[..., :k]


#: ranks of the shared activation candidate list (``_RidgeAttack.activation_candidates``)
SHARED_RANKS = 32


def fit_ridge(knowledge: Knowledge) -> RidgeMap:
    """The ridge map from the client copy's activations of the calibration documents to their input
    embeddings (What Gradients Add §3.1 step 1)."""
    client = knowledge.client
    ids = knowledge.calibration_ids()
    x = client.activations(ids)
    y = client.embedding[ids.to(client.device)]
    return RidgeMap.fit(x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1]))
