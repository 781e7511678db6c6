"""Shadow frames: the labelled latent frames an attacker makes for itself (Kerckhoffs; the shadow models of
Shokri et al. 2017).

The server knows the latent mode's mechanism and its public arguments (``config.latent``, which the
handshake carries), the public model and the training arguments it shares with the client (the learning
rate, the capture batch), and it counts the training frames it received. It holds documents of its own:
the calibration documents. With them it runs the whole mechanism itself, both roles: its own private
encoder and decoder trained from its own initialisation, its own draws of noise, decoys and gauges (keyed
by the attacker's seed, so that a reading can be replayed), as many training steps as it saw, then a
capture pass over its documents. It keeps its own record of which gauged rows are real and which token
each carries. A learned partition reader fits on these frames and is then read on the victim's: the
victim's record of real rows never reaches it.

What the shadow cannot copy is the victim's trained codec: its frames are the public mechanism's, not
the victim's, which is what an attacker who does not hold the client's private layers gets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from splitleak.attacks.partition import LatentTraffic, latent_traffic, public_latent
from splitleak.data import Document
from splitleak.defences.decoys import derived_seed
from splitleak.errors import ConfigError
from splitleak.models import LoadedModel, load_model
from splitleak.seeds import model_init_seed
from splitleak.training.latent import LatentClient, LatentServer, capture_latent, latent_split, train_latent
from splitleak.wire.channel import Crossing, InProcessChannel


@dataclass(frozen=True)
class ShadowPlan:
    """What the attacker needs to make its own frames: the public model (preset or path, precision, and
    the seed a random preset is initialised from), the public latent arguments, its own documents, the
    training steps it saw, the learning rate the server's surrogate trains at and the capture batch."""

    model: str
    precision: str
    model_seed: int
    model_path: str | None
    latent: dict[str, Any]
    documents: tuple[Document, ...]
    steps: int
    lr: float
    capture_batch: int


def shadow_plan(manifest: dict[str, Any], documents: tuple[Document, ...] | list[Document], steps: int) -> ShadowPlan:
    """The plan from a latent run's public manifest, the attacker's own documents and the number of training
    frames the server received."""
    cfg = manifest.get("config") or {}
    if cfg.get("latent") is None:
        raise ConfigError("shadow frames are made for latent-mode runs; this manifest has no config.latent")
    if not documents:
        raise ConfigError(
            "shadow frames need documents of the attacker's own: the run has no calibration documents "
            "(train it with --n-calib 1 or more)"
        )
    return ShadowPlan(
        model=str(cfg["model"]),
        precision=str(cfg.get("precision", "float32")),
        model_seed=model_init_seed(int(cfg["seed"])),
        model_path=cfg.get("model_path"),
        latent=dict(cfg["latent"]),
        documents=tuple(documents),
        steps=max(1, int(steps)),
        lr=float(cfg["lr"]),
        capture_batch=int(cfg.get("capture_batch", 16)),
    )


@dataclass
class ShadowFrames:
    """The attacker's own frames of both phases and its own record of them: per frame id the real-row mask
    and the token each row carries (a decoy: its origin's), in the gauged order its server saw."""

    train: LatentTraffic
    capture: LatentTraffic
    real: dict[int, np.ndarray]
    tokens: dict[int, np.ndarray]

    @property
    def frames(self) -> list:
        return list(self.train.frames) + list(self.capture.frames)


def make_shadow(
    plan: ShadowPlan, seed: int, lm: LoadedModel | None = None, codec: dict[str, torch.Tensor] | None = None
) -> ShadowFrames:
    """Run the public mechanism on the attacker's documents, both roles in this process, with the
    attacker's own draws (``gauge_entropy="derived"`` keyed by a seed derived from ``seed``: the same
    distribution as the victim's fresh draws, and replayable). ``codec``: the victim's trained encoder and
    decoder (``LatentClient.state_dict``), for a threat model that grants them; they are then used frozen."""
    cfg = public_latent(plan.latent).model_copy(update={"gauge_entropy": "derived"})
    own = derived_seed(int(seed), "shadow", 0, "latent", 0)
    if lm is None:
        lm = load_model(plan.model, precision=plan.precision, seed=plan.model_seed, model_path=plan.model_path)
    lm.model.to("cpu")
    split, _ = latent_split(lm, cfg)
    seen: dict[str, list] = {"train": [], "capture": []}

    def tap(c: Crossing) -> None:
        seen[c.frame.phase].append(c.frame)

    server = LatentServer(cfg, plan.lr, derived_seed(own, "shadow", 0, "server", 0))
    channel = InProcessChannel(server.handle, [tap])
    client = LatentClient(split, cfg, own, channel, plan.lr)
    if codec is not None:
        client.encoder.load_state_dict({k[len("encoder.") :]: v for k, v in codec.items() if k.startswith("encoder.")})
        client.decoder.load_state_dict({k[len("decoder.") :]: v for k, v in codec.items() if k.startswith("decoder.")})
        for q in client.params:
            q.requires_grad_(False)
        client.opt = None  # the victim's codec as it was trained: the shadow steps train the surrogate only
    with torch.random.fork_rng(devices=[]):
        train_latent(client, plan.documents, seed=own, steps=plan.steps)
        server.opt = None
        capture_latent(client, plan.documents, batch=plan.capture_batch)
    t = len(plan.documents[0].token_ids)
    return ShadowFrames(
        latent_traffic("train", seen["train"], t),
        latent_traffic("capture", seen["capture"], t),
        {f.frame_id: np.asarray(f.real, dtype=bool) for f in client.truth},
        {f.frame_id: np.asarray(f.tokens, dtype=np.int64) for f in client.truth},
    )
