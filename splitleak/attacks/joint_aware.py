"""``joint-aware`` (ours): the joint attacker that knows the defences of both wires.

The joint attacker (``beam.JointBeam``, What Gradients Add §3.1) gives half of the k candidate slots at every
position from the second on to the gradient read-out, whatever crossed. Kerckhoffs: the attacker knows the
chain's mechanism and public arguments (``Knowledge.defences``), not its draws. So:

- forward: as ``activation-aware`` (``attacks.aware``): candidates from the ridge map fitted on the
  attacker's own defended calibration rows, each candidate's recomputed activation passed through the
  chain's public forward and scored under its noise model;
- return wire, rounding (``DefenceChain.backward_rounds``): a gradient row whose levels all rounded to zero
  is the zero vector, whose cosine with every embedding is 0, so the joint attacker's read-out of it names
  arbitrary tokens (the first of the vocabulary) in the slots of the activation candidates ranked
  k/2..k−1. Where the row at t−1 is all zero levels, the candidates at t are the k activation candidates;
  elsewhere the joint attacker's (k/2 from each). With 4-bit rounding at the document's scale this is about
  a third of SmolLM2-135M's rows at depth 6 (experiments/PILOTS.md);
- return wire, Gaussian noise of a public scale (``clip-noise`` with where=backward or both,
  ``quant4-noisy``): nothing to model in one crossing. For the read-out's question (which token's
  direction u_v, of unknown positive scale a, does the row g point along), the likelihood of g = a·u_v +
  noise, maximised over a, is monotone in g·u_v/||u_v||: the cosine ranking the joint attacker already
  uses, whatever the noise's scale, and the per-row clip keeps the direction. What knowing the noise buys is
  combining a document's repeated crossings, which a one-crossing reader does not see.

With no defence on the return wire it is the joint attacker on the aware forward, and with no defence at all
the joint attacker, bit for bit (tests/test_joint_aware.py).
"""

from __future__ import annotations

from typing import Annotated, Any

import torch
from pydantic import Field, PositiveInt

from splitleak.attacks.aware import _Aware
from splitleak.attacks.base import Candidates
from splitleak.attacks.beam import (
    DEFAULT_GRADIENT_SOURCE,
    DEFAULT_READOUT,
    GradientSource,
    JointBeam,
    Readout,
    merge_candidates,
)
from splitleak.attacks.knowledge import Knowledge, Traffic
from splitleak.defences import DefenceChain


class ReturnWire:
    """The attacker's model of the returned gradient: which rows the chain's public backward left without a
    read-out (module docstring)."""

    def __init__(self, chain: DefenceChain):
        self.chain = chain

    @classmethod
    def of(cls, knowledge: Knowledge) -> "ReturnWire | None":
        """The return wire of ``knowledge``'s run, or None where no defence rounds it."""
        chain = DefenceChain(knowledge.chain(), seed=0)
        return cls(chain) if chain.backward_rounds() else None

    def drowned(self, gradients: torch.Tensor) -> torch.Tensor:
        """[n, T] bool: the rows whose every level rounded to zero."""
        return (gradients == 0).all(-1).cpu()

    def summary(self, drowned: torch.Tensor) -> dict[str, Any]:
        return {
            "return_wire": [d.name for d in self.chain.backward_defences()],
            "zero_rows": float(drowned[:, :-1].float().mean()) if drowned.shape[1] > 1 else 0.0,
        }


class AwareJointBeam(_Aware, JointBeam):
    """The joint attacker that knows the defence chain of both wires (module docstring); ``alpha``: the level of
    the forward noise test (as ``activation-aware``)."""

    name = "joint-aware"
    uses_gradients = True

    def __init__(
        self,
        k: Candidates = 32,
        width: PositiveInt = 2,
        seed: int = 0,
        chunk_docs: PositiveInt = 64,
        readout: Readout = DEFAULT_READOUT,
        gradient_source: GradientSource = DEFAULT_GRADIENT_SOURCE,
        alpha: Annotated[float, Field(gt=0, lt=1)] = 1e-3,
    ):
        super().__init__(
            k=k, width=width, seed=seed, chunk_docs=chunk_docs, readout=readout, gradient_source=gradient_source
        )
        self.alpha = alpha

    def params(self):
        return {**super().params(), "alpha": self.alpha}

    def fit(self, knowledge: Knowledge) -> "AwareJointBeam":
        super().fit(knowledge)
        # the chain's return-wire transforms act on the gradient returned at the observation point only
        self.return_wire_ = ReturnWire.of(knowledge) if self.gradient_source == "split" else None
        return self

    def candidates(self, traffic: Traffic) -> torch.Tensor:
        act = self.activation_candidates(traffic, self.k)
        cand = merge_candidates(act, self.gradient_candidates(traffic, self.k // 2), self.k)
        self.drowned_ = None
        if self.return_wire_ is not None:
            drowned = self.return_wire_.drowned(self.observed_gradients(traffic))
            at = torch.zeros_like(drowned)
            at[:, 1:] = drowned[:, :-1]  # the row at t−1 names the token at t
            cand[at] = act[at]
            self.drowned_ = drowned
        return cand

    def reconstruct(self, traffic, progress=None):
        rec = super().reconstruct(traffic, progress)
        if self.drowned_ is not None:
            rec.extra["summary"] = {**rec.extra.get("summary", {}), **self.return_wire_.summary(self.drowned_)}
        return rec
