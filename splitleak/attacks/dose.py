"""The dose ladder of the decoy system's probes as a job a grid runs (Politis & Pappas 2026, §4.1, Table 4,
Figure 3): its parameters, and the doses it plants.

The ladder plants a known token signal into the captured rows of a latent run at rising dose and reads where
each metric of the probe battery first detects it (``splitleak.audit.dose_latent``, which does the planting
and the reading). Planting needs the client's record of each row's token and of its real rows, and the probes
that read it are trained on that record: it is an instrument check under the oracle threat model (a positive
control), never a verdict on the traffic. Its job records what each dose read, so that a grid's report and a
reproduction read the onsets from the store (``splitleak.reproduce.dose``).

``doses``: ``paper``, the 19 doses of the artefact's sweep (coverage 0 to 1 at amplitude 1 and amplitude 0.05
to 0.5 at coverage 1 in coordinate mode, and coverage 0.05 to 1 in invariant mode); ``coverage``, its nine
coordinate-mode coverages at amplitude 1 alone (the axis Table 4 reports). ``channel``: the forward rows
(``activations``, the paper's injected leak on the forward wire) or the output-gradient rows
(``output-gradient``). The battery's views default to the channel's (``real-rows`` for the forward rows,
``gradient`` for the output gradient), its models to the MLP and the graph probe, one restart each (ours).
"""

from __future__ import annotations

from typing import Any, ClassVar

from splitleak.attacks.probes import MODELS, VIEWS, _names
from splitleak.errors import ConfigError

MODES = ("coordinate", "invariant")
#: channel -> the latent frame's field it doses
CHANNELS = {"activations": "x", "output-gradient": "g_out"}
#: the 19 doses of the artefact's sweep (``w24_dose_response.json``): (mode, coverage, amplitude)
PAPER_DOSES: tuple[tuple[str, float, float], ...] = (
    *[("coordinate", c, 1.0) for c in (0.0, 0.005, 0.01, 0.02, 0.04, 0.06, 0.10, 0.30, 1.0)],
    *[("coordinate", 1.0, a) for a in (0.05, 0.10, 0.15, 0.20, 0.30, 0.50)],
    *[("invariant", c, 1.0) for c in (0.05, 0.25, 0.50, 1.0)],
)
DOSE_SETS: dict[str, tuple[tuple[str, float, float], ...]] = {
    "paper": PAPER_DOSES,
    "coverage": tuple(d for d in PAPER_DOSES if d[0] == "coordinate" and d[2] == 1.0),
}
#: the battery's view per dosed channel: the rows the leak was planted in
CHANNEL_VIEW = {"activations": "real-rows", "output-gradient": "gradient"}
#: what every report prints beside a dose ladder's readings
DOSE_NOTE = (
    "positive control: a known token leak planted with the client's record and read by probes trained on that "
    "record (the oracle threat model); it says what the instrument detects, never what the traffic gives away"
)


class DoseLadder:
    """scikit-learn's shape: parameters in ``__init__``; the ladder itself is ``audit.dose_latent.dose_ladder``."""

    name: ClassVar[str] = "dose-ladder"
    uses_gradients: ClassVar[bool] = True

    def __init__(
        self,
        doses: str = "paper",
        channel: str = "activations",
        views: tuple[str, ...] | list[str] | str | None = None,
        models: tuple[str, ...] | list[str] | str = ("mlp", "graph"),
        restarts: int = 1,
        epochs: int = 30,
        n_boot: int = 2000,
        seed: int = 0,
    ):
        if doses not in DOSE_SETS:
            raise ConfigError(f"unknown dose set {doses!r}; use one of {', '.join(DOSE_SETS)}")
        if channel not in CHANNELS:
            raise ConfigError(f"unknown dosed channel {channel!r}; use one of {', '.join(CHANNELS)}")
        for k, v in {"restarts": restarts, "epochs": epochs, "n_boot": n_boot}.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{k} must be a positive integer, got {v!r}")
        self.doses, self.channel = doses, channel
        self.views = _names(views if views is not None else (CHANNEL_VIEW[channel],), VIEWS, "view")
        self.models = _names(models, MODELS, "model")
        self.restarts, self.epochs, self.n_boot, self.seed = restarts, epochs, n_boot, seed

    def params(self) -> dict[str, Any]:
        return {
            "doses": self.doses,
            "channel": self.channel,
            "views": list(self.views),
            "models": list(self.models),
            "restarts": self.restarts,
            "epochs": self.epochs,
            "n_boot": self.n_boot,
            "seed": self.seed,
        }

    def channels_read(self) -> tuple[str, ...]:
        return (self.channel,)

    def dose_points(self) -> tuple[tuple[str, float, float], ...]:
        return DOSE_SETS[self.doses]

    def battery(self) -> dict[str, Any]:
        """The probe battery's parameters (``splitleak.attacks.probes.ProbeBattery``)."""
        return {"views": self.views, "models": self.models, "restarts": self.restarts, "epochs": self.epochs}
