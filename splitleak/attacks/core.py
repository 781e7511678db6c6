"""The attacks of What Gradients Add §3.1, §4 and §5, with the scikit-learn shape.

Parameters go to ``__init__`` and nothing else happens there; ``fit(knowledge)`` learns from what
the observer holds; ``reconstruct(traffic)`` returns token ids per document (or, for property
inference, one score per document). Every random draw comes from ``numpy.random.default_rng`` /
``torch.Generator`` seeded with the attack seed.

The joint attacker's gradient read-out (What Gradients Add §3.1 step 3: "adds the tokens whose embeddings best
match this signal"). The returned gradient at position t−1 is the next-token loss's gradient, whose
target is token t; through the residual stream and tied embeddings, −gradient points towards the
embedding of token t, minus the model's expected embedding. Two read-outs turn it into candidates:

- ``gradient`` (default): the tokens whose input embeddings are most cosine-similar to −gradient.
  It needs nothing but the embedding matrix, and reads well when few blocks sit between the cut and
  the loss (SmolLM2 cut 6 blocks before the loss: next token within the top 16 at 90 % of
  positions), and poorly when many do (24 blocks: 4 %); experiments/PILOTS.md. It assumes tied
  input and output embeddings, as GPT-2, SmolLM2 and Qwen3-0.6B have; with untied ones −gradient
  points towards the output embedding, which the observer's copy of the client layers lacks.
- ``pseudo-map``: a ridge map fitted on the observed traffic itself, from the unit-normalised
  gradient at t−1 to the input embedding of token t as the activations decode it (ridge fit +
  cosine top-1, as VMI does); candidates are the tokens nearest the map's output by cosine. It
  learns the activations' answers where the traffic is small, so it is not gradient-only.

Neither uses labels, server layers or evaluation text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from splitleak.attacks.knowledge import Knowledge, Traffic
from splitleak.attacks.registry import REGISTRY, attack_info
from splitleak.attacks.ridge import RidgeMap, cosine_scores, cosine_topk
from splitleak.attacks.search import GradientGuidedOrder, beam_search, sipit
from splitleak.errors import ConfigError
from splitleak.progress import Progress


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


# ------------------------------------------------------------------ building blocks


class _RidgeAttack(Attack):
    """Fits the ridge map from activations to the input embedding of their token (What Gradients Add §3.1 step 1)."""

    def fit(self, knowledge: Knowledge) -> "_RidgeAttack":
        super().fit(knowledge)
        client = knowledge.client
        ids = knowledge.calibration_ids()
        x = client.activations(ids)
        y = client.embedding[ids.to(client.device)]
        self.ridge_ = RidgeMap.fit(x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1]))
        return self

    def embed_estimate(self, traffic: Traffic) -> torch.Tensor:
        act = traffic.activations.to(self.knowledge_.client.device, self.knowledge_.client.dtype)
        return self.ridge_(act)

    def activation_candidates(self, traffic: Traffic, k: int) -> torch.Tensor:
        return cosine_topk(self.embed_estimate(traffic), self.knowledge_.client.embedding, k).cpu()


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
            raise ConfigError(f"majority control: documents have {T} tokens but calibration documents only {len(self.tokens_)}")
        return Reconstruction(self.tokens_[:T].repeat(n, 1))


class GradientMap:
    """Ridge map from the unit-normalised gradient at t−1 to the embedding of the token at t,
    fitted on the observed traffic with activation-decoded pseudo-labels."""

    def __init__(self, ridge: RidgeMap):
        self.ridge = ridge

    @staticmethod
    def _features(grad: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.normalize(grad, dim=-1)

    @classmethod
    def fit(cls, gradients: torch.Tensor, pseudo: torch.Tensor, embedding: torch.Tensor) -> "GradientMap":
        x = cls._features(gradients[:, :-1].to(embedding.dtype))  # positions 0..T-2
        y = embedding[pseudo[:, 1:].to(embedding.device)]  # tokens 1..T-1
        keep = x.norm(dim=-1) > 0  # rows that were exactly zero carry nothing
        return cls(RidgeMap.fit(x[keep], y[keep].to(x.dtype)))

    def candidates(self, gradients: torch.Tensor, embedding: torch.Tensor, k: int) -> torch.Tensor:
        """Next-token candidates for positions 1..T-1 from the gradients at 0..T-2: [n, T-1, k]."""
        x = self._features(gradients[:, :-1].to(embedding.dtype))
        return cosine_topk(self.ridge(x), embedding, k).cpu()


READOUTS = ("gradient", "pseudo-map")
DEFAULT_READOUT = "gradient"


def gradient_readout(gradients: torch.Tensor, embedding: torch.Tensor, k: int) -> torch.Tensor:
    """Next-token candidates for positions 1..T-1: the k tokens whose input embeddings are most
    cosine-similar to −gradient at 0..T-2, best first: [n, T-1, k]."""
    return cosine_topk(-gradients[:, :-1].to(embedding.dtype), embedding, k).cpu()


def merge_candidates(act: torch.Tensor, grad: torch.Tensor, k: int) -> torch.Tensor:
    """What Gradients Add §3.1 step 3: the top k/2 activation candidates, then gradient candidates not among them,
    then further activation candidates where the halves overlapped; position 0 keeps all k from
    the activations. act: [n, T, >=k] ranked; grad: [n, T-1, >=k/2] ranked (for positions 1..)."""
    n, T, _ = act.shape
    half = k // 2
    out = act[:, :, :k].clone()
    a, g = act.tolist(), grad.tolist()
    for i in range(n):
        for t in range(1, T):
            chosen = a[i][t][:half]
            seen = set(chosen)
            for tok in g[i][t - 1][:half]:
                if tok not in seen:
                    chosen.append(tok)
                    seen.add(tok)
            for tok in a[i][t][half:]:
                if len(chosen) >= k:
                    break
                if tok not in seen:
                    chosen.append(tok)
                    seen.add(tok)
            out[i, t] = torch.tensor(chosen[:k])
    return out


def random_fill(act: torch.Tensor, k: int, vocab: int, seed: int) -> torch.Tensor:
    """Random-candidate control: the top k/2 activation candidates, the other half drawn uniformly
    without replacement from the rest of the vocabulary (position 0: all k from the activations)."""
    rng = np.random.default_rng([seed, 0xC0DE])
    n, T, _ = act.shape
    half = k // 2
    out = act[:, :, :k].clone()
    for i in range(n):
        for t in range(1, T):
            keep = act[i, t, :half]
            pool = np.setdiff1d(np.arange(vocab), keep.numpy(), assume_unique=False)
            draw = rng.choice(pool, size=k - half, replace=False)
            out[i, t, half:] = torch.from_numpy(draw)
    return out


def derangement(n: int, seed: int) -> np.ndarray:
    """A permutation with no fixed point (n >= 2): document i gets document p[i]'s gradient."""
    if n < 2:
        raise ConfigError("the shuffled-gradient control needs at least two documents")
    rng = np.random.default_rng([seed, 0x5AFF])
    order = rng.permutation(n)
    p = np.empty(n, dtype=np.int64)
    p[order] = np.roll(order, -1)
    return p


# ------------------------------------------------------------------ beam attackers


class ActivationBeam(_RidgeAttack):
    """Activation-only attacker: k ridge/cosine candidates per position, beam search of width 2."""

    name = "activation"

    def __init__(self, k: int = 32, width: int = 2, seed: int = 0, chunk_docs: int = 64):
        self.k = k
        self.width = width
        self.seed = seed
        self.chunk_docs = chunk_docs

    def params(self):
        return {"k": self.k, "width": self.width, "seed": self.seed}

    def candidates(self, traffic: Traffic) -> torch.Tensor:
        return self.activation_candidates(traffic, self.k)

    def reconstruct(self, traffic, progress=None):
        self._check(traffic)
        cand = self.candidates(traffic)
        res = beam_search(self.knowledge_.client, traffic.activations, cand, self.width, self.chunk_docs,
                          progress, name=f"{self.name} beam search (k={self.k})")
        coverage = (cand == res.tokens.unsqueeze(-1)).any(-1)
        return Reconstruction(res.tokens, {"candidates": cand, "distance": res.distance,
                                           "chosen_in_candidates": coverage})


GRADIENT_SOURCES = ("split", "output")
DEFAULT_GRADIENT_SOURCE = "split"


class _GradientReader:
    """Which gradient a gradient-reading attack reads (``gradient_source``):

    - ``split`` (default): the gradient returned at the observation point (channel ``gradient``);
      in a plain split it comes from the server's blocks after the cut, in a U-shape from the
      offloaded run and the client's top behind it.
    - ``output``: in a U-shape, the gradient the client returns for the trunk's output (channel
      ``output-gradient``), which sits next to the loss, as the server-side gradient of What Gradients Add's
      main split does (only the client's top blocks lie between it and the loss)."""

    gradient_source: str = DEFAULT_GRADIENT_SOURCE

    def observed_gradients(self, traffic: Traffic) -> torch.Tensor:
        if self.gradient_source == "split":
            if traffic.gradients is None:
                raise ConfigError(f"{self.name} needs the returned gradients, but the traffic holds activations only")
            return traffic.gradients
        if self.gradient_source == "output":
            if traffic.output_gradients is None:
                raise ConfigError(f"{self.name} with gradient_source=output reads the U-shape's output gradient, which "
                                  "this traffic does not carry (a plain split, or inference traffic); use split")
            return traffic.output_gradients
        raise ConfigError(f"{self.name}: unknown gradient_source {self.gradient_source!r}; known: "
                          f"{', '.join(GRADIENT_SOURCES)}")

    def gradient_channel(self) -> str:
        return "output-gradient" if self.gradient_source == "output" else "gradient"


class JointBeam(_GradientReader, ActivationBeam):
    """Joint attacker: half the candidates from the activations, half from the returned gradient
    through ``readout`` (``gradient`` or ``pseudo-map``; module docstring). It reads the gradient at
    the observation point, or with ``gradient_source=output`` the U-shape's output gradient."""

    name = "joint"
    uses_gradients = True

    def __init__(self, k: int = 32, width: int = 2, seed: int = 0, chunk_docs: int = 64,
                 readout: str = DEFAULT_READOUT, gradient_source: str = DEFAULT_GRADIENT_SOURCE):
        super().__init__(k=k, width=width, seed=seed, chunk_docs=chunk_docs)
        self.readout = readout
        self.gradient_source = gradient_source

    def params(self):
        p = {**super().params(), "readout": self.readout}
        if self.gradient_source != DEFAULT_GRADIENT_SOURCE:
            p["gradient_source"] = self.gradient_source
        return p

    def channels_read(self):
        return ("activations", self.gradient_channel())

    def gradient_map(self, traffic: Traffic) -> GradientMap:
        client = self.knowledge_.client
        pseudo = self.activation_candidates(traffic, 1)[..., 0]
        return GradientMap.fit(self.observed_gradients(traffic).to(client.device), pseudo, client.embedding)

    def gradient_candidates(self, traffic: Traffic, k: int) -> torch.Tensor:
        """Next-token candidates for positions 1..T-1 from the gradients at 0..T-2: [n, T-1, k]."""
        client = self.knowledge_.client
        grads = self.observed_gradients(traffic).to(client.device)
        if self.readout == "gradient":
            return gradient_readout(grads, client.embedding, k)
        if self.readout == "pseudo-map":
            self.gradient_map_ = self.gradient_map(traffic)
            return self.gradient_map_.candidates(grads, client.embedding, k)
        raise ConfigError(f"{self.name}: unknown gradient read-out {self.readout!r}; known: {', '.join(READOUTS)}")

    def candidates(self, traffic: Traffic) -> torch.Tensor:
        act = self.activation_candidates(traffic, self.k)
        return merge_candidates(act, self.gradient_candidates(traffic, self.k // 2), self.k)


class ShuffledGradient(JointBeam):
    """Control: the joint attacker given another document's gradient (a seeded derangement) — the
    same gradient it would read (``gradient_source``), taken from the wrong document."""

    name = "shuffled-gradient"

    def reconstruct(self, traffic, progress=None):
        self._check(traffic)
        p = derangement(len(traffic), self.seed)
        perm = torch.from_numpy(p)
        shuffled = traffic.replace(
            gradients=traffic.gradients[perm],
            output_gradients=None if traffic.output_gradients is None else traffic.output_gradients[perm])
        rec = super().reconstruct(shuffled, progress)
        rec.extra["gradient_from_row"] = p
        return rec


class RandomCandidate(ActivationBeam):
    """Control: the joint attacker's gradient half replaced by tokens drawn uniformly without
    replacement (it reads no gradient, so it takes no read-out)."""

    name = "random-candidate"

    def candidates(self, traffic):
        act = self.activation_candidates(traffic, self.k)
        return random_fill(act, self.k, self.knowledge_.client.vocab_size, self.seed)


class BackwardOnly(JointBeam):
    """Heuristic: the gradient at t−1 alone names token t (top-1 of the read-out); position 0 takes
    the calibration majority token. With the default ``gradient`` read-out it reads the gradient
    and the embeddings only. With ``pseudo-map`` the map is fitted on activation pseudo-labels, and
    with few documents its top-1 largely repeats them (experiments/PILOTS.md). It reads the gradient
    returned at the observation point, or with ``gradient_source=output`` the U-shape's output
    gradient (``_GradientReader``)."""

    name = "backward-only"

    def __init__(self, seed: int = 0, readout: str = DEFAULT_READOUT, gradient_source: str = DEFAULT_GRADIENT_SOURCE):
        super().__init__(seed=seed, readout=readout, gradient_source=gradient_source)

    def params(self):
        p = {"seed": self.seed, "readout": self.readout}
        if self.gradient_source != DEFAULT_GRADIENT_SOURCE:
            p["gradient_source"] = self.gradient_source
        return p

    def channels_read(self):
        return (self.gradient_channel(),) if self.readout == "gradient" else ("activations", self.gradient_channel())

    def fit(self, knowledge):
        super().fit(knowledge)
        self.majority_ = Majority().fit(knowledge)
        return self

    def reconstruct(self, traffic, progress=None):
        self._check(traffic)
        top = self.gradient_candidates(traffic, 1)[..., 0]
        first = self.majority_.reconstruct(traffic).tokens[:, :1]
        return Reconstruction(torch.cat([first, top], dim=1))


# ------------------------------------------------------------------ SipIt


class _RidgeOrder:
    """Candidate order for SipIt: tokens by cosine to the ridge estimate. The first ``depth`` ranks
    of every (document, position) are computed once; deeper ranks (exhaustive search) are sorted
    lazily for the documents that get there."""

    def __init__(self, estimate: torch.Tensor, embedding: torch.Tensor, depth: int):
        self.estimate = estimate
        self.embedding = embedding
        self.depth = min(depth, embedding.shape[0])
        self.top = cosine_topk(estimate, embedding, self.depth).cpu()  # [n, T, depth]
        self._full: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, rows: torch.Tensor, t: int, start: int, size: int, prefix=None) -> torch.Tensor:
        if start + size <= self.depth:
            return self.top[rows, t, start : start + size]
        out = []
        for row in rows.tolist():
            key = (row, t)
            if key not in self._full:
                sc = cosine_scores(self.estimate[row, t].unsqueeze(0), self.embedding)[0]
                self._full[key] = torch.sort(sc, descending=True, stable=True).indices.cpu()
            out.append(self._full[key][start : start + size])
        return torch.stack(out)


class SipIt(_RidgeAttack):
    """SipIt (Nikolaou et al. 2026), as What Gradients Add §2–3 describes it: per position, check candidates until
    one's recomputed activation matches the observed one within tolerance; a budget of checks per
    token returns the best checked candidate when it runs out; ``budget='exhaustive'`` checks the
    whole vocabulary if needed, so every match is certified.

    Order of checks (``order``): ``gradient`` (default) is SipIt's policy — start at the ridge
    estimate of the input embedding, check the nearest unchecked tokens by cosine, then take a
    normalised gradient step on the activation mismatch through the client layers and check the
    nearest unchecked tokens to the new estimate; ``ridge`` checks tokens in plain cosine order
    to the ridge estimate."""

    name = "sipit"

    def __init__(self, budget: int | str = 32, tol_rel: float = 1e-3, round_size: int = 16, seed: int = 0,
                 chunk_docs: int = 64, order: str = "gradient", step: float = 0.5):
        self.budget = budget
        self.order = order
        self.step = step
        self.tol_rel = tol_rel
        self.round_size = round_size
        self.seed = seed
        self.chunk_docs = chunk_docs

    def params(self):
        return {"budget": self.budget, "tol_rel": self.tol_rel, "round_size": self.round_size, "seed": self.seed,
                "order": self.order, "step": self.step}

    def reconstruct(self, traffic, progress=None):
        self._check(traffic)
        if self.budget != "exhaustive" and (not isinstance(self.budget, int) or self.budget < 1):
            raise ConfigError(f"SipIt budget must be a positive integer or 'exhaustive', got {self.budget!r}")
        client = self.knowledge_.client
        est = self.embed_estimate(traffic)
        budget = None if self.budget == "exhaustive" else int(self.budget)
        if self.order == "ridge":
            order = _RidgeOrder(est, client.embedding, 256 if budget is None else max(budget, self.round_size))
        elif self.order == "gradient":
            order = GradientGuidedOrder(client, traffic.activations, est, self.step)
        else:
            raise ConfigError(f"SipIt order must be 'gradient' or 'ridge', got {self.order!r}")
        obs = traffic.activations
        tol = self.tol_rel * obs.double().norm(dim=-1)
        res = sipit(client, obs, order, budget, tol, self.round_size, self.chunk_docs, progress,
                    name=f"SipIt (budget {self.budget})")
        return Reconstruction(res.tokens, {"matched": res.matched, "checks": res.checks, "distance": res.distance})


# ------------------------------------------------------------------ property inference


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

    def __init__(self, n_properties: int = 3, seed: int = 0):
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


class _Attacks(Mapping):
    """name -> class, a live view of the registry (attacks.registry is the one list of attacks):
    an attack registered at run time is here too."""

    def __getitem__(self, name: str) -> type[Attack]:
        return REGISTRY[name].load()

    def __iter__(self):
        return iter(list(REGISTRY))

    def __len__(self) -> int:
        return len(REGISTRY)


ATTACKS: Mapping[str, type[Attack]] = _Attacks()


def make_attack(name: str, **params) -> Attack:
    cls = ATTACKS.get(name)
    if cls is None:
        raise ConfigError(f"unknown attack {name!r}; known attacks: {', '.join(ATTACKS)}")
    import inspect

    allowed = set(inspect.signature(cls.__init__).parameters) - {"self"}
    given = {k: v for k, v in params.items() if v is not None}
    extra = set(given) - allowed
    if extra:
        raise ConfigError(f"attack {name!r} does not take {sorted(extra)}; it takes {sorted(allowed)}")
    return cls(**given)
