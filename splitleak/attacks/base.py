"""The shape every attack has (scikit-learn's): parameters in ``__init__`` and nothing else happens
there; ``fit(knowledge)`` learns from what the observer holds; ``reconstruct(traffic)`` returns token
ids per document (or, for property inference, one score per document). Every random draw comes from
``numpy.random.default_rng`` / ``torch.Generator`` seeded with the attack seed. What each attack is
(the channels it reads, its output, whether it is a control) lives in ``attacks.registry``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, Protocol, Union

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


class Judge(Protocol):
    """What the scorer (``splitleak.audit.evaluate``) offers a reconstruction for the extra outputs that are
    scored against the truth: the reconstruction names what it read, the judge, which alone holds the
    evaluation documents and the client's own records, says how much of it was right."""

    def in_candidates(self, candidates: torch.Tensor) -> float:
        """Share of positions whose true token is among ``candidates`` ([n, T, k])."""
        ...

    def stage_recovery(self, stage_tokens: dict[str, torch.Tensor]) -> dict[str, float]:
        """Token recovery of each stage's reading (-1: a position the stage did not read)."""
        ...

    def labels(self, labels: torch.Tensor) -> dict[str, Any]:
        """The scores of a label attack's reading of tokens 1 … T-1."""
        ...

    def probe_rows(self, probe_tokens: torch.Tensor, rows: list[int]) -> dict[str, Any]:
        """The scores of what was read of mixup's probe rows ``rows``."""
        ...


@dataclass
class Reconstruction:
    tokens: torch.Tensor | None  # [n, T] long, or None for attacks that infer properties
    extra: dict[str, Any] = field(default_factory=dict)

    def result_fields(self, judge: Judge) -> dict[str, Any]:
        """The fields of the attack's result that its extra outputs give, those read against the truth
        scored by ``judge``. The extras an attack may return: ``candidates`` with ``chosen_in_candidates``
        (a candidate search: how often the truth was among them), ``labels`` (a label attack), ``stage_tokens``
        (a chain's reading after each stage: BiSR, refit, mixup-history), ``summary`` (what the attack measured
        on the traffic alone), ``matched`` with ``checks`` (SipIt's exact-match certificate), ``lambda`` with
        ``lambda_estimated`` and ``probe_tokens`` with ``probed_rows`` (mixup-unmix); others stay unscored."""
        x, out = self.extra, dict[str, Any]()
        if "chosen_in_candidates" in x:
            out["true_token_in_candidates"] = judge.in_candidates(x["candidates"])
        if "labels" in x:
            out.update(judge.labels(x["labels"]))
        if "stage_tokens" in x:  # -1: a token the stage did not read (scored on the others)
            out["stage_token_recovery"] = judge.stage_recovery(x["stage_tokens"])
        if "summary" in x:
            out["attack_summary"] = x["summary"]
        if "matched" in x:
            out["certified_tokens"] = float(x["matched"].float().mean())
            out["mean_checks_per_token"] = float(x["checks"].float().mean())
        if "lambda" in x:
            out["lambda"] = x["lambda"]
            out["lambda_estimated"] = x["lambda_estimated"]
        if "probe_tokens" in x:
            out["probe_rows"] = judge.probe_rows(x["probe_tokens"], x["probed_rows"])
        return out


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
