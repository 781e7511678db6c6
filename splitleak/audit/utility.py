"""The all-local loss an audit or a comparison sets a split run against (ΔU = L_split − L_all-local), from
whichever run gives it without training the whole model once more."""

from __future__ import annotations

from typing import Any

#: how an undefended run of a split relates to the all-local run (``utility_baseline``): "exact" (the plain split:
#: the same modules in the same order, AdamW per parameter; tested bit for bit), "rounding" (label-shielded: the
#: same computation in three parts, held-out loss within 1e-5 nats; tests/test_shielded.py, and 2.7918 both on
#: SmolLM2's audit), "other" (no test says so, so the all-local run is trained: the U-shape, the latent mode)
SPLIT_BASELINE = {"plain": "exact", "label-shielded": "rounding"}
_SAME = {"exact": "exactly", "rounding": "to float rounding (1e-5 nats)"}


def split_baseline(mode: str) -> str:
    return SPLIT_BASELINE.get(mode, "other")


def utility_baseline(
    m: dict[str, Any], cost: dict[str, Any] | None, defended: bool, split: str = "exact"
) -> dict[str, Any]:
    """The all-local loss and ΔU = L_split − L_all-local, from whichever run gives them without training
    the whole model once more: with no defence the split run itself where it reproduces the all-local run
    (``SPLIT_BASELINE``), with a defence the undefended twin (the same identity), else the all-local baseline
    the run trained (``--no-twin``, or a split of kind "other")."""
    if m.get("heldout_ce") is None:
        return {"all_local_ce": None, "delta_u": None, "source": "the client measured no held-out loss"}
    if split not in _SAME:  # a split no test ties to the all-local run: the audit trained the all-local run
        if m.get("all_local_ce") is not None:
            return {"all_local_ce": m["all_local_ce"], "delta_u": m["delta_u"], "source": "the all-local baseline run"}
        return {"all_local_ce": None, "delta_u": None, "source": "no all-local run"}
    if not defended:
        return {
            "all_local_ce": m["heldout_ce"],
            "delta_u": 0.0,
            "source": f"no defence: the split run reproduces the all-local run {_SAME[split]} (tested), so it is not "
            "trained again",
        }
    if cost is not None and cost.get("twin_heldout_ce") is not None:
        return {
            "all_local_ce": cost["twin_heldout_ce"],
            "delta_u": m["heldout_ce"] - cost["twin_heldout_ce"],
            "source": f"from the undefended twin, which reproduces the all-local run {_SAME[split]} (tested)",
        }
    if m.get("all_local_ce") is not None:
        return {"all_local_ce": m["all_local_ce"], "delta_u": m["delta_u"], "source": "the all-local baseline run"}
    return {"all_local_ce": None, "delta_u": None, "source": "no all-local run and no twin"}
