"""Run one attack configuration against one run directory and score it.

The orchestrator is the only place that holds both sides: it gives the attack its ``Knowledge``
and the ``Traffic``, and afterwards scores the returned token ids against the evaluation documents,
which the attack never sees.

Observer-side gradient perturbations (What Gradients Add §4.4) change what the attacker observes, not training:
Gaussian noise σ × the document's gradient RMS, or symmetric signed rounding to b bits with one
max-abs scale per document.
"""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from splitleak.attacks.core import ATTACKS, DEFAULT_READOUT, VMI, Majority, make_attack
from splitleak.attacks.knowledge import (
    Knowledge,
    Traffic,
    load_knowledge,
    load_traffic,
    phase_documents,
    read_documents,
    read_manifest,
)
from splitleak.errors import ConfigError, SplitleakError
from splitleak.metrics import leakage_index, roc_auc, score_reconstruction
from splitleak.progress import Progress, Silent
from splitleak.wire.defences import quantize_symmetric
from splitleak.wire.store import config_hash

#: hyperparameters that had their own columns before ``params`` existed; they stay top-level keys of
#: the dump (``k`` and ``budget`` always, the others when set), so that earlier job keys do not change
LEGACY_PARAMS = ("k", "budget", "readout", "gradient_source", "lam")


class _LegacyParams(BaseModel):
    """Type checks of the legacy hyperparameters (the others are checked by the attack's class)."""

    model_config = ConfigDict(extra="ignore")
    k: int | None = Field(None, ge=2)
    budget: int | Literal["exhaustive"] | None = None
    # how a gradient-reading attack turns the gradient into tokens (attacks.core.READOUTS)
    readout: Literal["gradient", "pseudo-map"] | None = None
    # which gradient a gradient-reading attack reads: absent is the gradient at the observation
    # point, "output" the U-shape's output gradient (attacks.core.GRADIENT_SOURCES)
    gradient_source: Literal["output"] | None = None
    # mixup-unmix: λ if the attacker knows it (absent: estimated from the traffic)
    lam: float | None = Field(None, gt=0, le=1)


class AttackConfig(BaseModel):
    """One attack evaluation; hashed into ``config_hash``. ``params`` holds the attack's
    hyperparameters, checked against its class's signature (``make_attack_config``), so that any
    registered attack's parameters travel without new columns; ``k=...`` and the other legacy
    names are accepted at the top level too."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    attack: str
    client_copy: Literal["public", "trained"] = "public"
    attack_seed: int = 0
    gradient_noise: float | None = Field(None, ge=0)
    gradient_bits: int | None = Field(None, ge=2, le=16)
    inference: bool = False  # traffic of inference: activations only
    # which recorded traffic: the capture pass over the evaluation documents, or the training steps
    phase: Literal["capture", "train"] = "capture"
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _gather(cls, data):
        if not isinstance(data, dict):
            return data
        data = dict(data)
        params = dict(data.pop("params", None) or {})
        for key in LEGACY_PARAMS:
            value = data.pop(key, None)
            if value is None:
                continue
            if key in params and params[key] != value:
                raise ValueError(f"{key} is given twice, as {value!r} and in params as {params[key]!r}")
            params[key] = value
        data["params"] = {k: v for k, v in params.items() if v is not None}
        return data

    @field_validator("params")
    @classmethod
    def _typed(cls, v):
        if "seed" in v:
            raise ValueError("the attack's seed is attack_seed, not a parameter")
        _LegacyParams(**v)
        return v

    def __getattr__(self, name: str):  # cfg.k, cfg.budget, ...: the legacy names read from params
        if name in LEGACY_PARAMS:
            return self.params.get(name)
        return super().__getattr__(name)

    @model_serializer(mode="plain")
    def _dump(self) -> dict[str, Any]:
        # the layout of the columns before params existed, so that the keys of earlier results do not
        # change: k and budget always, readout, gradient_source, lam and phase only when set
        d: dict[str, Any] = {
            "attack": self.attack, "k": self.params.get("k"), "client_copy": self.client_copy,
            "budget": self.params.get("budget"), "attack_seed": self.attack_seed,
            "gradient_noise": self.gradient_noise, "gradient_bits": self.gradient_bits, "inference": self.inference,
        }
        for key in ("readout", "gradient_source", "lam"):
            if key in self.params:
                d[key] = self.params[key]
        if self.phase != "capture":
            d["phase"] = self.phase
        rest = {k: v for k, v in self.params.items() if k not in LEGACY_PARAMS}
        if rest:
            d["params"] = dict(sorted(rest.items()))
        return d

    def attack_params(self) -> dict[str, Any]:
        return {"seed": self.attack_seed, **self.params}

    def hash(self) -> str:
        return config_hash(self.model_dump(mode="json"))


def make_attack_config(**kw) -> AttackConfig:
    """An AttackConfig whose parameters the attack's class takes (by name, checked against its
    signature) and whose read-out is filled with the default for gradient-reading attacks."""
    from pydantic import ValidationError

    if kw.get("attack") not in ATTACKS:
        raise ConfigError(f"unknown attack {kw.get('attack')!r}; known attacks: {', '.join(ATTACKS)}")
    if kw.get("gradient_noise") is not None and kw.get("gradient_bits") is not None:
        raise ConfigError("give either --gradient-noise or --gradient-bits, not both")
    kw = dict(kw)
    params = dict(kw.pop("params", None) or {})
    for key in LEGACY_PARAMS:
        if kw.get(key) is not None:
            params.setdefault(key, kw[key])
        kw.pop(key, None)
    takes = inspect.signature(ATTACKS[kw["attack"]].__init__).parameters
    if params.get("readout") is not None and "readout" not in takes:
        raise ConfigError(f"attack {kw['attack']!r} reads no gradient, so it takes no gradient read-out; drop readout")
    if params.get("readout") is None and "readout" in takes:
        params["readout"] = DEFAULT_READOUT
    if params.get("gradient_source") == "split":
        params.pop("gradient_source")  # the default
    if params.get("gradient_source") is not None and "gradient_source" not in takes:
        raise ConfigError(f"attack {kw['attack']!r} reads no gradient, so it takes no gradient source; drop it")
    if params.get("lam") is not None and "lam" not in takes:
        raise ConfigError(f"attack {kw['attack']!r} takes no lam (only mixup-unmix does)")
    try:
        cfg = AttackConfig(**kw, params=params)
    except ValidationError as exc:
        raise ConfigError(
            "invalid attack configuration: "
            + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        ) from None
    make_attack(cfg.attack, **cfg.attack_params())  # parameter names checked here
    return cfg


def perturb_gradients(grad: torch.Tensor, noise: float | None, bits: int | None, seed: int) -> torch.Tensor:
    """Observer-side perturbation of captured gradients [n, T, d] (What Gradients Add §4.4)."""
    if noise is not None:
        g = torch.Generator().manual_seed(int(seed) * 1_000_003 + 17)
        rms = grad.double().pow(2).mean(dim=(1, 2), keepdim=True).sqrt().to(grad.dtype)
        return grad + noise * rms * torch.randn(grad.shape, generator=g, dtype=grad.dtype)
    if bits is not None:
        return quantize_symmetric(grad, bits)
    return grad


def probe_scores(run_dir: Path, traffic: Traffic, probe_tokens: torch.Tensor, rows: list[int]) -> dict[str, Any]:
    """What an attack read of mixup's probe rows, scored against the client's own record of where each
    decoy came from (``client/mixup_decoys.json``; it never crossed): per row, the token of the
    earlier training document at the decoy's position. Also how many distinct training tokens the
    probe rows of this traffic exposed."""
    from splitleak.wire.store import read_recorded, recorded_digest

    rel = "client/mixup_decoys.json"
    if recorded_digest(run_dir, rel) is None:
        return {"scored": False, "why": f"the run has no {rel}"}
    draws = json.loads(read_recorded(run_dir, rel))
    phase = traffic.phase
    train = {d.doc_id: d for d in read_documents(run_dir).train}
    by_key = {(d["step"], d["doc_id"]): d["sources"] for d in draws if d["phase"] == phase}
    steps = traffic.steps if traffic.steps is not None else (-1,) * len(traffic)
    correct = total = 0
    exposed: set[tuple[int, int]] = set()
    for r in rows:
        sources = by_key.get((steps[r], traffic.doc_ids[r]))
        if sources is None:
            return {"scored": False, "why": f"no decoy record for document {traffic.doc_ids[r]} at step {steps[r]}"}
        for t, (_, src_doc, pos) in enumerate(sources):
            correct += int(probe_tokens[r, t]) == train[src_doc].token_ids[pos]
            total += 1
            exposed.add((src_doc, pos))
    n_train_tokens = sum(len(d.token_ids) for d in train.values())
    return {"scored": True, "rows": total, "token_recovery": correct / max(1, total),
            "distinct_training_tokens": len(exposed), "training_token_share": len(exposed) / max(1, n_train_tokens),
            "how": "VMI (ridge map, nearest token) on each probe row; truth from the client's decoy record"}


def _decoder(tokenizer):
    if tokenizer is None:
        return None
    return lambda i: tokenizer.decode([int(i)])


def property_scores(scores: np.ndarray, tokens: list[int], docs) -> list[dict[str, Any]]:
    out = []
    for tok in tokens:
        labels = np.array([int(tok in d.token_ids) for d in docs])
        auc = roc_auc(scores, labels) if 0 < labels.sum() < len(labels) else None
        out.append({"token_id": int(tok), "auc": auc, "share_present": float(labels.mean())})
    return out


def run_attack(
    run_dir: str | Path,
    config: AttackConfig,
    *,
    out: str | Path | None = None,
    force: bool = False,
    knowledge: Knowledge | None = None,
    traffic: Traffic | None = None,
    progress: Progress | None = None,
    device: str | None = None,
    protocol_hash: str | None = None,
) -> dict[str, Any]:
    """Fit and run the attack, score it, and (with ``out``) write RESULT.json and the per-document
    predictions as Parquet beside it. Returns the result dictionary."""
    progress = progress or Silent()
    run_dir = Path(run_dir)
    out_path = Path(out) if out is not None else None
    if out_path is not None and out_path.exists() and not force:
        raise SplitleakError(f"{out_path} already exists; choose another --out or pass --force")
    manifest = read_manifest(run_dir)
    attack = make_attack(config.attack, **config.attack_params())
    if knowledge is None:
        knowledge = load_knowledge(run_dir, config.client_copy)
    if device is not None:
        knowledge.client.to(device)
    if traffic is None:
        traffic = load_traffic(run_dir, with_gradients=not config.inference, phase=config.phase)
    if config.inference and attack.uses_gradients:
        raise ConfigError(f"attack {config.attack!r} needs gradients, which inference traffic does not carry")
    if traffic.gradients is not None and (config.gradient_noise is not None or config.gradient_bits is not None):
        perturb = lambda g: None if g is None else perturb_gradients(  # noqa: E731
            g, config.gradient_noise, config.gradient_bits, config.attack_seed)
        traffic = traffic.replace(gradients=perturb(traffic.gradients),
                                  output_gradients=perturb(traffic.output_gradients))
    docs_by_id = {d.doc_id: d for d in phase_documents(run_dir, config.phase)}
    docs = [docs_by_id[i] for i in traffic.doc_ids]

    t0 = time.perf_counter()
    attack.fit(knowledge)
    rec = attack.reconstruct(traffic, progress)
    seconds = time.perf_counter() - t0

    result: dict[str, Any] = {
        "attack": config.attack,
        "config": config.model_dump(mode="json"),
        "config_hash": config.hash(),
        "attack_params": attack.params(),
        "run": {"dir": str(run_dir), "config_hash": manifest["config_hash"], "config": manifest["config"],
                "cut": manifest["split"]["cut"]},
        "protocol_hash": protocol_hash,
        "phase": config.phase,
        "channels_read": list(attack.channels_read()),
        "n_docs": len(traffic),
        "n_tokens": int(traffic.activations.shape[0] * traffic.activations.shape[1]),
        "seconds": seconds,
    }
    per_doc_rows: list[dict[str, Any]] = []
    if rec.tokens is not None:
        sc = score_reconstruction(rec.tokens.numpy(), docs, _decoder(knowledge.client.tokenizer))
        result.update(sc.as_dict())
        if "chosen_in_candidates" in rec.extra:
            truth = torch.tensor([list(d.token_ids) for d in docs])
            result["true_token_in_candidates"] = float((rec.extra["candidates"] == truth.unsqueeze(-1)).any(-1).float().mean())
        if "matched" in rec.extra:
            result["certified_tokens"] = float(rec.extra["matched"].float().mean())
            result["mean_checks_per_token"] = float(rec.extra["checks"].float().mean())
        if "lambda" in rec.extra:
            result["lambda"] = rec.extra["lambda"]
            result["lambda_estimated"] = rec.extra["lambda_estimated"]
        if "probe_tokens" in rec.extra:
            result["probe_rows"] = probe_scores(run_dir, traffic, rec.extra["probe_tokens"], rec.extra["probed_rows"])
        steps = traffic.steps if traffic.steps is not None else (None,) * len(traffic)
        for row, pred, step in zip(sc.per_doc(), rec.tokens.tolist(), steps):
            row = dict(row)
            row["predicted"] = pred
            if config.phase == "train":
                row["step"] = step
            per_doc_rows.append(row)
        if config.phase == "train":
            result["weights"] = (
                f"each frame was produced by the client weights after as many training steps as its step number "
                f"(0 … {max(steps)}); the attacker's copy is the {config.client_copy} one "
                f"({'pretrained' if config.client_copy == 'public' else 'after the last step'})")
    else:
        scores = rec.extra["scores"]
        props = property_scores(scores, rec.extra["property_tokens"], docs)
        vmi = VMI(seed=config.attack_seed).fit(knowledge).reconstruct(traffic).tokens
        maj = Majority().fit(knowledge).reconstruct(traffic).tokens
        truth = torch.tensor([list(d.token_ids) for d in docs])
        a_vmi = float((vmi == truth).float().mean())
        a_ctl = float((maj == truth).float().mean())
        aucs = [p["auc"] for p in props if p["auc"] is not None]
        result.update({"properties": props, "vmi_token_recovery": a_vmi, "majority_token_recovery": a_ctl,
                       "leakage_index": leakage_index(a_vmi, a_ctl, aucs),
                       "token_recovery": None, "doc_recovery": None, "span_recovery": None})
        per_doc_rows = [{"doc_id": int(i), "score": float(s)} for i, s in zip(traffic.doc_ids, scores)]
    if out_path is not None:
        write_result(out_path, result, per_doc_rows)
    result["per_doc"] = per_doc_rows
    return result


def write_result(out_path: Path, result: dict[str, Any], per_doc_rows: list[dict[str, Any]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_path.parent.mkdir(parents=True, exist_ok=True)
    pq_path = out_path.with_suffix(".parquet")
    flat = []
    for row in per_doc_rows:
        r = {}
        for k, v in row.items():
            r[k] = json.dumps(v, sort_keys=True) if isinstance(v, dict) else v
        flat.append(r)
    table = pa.Table.from_pylist(flat) if flat else pa.table({})
    tmp = pq_path.with_name(f".{pq_path.name}.tmp")
    pq.write_table(table, tmp)
    tmp.replace(pq_path)
    result = dict(result)
    result["predictions"] = pq_path.name
    tmpj = out_path.with_name(f".{out_path.name}.tmp")
    tmpj.write_text(json.dumps(result, indent=2, sort_keys=True, default=_json_default) + "\n")
    tmpj.replace(out_path)


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(type(o).__name__)
