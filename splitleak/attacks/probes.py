"""The probe battery on the decoy system's released rows (Politis & Pappas 2026, §3–§4, Tables 6, 8, 9).

A probe learns, from frames whose tokens it knows, to name the token a released row carries, and is
then scored on frames it never saw: the capture pass (the evaluation documents), on the real rows only.
An evaluation token that never occurs in probe training cannot be named, so it counts as wrong.

**Threat models** (``threat``), which say where the labelled frames come from:

- ``shadow`` (the default; Kerckhoffs): the attacker's own frames, made by running the public mechanism
  on its own documents with its own codec and draws (``splitleak.attacks.shadow``). The views that read
  only real rows read the rows a wire-only partition reader picks in each victim frame: the
  ``classifier`` rule fitted on the same shadow frames (every row where the public arguments send no
  decoy). A row it does not pick is named nothing.
- ``trained-codec``: the same, but the shadow frames go through the victim's trained encoder and decoder,
  which this threat model grants (as ``client_copy="trained"`` grants a split run's trained layers).
- ``oracle``: the victim's training-phase frames with the client's record of each row's token and of
  its real rows, and that record's real rows in the evaluation frames too (002's known-plaintext
  probes). It is an upper bound, labelled so in every report and never a verdict.

**Views** (what the probe reads of a frame; all as the server holds it):

- ``forward``: the forward rows, every row; it trains on decoys too (labelled with the token of the
  row they re-send) and never uses the partition;
- ``real-rows``: the forward rows of the real rows only (the paper's "forward arm"; the partition
  the open output gradient hands over exactly, or the one the attacker read);
- ``gradient``: the output-gradient rows of the real rows (the paper's "gradient arm");
- ``joint``: [x ‖ g · (median ‖x‖ / median ‖g‖)] of the real rows, the medians over the rows taken as
  real (the paper's "joint arm");
- ``cross-gram``: gauge-invariant features of the cross-Gram X Gᵀ (cosine form), which cancels the
  frame's rotation: a row's own cross term, its row's and its column's statistics.

**Probe models**, each over a row's coordinates and 22 gauge-invariant row features (its norm; the
mean, std, max and min of its row of the unit-row Gram; its top-8 similarities and top-8 absolute
similarities; its index in the frame over n):

- ``mlp``: a GELU MLP over coordinates and features;
- ``features``: the same MLP over the 22 features alone;
- ``graph``: one round of message passing over the row-normalised squared Gram (S²ᵢⱼ / Σⱼ S²ᵢⱼ);
- ``deep``: the paper's deep probe, a transformer encoder over the frame's rows (4 layers, 8 heads).

Each model runs ``restarts`` times (the paper: three) from its own seed; an arm is one (view,
model, restart). ``shuffle=True`` builds the shuffled-label negative control: the tokens of every
labelled training row are permuted globally once (one permutation for all views) and the whole battery
is retrained on them. Under ``oracle`` the evaluation rows' labels are permuted with them (the paper's
twin); under the shadow threat models the twin is scored against the true labels, so that a battery that
reaches the victim's tokens some other way reads above floor. ``control=True`` (the default) has the
audit run that twin beside the battery (``splitleak.audit.latent_attacks.run_probe_attack``).

Ours, where the paper gives no number: hidden width 256, AdamW at lr 1e-3 with weight decay 0.01,
16 frames per batch, 30 epochs, the deep probe at width 128; no epoch is selected on the evaluation
frames (the paper's Table 6 selects the best of 50 epochs there, a selection reading): the last
epoch is scored.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from splitleak.attacks.partition import LatentFrame, LatentTraffic
from splitleak.defences.decoys import derived_seed
from splitleak.errors import ConfigError
from splitleak.runtime import fused_optimizer

VIEWS = ("forward", "real-rows", "gradient", "joint", "cross-gram")
MODELS = ("mlp", "features", "graph", "deep")
THREATS = ("shadow", "trained-codec", "oracle")
N_FEATURES = 22
TOP = 8
EPS = 1e-12


# ----------------------------------------------------------------------------- features


def _unit(z: torch.Tensor) -> torch.Tensor:
    return z / (z.norm(dim=-1, keepdim=True) + EPS)


def _stats(s: torch.Tensor, dim: int) -> list[torch.Tensor]:
    """Mean, std, max, min of a similarity matrix along ``dim`` (NaN-free for a single entry)."""
    return [s.mean(dim), s.std(dim, unbiased=False), s.amax(dim), s.amin(dim)]


def _top(s: torch.Tensor, k: int = TOP) -> torch.Tensor:
    """The k largest entries of each row, descending, zero-padded when a row has fewer."""
    out = torch.zeros(s.shape[0], k, dtype=s.dtype)
    kk = min(k, s.shape[1])
    if kk:
        out[:, :kk] = torch.topk(s, kk, dim=1).values
    return out


def row_features(z: torch.Tensor) -> torch.Tensor:
    """The 22 gauge-invariant features of each row of ``z`` [n, D] (see the module's docstring)."""
    n = z.shape[0]
    u = _unit(z)
    s = u @ u.T
    if n > 1:
        off = s[~torch.eye(n, dtype=torch.bool)].reshape(n, n - 1)
    else:
        off = torch.zeros(n, 1, dtype=z.dtype)
    pos = torch.arange(n, dtype=z.dtype) / max(1, n)
    cols = [z.norm(dim=-1), *_stats(off, 1)]
    return torch.cat([torch.stack(cols, -1), _top(off), _top(off.abs()), pos[:, None]], -1)


def cross_gram_features(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """22 rotation-invariant features of the cross-Gram C = cos(xᵢ, gⱼ): a row's own term Cᵢᵢ, the
    statistics and top 8 of its row (what its activation sees of every gradient) and the statistics
    and top 4 of its column (what its gradient sees of every activation), and its index over n."""
    c = _unit(x) @ _unit(g).T
    n = c.shape[0]
    pos = torch.arange(n, dtype=x.dtype) / max(1, n)
    cols = [c.diagonal(), *_stats(c, 1), *_stats(c, 0)]
    return torch.cat([torch.stack(cols, -1), _top(c), _top(c.T, 4), pos[:, None]], -1)


def squared_gram(z: torch.Tensor) -> torch.Tensor:
    """The row-normalised squared Gram of the unit rows: the graph probe's adjacency [n, n]."""
    s2 = (_unit(z) @ _unit(z).T) ** 2
    return s2 / (s2.sum(-1, keepdim=True) + EPS)


@dataclass
class ViewFrame:
    """One frame seen through one view: inputs [n, c + 22], the adjacency [n, n], labels [n]
    (-1: not a row this view trains on or scores) and which rows are real."""

    inputs: torch.Tensor
    n_coords: int
    adjacency: torch.Tensor
    labels: np.ndarray
    real: np.ndarray


def view_frame(f: LatentFrame, view: str, tokens: np.ndarray, real: np.ndarray) -> ViewFrame:
    x, g = f.x.double(), f.g_out.double()
    adj = squared_gram(g if view == "gradient" else x)
    if view in ("forward", "real-rows"):
        coords, feats = x, row_features(x)
    elif view == "gradient":
        coords, feats = g, row_features(g)
    elif view == "joint":
        nx = x[real].norm(dim=-1).median() if real.any() else x.norm(dim=-1).median()
        ng = g[real].norm(dim=-1).median() if real.any() else g.norm(dim=-1).median()
        coords = torch.cat([x, g * (nx / (ng + EPS))], -1)
        feats = torch.cat([row_features(x), row_features(g)[:, :-1]], -1)
    elif view == "cross-gram":
        coords, feats = x[:, :0], cross_gram_features(x, g)
    else:
        raise ConfigError(f"unknown probe view {view!r}; use one of {', '.join(VIEWS)}")
    labels = tokens.copy() if view == "forward" else np.where(real, tokens, -1)
    return ViewFrame(torch.cat([coords, feats], -1), coords.shape[1], adj, labels, real)


# ----------------------------------------------------------------------------- models


class RowMLP(nn.Module):
    def __init__(self, n_in: int, hidden: int, classes: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(n_in, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, classes)
        )

    def forward(self, z, adj, pad):  # noqa: ARG002 (one signature for every probe)
        return self.net(z)


class GraphProbe(nn.Module):
    def __init__(self, n_in: int, hidden: int, classes: int):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(n_in, hidden), nn.GELU())
        self.msg = nn.Linear(hidden, hidden)
        self.head = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.GELU(), nn.Linear(hidden, classes))

    def forward(self, z, adj, pad):  # noqa: ARG002
        h = self.enc(z)
        return self.head(torch.cat([h, adj @ self.msg(h)], -1))


class DeepProbe(nn.Module):
    def __init__(self, n_in: int, width: int, classes: int, layers: int, heads: int):
        super().__init__()
        self.inp = nn.Linear(n_in, width)
        layer = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, z, adj, pad):  # noqa: ARG002
        return self.head(self.enc(self.inp(z), src_key_padding_mask=pad))


# ----------------------------------------------------------------------------- the battery


@dataclass
class ArmPredictions:
    view: str
    model: str
    restart: int
    predictions: list[np.ndarray]  # per evaluation frame, the token named for every row (-1: unnamed)
    classes: int
    seconds: float

    @property
    def name(self) -> str:
        return f"{self.view}/{self.model}/{self.restart}"


class ProbeBattery:
    """scikit-learn's shape: parameters in ``__init__``; ``run(train, eval, tokens, real)`` trains every
    arm on the training frames and names a token for every row of the evaluation frames."""

    name: ClassVar[str] = "latent-probe"
    uses_gradients: ClassVar[bool] = True

    def __init__(
        self,
        views: tuple[str, ...] | list[str] | str = VIEWS,
        models: tuple[str, ...] | list[str] | str = MODELS,
        restarts: int = 3,
        epochs: int = 30,
        hidden: int = 256,
        lr: float = 1e-3,
        batch_frames: int = 16,
        deep_width: int = 128,
        deep_layers: int = 4,
        deep_heads: int = 8,
        shuffle: bool = False,
        control: bool = True,
        threat: str = "shadow",
        seed: int = 0,
    ):
        if threat not in THREATS:
            raise ConfigError(f"unknown probe threat model {threat!r}; use one of {', '.join(THREATS)}")
        self.threat = threat
        self.views = _names(views, VIEWS, "view")
        self.models = _names(models, MODELS, "model")
        for k, v in {"restarts": restarts, "epochs": epochs, "hidden": hidden, "batch_frames": batch_frames}.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{k} must be a positive integer, got {v!r}")
        if deep_width % deep_heads:
            raise ConfigError(f"deep_width {deep_width} must be a multiple of deep_heads {deep_heads}")
        self.restarts, self.epochs, self.hidden, self.lr = restarts, epochs, hidden, float(lr)
        self.batch_frames, self.shuffle, self.control, self.seed = batch_frames, bool(shuffle), bool(control), seed
        self.deep_width, self.deep_layers, self.deep_heads = deep_width, deep_layers, deep_heads

    def params(self) -> dict[str, Any]:
        return {
            "views": list(self.views),
            "models": list(self.models),
            "restarts": self.restarts,
            "epochs": self.epochs,
            "hidden": self.hidden,
            "lr": self.lr,
            "batch_frames": self.batch_frames,
            "deep_width": self.deep_width,
            "deep_layers": self.deep_layers,
            "deep_heads": self.deep_heads,
            "shuffle": self.shuffle,
            "control": self.control,
            "threat": self.threat,
            "seed": self.seed,
        }

    def channels_read(self) -> tuple[str, ...]:
        out = ["activations"] if set(self.views) - {"gradient"} else []
        return tuple(out + (["output-gradient"] if set(self.views) - {"forward", "real-rows"} else []))

    def twin(self) -> ProbeBattery:
        """The same battery on globally shuffled labels: the negative control."""
        return type(self)(**{**self.params(), "shuffle": True, "control": False})

    def shuffled_tokens(self, tokens: dict[int, np.ndarray], frame_ids: list[int]) -> dict[int, np.ndarray]:
        """The negative control's labels: every known row's token, permuted once over the rows of all
        ``frame_ids``."""
        rng = np.random.default_rng([self.seed, 0x5F])
        flat = np.concatenate([tokens[f] for f in frame_ids])
        known = flat >= 0
        flat[known] = rng.permutation(flat[known])
        out, at = {}, 0
        for f in frame_ids:
            out[f] = flat[at : at + len(tokens[f])]
            at += len(tokens[f])
        return out

    def run(
        self,
        train: LatentTraffic,
        evaluation: LatentTraffic,
        tokens: dict[int, np.ndarray],
        real: dict[int, np.ndarray],
        taken: dict[int, np.ndarray] | None = None,
    ) -> list[ArmPredictions]:
        """Train every arm on ``train`` (``tokens`` and ``real``: each training row's token and whether it is
        real) and name a token for every row of ``evaluation``. ``taken``: per evaluation frame, the rows the
        attacker takes as real (the partition it read); the views of real rows name nothing elsewhere. None
        (the oracle): ``tokens`` and ``real`` cover the evaluation frames too, and the shuffle spans them."""
        if not len(train) or not len(evaluation):
            raise ConfigError("the probes need labelled frames and capture-phase frames; one of them is empty")
        ids = [f.frame_id for f in train.frames] + ([f.frame_id for f in evaluation.frames] if taken is None else [])
        if self.shuffle:
            tokens = {**tokens, **self.shuffled_tokens(tokens, ids)}
        ev_real = real if taken is None else taken
        unknown = {f.frame_id: np.full(len(f.x), -1, dtype=np.int64) for f in evaluation.frames}
        ev_tokens = tokens if taken is None else unknown
        out = []
        for view in self.views:
            tr = [view_frame(f, view, tokens[f.frame_id], real[f.frame_id]) for f in train.frames]
            ev = [view_frame(f, view, ev_tokens[f.frame_id], ev_real[f.frame_id]) for f in evaluation.frames]
            classes = np.unique(np.concatenate([v.labels for v in tr]))
            classes = classes[classes >= 0]
            if not len(classes):
                raise ConfigError(f"the {view} view has no labelled training row")
            z_tr, a_tr, pad_tr, y_tr = _batch(tr, classes)
            z_ev, a_ev, pad_ev, _ = _batch(ev, classes)
            known = torch.from_numpy(y_tr >= 0) & ~pad_tr
            mean = z_tr[known].mean(0)
            std = z_tr[known].std(0) + 1e-6
            z_tr, z_ev = ((z_tr - mean) / std).float(), ((z_ev - mean) / std).float()
            for model in self.models:
                for restart in range(self.restarts):
                    t0 = time.perf_counter()
                    net = self._train(view, model, restart, z_tr, a_tr.float(), pad_tr, y_tr, len(classes))
                    with torch.no_grad():
                        logits = net(z_ev, a_ev.float(), pad_ev)
                    named = classes[logits.argmax(-1).numpy()]
                    preds = [named[i, : len(v.labels)] for i, v in enumerate(ev)]
                    if taken is not None and view != "forward":  # a row not taken as real is named nothing
                        preds = [np.where(v.real, p, -1) for p, v in zip(preds, ev)]
                    out.append(ArmPredictions(view, model, restart, preds, len(classes), time.perf_counter() - t0))
        return out

    def _net(self, model: str, n_in: int, classes: int) -> nn.Module:
        if model in ("mlp", "features"):
            return RowMLP(n_in, self.hidden, classes)
        if model == "graph":
            return GraphProbe(n_in, self.hidden, classes)
        return DeepProbe(n_in, self.deep_width, classes, self.deep_layers, self.deep_heads)

    def _train(self, view, model, restart, z, adj, pad, y, classes) -> nn.Module:
        n_coords = z.shape[-1] - _n_features(view)
        if model == "features":
            z = z[..., n_coords:]
        key = derived_seed(self.seed, "probe", restart, f"{view}/{model}/{int(self.shuffle)}", 0)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(key)
            net = self._net(model, z.shape[-1], classes)
        opt = fused_optimizer(torch.optim.AdamW, net.parameters(), lr=self.lr, weight_decay=0.01)
        rng = np.random.default_rng(key)
        target = torch.from_numpy(y)
        for _ in range(self.epochs):
            for idx in np.array_split(rng.permutation(len(z)), max(1, -(-len(z) // self.batch_frames))):
                i = torch.from_numpy(idx)
                loss = nn.functional.cross_entropy(
                    net(z[i], adj[i], pad[i]).reshape(-1, classes), target[i].reshape(-1), ignore_index=-100
                )
                opt.zero_grad()
                loss.backward()
                opt.step()
        net.eval()
        if model == "features":
            return _Slice(net, n_coords)
        return net


class _Slice(nn.Module):
    def __init__(self, net: nn.Module, start: int):
        super().__init__()
        self.net, self.start = net, start

    def forward(self, z, adj, pad):
        return self.net(z[..., self.start :], adj, pad)


def _n_features(view: str) -> int:
    return 2 * N_FEATURES - 1 if view == "joint" else N_FEATURES


def _batch(frames: list[ViewFrame], classes: np.ndarray):
    """Frames padded to the longest: inputs [F, n, c], adjacency [F, n, n], padding [F, n] and
    class targets [F, n] (-100: padding, unlabelled, or a token outside ``classes``)."""
    n = max(len(v.labels) for v in frames)
    c = frames[0].inputs.shape[1]
    z = torch.zeros(len(frames), n, c, dtype=torch.float64)
    adj = torch.zeros(len(frames), n, n, dtype=torch.float64)
    pad = torch.ones(len(frames), n, dtype=torch.bool)
    y = np.full((len(frames), n), -100, dtype=np.int64)
    for i, v in enumerate(frames):
        m = len(v.labels)
        z[i, :m], adj[i, :m, :m], pad[i, :m] = v.inputs, v.adjacency, False
        pos = np.searchsorted(classes, v.labels)
        ok = (v.labels >= 0) & (pos < len(classes)) & (classes[np.minimum(pos, len(classes) - 1)] == v.labels)
        y[i, :m] = np.where(ok, pos, -100)
    return z, adj, pad, y


def _names(value, known: tuple[str, ...], what: str) -> tuple[str, ...]:
    names = tuple(value.split(",")) if isinstance(value, str) else tuple(value)
    bad = [v for v in names if v not in known]
    if bad or not names:
        raise ConfigError(f"unknown probe {what}(s) {bad or names!r}; use some of {', '.join(known)}")
    return names
