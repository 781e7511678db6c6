"""Section 1 of the grid report: the title, the provenance (spec, protocol, their hashes, version,
date, bootstrap counts), the grid's jobs per state, the failed jobs grouped by error, and the
contents."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from splitleak import __version__
from splitleak.audit.protocol import Protocol
from splitleak.report.document import Contents, Document, Heading, Para, Table
from splitleak.report.grid_common import Ctx, count, first_line, num


def protocol_boot_counts(protocol: Protocol) -> list[str]:
    """The protocol's bootstrap replicate counts, as phrases (``main test 100,000``)."""
    out = []
    if protocol.main_test is not None:
        out.append(f"main test {protocol.main_test.n_boot:,}")
    if protocol.family is not None and (protocol.family.comparisons or protocol.family.controls):
        out.append(f"family {protocol.family.n_boot:,}")
    if protocol.tests:
        out.append(f"partial-offloading seed bootstrap {int(protocol.thresholds.get('bootstrap_draws', 10_000)):,}")
    return out


def header_section(doc: Document, ctx: Ctx, h: dict[str, Any], date: str | None, attack_rows) -> None:
    """1. Title, provenance (spec, protocol, hashes, version, date), job counts, contents."""
    doc.add(Heading(1, h["title"]))
    doc.add(Table(["", "value"], _provenance_rows(ctx, h, date), kv=True))
    if ctx.n_boot is not None:
        doc.add(
            Para(
                f"The bootstrap replicate counts of the protocol were overridden with --n-boot {ctx.n_boot:,} "
                "for a quick look; intervals and pass/fail below may differ from the pre-registered analysis.",
                "note",
            )
        )
    doc.add(_jobs_table(h["jobs"]))
    failures = h.get("failures") or []
    if any(f.get("error_type") != "skipped" for f in failures):
        doc.add(_failures_table(failures))
    if h.get("other_rows"):
        doc.add(
            Para(
                f"{h['other_rows']} further attack job(s) in the store belong to other grids (another profile, "
                "other overrides, or an earlier version of the spec) and are left out.",
                "note",
            )
        )
    doc.add(Contents())


def _provenance_rows(ctx: Ctx, h: dict[str, Any], date: str | None) -> list[list[str]]:
    """Spec and protocol with their hashes, the store, the version, the date and the bootstrap counts."""
    date = date or datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    meta = []
    if h.get("spec"):
        meta += [
            ["spec", f"`{h['spec']}`"],
            ["spec SHA-256", f"`{h['spec_sha256']}`"],
            ["profile", h.get("profile") or "(base)"],
            ["overrides", ", ".join(f"`{o}`" for o in h.get("overrides") or []) or "none"],
        ]
    meta += [
        ["protocol", f"{ctx.protocol.name} (`{ctx.protocol_path}`)"],
        ["protocol SHA-256", f"`{ctx.protocol_hash}` (frozen; every result in this report carries it)"],
        ["results store", f"`{h['store']}`"],
        ["splitleak version", __version__],
        ["generated", date],
    ]
    boots = protocol_boot_counts(ctx.protocol)
    if ctx.n_boot is not None:
        meta.append(
            [
                "bootstrap replicates",
                f"**overridden to {ctx.n_boot:,} (--n-boot)**; the protocol's ({', '.join(boots)}) are what count",
            ]
        )
    elif boots:
        meta.append(["bootstrap replicates", f"as the protocol fixes them ({', '.join(boots)})"])
    meta.append(["descriptive intervals", f"{ctx.descriptive_boot:,} bootstrap replicates, seed 0"])
    return meta


def _jobs_table(jobs: dict[str, dict[str, int]]) -> Table:
    """Jobs per kind and state, with totals."""
    states = [s for s in ("done", "running", "failed", "pending") if any(s in v for v in jobs.values())]
    jrows = []
    for kind in ("train", "attack", "reuse"):
        v = jobs.get(kind, {})
        jrows.append([kind] + [num(v.get(s, 0)) for s in states] + [num(sum(v.get(s, 0) for s in states))])
    tot = [sum(jobs.get(k, {}).get(s, 0) for k in ("train", "attack", "reuse")) for s in states]
    jrows.append(["all"] + [num(x) for x in tot] + [num(sum(tot))])
    return Table(
        ["jobs"] + states + ["total"],
        jrows,
        caption="Jobs of the grid in the store (reuse: inference-setting rows that copy a training-setting "
        "measurement).",
    )


def _failures_table(failures: list[dict[str, Any]]) -> Table:
    """The failed jobs grouped by their error's first line, the largest group first; skipped ones counted."""
    real = [f for f in failures if f.get("error_type") != "skipped"]
    groups: dict[str, list[dict[str, Any]]] = {}
    for f in real:
        groups.setdefault(f"{f.get('error_type')}: {first_line(f.get('error'))}", []).append(f)
    rows = []
    for error, fs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        named = "; ".join(f"{f.get('summary', '')} (`{f['key'][:12]}`)" for f in fs[:3])
        rows.append(
            [count(len(fs), "job"), f"{error} — {named}" + (f"; and {len(fs) - 3} more" if len(fs) > 3 else "")]
        )
    skipped = len(failures) - len(real)
    return Table(
        ["jobs", "error and jobs"],
        rows,
        kv=True,
        caption=(
            f"{count(len(real), 'job')} failed"
            + (
                f" and {count(skipped, 'job')} depending on them {'was' if skipped == 1 else 'were'} skipped"
                if skipped
                else ""
            )
            + "; their results are missing from every section below (tracebacks: `splitleak experiment status`)."
        ),
    )
