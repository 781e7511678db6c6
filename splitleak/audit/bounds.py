"""The audit's upper side: what no reader of the recorded traffic can read (``splitleak.privacy``), beside what
its strongest reader read.

Every crossing of each evaluation document the tap recorded is composed (``privacy.bound.count_crossings``),
under the chain's noise guarantees, the informed adversary and replace-one neighbours; κ from the public model
(``privacy.prior``), and each noised channel's mechanism is played against its declaration (``audit.dp_audit``:
an empirical lower bound on ε that must not exceed the claim). No bound holds where a channel of the document crosses without noise, where the noise is
keyed by the run seed (``--draws derived``: a reader that finds the seed removes it), or, against the server
of a plain split, where the labels cross in clear: the bound is then stated for an observer of the activations
and gradients (What Gradients Add's view), and the server's reading of the labels is said beside it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from splitleak.audit.dp_audit import audit_chain
from splitleak.defences import build_defence
from splitleak.privacy.bound import count_crossings, document_bound, summarise
from splitleak.privacy.guarantee import chain_guarantees
from splitleak.privacy.prior import document_priors, token_priors

#: the neighbouring relation every bound states
RELATION = (
    "replace-one: one token replaced changes its own activation row and every later one (causal attention) and "
    "any returned-gradient row, each within its clip C (2C apart); the informed adversary knows every other token"
)


def audit_bound(
    traffic_folder: str | Path,
    defences: Sequence[Any],
    mode: str,
    draws: str,
    doc_ids: Sequence[int],
    truth: Any,
    model: torch.nn.Module,
    mechanism: bool = True,
) -> dict[str, Any]:
    """The bound on the evaluation documents ``doc_ids`` (their token ids ``truth`` [n, T]) under the chain
    ``defences`` (a run config's ``DefenceConfig``s, or mappings with name and args), from the crossings
    recorded in ``traffic_folder``."""
    named = [(d["name"], d.get("args")) if isinstance(d, dict) else (d.name, d.args) for d in defences]
    chain = [build_defence(name, dict(args or {})) for name, args in named if name != "none"]
    guarantees = chain_guarantees(chain)
    out: dict[str, Any] = {"relation": RELATION, "notes": list(guarantees.notes)}
    exclude = ["labels"] if mode == "plain" else []
    out["view"] = (
        "an observer of the activations and gradients (the server that computes the loss reads the labels, "
        "the text itself, in clear)"
        if mode == "plain"
        else "the server: every channel it receives"
    )
    if not guarantees.by_channel:
        out.update(bounded=False, why="no defence of the chain adds noise with a formal guarantee")
        return out
    # check (2): the defence's own mechanism played against its declaration (the auditor's key, not the run's;
    # it reads no document, so an audit that bounds two sets of documents plays it once: ``mechanism``)
    if mechanism:
        out["mechanism_audit"] = [a.as_dict() for a in audit_chain(chain)]
    if draws != "os":
        out.update(
            bounded=False,
            why=f"the noise is keyed by the run seed (--draws {draws}): a reader that finds the seed removes it",
        )
        return out
    ids = torch.as_tensor(truth, dtype=torch.long)
    kappa = token_priors(model, ids)
    kappa_doc = document_priors(model, ids)
    crossed = count_crossings(traffic_folder)
    bounds = [
        document_bound(
            int(d),
            crossed.get(int(d), {}),
            guarantees,
            ids.shape[1],
            kappa[i].tolist(),
            float(kappa_doc[i]),
            exclude=exclude,
        )  # fmt: skip
        for i, d in enumerate(doc_ids)
    ]
    out.update(summarise(bounds))
    out["per_document"] = [
        {
            "doc_id": b.doc_id,
            "crossings": b.crossings,
            "token_bound": b.token_bound,
            "doc_bound": b.doc_bound,
            "mu_doc": b.mu_doc,
            "epsilon_doc": b.epsilon_doc,
            "why": b.why_none,
        }  # fmt: skip
        for b in bounds
    ]
    return out
