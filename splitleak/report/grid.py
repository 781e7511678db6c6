"""`splitleak experiment report SPEC --out DIR`: the report of an experiment grid, recomputed from
its results store.

    from splitleak.report.grid import grid_report
    rep = grid_report("paper_main", profile="quick", overrides=["model=tiny-gpt2"], out="report/")
    rep.markdown, rep.html, rep.figures

It writes ``DIR/report.md``, a self-contained ``DIR/report.html`` (CSS inline, figures embedded as
base64 PNG, no scripts or external assets) and each figure as PNG and SVG beside them. Sections,
as the store's data allows (a section without data says why in one line):

1. header: spec and its SHA-256 (profile, overrides), protocol and its SHA-256, splitleak version,
   jobs done / running / failed / pending, date;
2. the negative controls: every token attack job's mis-paired twin (``splitleak.audit.verdicts``), per
   attack and copy, and each job whose control was detected named as an instrument fault, above the tests;
   the protocol's main test and its Bonferroni family (``splitleak.audit.analysis.analyse``);
3. token, whole-document and span recovery per attack configuration x split x copy, with 95 %
   bootstrap intervals (What Gradients Add Tables 2, 3, 4, 7);
4. the joint attacker under observer-side gradient perturbations (What Gradients Add Figure 5);
5. leakage against the utility cost of each defence (What Gradients Add Figure 6);
6. the attack x condition heatmap of token recovery (What Gradients Add Figure 7);
7. partial offloading: means per placement, the variance tests and the held-out-seed RMSE
   (What Gradients Add Tables 10 and 5);
8. the decoy system (002), when the grid trained latent arms: the support partition, the probe
   battery with its shuffled-label twins and seed-level pooling, the held-out loss and the output
   gradient's cost, beside the paper's numbers (``splitleak.report.grid_latent``), and the dose ladder,
   the probes' positive control (``splitleak.report.grid_dose``);
9. label-shielded fine-tuning (003), when the grid trained shielded arms: per arm the held-out loss, the
   output gradient's utility and what GMA-SL and BiSR read, the privacy–utility figure and the paper's
   claims of shape checked on the grid's numbers (``splitleak.report.grid_shielded``).

Results written under another protocol hash are refused before anything is written, naming them.
``store_report`` does the same from a store and a protocol file without a spec (no pending count).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from splitleak.attacks.config import record_identity
from splitleak.audit.analysis import analyse
from splitleak.audit.gate import resolve_thresholds
from splitleak.audit.protocol import Protocol, check_results, file_sha256, load_protocol
from splitleak.errors import ConfigError, DataError, IntegrityError
from splitleak.experiments import grid_status, load_spec, read_results
from splitleak.experiments.store import ResultsStore
from splitleak.report.document import Document, render_html, render_markdown
from splitleak.report.grid_bound import bound_section, run_bounds
from splitleak.report.grid_common import Ctx, GridReport
from splitleak.report.grid_controls import controls_section
from splitleak.report.grid_cost import cost_section
from splitleak.report.grid_dose import dose_section
from splitleak.report.grid_header import header_section
from splitleak.report.grid_latent import is_latent, latent_section
from splitleak.report.grid_offload import offload_section
from splitleak.report.grid_passes import passes_section, run_passes
from splitleak.report.grid_recovery import heatmap_section, perturbation_section, recovery_section
from splitleak.report.grid_shielded import is_shielded, shielded_section
from splitleak.report.grid_stats import Config, recovery_cells, split_text
from splitleak.report.grid_tests import main_section

#: bootstrap replicates of the descriptive intervals (sections 3-6); the protocol's tests use its own count
DESCRIPTIVE_BOOT = 2000
FIGURES = ("gradient-perturbations", "leakage-cost", "heatmap")


# ------------------------------------------------------------------ adapters from the store


def analysis_rows(attack_rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-document records ``splitleak.audit.analysis.analyse`` reads, from store attack rows.

    Rows without per-token scores (property inference) are left out; the attack's fields are its
    identity (``attacks.config.record_identity``: read from the row's ``attack_config``, ``budget``
    an int or ``"exhaustive"``, ``params`` canonical JSON), ``defence`` is the chain's names joined by
    ``+`` (the store's ``defence_name``), ``config_hash`` the job's key. Inference-setting reuse rows
    are kept (``inference`` True), so a selector that names ``inference: true`` finds them."""
    out = []
    for r in attack_rows:
        if r.get("token_counted") is None:
            continue
        out.append(
            {
                **record_identity(r),
                "model": r.get("model"),
                "depth": r.get("depth"),
                "offload_start": r.get("offload_start"),
                "offload_length": r.get("offload_length"),
                "defence": r.get("defence_name") or "none",
                "data": r.get("data"),
                "victim_seed": r.get("victim_seed"),
                "doc_id": r["doc_id"],
                "token_correct": r["token_correct"],
                "token_counted": r["token_counted"],
                "exact": bool(r["exact"]),
                "protocol_hash": r.get("protocol_hash"),
                "config_hash": r["key"],
            }
        )
    return out


def offload_run_rows(
    attack_rows: Sequence[dict[str, Any]], train_rows: Sequence[dict[str, Any]], protocol_hash: str
) -> list[dict[str, Any]]:
    """One record per partial-offloading train job for ``analyse``'s partial-offloading tests:
    defence (names), victim seed, start, length, ``delta_u`` and perplexity from the train table, and
    ``leakage_index`` and ``vmi_excess`` (VMI minus majority-control token recovery) from the
    ``property`` attack rows of that train job (averaged when several property jobs ran on it).

    A train job without a property result keeps ``leakage_index`` None and carries the protocol's
    hash (train rows are not stamped with one; their attack jobs are)."""
    prop: dict[str, dict[str, dict[str, Any]]] = {}
    for r in attack_rows:
        if r["attack"] == "property" and r.get("leakage_index") is not None:
            prop.setdefault(r["train_key"], {})[r["key"]] = r  # one record per job (rows repeat per document)
    out = []
    for t in train_rows:
        if t.get("offload_length") is None:
            continue
        jobs = list(prop.get(t["key"], {}).values())
        li = [j["leakage_index"] for j in jobs]
        vmi = [
            j["vmi_token_recovery"] - j["majority_token_recovery"]
            for j in jobs
            if j.get("vmi_token_recovery") is not None and j.get("majority_token_recovery") is not None
        ]
        out.append(
            {
                "model": t.get("model"),
                "defence": t.get("defence_name") or "none",
                "victim_seed": t["victim_seed"],
                "offload_start": t["offload_start"],
                "offload_length": t["offload_length"],
                "delta_u": t.get("delta_u"),
                "perplexity": t.get("perplexity"),
                "leakage_index": sum(li) / len(li) if li else None,
                "vmi_excess": sum(vmi) / len(vmi) if vmi else None,
                "attack": "property",
                "config_hash": jobs[0]["key"] if jobs else t["key"],
                "protocol_hash": jobs[0]["protocol_hash"] if jobs else protocol_hash,
            }
        )
    return out


def check_protocol(attack_rows: Sequence[dict[str, Any]], protocol_hash: str, store: Path | None = None) -> None:
    """Refuse (IntegrityError) attack results written under another protocol hash, one line per job
    naming its configuration, key and hash."""
    jobs = {}
    for r in attack_rows:
        if r["key"] not in jobs:
            split = split_text(r.get("depth"), r.get("offload_start"), r.get("offload_length"))
            what = (
                f"{r.get('model')} {split} {r.get('defence')} seed {r.get('victim_seed')} | "
                f"{Config.of(r).attack_text()} {r.get('client_copy')} a{r.get('attack_seed')}"
            )
            jobs[r["key"]] = {"attack": what, "config_hash": r["key"], "protocol_hash": r.get("protocol_hash")}
    try:
        check_results(jobs.values(), protocol_hash)
    except IntegrityError as exc:
        where = f" (files attacks/<key>.parquet in {store})" if store is not None else ""
        raise IntegrityError(
            f"refusing to report: {exc}{where}. Report them under the protocol they were written with, or move them "
            "out of the store"
        ) from None


# ------------------------------------------------------------------ entry points


def grid_report(
    spec: str | Path,
    *,
    out: str | Path,
    profile: str | None = None,
    overrides: Sequence[str] = (),
    store: str | Path | None = None,
    n_boot: int | None = None,
    descriptive_boot: int = DESCRIPTIVE_BOOT,
    date: str | None = None,
) -> GridReport:
    """Write the report of a grid (spec, profile, overrides) from its results store into ``out``.

    Only the grid's own jobs are reported; attack results on the grid's trained models written under
    another protocol hash are refused (IntegrityError), naming them. ``n_boot`` replaces the
    protocol's bootstrap replicate counts for a quick look (the report says so); ``descriptive_boot``
    is the replicate count of the descriptive intervals. Returns the paths written."""
    loaded = load_spec(spec, profile, tuple(overrides))
    protocol, phash = load_protocol(loaded.protocol_path)
    status = grid_status(loaded, store=store)
    grid = status.grid
    train_keys = {j.key for j in grid.of_kind("train")}
    keys = {j.key for j in grid.jobs}
    attack_all = read_results(status.store, "attack", as_rows=True)
    mine = [r for r in attack_all if r.get("train_key") in train_keys]
    check_protocol(mine, phash, status.store)
    attack_rows = [r for r in mine if r["key"] in keys]
    # the readings of the training traffic (phase: train), kept out of every table of the capture pass
    train_phase = [r for r in read_results(status.store, "attack", as_rows=True, phase="train") if r["key"] in keys]
    check_protocol(train_phase, phash, status.store)
    train_rows = [r for r in read_results(status.store, "train", as_rows=True) if r["key"] in train_keys]
    counts = status.counts()
    header = {
        "title": f"Experiment report: {loaded.name}" + (f" (profile {loaded.profile})" if loaded.profile else ""),
        "spec": str(loaded.path),
        "spec_sha256": file_sha256(loaded.path),
        "profile": loaded.profile,
        "overrides": list(loaded.overrides),
        "store": str(status.store),
        "jobs": counts,
        "other_rows": len({r["key"] for r in attack_all}) - len({r["key"] for r in attack_rows}),
        "failures": [{"key": k, **f} for k, f in status.failures.items()],
    }
    return build_report(
        protocol,
        phash,
        loaded.protocol_path,
        attack_rows,
        train_rows,
        out,
        header=header,
        n_boot=n_boot,
        descriptive_boot=descriptive_boot,
        date=date,
        train_phase=train_phase,
    )


def store_report(
    store: str | Path,
    protocol_path: str | Path,
    *,
    out: str | Path,
    n_boot: int | None = None,
    descriptive_boot: int = DESCRIPTIVE_BOOT,
    date: str | None = None,
    title: str | None = None,
) -> GridReport:
    """Write the report of everything in a results store under a frozen protocol (no spec: the
    header counts jobs done and failed, not pending). Refuses results under another protocol hash."""
    protocol, phash = load_protocol(protocol_path)
    rs = ResultsStore(store)
    attack_rows = read_results(rs.root, "attack", as_rows=True)
    check_protocol(attack_rows, phash, rs.root)
    train_phase = read_results(rs.root, "attack", as_rows=True, phase="train")
    check_protocol(train_phase, phash, rs.root)
    train_rows = read_results(rs.root, "train", as_rows=True)
    counts = {"train": {"done": len(train_rows)}, "attack": {"done": 0}, "reuse": {"done": 0}}
    for kind in {r["key"]: r["kind"] for r in [*attack_rows, *train_phase]}.values():
        counts["reuse" if kind == "reuse" else "attack"]["done"] += 1
    for f in rs.failures().values():
        k = f["kind"] if f["kind"] in counts else "attack"
        counts[k]["failed"] = counts[k].get("failed", 0) + 1
    header = {
        "title": title or f"Results store report: {rs.root.name}",
        "store": str(rs.root),
        "jobs": counts,
        "failures": [{"key": k, **f} for k, f in rs.failures().items()],
    }
    return build_report(
        protocol,
        phash,
        Path(protocol_path),
        attack_rows,
        train_rows,
        out,
        header=header,
        n_boot=n_boot,
        descriptive_boot=descriptive_boot,
        date=date,
        train_phase=train_phase,
    )


def _with_n_boot(protocol: Protocol, n: int) -> Protocol:
    upd: dict[str, Any] = {}
    if protocol.main_test is not None:
        upd["main_test"] = protocol.main_test.model_copy(update={"n_boot": n})
    if protocol.family is not None:
        upd["family"] = protocol.family.model_copy(update={"n_boot": n})
    if protocol.tests:
        upd["thresholds"] = {**protocol.thresholds, "bootstrap_draws": n}
    return protocol.model_copy(update=upd)


def build_report(
    protocol: Protocol,
    protocol_hash: str,
    protocol_path: Path,
    attack_rows: Sequence[dict[str, Any]],
    train_rows: Sequence[dict[str, Any]],
    out: str | Path,
    *,
    header: dict[str, Any],
    n_boot: int | None = None,
    descriptive_boot: int = DESCRIPTIVE_BOOT,
    date: str | None = None,
    train_phase: Sequence[dict[str, Any]] = (),
) -> GridReport:
    """Analyse store rows under a protocol and write the report (Markdown, HTML, figures) into ``out``;
    ``train_phase``: the attack rows that read the training traffic (their own section)."""
    check_protocol(attack_rows, protocol_hash)
    if n_boot is not None and (isinstance(n_boot, bool) or int(n_boot) < 1):
        raise ConfigError(f"--n-boot is {n_boot!r}; pass an integer >= 1")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for stem in FIGURES:  # a figure of an earlier report that this one omits must not linger
        for ext in ("png", "svg"):
            (out / f"{stem}.{ext}").unlink(missing_ok=True)
    used = _with_n_boot(protocol, int(n_boot)) if n_boot is not None else protocol
    every_attack_row = list(attack_rows)
    latent_rows = [r for r in attack_rows if is_latent(r)]  # frames, not documents: their own section
    attack_rows = [r for r in attack_rows if not is_latent(r)]
    latent_train = [t for t in train_rows if is_latent(t)]
    train_rows = [t for t in train_rows if not is_latent(t)]
    shielded_rows = [r for r in attack_rows if is_shielded(r)]  # label attacks on 003's setting: their own section
    attack_rows = [r for r in attack_rows if not is_shielded(r)]
    shielded_train = [t for t in train_rows if is_shielded(t)]
    train_rows = [t for t in train_rows if not is_shielded(t)]
    rows = analysis_rows(attack_rows)
    run_rows = offload_run_rows(attack_rows, train_rows, protocol_hash)
    analysis, error = None, None
    try:
        analysis = analyse(used, protocol_hash, rows, run_rows)
    except (DataError, ConfigError) as exc:
        error = str(exc)
    cells = recovery_cells(attack_rows, n_boot=descriptive_boot, seed=0)
    rep = GridReport(out, out / "report.md", out / "report.html", analysis=analysis, analysis_error=error)
    doc = Document(header["title"])
    ctx = Ctx(protocol, used, protocol_hash, protocol_path, n_boot, descriptive_boot, out, rep)
    header_section(doc, ctx, header, date, attack_rows)
    controls_section(doc, ctx, every_attack_row)
    main_section(doc, ctx, rows, analysis, error)
    recovery_section(doc, ctx, cells, attack_rows)
    perturbation_section(doc, ctx, cells)
    cost_section(doc, ctx, attack_rows, train_rows)
    heatmap_section(doc, ctx, cells)
    offload_section(doc, ctx, run_rows, analysis, error)
    latent_section(doc, latent_rows, latent_train, resolve_thresholds(protocol, protocol_hash))
    dose_section(doc, latent_rows)
    shielded_section(doc, shielded_rows, shielded_train, out, used.thresholds)
    # every defended run, of every split mode (a label-shielded arm's strongest token reading, its labels included)
    rep.bounds = run_bounds([*train_rows, *shielded_train], [*attack_rows, *shielded_rows], header.get("store"))
    bound_section(doc, rep.bounds)
    rep.passes = run_passes([*train_rows, *shielded_train], train_phase, header.get("store"))
    passes_section(doc, rep.passes)
    rep.markdown.write_text(render_markdown(doc), encoding="utf-8")
    rep.html.write_text(render_html(doc), encoding="utf-8")
    return rep
