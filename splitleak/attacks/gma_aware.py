"""GMA-SL that knows the label-shielded defence chain (``AwareGMASL``, ``gma-sl-aware``; Gradient Mirage).

GMA-SL (``splitleak.attacks.gma``) assumes the full-label loss; Gradient Mirage's defences expose another
one (003 §4). Kerckhoffs gives the server their mechanism and public arguments, so the aware attack
matches under the exposed loss they declare: the proxy's gradient is J^T (S * (p - q)) / N with a factor
S per target, the public scale divided out or fitted within its public range (0 allowed where sas drops
targets), zeroed coordinates left out, seq-dp's clip applied. The range's upper end is what keeps a
fitted scale from cosine's blindness (``splitleak.attacks.gma``'s docstring: "Scale and the choice of
distance").
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from splitleak.attacks.base import Reconstruction
from splitleak.attacks.gma import GMASL, check_inputs, initial_logits, vocab_of
from splitleak.attacks.gma_core import LabelWatch, gradient_distance
from splitleak.defences import build_defence
from splitleak.defences.masking import GradientDropout, GradientPruning
from splitleak.defences.mirage import Mirage, ScaleBlinding, SelectiveSupervision, SequenceDP
from splitleak.defences.vmf import VMFDirection
from splitleak.errors import ConfigError
from splitleak.progress import Progress, Silent
from splitleak.runtime import fused_optimizer

AWARE_SCALES = ("auto", "none", "public", "fit")
AWARE_DISTANCES = ("auto", "l2", "row-l2", "row-cos")
AWARE_MASKS = ("auto", "on", "bound", "off")


def _check_choices(scale: str, distance: str, mask: str) -> None:
    """Each of the aware attack's choices is one it knows."""
    for name, value, allowed in (
        ("scale", scale, AWARE_SCALES),
        ("distance", distance, AWARE_DISTANCES),
        ("mask", mask, AWARE_MASKS),
    ):
        if value not in allowed:
            raise ConfigError(f"gma-sl-aware: {name} must be one of {', '.join(allowed)}; got {value!r}")


@dataclass(frozen=True)
class ExposedModel:
    """What the chain's public arguments say about the output gradient g_t (Kerckhoffs: the mechanism and its
    arguments, never its draws). Each target's term is multiplied by a factor of mean ``mean`` in
    [``lo``, ``hi``], or by 0 where ``drops`` (sas); ``kappa``: each row's direction is vMF-noised (its norm
    kept); ``zeroes``: coordinates are zeroed, the kept ones exact: "smallest" (grad-prune: each zeroed one no
    larger than the smallest kept) or "random" (grad-dropout); ``clip``: each
    document's g_t is clipped to that L2 norm, then given Gaussian noise of std ``noise_std`` (seq-dp)."""

    mean: float = 1.0
    lo: float = 1.0
    hi: float = 1.0
    drops: bool = False
    kappa: float | None = None
    zeroes: str | None = None
    clip: float | None = None
    noise_std: float | None = None
    chain: tuple[str, ...] = ()

    @property
    def scaled(self) -> bool:
        return self.drops or not (self.lo == self.hi == self.mean == 1.0)


def exposed_model(chain: Sequence[Any]) -> ExposedModel:
    """The ``ExposedModel`` of a defence chain (``Knowledge.chain()``), its transforms taken in order. A
    defence that changes the exposed loss or the output gradient in a way this attack does not model is
    refused, naming it; defences acting elsewhere (the forward wire) are passed over."""
    m = ExposedModel()
    for d in chain:
        if isinstance(d, Mirage):
            parts: list[Any] = [d.sas, d.scale, d.vmf]
        else:
            parts = [d]
        for x in parts:
            if isinstance(x, SelectiveSupervision):
                m = replace(m, drops=True)
            elif isinstance(x, ScaleBlinding):
                m = replace(m, mean=m.mean * x.m, lo=m.lo * x.m * (1 - x.r), hi=m.hi * x.m * (1 + x.r))
            elif isinstance(x, VMFDirection):
                m = replace(m, kappa=x.kappa, zeroes=None)
            elif isinstance(x, GradientPruning):
                m = replace(m, zeroes="smallest")
            elif isinstance(x, GradientDropout):
                m = replace(m, zeroes="random")
            elif isinstance(x, SequenceDP):
                m = replace(m, clip=x.clip, noise_std=x.noise_multiplier * x.clip, zeroes=None)
            elif {"exposed-loss", "backward-wire"} & set(x.roles()):
                raise ConfigError(
                    f"gma-sl-aware does not model defence {x.name!r}, which changes the output gradient; attack "
                    "this run with gma-sl, or pass chain=[...] naming the defences to model"
                )
        m = replace(m, chain=m.chain + (d.name,))
    return m


@dataclass(frozen=True)
class Objective:
    """The matching objective resolved from ``ExposedModel`` and the attack's choices: ``scale`` ("none",
    "public", "fit" or "known"), the per-target factor's mean and bounds, the distance, the mask, the clip."""

    scale: str
    mean: float
    lo: float
    hi: float
    distance: str
    mask: str
    clip: float | None
    norm_weight: float

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def resolve_objective(
    model: ExposedModel, scale: str = "auto", distance: str = "auto", mask: str = "auto", norm_weight: float = 0.1
) -> Objective:
    """``auto`` choices (ours, chosen on SmolLM2's mirage and scale-blind captures, experiments/PILOTS.md): the
    public mean divided out wherever the chain scales, drops or clips (``public``; a fitted factor collapses to 0
    on targets whose labels are still wrong, which then get no gradient), else none; l2 (on vMF-noised traffic
    row-cos and row-l2 read less); where the last transform zeroes coordinates, they are left out (``on``,
    grad-dropout) or held to the smallest kept magnitude (``bound``, grad-prune). With ``scale="none"`` the clip
    is not modelled either (plain GMA-SL's objective)."""
    _check_choices(scale, distance, mask)
    s = scale if scale != "auto" else ("public" if model.scaled or model.clip is not None else "none")
    lo = 0.0 if model.drops else model.lo
    return Objective(
        scale=s,
        mean=model.mean if s != "none" else 1.0,
        lo=lo if s == "fit" else model.mean,
        hi=model.hi if s == "fit" else model.mean,
        distance=distance if distance != "auto" else "l2",
        mask=(("bound" if model.zeroes == "smallest" else "on") if model.zeroes else "off") if mask == "auto" else mask,
        clip=model.clip if s != "none" else None,
        norm_weight=float(norm_weight),
    )


def _aware_distance(
    g_hat: torch.Tensor, g_obs: torch.Tensor, rows_on: torch.Tensor, distance: str, norm_weight: float
) -> torch.Tensor:
    """Per-document distance between [m, T, H] gradients, as [m]. ``row-cos``: over the rows observed
    non-zero, 1 - cosine (the vMF log-likelihood of a row is kappa times its cosine, whatever its norm) plus
    ``norm_weight`` times the squared log-ratio of the row norms (vMF keeps each norm)."""
    if distance == "l2":
        return gradient_distance(g_hat, g_obs, "l2", 0.0)
    a, b = g_hat.float(), g_obs.float()
    bn = b.norm(dim=-1)
    if distance == "row-l2":
        return ((a - b).pow(2).sum(-1) / bn.pow(2).clamp_min(1e-30) * rows_on).sum(-1)
    an2 = a.pow(2).sum(-1)
    tiny = (1e-6 * bn).pow(2) + 1e-30
    cos = (a * b).sum(-1) / (an2.add(tiny).sqrt() * bn).clamp_min(1e-30)
    lognorm = 0.5 * torch.log(an2 + tiny) - torch.log(bn.clamp_min(1e-30))
    per_row = (1.0 - cos) + norm_weight * lognorm.pow(2)
    return (per_row * rows_on).sum(-1)


def match_labels_aware(
    top: Callable[[torch.Tensor], torch.Tensor],
    h_t: torch.Tensor,
    g_t: torch.Tensor,
    objective: Objective,
    *,
    target_scale: torch.Tensor | None = None,
    n_norm: float | None = None,
    steps: int = 400,
    lr: float = 0.1,
    init: torch.Tensor | str | None = None,
    tol: float = 1e-5,
    patience: int = 20,
    seed: int = 0,
    batch: int = 8,
    progress: Progress | None = None,
    label_patience: int = 0,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """GMA-SL under the exposed loss a defence chain declares: the proxy's gradient for soft labels q is
    g(Z, S) = J^T (S * (p - q)) / N, S [n, T-1] the per-target factor, fixed at 1 (``none``) or the public mean
    (``public``), fitted jointly with Z by projected Adam within [lo, hi] (``fit``; lo = 0 where sas may drop a
    target, which a 0/1 weight then also fits), or given (``target_scale``: the defence's secret, for positive
    controls). With ``objective.clip`` each document's g is clipped to that norm as seq-dp does; with
    ``objective.mask`` "on" the coordinates observed exactly zero are left out, with "bound" they count only
    where they exceed the smallest magnitude kept in their document (grad-prune's rule). The upper bound hi
    is what keeps a fitted scale from the degeneracy cosine has (q = (1 - c) p + c y gives c g(y): a tilt c
    of the labels fits only with a scale hi / c); where the magnitude is lost altogether (a clip that binds)
    nothing pins q to a vertex and the labels are not identified. Arguments otherwise as ``match_labels``;
    info adds ``objective`` and, under ``fit``, the fitted ``target_scale`` [n, T-1]."""
    check_inputs(h_t, g_t, "l2", n_norm, steps, lr, tol, patience, batch, 0.0)
    n, T, _ = h_t.shape
    if target_scale is not None:
        if tuple(target_scale.shape) != (n, T - 1) or not torch.isfinite(target_scale).all() or target_scale.min() < 0:
            raise ConfigError(
                f"gma-sl-aware: target_scale must be finite, nonnegative factors [n, T-1] = {(n, T - 1)}; got "
                f"{tuple(target_scale.shape)}"
            )
        objective = replace(objective, scale="known")
    started = time.perf_counter()
    N = float(n_norm) if n_norm is not None else float(n * (T - 1))
    progress = progress or Silent()
    V = vocab_of(top, h_t)
    z_all = initial_logits(init, n, T, V, seed)
    zero_docs = [i for i in range(n) if not bool(g_t[i].ne(0).any())]
    chunk_steps: list[int] = []
    final = torch.zeros(n, dtype=torch.float32)
    preds = torch.empty(n, T - 1, dtype=torch.long)
    fitted = torch.full((n, T - 1), objective.mean, dtype=torch.float32)
    task = progress.start("GMA-SL (defence-aware) label matching", n)
    for s in range(0, n, batch):
        e = min(n, s + batch)
        active = torch.tensor([i not in zero_docs for i in range(s, e)])
        known = None if target_scale is None else target_scale[s:e]
        steps_taken, dist, z, sc = _match_chunk_aware(
            top, h_t[s:e], g_t[s:e], z_all[s:e], active, N, objective, known, steps, lr, tol, patience,
            LabelWatch(label_patience),
        )  # fmt: skip
        chunk_steps.append(steps_taken)
        final[s:e] = dist
        preds[s:e] = z.argmax(-1).cpu()
        fitted[s:e] = sc.cpu()
        progress.advance(task, e - s)
    progress.finish(task)
    info: dict[str, Any] = {
        "steps": chunk_steps,
        "distance": [float(x) for x in final],
        "seconds": time.perf_counter() - started,
        "n_norm": N,
        "objective": objective.as_dict(),
        "zero_gradient_docs": zero_docs,
    }
    if objective.scale == "fit":
        info["target_scale"] = fitted
    return preds, info


def _match_chunk_aware(
    top: Callable[[torch.Tensor], torch.Tensor],
    h: torch.Tensor,
    g_obs: torch.Tensor,
    z0: torch.Tensor,
    active: torch.Tensor,
    N: float,
    ob: Objective,
    known: torch.Tensor | None,
    steps: int,
    lr: float,
    tol: float,
    patience: int,
    watch: LabelWatch,
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Optimise one chunk's Z (and S under ``fit``); returns (steps taken, final per-document distance, final Z,
    the per-target factors)."""
    with sdpa_kernel(SDPBackend.MATH), torch.enable_grad():
        h = h.detach().clone().requires_grad_(True)
        logits = top(h)[:, :-1]
        p = torch.softmax(logits.detach().float(), dim=-1)
        g_obs = g_obs.detach().to(h.device).float()
        z = z0.to(h.device).clone().requires_grad_(True)
        params = [z]
        m, t1 = z.shape[:2]
        # the factor in units of the public mean (1 where nothing scales), so that Adam's step suits any m
        unit = ob.mean if ob.mean > 0 else 1.0
        if known is not None:
            a = known.to(h.device, torch.float32) / unit
        else:
            a = torch.ones(m, t1, device=h.device)
        # under ``fit`` the factor is released only once the labels have settled at the public mean (or half the
        # steps are spent): released from the start, a target whose labels are still wrong fits best with its
        # factor at 0, where its labels get no gradient any more (ours)
        fitting = False
        if ob.scale == "fit":
            a = a.clone().requires_grad_(True)
        lo, hi = ob.lo / unit, ob.hi / unit
        opt = fused_optimizer(torch.optim.Adam, params, lr=lr)
        weight = active.to(h.device, torch.float32)
        keep = (g_obs != 0).float() if ob.mask != "off" else None
        if ob.mask == "bound":  # a zeroed coordinate was no larger than the smallest one kept in its document
            kept_abs = torch.where(g_obs != 0, g_obs.abs(), torch.full_like(g_obs, math.inf))
            bound = kept_abs.flatten(1).amin(1).clamp(max=torch.finfo(torch.float32).max).view(-1, 1, 1)
        rows_on = (g_obs.norm(dim=-1) > 0).float()
        if ob.distance == "l2":
            ref = float((g_obs.flatten(1).pow(2).sum(1) * weight).sum()) or 1.0
        else:
            ref = float((rows_on.sum(-1) * weight).sum()) or 1.0
        history: list[float] = []
        t = since = 0
        while True:
            q = torch.softmax(z, dim=-1)
            factor = (unit * a).unsqueeze(-1) if ob.scale != "none" else 1.0
            grad_logits = (factor * (p - q) / N).to(logits.dtype)
            (g_hat,) = torch.autograd.grad(logits, h, grad_outputs=grad_logits, create_graph=True, retain_graph=True)
            g_hat = g_hat.float()
            if ob.clip is not None:
                norms = g_hat.flatten(1).norm(dim=1).clamp_min(1e-30)
                g_hat = g_hat * (ob.clip / norms).clamp(max=1.0).view(-1, 1, 1)
            over = None
            if ob.mask == "bound":
                over = (torch.relu(g_hat.abs() - bound) * (1 - keep)).pow(2).flatten(1).sum(1)  # type: ignore[operator]
            if keep is not None:
                g_hat = g_hat * keep
            per_doc = _aware_distance(g_hat, g_obs, rows_on, ob.distance, ob.norm_weight)
            if over is not None:
                per_doc = per_doc + over
            objective = (per_doc * weight).sum() / ref
            value = float(objective.detach())
            history.append(value)
            if t >= steps or not bool(active.any()):
                break
            stable = watch.settled(z)  # the labels unchanged for label_patience steps
            settled = stable or (
                t - since >= patience and history[-1 - patience] - value <= tol * abs(history[-1 - patience])
            )
            if ob.scale == "fit" and not fitting and (settled or t >= steps // 2):
                fitting, since, settled, watch.unchanged = True, t, False, 0
                params.append(a)
                opt.add_param_group({"params": [a]})
            if settled:
                break
            grads = torch.autograd.grad(objective, params)
            opt.zero_grad(set_to_none=True)
            for x, gx in zip(params, grads):
                x.grad = gx
            opt.step()
            if fitting:
                with torch.no_grad():
                    a.clamp_(lo, hi)
            t += 1
    return t, per_doc.detach().cpu(), z.detach(), (unit * a).detach()


class AwareGMASL(GMASL):
    """``gma-sl-aware``: GMA-SL that knows the label-shielded defence chain (Kerckhoffs; Gradient Mirage's
    threat model gives the server the mechanism, 003 §3): it reads the chain's public arguments from the
    knowledge (``Knowledge.chain()``) or from ``chain`` (a list of {name, args}, the chain it assumes) and
    matches under the exposed loss they declare (``resolve_objective``, ``match_labels_aware``).

    ``scale``: auto | none | public (divide out the public mean m) | fit (a factor per target within the
    public range, 0 allowed under sas). ``distance``: auto | l2 | row-l2 (each row's l2 relative to its
    observed norm) | row-cos (1 - cosine per row, vMF's log-likelihood, plus ``norm_weight`` times the
    squared log-ratio of the row norms; 0.1, ours: at 1 it commits to wrong labels early). ``mask``: auto |
    on (leave out coordinates observed zero) | bound (hold them to the smallest kept magnitude) | off.
    ``auto``: ``resolve_objective``'s choices. Other parameters as ``gma-sl``; defaults are ours."""

    name = "gma-sl-aware"

    def __init__(
        self,
        scale: str = "auto",
        distance: str = "auto",
        mask: str = "auto",
        norm_weight: float = 0.1,
        chain: list[dict[str, Any]] | None = None,
        steps: int = 400,
        lr: float = 0.1,
        batch: int = 8,
        seed: int = 0,
        start: str = "noise",
        label_patience: int = 0,
    ):
        _check_choices(scale, distance, mask)
        _positive = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # noqa: E731
        if not (_positive(norm_weight) and norm_weight >= 0):
            raise ConfigError(f"gma-sl-aware: norm_weight must be a finite number >= 0; got {norm_weight!r}")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ConfigError(f"gma-sl-aware: steps must be an integer >= 0; got {steps!r}")
        if not (_positive(lr) and lr > 0):
            raise ConfigError(f"gma-sl-aware: lr must be a finite number > 0; got {lr!r}")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ConfigError(f"gma-sl-aware: batch must be an integer >= 1; got {batch!r}")
        if chain is not None:
            _build_chain(chain)  # refused here, naming the defence and argument, not after the run is loaded
        self.scale, self.mask, self.norm_weight, self.chain = scale, mask, norm_weight, chain
        super().__init__(
            distance="l2", steps=steps, lr=lr, batch=batch, seed=seed, start=start, label_patience=label_patience
        )
        self.distance = distance

    def params(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "distance": self.distance,
            "mask": self.mask,
            "norm_weight": self.norm_weight,
            "chain": self.chain,
            "steps": self.steps,
            "lr": self.lr,
            "batch": self.batch,
            "seed": self.seed,
            "start": self.start,
            "label_patience": self.label_patience,
        }

    def fit(self, knowledge) -> "AwareGMASL":
        super().fit(knowledge)
        chain = _build_chain(self.chain) if self.chain is not None else knowledge.chain()
        self.model_ = exposed_model(chain)
        self.objective_ = resolve_objective(self.model_, self.scale, self.distance, self.mask, self.norm_weight)
        return self

    def _match_frame(self, top, h_t, g_t, n_norm: float, init, seed: int, progress) -> tuple[torch.Tensor, dict]:
        return match_labels_aware(
            top,
            h_t,
            g_t,
            self.objective_,
            n_norm=n_norm,
            steps=self.steps,
            lr=self.lr,
            init=self.initial(init),
            seed=seed,
            batch=self.batch,
            progress=progress,
            label_patience=self.label_patience,
        )

    def reconstruct(self, traffic, progress: Progress | None = None) -> Reconstruction:
        rec = super().reconstruct(traffic, progress)
        rec.extra["summary"] = {"chain": list(self.model_.chain), "objective": self.objective_.as_dict()}
        return rec


def _build_chain(chain: Any) -> list[Any]:
    if not isinstance(chain, (list, tuple)) or not all(isinstance(d, dict) and "name" in d for d in chain):
        raise ConfigError(
            'gma-sl-aware: chain must be a list of {"name": ..., "args": {...}} (the defences to model); got '
            f"{chain!r}"
        )
    return [build_defence(d["name"], d.get("args")) for d in chain if d["name"] != "none"]
