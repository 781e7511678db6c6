"""The informed adversary's reconstruction bound, per token and per document, over every recorded crossing.

The adversary knows every token of the document but the target, the mechanism and its public arguments, and
sees every crossing of the document's rows the tap recorded (each training step it was in, the capture pass,
both directions). Its success at guessing the target is at most 1 − f(κ) (Hayes, Mahloujifar & Balle 2023,
"Bounding Data Reconstruction Attacks with the Hypothesis Testing Interpretation of Differential Privacy"),
with f the trade-off curve of the composed crossings and κ the prior success: the public model's top-1
probability at the target given the true prefix (a token), or of its best guess of the whole document.

Neighbouring relation (replace-one, stated in every report): one token replaced changes its own row and,
through causal attention, every later row of the document's activations (T − t rows for position t), and any
row of a returned gradient (T rows, the conservative count); each row lies within its clip C, so two
neighbouring rows are at most 2C apart. A document clipped as a whole (``level="document"``) moves by 2C. The
whole document's neighbour changes every row.

A channel of the document that crosses without a guarantee leaves no bound (the report says which); the
frames' metadata (row ids, shapes) depend on the lengths alone and are not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
from scipy import stats

from splitleak.privacy.accounting import DELTA, compose, epsilon
from splitleak.privacy.guarantee import ChainGuarantee

#: the channels whose content depends on the document's tokens (the frame metadata does not)
CONTENT_CHANNELS = (
    "activations",
    "probe-activations",
    "gradient",
    "probe-gradient",
    "trunk-output",
    "output-gradient",
    "labels",
)
#: the channels whose rows a replaced token changes from its own position on (the rest: every row)
CAUSAL_CHANNELS = ("activations", "trunk-output")


def reconstruction_bound(mu: float, kappa: float) -> float:
    """The most any reader's success can be, for a composition of parameter ``mu`` and prior success ``kappa``."""
    if math.isinf(mu):
        return 1.0
    # 1 − f(κ) = 1 − Φ(Φ⁻¹(1 − κ) − μ), in the survival function: exact where κ is tiny (a whole document's prior)
    return max(float(kappa), float(stats.norm.sf(stats.norm.isf(float(kappa)) - mu)))


def count_crossings(run_dir: str | Path, phases: Sequence[str] | None = None) -> dict[int, dict[str, int]]:
    """Document id -> content channel -> how many times its rows crossed, from the run's recorded wire (every
    phase the tap recorded, or ``phases``); for a resumed run with the runs it continues, counting too the
    steps sent before a kill and again after the resume (each crossed)."""
    # lazy: reading the wire imports torch and safetensors
    from splitleak.runs.chain import read_wire_whole
    from splitleak.runs.wire import wire_phases

    out: dict[int, dict[str, int]] = {}
    for phase in phases or wire_phases(run_dir):
        for rec in read_wire_whole(run_dir, phase, redone=True):
            channels = [c for c in rec.header["channels"] if c in CONTENT_CHANNELS]
            for doc in rec.frame.doc_ids:
                per = out.setdefault(int(doc), {})
                for c in channels:
                    per[c] = per.get(c, 0) + 1
    return out


@dataclass
class DocumentBound:
    """The bound on one document: per token and whole, with what it composed."""

    doc_id: int
    crossings: dict[str, int]
    token_bounds: list[float] = field(default_factory=list)  # per position
    token_kappas: list[float] = field(default_factory=list)
    doc_bound: float | None = None
    doc_kappa: float | None = None
    mu_doc: float | None = None
    epsilon_doc: float | None = None
    delta: float = DELTA
    accountant: str = ""  # what gave epsilon_doc
    why_none: str = ""  # where no bound holds

    @property
    def token_bound(self) -> float | None:
        """The bound on the share of the document's tokens any reader recovers (the mean over positions)."""
        return float(np.mean(self.token_bounds)) if self.token_bounds else None


def _mus(guarantees: ChainGuarantee, crossings: dict[str, int], rows: int) -> list[float]:
    """The per-crossing μ of every noised crossing, for a neighbour that changes ``rows`` rows of causal channels
    (and every row, ``T``, of the others; ``rows`` is then the document's length)."""
    out = []
    for channel, n in crossings.items():
        for g in guarantees.of(channel):
            out.extend([g.mu(rows)] * n)
    return out


def bare_words(channels: list[str]) -> str:
    """Why there is no bound: the channels that cross without noise, in a sentence."""
    named = channels[0] if len(channels) == 1 else f"{', '.join(channels[:-1])} and {channels[-1]}"
    return f"the {named} {'crosses' if len(channels) == 1 else 'cross'} without a noise guarantee"


def document_bound(
    doc_id: int,
    crossings: dict[str, int],
    guarantees: ChainGuarantee,
    length: int,
    token_kappas: Sequence[float],
    doc_kappa: float,
    exclude: Iterable[str] = (),
    with_epsilon: bool = True,
) -> DocumentBound:
    """The bound on one document of ``length`` tokens, from its recorded ``crossings`` (per content channel) under
    the chain's ``guarantees``; ``exclude``: channels outside the adversary's view (the labels, for an observer
    of the activations and gradients); ``token_kappas``: the prior success at each position."""
    seen = {c: n for c, n in crossings.items() if n and c not in set(exclude)}
    b = DocumentBound(doc_id, dict(crossings))
    bare = sorted(c for c in seen if not guarantees.of(c))
    if bare:
        b.why_none = bare_words(bare)
        return b
    if len(token_kappas) != length:
        raise ValueError(f"{len(token_kappas)} prior successes for a document of {length} tokens")
    for t, kappa in enumerate(token_kappas):
        per: list[float] = []
        for channel, n in seen.items():
            rows = length - t if channel in CAUSAL_CHANNELS else length
            per.extend(g.mu(rows) for g in guarantees.of(channel) for _ in range(n))
        b.token_bounds.append(reconstruction_bound(compose(per), kappa))
    b.token_kappas = [float(k) for k in token_kappas]
    doc_mus = _mus(guarantees, seen, length)
    b.mu_doc = compose(doc_mus)
    b.doc_kappa = float(doc_kappa)
    b.doc_bound = reconstruction_bound(b.mu_doc, doc_kappa)
    if with_epsilon:
        b.epsilon_doc, b.accountant = epsilon(b.mu_doc, DELTA)
    return b


def run_epsilon(
    crossed: dict[int, dict[str, int]], guarantees: ChainGuarantee, length: int, exclude: Iterable[str] = ()
) -> tuple[float | None, str]:
    """The largest ε per document at ``DELTA`` over a run's recorded crossings (``count_crossings``) under the
    chain's guarantees, without the token bound (which needs the public model's κ), and what gave it; None
    with the reason where a document's channel crosses without noise, or none crossed."""
    worst, how = None, ""
    for per in crossed.values():
        seen = {c: n for c, n in per.items() if n and c not in set(exclude)}
        bare = sorted(c for c in seen if not guarantees.of(c))
        if bare:
            return None, bare_words(bare)
        eps, how = epsilon(compose(_mus(guarantees, seen, length)), DELTA)
        worst = eps if worst is None else max(worst, eps)
    return worst, how if worst is not None else "no document crossed"


def summarise(bounds: Sequence[DocumentBound]) -> dict[str, Any]:
    """The mean token bound and the whole-document bound over documents, with the κ and ε they rest on."""
    held = [b for b in bounds if not b.why_none]
    if not held:
        why = sorted({b.why_none for b in bounds})
        return {"bounded": False, "why": "; ".join(why) or "no document crossed", "documents": len(bounds)}
    tok = [b.token_bound for b in held if b.token_bound is not None]
    return {
        "bounded": len(held) == len(bounds),
        "documents": len(bounds),
        "documents_bounded": len(held),
        "token_bound": float(np.mean(tok)) if tok else None,
        "doc_bound": float(np.mean([b.doc_bound for b in held if b.doc_bound is not None])),
        "token_kappa": float(np.mean([np.mean(b.token_kappas) for b in held if b.token_kappas])),
        "doc_kappa": float(np.mean([b.doc_kappa for b in held if b.doc_kappa is not None])),
        "epsilon_doc_max": max((b.epsilon_doc for b in held if b.epsilon_doc is not None), default=None),
        "accountant": sorted({b.accountant for b in held if b.accountant}),
        "delta": DELTA,
        "crossings_max": max(sum(b.crossings.values()) for b in held),
        "why": "; ".join(sorted({b.why_none for b in bounds if b.why_none})),
    }
