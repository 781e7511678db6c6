"""The beam-search attackers of What Gradients Add §3.1: activation-only, the joint attacker that adds
candidates from the returned gradient, its controls (shuffled gradient, random candidates) and the
backward-only heuristic.

The joint attacker's gradient read-out (What Gradients Add §3.1 step 3: "adds the tokens whose embeddings best
match this signal"). The returned gradient at position t−1 is the next-token loss's gradient, whose
target is token t; through the residual stream and tied embeddings, −gradient points towards the
embedding of token t, minus the model's expected embedding. Two read-outs turn it into candidates:

- ``gradient`` (default): the tokens whose input embeddings are most cosine-similar to −gradient.
  It needs nothing but the embedding matrix, and reads well when few blocks sit between the cut and
  the loss, and poorly when many do (measured on SmolLM2 in experiments/PILOTS.md). It assumes tied
  input and output embeddings, as GPT-2, SmolLM2 and Qwen3-0.6B have; with untied ones −gradient
  points towards the output embedding, which the observer's copy of the client layers lacks.
- ``pseudo-map``: a ridge map fitted on the observed traffic itself, from the unit-normalised
  gradient at t−1 to the input embedding of token t as the activations decode it (ridge fit +
  cosine top-1, as VMI does); candidates are the tokens nearest the map's output by cosine. It
  learns the activations' answers where the traffic is small, so it is not gradient-only.

Neither uses labels, server layers or evaluation text.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, get_args

import numpy as np
import torch
from pydantic import PositiveInt

from splitleak.attacks.base import Candidates, Reconstruction, _RidgeAttack
from splitleak.attacks.knowledge import Traffic
from splitleak.attacks.ridge import RidgeMap, cosine_topk
from splitleak.attacks.search import beam_search
from splitleak.attacks.vmi import Majority
from splitleak.errors import ConfigError


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


Readout = Literal["gradient", "pseudo-map"]
READOUTS: tuple[str, ...] = get_args(Readout)
DEFAULT_READOUT: Readout = "gradient"


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


class ActivationBeam(_RidgeAttack):
    """Activation-only attacker: k ridge/cosine candidates per position, beam search of width 2."""

    name = "activation"

    def __init__(self, k: Candidates = 32, width: PositiveInt = 2, seed: int = 0, chunk_docs: PositiveInt = 64):
        if isinstance(k, int) and isinstance(width, int) and width > k:
            raise ConfigError(
                f"attack {self.name!r}: width={width} is not allowed with k={k}: the beam keeps at most the k "
                "candidates of each position, so width should be at most k"
            )
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
        wire = self.public_wire(traffic)
        res = self.run_beam(traffic, cand, wire, progress)
        coverage = (cand == res.tokens.unsqueeze(-1)).any(-1)
        extra = {"candidates": cand, "distance": res.distance, "chosen_in_candidates": coverage}
        if wire is not None:
            extra["summary"] = wire.summary()
        return Reconstruction(res.tokens, extra)

    def run_beam(self, traffic: Traffic, cand: torch.Tensor, wire: Any, progress: Any) -> Any:
        """The beam search of the traffic's activations over ``cand``. Without a public wire it is a function of the
        activations and candidates alone, so a twin that holds the same rows in the same order reads the arm's
        (``Knowledge.memo_content``); under a public wire the search's distance is the chain's, searched each
        time."""

        def run():
            return beam_search(
                self.knowledge_.client,
                traffic.activations,
                cand,
                self.width,
                self.chunk_docs,
                progress,
                name=f"{self.name} beam search (k={self.k})",
                distance=None if wire is None else wire.beam_distance,
            )

        if wire is not None:
            return run()
        return self.knowledge_.memo_content(
            ("beam search", self.width, self.chunk_docs), (traffic.activations, cand), run
        )


GradientSource = Literal["split", "output"]
GRADIENT_SOURCES: tuple[str, ...] = get_args(GradientSource)
DEFAULT_GRADIENT_SOURCE: GradientSource = "split"


class _GradientReader:
    """Which gradient a gradient-reading attack reads (``gradient_source``):

    - ``split`` (default): the gradient returned at the observation point (channel ``gradient``);
      in a plain split it comes from the server's blocks after the cut, in a U-shape from the
      offloaded run and the client's top behind it.
    - ``output``: in a U-shape, the gradient the client returns for the trunk's output (channel
      ``output-gradient``), which sits next to the loss, as the server-side gradient of What Gradients Add's
      main split does (only the client's top blocks lie between it and the loss)."""

    name: ClassVar[str]  # declared only: the attack this is mixed into names itself (Attack.name)
    gradient_source: str = DEFAULT_GRADIENT_SOURCE

    def observed_gradients(self, traffic: Traffic) -> torch.Tensor:
        if self.gradient_source == "split":
            if traffic.gradients is None:
                raise ConfigError(f"{self.name} needs the returned gradients, but the traffic holds activations only")
            return traffic.gradients
        if self.gradient_source == "output":
            if traffic.output_gradients is None:
                raise ConfigError(
                    f"{self.name} with gradient_source=output reads the U-shape's output gradient, which "
                    "this traffic does not carry (a plain split, or inference traffic); use split"
                )
            return traffic.output_gradients
        raise ConfigError(
            f"{self.name}: unknown gradient_source {self.gradient_source!r}; known: {', '.join(GRADIENT_SOURCES)}"
        )

    def gradient_channel(self) -> str:
        return "output-gradient" if self.gradient_source == "output" else "gradient"


class JointBeam(_GradientReader, ActivationBeam):
    """Joint attacker: half the candidates from the activations, half from the returned gradient
    through ``readout`` (``gradient`` or ``pseudo-map``; module docstring). It reads the gradient at
    the observation point, or with ``gradient_source=output`` the U-shape's output gradient."""

    name = "joint"
    uses_gradients = True

    def __init__(
        self,
        k: Candidates = 32,
        width: PositiveInt = 2,
        seed: int = 0,
        chunk_docs: PositiveInt = 64,
        readout: Readout = DEFAULT_READOUT,
        gradient_source: GradientSource = DEFAULT_GRADIENT_SOURCE,
    ):
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
            output_gradients=None if traffic.output_gradients is None else traffic.output_gradients[perm],
        )
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

    def __init__(
        self,
        seed: int = 0,
        readout: Readout = DEFAULT_READOUT,
        gradient_source: GradientSource = DEFAULT_GRADIENT_SOURCE,
    ):
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
