"""Replica median (What Gradients Add §4.5): the server side run as several perturbed copies."""

from __future__ import annotations

from splitleak.defences.base import Defence, check_integer, check_number, register


@register
class ReplicaMedian(Defence):
    """Replica median (What Gradients Add §4.5): ``k`` >= 3 server copies, each with its own seed and a seeded
    relative weight perturbation ``perturbation``, their returned gradients combined by the
    coordinate-wise median; copies deviating by more than ``threshold`` (relative) are flagged.
    The wire transforms are the identity: this defence changes the server side, which the training code
    builds from its public arguments (``splitleak.training.replicas.build_server``)."""

    name = "replica-median"
    split_modes = ("plain",)
    adaptive = ()
    adaptive_note = (
        "no attack is built for replica-median: it changes only the server's copies and the median the client "
        "takes, which never crosses; the activations cross unchanged to every copy, so the suite's forward-wire "
        "attacks read them as undefended. The defence guards the gradient's integrity, not the text"
    )

    def roles(self):
        return ("server",)

    def __init__(self, k: int = 3, perturbation: float = 1e-4, threshold: float = 0.02):
        self.k = check_integer(self.name, "k", k, 3, why=" (a median of fewer copies cannot outvote a liar)")
        self.perturbation = check_number(self.name, "perturbation", perturbation, 0.0)
        self.threshold = check_number(self.name, "threshold", threshold, 0.0, lo_open=True)

    def args(self):
        return {"k": self.k, "perturbation": self.perturbation, "threshold": self.threshold}

    def links(self) -> list[str]:
        """Each copy is its own server on its own link; the client takes the median of the replies."""
        return [f"replica-{r}" for r in range(self.k)]

    def channel_note(self) -> str:
        return (
            f"replica-median: the activations cross to each of {self.k} server copies and each copy returns "
            "its own gradient; the median is taken on the client and never crosses"
        )
