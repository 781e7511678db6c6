"""The report of a ``splitleak tune`` (``splitleak.experiments.tune``): the utility-privacy frontier as a
figure and ``tune.md``, drawn from the trials the study recorded. ``render_tune`` is what ``tune(...,
render=...)`` calls."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from splitleak.experiments.tune import ADAPTIVE, Space, TuneSettings, resolve_attacks
from splitleak.report.figures import pyplot, save_png_svg


def render_tune(
    out: Path,
    settings: TuneSettings,
    space: Space,
    trials: list[dict[str, Any]],
    passing: list[dict[str, Any]],
    frontier: list[int],
) -> list[Path]:
    """``frontier.png`` / ``.svg`` and ``tune.md`` in ``out``; the paths written."""
    return [
        *frontier_figure(out / "frontier", settings, trials),
        write_markdown(out, settings, space, trials, passing, frontier),
    ]


def _cost_text(settings: TuneSettings, cost: float | None) -> str:
    if cost is None:
        return "n/a"
    return f"{100 * cost:+.2f} %" if settings.utility == "rel-ppl" else f"{cost:+.4f} nats"


def frontier_figure(out_stem: Path, settings: TuneSettings, trials: list[dict[str, Any]]) -> list[Path]:
    """One point per configuration: x the utility cost, y the worst reader's token recovery; passing
    (green circles), failing (red crosses) and stopped early (grey triangles: lower bounds); the Pareto
    frontier as a step line (a stopped trial joins it only when it already reads every token, the one
    lower bound that is exact); the undefended points labelled."""
    plt = pyplot()
    scale = 100.0 if settings.utility == "rel-ppl" else 1.0
    fig, ax = plt.subplots(figsize=(6.4, 4.6), constrained_layout=True)
    pts = [t for t in trials if t["error"] is None and t["cost"] is not None and t["worst_token_recovery"] is not None]
    kinds = (
        ("passes", lambda t: t["passes"], dict(marker="o", color="C2", s=46), "passes (gate held, within budget)"),
        (
            "fails",
            lambda t: not t["passes"] and t["stopped"] is None,
            dict(marker="x", color="C3", s=46),
            "fails (gate broken or over budget)",
        ),
        (
            "stopped",
            lambda t: t["stopped"] is not None,
            dict(marker="^", facecolors="none", edgecolors="0.45", s=46),
            "stopped early (recovery a lower bound)",
        ),
    )
    for _, pick, style, label in kinds:
        sel = [t for t in pts if pick(t)]
        if sel:
            ax.scatter(
                [scale * t["cost"] for t in sel],
                [100 * t["worst_token_recovery"] for t in sel],
                zorder=3,
                label=label,
                **style,
            )
    front = sorted((t for t in pts if t.get("on_frontier")), key=lambda t: (t["cost"], t["worst_token_recovery"]))
    if front:
        xs = [scale * t["cost"] for t in front]
        ys = [100 * t["worst_token_recovery"] for t in front]
        ax.step(xs, ys, where="post", color="C0", lw=1.4, zorder=2, label="Pareto frontier")
    labels: dict[tuple[float, float], tuple[float, float, list[str], list[str]]] = {}  # points that coincide
    for t in pts:
        if t["defence"] != "none" and not t.get("on_frontier"):
            continue
        x, y = scale * t["cost"], 100 * t["worst_token_recovery"]
        gx, gy, undefended, others = labels.setdefault((round(x, 2), round(y, 1)), (x, y, [], []))
        if t["defence"] == "none":
            undefended.append(str(t["depth"]))
        else:
            others.append(f"d{t['depth']} {t['defence']}")
    for x, y, undefended, others in labels.values():
        text = others + (
            [f"undefended, depth{'s' if len(set(undefended)) > 1 else ''} {', '.join(sorted(set(undefended)))}"]
            if undefended
            else []
        )
        low = y < 50  # labels point into the panel
        ax.annotate(
            "\n".join(text),
            (x, y),
            textcoords="offset points",
            xytext=(6, 4 if low else -4),
            fontsize=8,
            va="bottom" if low else "top",
        )
    ax.axvline(scale * settings.budget, color="0.5", ls="--", lw=1, label="utility budget")
    ax.set_xlabel(
        "cost: held-out perplexity change vs. undefended, same depth (%)"
        if settings.utility == "rel-ppl"
        else "cost: held-out cross-entropy change vs. undefended (nats)"
    )
    ax.set_ylabel("worst reader's token recovery (%)")
    ax.set_title(f"tune of {settings.model}: one point per configuration")
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return save_png_svg(fig, out_stem, dpi=130)


def not_measured(settings: TuneSettings) -> list[str]:
    """What a tune leaves out, for the reader of its Markdown and the README."""
    suite = dict(resolve_attacks(settings.attacks))
    copies = {e["client_copy"] for e in suite.values()}
    out = [
        "Only the attacks of the suite ("
        + ", ".join(settings.attacks)
        + ") are run; the gate holds against them, not against the audit's full suite (joint, SipIt without a "
        "budget) or any attack not written yet.",
        "Only token top-1 on the evaluation documents is read: no whole-document or span verdict, no "
        "membership, no property (leakage index) reading, and no injected-leak calibration, so a configuration "
        "that holds the gate is not shown to be calibrated (run `splitleak audit --defence ...` on it).",
        "Only the capture pass over the evaluation documents is attacked, not the training steps' frames.",
    ]
    if ADAPTIVE not in suite:
        out.append(
            "No attack built for the trial's defences (the adaptive attacks each defence names) is run: the gate "
            "holds against attacks that ignore the defence only."
        )
    else:
        out.append("The attacks built for each trial's defences run on the trained copy only.")
    if "trained" not in copies:
        out.append("The threat model of an attacker holding the client's trained layers is not run.")
    if "public" not in copies:
        out.append("The threat model of an observer with the public pretrained weights is not run.")
    if not any(e["attack"] in ("joint", "backward-only") for e in suite.values()):
        out.append("The returned gradient is not read by any attack of the suite (only the activations are).")
    out.append(
        f"One victim seed ({settings.victim_seed}) and one draw of documents: the cost and the gate vary with both."
    )
    out.append(
        "The bound is for an observer of the activations and gradients (the server of a plain split reads the "
        "labels in clear), and the readings are not checked against it here: a reading above it is an instrument "
        "fault that `splitleak audit` reports."
    )
    return out


def write_markdown(
    out: Path,
    settings: TuneSettings,
    space: Space,
    trials: list[dict[str, Any]],
    passing: list[dict[str, Any]],
    frontier: list[int],
) -> Path:
    def row(t: dict[str, Any]) -> str:
        G = "n/a" if t["G"] is None else f"{100 * t['G']:+.2f}" + (" (≥)" if t["stopped"] else "")
        rec = "n/a" if t["worst_token_recovery"] is None else f"{100 * t['worst_token_recovery']:.1f}"
        verdict = "error" if t["error"] else ("**passes**" if t["passes"] else "fails")
        note = t["error"] or t["stopped"] or ""
        bound = "none" if t.get("token_bound") is None else f"{100 * t['token_bound']:.1f}"
        return (
            f"| {t['number']} | {t['depth']} | `{t['defence']}` | {_cost_text(settings, t['cost'])} | {G} | "
            f"{t['worst_reader'] or 'n/a'} {rec} | {bound} | {'yes' if t['number'] in frontier else ''} | "
            f"{verdict} | {note} |"
        )

    head = (
        "| trial | depth | defence | cost | G (pp) | worst reader, token recovery (%) | no reader above (%) | "
        "frontier | verdict | note |\n"
        "| ---: | ---: | --- | ---: | ---: | --- | ---: | :---: | --- | --- |"
    )
    budget = (
        f"{100 * settings.budget:.2f} % perplexity" if settings.utility == "rel-ppl" else f"{settings.budget:g} nats"
    )
    lines = [
        f"# Tune: {settings.model}",
        "",
        f"Budget: {budget} against the undefended run at the same depth. Privacy: the gate of Politis & Pappas "
        "(2026, Eq. 1), G = the largest Bonferroni–Wilson upper-95 token top-1 of the suite's readers minus the "
        "constant baseline, held when G <= +1.00 pp. A configuration passes when it holds the gate and stays "
        "within the budget"
        + (
            f", and no reader can read more than {100 * settings.bound_below:.1f} % of its tokens (its bound)."
            if settings.bound_below is not None
            else "."
        ),
        "",
        'The upper side ("no reader above"): the mean over the evaluation documents of the most any reader of the '
        "defended run's traffic can read of a token, composed over every crossing the tap recorded under the "
        "chain's noise guarantees (dp-accounting's PLD; replace-one neighbours, the informed adversary that knows "
        "every other token, κ from the public model). It is stated for an observer of the activations and "
        "gradients: the server of a plain split reads the labels in clear. A defence without a noise guarantee "
        "has no bound (a stronger reader may read up to 100 %).",
        "",
        f"Searched: depths {', '.join(map(str, space.depths))}; defences {', '.join(Space.label(c) for c in space.chains)}"
        + (
            "; strengths (ranges ours): "
            + ", ".join(
                f"{k} in [{r['low']:g}, {r['high']:g}]{' (log)' if r['log'] else ''}" for k, r in space.ranges.items()
            )
            if space.ranges
            else ""
        )
        + f". Attacks, in order (the first is the early-stop probe): {', '.join(settings.attacks)}. "
        f"{len(trials)} trials, seed {settings.seed}.",
        "",
        "## Passing configurations, cheapest first",
        "",
    ]
    if passing:
        lines += [head, *(row(t) for t in passing)]
    else:
        lines.append("None of the trials passes: widen the budget, the strengths or the depths, or run more trials.")
    lines += ["", "## Every trial", "", head, *(row(t) for t in trials), ""]
    lines += ["## What this tune does not measure", "", *(f"- {s}" for s in not_measured(settings)), ""]
    lines += ["Figure: `frontier.png` / `frontier.svg`; every number: `tune.json`; the runs: `store/`.", ""]
    path = out / "tune.md"
    path.write_text("\n".join(lines))
    return path
