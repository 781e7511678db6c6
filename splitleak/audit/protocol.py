"""Protocols fixed before the runs: hypotheses, the main test and its pass mark, the comparison
family, thresholds, seeds and document counts, in a YAML file.

``freeze_protocol(FILE)`` records the SHA-256 of the file's bytes in ``FILE.frozen.json``. From
then on ``load_protocol(FILE)`` refuses the file if its bytes no longer match (the message names
both hashes), every result written under it carries ``protocol_hash``, and ``check_results``
refuses results whose hash differs, naming them.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from splitleak.errors import ConfigError, IntegrityError
from splitleak.files import read_json, read_yaml

#: the protocols shipped with splitleak; each ships frozen (its FILE.frozen.json is package data), so a
#: grid under a shipped protocol never writes into the installed package
SHIPPED = Path(__file__).parent / "protocols"


class MainTest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    description: str
    metric: str = "token_recovery"
    treatment: dict[str, Any]  # attack configuration whose score is the minuend
    control: dict[str, Any]  # attack configuration subtracted
    pass_mark: float  # the lower end of the interval must exceed this (a share: 0.02 = 2 points)
    alpha: float = Field(0.05, gt=0, lt=1)
    interval: str = "crossed bootstrap over victim models and documents"
    n_boot: int = Field(100_000, ge=1)
    bootstrap_seed: int = 0


class Comparison(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    treatment: dict[str, Any]
    control: dict[str, Any]


class Family(BaseModel):
    """A family of comparisons tested at alpha / size each (Bonferroni).

    The comparisons are listed in ``comparisons``, or generated as ``treatment`` against each of
    ``controls`` at every combination of the values in ``over`` (keys such as depth, client_copy,
    k); a key that the treatment or a control names itself is kept as written (``k: null`` for an
    attack without a candidate budget); with ``exclude_main_test`` the combination equal to the main test is left out. Either way
    the number of comparisons must equal ``size``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    description: str
    size: int = Field(ge=1)
    alpha: float = Field(0.05, gt=0, lt=1)
    correction: Literal["bonferroni"] = "bonferroni"
    pass_rule: str = "lower end of the corrected interval above zero"
    metric: str = "token_recovery"
    n_boot: int = Field(100_000, ge=1)
    bootstrap_seed: int = 0
    comparisons: list[Comparison] = Field(default_factory=list)
    treatment: dict[str, Any] = Field(default_factory=dict)
    controls: list[dict[str, Any]] = Field(default_factory=list)
    over: dict[str, list[Any]] = Field(default_factory=dict)
    exclude_main_test: bool = True

    def expand(self, main: "MainTest | None" = None) -> list[Comparison]:
        """The family's comparisons, listed or generated (see the class docstring)."""
        if self.comparisons:
            return list(self.comparisons)
        if not self.controls:
            return []

        keys = list(self.over)
        out = []
        for values in itertools.product(*(self.over[k] for k in keys)):
            cond = dict(zip(keys, values))
            for ctl in self.controls:
                c = Comparison(treatment={**cond, **self.treatment}, control={**cond, **ctl})
                if (
                    self.exclude_main_test
                    and main is not None
                    and c.treatment == main.treatment
                    and c.control == main.control
                ):
                    continue
                out.append(c)
        return out


class Protocol(BaseModel):
    """The typed content of a protocol file; unknown keys are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    source: str  # the paper section it implements
    hypotheses: list[str]
    main_test: MainTest | None = None
    family: Family | None = None
    tests: list[dict[str, Any]] = Field(default_factory=list)  # further pre-registered tests
    thresholds: dict[str, float] = Field(default_factory=dict)
    victim_seeds: list[int]
    attack_seeds: list[int] = Field(default_factory=lambda: [0])
    documents: dict[str, int]
    models: list[str] = Field(default_factory=list)
    notes: str = ""


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def frozen_record_path(path: Path) -> Path:
    """Where ``freeze_protocol`` records a protocol's hash: FILE.frozen.json beside it."""
    return path.with_name(path.name + ".frozen.json")


def parse_protocol(path: str | Path) -> Protocol:
    path = Path(path)
    data = read_yaml(path, "protocol")
    try:
        proto = Protocol(**(data or {}))
    except (ValidationError, TypeError) as exc:
        raise ConfigError(f"{path} is not a valid protocol: {exc}") from None
    fam = proto.family
    if fam is not None and (fam.comparisons or fam.controls):
        n = len(fam.expand(proto.main_test))
        if n != fam.size:
            raise ConfigError(
                f"{path}: the family lists or generates {n} comparisons but declares size {fam.size}; "
                "make them agree (the Bonferroni split uses size)"
            )
    return proto


def read_frozen_record(path: Path) -> str:
    """The SHA-256 that ``freeze_protocol`` recorded for the protocol ``path`` (FILE.frozen.json), checked:
    a JSON object whose ``sha256`` is 64 hex digits and whose ``file`` is the protocol's name."""
    rec = frozen_record_path(path)
    fix = (
        "the freeze record is damaged: restore it from version control; a protocol cannot be re-frozen after "
        "the runs (write a new protocol file under a new name)"
    )
    data = read_json(rec, "freeze record", fix)
    digest = data.get("sha256")
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise IntegrityError(f"{rec}: sha256 is not 64 hex digits; {fix}")
    if data.get("file", path.name) != path.name:
        raise IntegrityError(f"{rec} records the freeze of {data.get('file')!r}, not of {path.name}; {fix}")
    return digest


def freeze_protocol(path: str | Path) -> str:
    """Validate the protocol and record its SHA-256 beside it; refreezing an edited file is refused."""
    path = Path(path)
    parse_protocol(path)
    digest = file_sha256(path)
    rec = frozen_record_path(path)
    if rec.exists():
        old = read_frozen_record(path)
        if old != digest:
            raise IntegrityError(
                f"{path} was frozen with sha256 {old} and now hashes to {digest}: it was edited after freezing. "
                "A frozen protocol cannot be changed; write a new protocol file under a new name"
            )
        return digest
    rec.write_text(
        json.dumps(
            {
                "file": path.name,
                "sha256": digest,
                "frozen_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            },
            indent=2,
        )
        + "\n"
    )
    return digest


def load_protocol(path: str | Path) -> tuple[Protocol, str]:
    """The protocol and its hash, only if it was frozen and is unchanged since."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"protocol file {path} does not exist" + (" (it is a directory)" if path.is_dir() else ""))
    rec = frozen_record_path(path)
    if not rec.exists():
        raise IntegrityError(f"{path} has not been frozen; run `splitleak protocol freeze {path}` before the runs")
    frozen = read_frozen_record(path)
    now = file_sha256(path)
    if now != frozen:
        raise IntegrityError(
            f"{path} was frozen with sha256 {frozen} but now hashes to {now}: the protocol was edited after "
            "freezing, so results cannot be analysed under it"
        )
    return parse_protocol(path), now


def check_results(results: Iterable[dict[str, Any]], protocol_hash: str) -> None:
    """Refuse results not written under ``protocol_hash``, naming them and both hashes."""
    bad = []
    for r in results:
        h = r.get("protocol_hash")
        if h != protocol_hash:
            bad.append(f"{r.get('attack', '?')} ({r.get('config_hash', '?')[:12]}): protocol_hash {h}")
    if bad:
        raise IntegrityError(
            f"{len(bad)} result(s) were not written under the protocol with sha256 {protocol_hash}: "
            + "; ".join(bad[:5])
            + ("" if len(bad) <= 5 else f"; and {len(bad) - 5} more")
        )


def shipped_protocols() -> list[Path]:
    return sorted(SHIPPED.glob("*.yaml"))
