"""A resumed run read whole: the runs it continues, found, verified and joined step by step.

A deployed run that was killed continues in a new run directory (``train --resume``, and on the
server a new session): its training phase holds the frames from the resumed step on, and the frames
before it are in the run it continued, which its manifest's ``resumed_from`` names (that run may
itself have continued another). Each side flushes its training tap before it writes a checkpoint, so
the run it continued holds every frame before the step it resumed from, whatever killed it.

``continued_run`` finds the run a manifest names (beside the run first, by the relative path the
manifest records, then by the path given at the resume), verifies it to its journal's last whole entry
and checks the link: the same configuration, and the checkpoint resumed from is the one it recorded
(the client's journal entry and digest; the server's checkpoint token). ``read_wire_whole`` returns the
training frames of the whole chain, every step once: those of each earlier run before the step the next
one resumed from, then the run's own. A chain with a step missing, a run not found or one that does not
verify is refused: a reader of it would read part of the traffic as if it were all of it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitleak.errors import IntegrityError
from splitleak.runs.journal import journal_entries, read_run_json
from splitleak.runs.verify import verify_run
from splitleak.runs.wire import WireRecord, read_wire, wire_phases

#: the phase that continues across a resume (the capture pass runs whole in the last run)
CHAINED_PHASE = "train"


@dataclass(frozen=True)
class Continued:
    """The run a resumed run continues, verified, and the steps done before the resume."""

    run: Path
    after_steps: int


def resumed_record(earlier: str | Path, after_steps: int, here: str | Path, **extra: Any) -> dict[str, Any]:
    """A manifest's ``resumed_from``: the run continued (as given, and relative to ``here``, the new run's
    folder, so that the two can move together) and the steps done before the resume."""
    rel = os.path.relpath(Path(earlier).resolve(), Path(here).resolve())
    return {"run": str(earlier), "path_from_run": Path(rel).as_posix(), "after_steps": after_steps, **extra}


def _manifest(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}


def _locate(run_dir: Path, rec: dict[str, Any]) -> Path:
    tried: list[Path] = []
    if isinstance(rec.get("path_from_run"), str):
        tried.append(Path(os.path.normpath(run_dir / rec["path_from_run"])))
    if isinstance(rec.get("run"), str):
        tried += [Path(rec["run"]), run_dir.parent / Path(rec["run"]).name]
    for p in tried:
        if p.is_dir():
            return p
    where = ", ".join(dict.fromkeys(str(p) for p in tried)) or "nowhere (its manifest names no run)"
    raise IntegrityError(
        f"{run_dir} continues a run that is not found (looked in {where}); its training frames before step "
        f"{rec.get('after_steps')} are there: put that run back beside it, or read only the capture pass"
    )


def continued_run(run_dir: str | Path) -> Continued | None:
    """The run ``run_dir`` continues (None when it is not a resumed run), found and verified."""
    run_dir = Path(run_dir)
    manifest = _manifest(run_dir)
    rec = manifest.get("resumed_from")
    if not isinstance(rec, dict):
        return None
    earlier = _locate(run_dir, rec)
    v = verify_run(earlier, to_last_entry=True)
    if not v.ok:
        raise IntegrityError(f"{run_dir} continues {earlier}, which does not verify: {v.message}")
    before = read_run_json(earlier, "manifest.json")
    if before.get("config_hash") != manifest.get("config_hash"):
        raise IntegrityError(
            f"{run_dir} continues {earlier}, a run of another configuration ({str(before.get('config_hash'))[:12]}, "
            f"this run's {str(manifest.get('config_hash'))[:12]}): the manifest names the wrong run"
        )
    after = int(rec["after_steps"])
    _check_link(run_dir, earlier, rec, before, after)
    return Continued(earlier, after)


def _check_link(run_dir: Path, earlier: Path, rec: dict[str, Any], before: dict[str, Any], after: int) -> None:
    """The checkpoint resumed from is one the earlier run wrote: the client's run recorded it in its journal
    (digest and step); a server session named its checkpoints with the token the resume presented."""
    if "checkpoint_sha256" in rec:
        held = [
            e.get("info", {})
            for e in journal_entries(earlier)
            if e.get("kind") == "checkpoint" and e.get("info", {}).get("done") == after
        ]
        if not any(h.get("sha256") == rec["checkpoint_sha256"] for h in held):
            raise IntegrityError(
                f"{run_dir} resumed from a checkpoint after {after} steps that {earlier} never recorded (its journal "
                f"holds {len(held)} checkpoint(s) after that step, none with the digest resumed from): another run"
            )
    if "token" in rec and (before.get("checkpoints") or {}).get("token") != rec["token"]:
        raise IntegrityError(f"{run_dir} resumed a training whose checkpoints {earlier} did not write (another token)")


def chain_of(run_dir: str | Path) -> list[Continued]:
    """Every run ``run_dir`` continues, nearest first, each verified."""
    out: list[Continued] = []
    here: Path | None = Path(run_dir)
    while here is not None and (link := continued_run(here)) is not None:
        if any(c.run.resolve() == link.run.resolve() for c in out) or link.run.resolve() == Path(run_dir).resolve():
            raise IntegrityError(f"{run_dir}: its chain of resumed runs loops back to {link.run}")
        out.append(link)
        here = link.run
    return out


def read_wire_whole(run_dir: str | Path, phase: str, *, redone: bool = False) -> list[WireRecord]:
    """``read_wire(run_dir, phase)``, and for the training phase of a resumed run the frames of the runs it
    continues before it: each earlier run's frames of the steps before the one its successor resumed
    from (every step once, none missing), then the run's own. ``redone``: keep too the frames an earlier
    run sent after the checkpoint it was resumed from, which crossed and were sent again after the resume
    (what a count of every crossing, the privacy bound's, must see)."""
    run_dir = Path(run_dir)
    own = read_wire(run_dir, phase) if phase in wire_phases(run_dir) else []
    link = continued_run(run_dir) if phase == CHAINED_PHASE else None
    if link is None:
        return own
    every = read_wire_whole(link.run, phase, redone=redone)
    earlier = [r for r in every if int(r.header["step"]) < link.after_steps]
    steps = {int(r.header["step"]) for r in earlier if r.header["kind"] == "forward"}
    missing = sorted(set(range(link.after_steps)) - steps)
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (" …" if len(missing) > 8 else "")
        raise IntegrityError(
            f"{run_dir} continues {link.run} after {link.after_steps} steps, and the frames of step(s) {shown} are "
            f"in neither: they were never written (a run written before each side flushed its frames at a "
            f"checkpoint, and killed), so its training traffic cannot be read whole"
        )
    return (every if redone else earlier) + own


def verify_chain(run_dir: str | Path) -> str | None:
    """For a resumed run, that it reads whole: every run it continues found, verified and linked, and the
    training steps of the chain each present once. A line saying so, None for a run that resumed nothing;
    IntegrityError naming the first problem."""
    chain = chain_of(run_dir)
    if not chain:
        return None
    records = read_wire_whole(run_dir, CHAINED_PHASE)
    steps = len({int(r.header["step"]) for r in records if r.header["kind"] == "forward"})
    runs = ", ".join(f"{c.run} (its steps before {c.after_steps})" for c in chain)
    return f"continues {runs}: the training traffic reads whole, {steps} steps each once"
