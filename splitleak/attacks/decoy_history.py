"""History matching: tell the decoy system's decoys from its real rows by what the server saw before
(ours, built for the decoy mix of Politis & Pappas 2026, §2, Figure 2 step 4).

A decoy is a real row of an earlier frame. Re-sent as it was released (``decoy_release="verbatim"``),
it repeats that row up to the new gauge, and the gauge keeps what a rotation and a permutation keep:
its norm, and with a second decoy from the same earlier frame, the pair's inner product. Clipped and
noised afresh with its frame (``"fresh"``, the paper's order), it repeats nothing. Each row of each
frame is scored by its distance to the nearest match among the rows of every earlier frame (by frame
id: the training frames, then earlier capture frames), on up to three features:

- ``norm``: the row's norm against every earlier row's norm;
- ``gram``: for each pair of rows of the frame, (smaller norm, larger norm, inner product) against the
  same triples of the pairs within every earlier frame; a row takes its best pair;
- ``raw``: the row itself against every earlier row (only where no rotation is applied, ``gauges=false``).

Each feature's log distance is standardised over the scored rows (median and interquartile range),
and a row's score is its smallest: higher is more likely real. The hard partition calls the T
highest-scoring rows of each frame real.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
from scipy.spatial import cKDTree

from splitleak.attacks.partition import LatentPartition, LatentTraffic, public_latent, top_rows
from splitleak.errors import ConfigError

FEATURES = ("norm", "gram", "raw")


class NearestIndex:
    """The distance from each query point to the nearest point added so far: one k-d tree per block of
    points, blocks of equal size merged (the logarithmic method), so that adding stays cheap."""

    def __init__(self) -> None:
        self.levels: list[tuple[np.ndarray, Any]] = []

    def add(self, points: np.ndarray) -> None:
        data = np.asarray(points, dtype=np.float64)
        if not len(data):
            return
        while self.levels and len(self.levels[-1][0]) <= len(data):
            data = np.concatenate([self.levels.pop()[0], data])
        self.levels.append((data, cKDTree(data)))

    def query(self, points: np.ndarray) -> np.ndarray:
        d = np.full(len(points), np.inf)
        for _, tree in self.levels:
            d = np.minimum(d, tree.query(np.asarray(points, dtype=np.float64), k=1)[0])
        return d


def pair_triples(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(smaller norm, larger norm, inner product) of every pair i < j of the rows of ``x``, with i and j."""
    i, j = np.triu_indices(len(x), k=1)
    norms = np.linalg.norm(x, axis=1)
    gram = x @ x.T
    triples = np.stack([np.minimum(norms[i], norms[j]), np.maximum(norms[i], norms[j]), gram[i, j]], axis=1)
    return triples, i, j


class DecoyHistory(LatentPartition):
    name: ClassVar[str] = "decoy-history"
    uses_gradients: ClassVar[bool] = False

    def __init__(self, features: str = "auto", seed: int = 0):
        self.features, self.seed = features, seed
        self._parse()

    def _parse(self) -> tuple[str, ...]:
        if self.features == "auto":
            return ()
        names = tuple(f.strip() for f in self.features.split(",") if f.strip())
        bad = sorted(set(names) - set(FEATURES))
        if bad or not names:
            raise ConfigError(
                f"decoy-history: unknown feature(s) {bad or self.features!r}; use 'auto' or a comma-separated "
                f"subset of {', '.join(FEATURES)}"
            )
        return names

    def params(self) -> dict[str, Any]:
        return {"features": self.features, "seed": self.seed}

    def channels_read(self) -> tuple[str, ...]:
        return ("activations",)

    def reads_history(self) -> bool:
        return True

    def fit(self, history: LatentTraffic | None = None, public: dict[str, Any] | None = None, shadow=None):
        """Keep the earlier frames; choose the features the public arguments allow ("auto": norm and
        gram, and raw rows where the gauges are off)."""
        cfg = public_latent(public)
        chosen = self._parse()
        if not chosen:
            chosen = ("norm", "gram") + (("raw",) if not cfg.gauges else ())
        if "raw" in chosen and cfg.gauges:
            raise ConfigError(
                "decoy-history: raw rows match only where no rotation is applied, and this run gauges its rows; "
                "drop raw from features (norm and gram are rotation-invariant)"
            )
        self.features_ = chosen
        self.history_ = history
        return self

    def partition(self, traffic: LatentTraffic) -> list[tuple[np.ndarray, np.ndarray]]:
        if not hasattr(self, "features_"):
            raise ConfigError("call fit(history, public=...) before partition")
        scored = {f.frame_id for f in traffic.frames}
        earlier = [f for f in (self.history_.frames if self.history_ is not None else []) if f.frame_id not in scored]
        frames = sorted(earlier + list(traffic.frames), key=lambda f: f.frame_id)
        index = {name: NearestIndex() for name in self.features_}
        dist: dict[int, dict[str, np.ndarray]] = {}
        for f in frames:
            x = f.x.double().numpy()
            norms = np.linalg.norm(x, axis=1)
            gram = pair_triples(x) if "gram" in index else None
            if f.frame_id in scored:
                d: dict[str, np.ndarray] = {}
                if "norm" in index:
                    d["norm"] = index["norm"].query(norms[:, None])
                if "raw" in index:
                    d["raw"] = index["raw"].query(x)
                if gram is not None:
                    triples, i, j = gram
                    pair_d = index["gram"].query(triples)
                    row_d = np.full(len(x), np.inf)
                    np.minimum.at(row_d, i, pair_d)
                    np.minimum.at(row_d, j, pair_d)
                    d["gram"] = row_d
                dist[f.frame_id] = d
            if "norm" in index:
                index["norm"].add(norms[:, None])
            if "raw" in index:
                index["raw"].add(x)
            if gram is not None:
                index["gram"].add(gram[0])
        z = {name: _standardised_log([dist[f.frame_id][name] for f in traffic.frames]) for name in self.features_}
        out = []
        for k in range(len(traffic.frames)):
            s = np.min(np.stack([z[name][k] for name in self.features_]), axis=0)
            out.append((s, top_rows(s, traffic.real_rows)))
        self.report_ = {"features": list(self.features_), "earlier_frames": len(earlier)}
        return out

    def report(self) -> dict[str, Any]:
        return getattr(self, "report_", {})


def _standardised_log(per_frame: list[np.ndarray]) -> list[np.ndarray]:
    """log distance, standardised by its median and interquartile range over every scored row; a row
    with nothing earlier to match (the first frame) takes the largest finite value."""
    flat = np.concatenate(per_frame) if per_frame else np.zeros(0)
    with np.errstate(divide="ignore"):
        logs = np.log(flat)
    finite = np.isfinite(logs)
    hi = logs[finite].max() if finite.any() else 0.0
    lo = logs[finite].min() if finite.any() else 0.0
    logs = np.where(np.isposinf(logs) | np.isnan(logs), hi, np.where(np.isneginf(logs), lo, logs))
    med = np.median(logs) if len(logs) else 0.0
    q75, q25 = np.percentile(logs, [75, 25]) if len(logs) else (1.0, 0.0)
    scaled = (logs - med) / max(q75 - q25, 1e-12)
    return np.split(scaled, np.cumsum([len(p) for p in per_frame])[:-1])
