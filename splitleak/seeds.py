"""Seeds derived from the run seed, one per purpose, so that what one side needs never reveals another.

The run seed (``TrainConfig.seed``, the victim seed) keys the client's own randomness: the training
order, the forward defences' noise, mixup's decoy draws. The untrusted server must never learn it —
with it, the server regenerates the client's noise and undoes the defence. The server needs two
things derived from it, and gets only those, through a one-way function (SHA-256):

- ``server_seed``: keys the randomness of the defences the server runs (noise on the gradient it
  returns, the replica copies' perturbations);
- ``model_init_seed``: the initial weights of a randomly initialised model (the tiny test model),
  which both sides must build alike. A pretrained model's weights do not depend on it.

One-way is not secret: a run seed from a small range can be found by trying each candidate
against anything the server sees that depends on it (the training order crosses as row ids).
"""

from __future__ import annotations

import hashlib
import os

PURPOSES = ("server", "model-init")


def derive_seed(seed: int, purpose: str) -> int:
    """A 63-bit seed for ``purpose``: the first 8 bytes of SHA-256("splitleak|PURPOSE|SEED")."""
    if purpose not in PURPOSES:
        raise ValueError(f"unknown seed purpose {purpose!r}; known: {', '.join(PURPOSES)}")
    digest = hashlib.sha256(f"splitleak|{purpose}|{int(seed)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def server_seed(run_seed: int) -> int:
    return derive_seed(run_seed, "server")


def model_init_seed(run_seed: int) -> int:
    return derive_seed(run_seed, "model-init")


def entropy(n: int) -> bytes:
    """``n`` bytes of OS entropy: the one source of the client's unguessable secrets (``draws="os"``, the latent
    mode's noise and gauge keys). Callers look it up on this module, so that the test suite can make every
    run's draws a replayable function of a printed seed (tests/conftest.py)."""
    return os.urandom(n)
