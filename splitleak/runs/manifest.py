"""The manifest of a run directory and what it says: the split mode, the configuration (checked against
its hash), and whether a server's session and a client's run recorded the same session.

The fields every reader relies on are checked when the manifest is read (``ManifestCore``); the rest
is free, as it grows with the modes. ``read_calibration`` gives the calibration documents alone: what
an attacker may hold (``splitleak.attacks.knowledge``); the rest of ``documents.json`` is the scorer's
(``splitleak.runs.truth``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from splitleak.data import Document
from splitleak.errors import ConfigError, IntegrityError
from splitleak.files import config_hash, validated
from splitleak.runs.journal import read_run_json
from splitleak.runs.truth import read_documents


def run_mode(manifest: dict[str, Any]) -> str:
    """The split mode of a run from its manifest: "latent", "label-shielded", "u-shape" or "plain"."""
    if manifest.get("mode") == "latent":
        return "latent"
    if (manifest.get("split") or {}).get("label_shielded"):
        return "label-shielded"
    return "u-shape" if (manifest.get("split") or {}).get("u_shape") else "plain"


def read_manifest(run_dir: str | Path) -> dict[str, Any]:
    """The run's manifest, its structure checked: the fields every reader relies on are there, with
    their types (``ManifestCore``); an IntegrityError in one line names the file and the field."""
    path = Path(run_dir) / "manifest.json"
    if not path.exists() and not path.is_symlink():
        raise IntegrityError(f"{run_dir} has no manifest.json; pass a run directory written by `splitleak train`")
    m = read_run_json(run_dir, "manifest.json")
    fix = f"the manifest is damaged: run `splitleak verify {run_dir}`, or rerun `splitleak train`"
    validated(ManifestCore, m, path, fix)
    if config_hash(m["config"]) != m["config_hash"]:
        raise IntegrityError(f"{path}: config_hash does not match its config (one of them was changed); {fix}")
    return m


class _Split(BaseModel):
    model_config = ConfigDict(extra="allow")
    cut: int = Field(ge=1)


class ManifestCore(BaseModel):
    """What every reader of a manifest relies on; the rest is free (it grows with the modes)."""

    model_config = ConfigDict(extra="allow")
    config: dict[str, Any]
    config_hash: str
    split: _Split
    channels: dict[str, Any]
    model: dict[str, Any] | None = None


def pair_session(session: str | Path, client_run: str | Path, phase: str) -> None:
    """Check that a server's capture (``splitleak serve --capture``, one ``session-NNNN/``) and a
    client's run directory recorded the same session: the session's configuration is the one the
    client sent (its hash is in the client's manifest) and the phase's ledger, the hash of every
    frame that crossed, is the same bytes on both sides. Raises IntegrityError naming what differs."""
    m_s, m_c = read_manifest(session), read_manifest(client_run)
    if m_s.get("role") != "server":
        raise ConfigError(f"{session} is not a server session (its manifest has no role 'server')")
    if m_c.get("role") == "server":
        raise ConfigError(f"{client_run} is a server session too; --documents takes the client's run directory")
    sent = (m_c.get("transport") or {}).get("server_config_hash")
    if sent is None:
        raise IntegrityError(
            f"{client_run} was not trained against a server (`train --connect`); it pairs with no session"
        )
    if sent != m_s.get("config_hash"):
        raise IntegrityError(
            f"{session} served configuration {str(m_s.get('config_hash'))[:12]}, but {client_run} sent "
            f"{sent[:12]}: they are not the same session"
        )
    rel = Path("wire") / f"{phase}-ledger.json"
    a, b = Path(session) / rel, Path(client_run) / rel
    if not a.is_file() or not b.is_file():
        raise IntegrityError(f"{rel} is missing from {session if not a.is_file() else client_run}; nothing to pair")
    if a.read_bytes() != b.read_bytes():
        raise IntegrityError(
            f"the {phase} frames the server recorded ({a}) differ from those the client recorded ({b}): "
            "not the same session, or one side's capture is not what crossed"
        )


def find_session(capture: str | Path, client_run: str | Path) -> Path:
    """The session of a server's capture folder (or the session folder itself) that recorded the same
    frames as ``client_run``, in both phases."""
    capture = Path(capture)
    candidates = [capture] if (capture / "manifest.json").is_file() else sorted(capture.glob("session-*"))
    why = []
    for session in candidates:
        try:
            for phase in ("train", "capture"):
                pair_session(session, client_run, phase)
        except (ConfigError, IntegrityError) as exc:
            why.append(f"{session.name}: {exc}")
            continue
        return session
    raise IntegrityError(
        f"no session in {capture} recorded the frames of {client_run}"
        + (f" ({len(candidates)} tried; last: {why[-1]})" if why else " (it holds no session-NNNN folder)")
    )


def read_calibration(run_dir: str | Path) -> tuple[Document, ...]:
    """The run's public calibration documents (their own section of ``documents.json``), checked as
    ``read_documents`` checks the whole file; the evaluation and training text stay with the scorer."""
    return read_documents(run_dir).calibration
