"""`splitleak audit`: train and capture on embedded defaults, attack the captured traffic, report.

Layout of the output folder: ``run/`` is the verifiable run directory (see ``splitleak.wire.store``),
``attacks/`` one RESULT.json + Parquet per attack, ``report.md`` and ``report.json`` the summary.
The verdict line is descriptive: calibrated, pre-registered verdicts come with the protocol stage.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from splitleak.attacks import load_knowledge, load_traffic, make_attack_config, run_attack
from splitleak.data import LABELS
from splitleak.errors import SplitleakError
from splitleak.metrics import fmt_pct
from splitleak.models import PRESETS, load_model, preset_available
from splitleak.progress import Progress
from splitleak.training import RunResult, make_train_config, run_training
from splitleak.wire import load_capture, verify_run

DEFAULT_MODEL = "smollm2-135m"
FALLBACK_MODEL = "tiny-gpt2"
DEFAULT_DEPTH = 6
#: the attacks the audit runs, with the main setting of 000 (k = 32; SipIt with 32 checks per token)
AUDIT_ATTACKS = (
    ("majority", {}),
    ("vmi", {}),
    ("activation", {"k": 32}),
    ("joint", {"k": 32}),
    ("sipit", {"budget": 32}),
)


def choose_default_model() -> tuple[str, str]:
    ok, where = preset_available(DEFAULT_MODEL)
    if ok:
        return DEFAULT_MODEL, f"the default real model, from {where}"
    return FALLBACK_MODEL, f"{DEFAULT_MODEL} is not available ({where}); falling back to the tiny random model"


@dataclass
class AuditResult:
    out: Path
    run: RunResult
    capture: dict[str, Any]
    summary: str
    attacks: list[dict[str, Any]]
    verdict: str


def capture_summary(run_dir: Path) -> dict[str, Any]:
    cap = load_capture(run_dir)
    act, grad = cap.activations.double(), cap.gradients.double()
    return {
        "documents": len(cap),
        "tokens_per_document": int(cap.mask.shape[1]),
        "width": int(act.shape[-1]),
        "activation_rms": float(act.pow(2).mean().sqrt()),
        "gradient_rms": float(grad.pow(2).mean().sqrt()),
        "all_zero_gradient_rows": int((cap.gradients == 0).all(dim=-1).sum()),
        "bytes_on_disk": sum(p.stat().st_size for p in (run_dir / "captures").glob("*.safetensors")),
    }


def run_audit(
    out: str | Path,
    *,
    model: str,
    model_path: str | None = None,
    depth: int | None = None,
    defences: list[dict[str, Any]] | None = None,
    data: str = "synthetic-pii",
    data_path: str | None = None,
    seed: int = 0,
    steps: int | None = None,
    n_calib: int = 32,
    n_train: int = 128,
    n_eval: int = 256,
    force: bool = False,
    device: str = "auto",
    threads: int | None = None,
    progress: Progress | None = None,
    say: Callable[[str], None] = print,
) -> AuditResult:
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise SplitleakError(f"{out} already exists and is not empty; choose another --out or pass --force")
    preset = PRESETS.get(model)
    lm = load_model(model, seed=seed, model_path=model_path)
    n_blocks = lm.info["n_blocks"]
    if depth is None:
        depth = min(DEFAULT_DEPTH, n_blocks // 2) if n_blocks <= DEFAULT_DEPTH else DEFAULT_DEPTH
        if depth != DEFAULT_DEPTH:
            say(f"depth: {depth} ({model} has only {n_blocks} blocks; the default depth {DEFAULT_DEPTH} does not fit)")
    cfg = make_train_config(
        model=model, model_path=model_path, depth=depth, defences=defences or [{"name": "none"}],
        data=data, data_path=data_path, seed=seed, steps=steps,
        n_calib=n_calib, n_train=n_train, n_eval=n_eval,
    )
    if force and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    run = run_training(cfg, out / "run", device=device, threads=threads, progress=progress, lm=lm)
    del lm  # the trained weights; the attacker loads its own copy
    ver = verify_run(out / "run")
    if not ver.ok:
        raise SplitleakError(f"the run just written does not verify: {ver.message}")
    cap = capture_summary(out / "run")
    knowledge = load_knowledge(out / "run", "public")
    traffic = load_traffic(out / "run")
    results = []
    for name, params in AUDIT_ATTACKS:
        acfg = make_attack_config(attack=name, client_copy="public", attack_seed=seed, **params)
        res = run_attack(out / "run", acfg, out=out / "attacks" / f"{name}.json", knowledge=knowledge,
                         traffic=traffic, progress=progress, force=force)
        res.pop("per_doc", None)
        results.append(res)
    m = run.metrics
    verdict = verdict_line(results)
    summary = (
        f"{model}{' (preset)' if preset else ''}, depth {depth}, defence "
        f"{'+'.join(d['name'] for d in cfg.as_dict()['defences'])}, {data}: held-out CE {m['heldout_ce']:.4f} "
        f"(all-local {m['all_local_ce']:.4f}, ΔU {m['delta_u']:+.4f}); captured {cap['documents']} documents × "
        f"{cap['tokens_per_document']} tokens × width {cap['width']}; run verified ({ver.message})."
    )
    report = {"config": cfg.as_dict(), "config_hash": cfg.hash(), "metrics": m, "capture": cap,
              "verify": ver.message, "attacks": results, "verdict": verdict, "summary": summary,
              "torch_threads": torch.get_num_threads()}
    (out / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")
    (out / "report.md").write_text(report_markdown(report))
    return AuditResult(out, run, cap, summary, results, verdict)


def attack_label(res: dict[str, Any]) -> str:
    p = res["attack_params"]
    extra = f" k={p['k']}" if "k" in p else (f" budget={p['budget']}" if "budget" in p else "")
    return f"{res['attack']}{extra}"


def verdict_line(results: list[dict[str, Any]]) -> str:
    """One descriptive line: the best attack against the majority control."""
    control = next((r for r in results if r["attack"] == "majority"), None)
    scored = [r for r in results if r["attack"] != "majority" and r.get("token_recovery") is not None]
    if not scored:
        return "no token-recovering attack was run"
    best = max(scored, key=lambda r: (r["token_recovery"], r["doc_recovery"]))
    best_doc = max(scored, key=lambda r: (r["doc_recovery"], r["token_recovery"]))
    ctl = f"; the majority control reads {fmt_pct(control['token_recovery'])} %" if control else ""
    return (
        f"LEAKS (descriptive, not a calibrated verdict): an observer at the split recovers "
        f"{fmt_pct(best['token_recovery'])} % of tokens ({attack_label(best)}) and "
        f"{fmt_pct(best_doc['doc_recovery'])} % of whole documents ({attack_label(best_doc)}){ctl}."
    )


def attack_table_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in results:
        spans = r.get("span_recovery") or {}
        rows.append([attack_label(r), fmt_pct(r["token_recovery"]), fmt_pct(r["doc_recovery"])]
                    + ["n/a" if spans.get(c) is None else fmt_pct(spans[c]) for c in LABELS]
                    + [f"{r['seconds']:.0f}"])
    return rows


ATTACK_HEADER = ["attack", "token %", "document %", "name spans %", "number spans %", "identifier spans %", "seconds"]


def report_markdown(report: dict[str, Any]) -> str:
    m, cfg = report["metrics"], report["config"]
    lines = [
        "# splitleak audit",
        "",
        f"**{report['verdict']}**",
        "",
        f"Model `{cfg['model']}`, cut after {cfg['depth']} blocks, defence "
        f"`{'+'.join(d['name'] for d in cfg['defences'])}`, data `{cfg['data']}` (seed {cfg['seed']}; "
        f"{cfg['n_calib']} calibration / {cfg['n_train']} training / {cfg['n_eval']} evaluation documents of "
        f"{cfg['doc_len']} tokens). Configuration hash `{report['config_hash'][:16]}`.",
        "",
        "## Leakage (public copy of the client layers, evaluation documents)",
        "",
        "| " + " | ".join(ATTACK_HEADER) + " |",
        "|" + "---|" * len(ATTACK_HEADER),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in attack_table_rows(report["attacks"])]
    lines += [
        "",
        "Percentages are rounded half-up to two decimals. Span recovery counts a span only when all its",
        "tokens are right. `majority` is the control that guesses the calibration documents' most",
        "frequent token at every position.",
        "",
        "## Utility",
        "",
        "| measure | value |",
        "|---|---|",
        f"| held-out cross-entropy (nats) | {m['heldout_ce']:.4f} |",
        f"| held-out perplexity (geometric mean) | {m['perplexity']:.2f} |",
        f"| all-local cross-entropy | {m['all_local_ce']:.4f} |",
        f"| ΔU = L_split − L_all-local | {m['delta_u']:+.4f} |",
        f"| pretrained cross-entropy | {m['pretrained_ce']:.4f} |",
        "",
        f"Run directory verified: {report['verify']}.",
        "",
    ]
    return "\n".join(lines)
