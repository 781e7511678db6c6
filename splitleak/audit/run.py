"""`splitleak audit`: train and capture on embedded defaults and summarise what crossed the wire.

Layout of the output folder: ``run/`` is the verifiable run directory (see ``splitleak.wire.store``);
``audit.json`` summarises it. Attacks and verdicts are added by later stages.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from splitleak.errors import SplitleakError
from splitleak.models import PRESETS, load_model, preset_available
from splitleak.progress import Progress
from splitleak.training import RunResult, make_train_config, run_training
from splitleak.wire import load_capture, verify_run

DEFAULT_MODEL = "smollm2-135m"
FALLBACK_MODEL = "tiny-gpt2"
DEFAULT_DEPTH = 6


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
    ver = verify_run(out / "run")
    if not ver.ok:
        raise SplitleakError(f"the run just written does not verify: {ver.message}")
    cap = capture_summary(out / "run")
    m = run.metrics
    summary = (
        f"{model}{' (preset)' if preset else ''}, depth {depth}, defence "
        f"{'+'.join(d['name'] for d in cfg.as_dict()['defences'])}, {data}: held-out CE {m['heldout_ce']:.4f} "
        f"(all-local {m['all_local_ce']:.4f}, ΔU {m['delta_u']:+.4f}); captured {cap['documents']} documents × "
        f"{cap['tokens_per_document']} tokens × width {cap['width']}; run verified ({ver.message})."
    )
    (out / "audit.json").write_text(
        json.dumps({"config": cfg.as_dict(), "metrics": m, "capture": cap, "verify": ver.message,
                    "torch_threads": torch.get_num_threads()}, indent=2, sort_keys=True) + "\n"
    )
    return AuditResult(out, run, cap, summary)
