"""SIP: a learned inverter from the Bottom's activations to the tokens (Gradient Mirage, 003 App. C.2; the
first stage of BiSR).

The attacker runs its copy of the client layers (the frozen Bottom: the public pretrained weights, or
the run's trained ones) over public text, and trains a single-layer GRU over the activations with a
linear head to the vocabulary, by token-level cross-entropy with AdamW; ``reconstruct`` reads each
captured activation sequence and takes the argmax token per position. 003 trains a GRU of hidden
size 4096 for 3 epochs on CNN-DailyMail (AdamW, lr 1e-3, weight decay 1e-5, batch 32). Ours: the
public text is the calibration documents the observer holds (the threat model's public text, no
download), ``hidden`` = 256 and ``epochs`` = 40 by default, since that text is a few thousand tokens
on a CPU; the optimiser settings are 003's. Every draw (initialisation, batch order) comes from the
attack seed; the global random state is left as it was.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from splitleak.attacks.base import Attack, Reconstruction
from splitleak.errors import ConfigError
from splitleak.progress import Progress, Silent
from splitleak.runtime import fused_optimizer


class _GRUInverter(nn.Module):
    def __init__(self, width: int, hidden: int, vocab: int):
        super().__init__()
        self.gru = nn.GRU(width, hidden, num_layers=1, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x)
        return self.head(out)


class SipGRU(Attack):
    """``sip-gru``: the GRU inverter over the frozen Bottom (see the module docstring)."""

    name = "sip-gru"

    def __init__(
        self,
        hidden: int = 256,
        epochs: int = 40,
        lr: float = 1e-3,
        weight_decay: float = 1e-5,
        batch: int = 32,
        seed: int = 0,
    ):
        super().__init__(seed)
        for arg, value, lo in (("hidden", hidden, 1), ("epochs", epochs, 1), ("batch", batch, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ConfigError(f"sip-gru: {arg} must be an integer >= {lo}, got {value!r}")
        for arg, number in (("lr", lr), ("weight_decay", weight_decay)):
            if isinstance(number, bool) or not isinstance(number, (int, float)) or not number >= 0:
                raise ConfigError(f"sip-gru: {arg} must be a number >= 0, got {number!r}")
        self.hidden, self.epochs, self.lr, self.weight_decay, self.batch = hidden, epochs, lr, weight_decay, batch

    def params(self) -> dict[str, Any]:
        return {
            "hidden": self.hidden,
            "epochs": self.epochs,
            "lr": self.lr,
            "weight_decay": self.weight_decay,
            "batch": self.batch,
            "seed": self.seed,
        }

    def fit(self, knowledge, progress: Progress | None = None) -> "SipGRU":
        super().fit(knowledge)
        progress = progress or Silent()
        client = knowledge.client
        ids = knowledge.calibration_ids()
        if ids.numel() == 0:
            raise ConfigError("sip-gru trains on the observer's public text, and the run has no calibration documents")
        x = client.activations(ids).float().cpu()
        # standardise each coordinate by the public activations' own statistics (ours): a block's output
        # can sit far from the GRU's tanh range
        self.mean_, self.std_ = x.mean(dim=(0, 1)), x.std(dim=(0, 1)).clamp_min(1e-6)
        x = (x - self.mean_) / self.std_
        y = ids.cpu()
        gen = torch.Generator().manual_seed(self.seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = _GRUInverter(x.shape[-1], self.hidden, client.vocab_size)
        opt = fused_optimizer(torch.optim.AdamW, model.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        task = progress.start("sip-gru training", self.epochs)
        self.losses_: list[float] = []
        for _ in range(self.epochs):
            total = 0.0
            for rows in torch.randperm(len(x), generator=gen).split(self.batch):
                logits = model(x[rows])
                loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[rows].reshape(-1))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total += float(loss.detach()) * len(rows)
            self.losses_.append(total / len(x))
            progress.advance(task)
        progress.finish(task)
        self.model_ = model.eval()
        return self

    @torch.no_grad()
    def reconstruct(self, traffic, progress: Progress | None = None) -> Reconstruction:
        self._check(traffic)
        logits = self.model_((traffic.activations.float().cpu() - self.mean_) / self.std_)
        return Reconstruction(logits.argmax(-1), {"train_loss": self.losses_})
