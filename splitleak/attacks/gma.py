"""GMA-SL: recover a label-shielded client's labels by gradient matching (Gradient Mirage).

Setting. Under label-shielded split learning (the U-shape) the client keeps the Bottom, the Top
(the last blocks, the final norm, the LM head) and the labels; the server runs the Trunk. The
server sees the Trunk output ``h_t`` [n, T, H] and the gradient the client returns for it,
``g_t = dL/dh_t``, where::

    L = sum_b sum_{l < T-1} M[b, l] * CE(Top(h_t)[b, l], y[b, l+1]) / N

and N is the number of supervised targets in the batch.

Attack. The attacker holds a proxy of the Top and looks for soft labels ``q = softmax(Z)``,
Z of shape [n, T-1, V], whose gradient through the proxy matches the observed one::

    g(Z) = d/dh [ sum CE(top(h)[:, :-1], softmax(Z)) / N ] at h = h_t
         = J^T (softmax(top(h_t)[:, :-1]) - softmax(Z)) / N,

J being the Jacobian of the proxy's logits with respect to h at h_t. The prediction is the
argmax of Z at each position. g(Z) is one vector-Jacobian product through the proxy; optimising Z
through it needs the derivative of that product (autograd double backward, ``create_graph=True``).

Scale and the choice of distance. For any c in (0, 1], the soft label q = (1 - c) p + c y (p the
proxy's own prediction, y the true one-hot label) gives g = c * g(y) exactly, so every such q is a
perfect cosine match: the cosine distance cannot tell the labels from a faint tilt of p towards
them, and Adam stops wherever it first reaches distance 0. On the random tiny-gpt2 (V = 615,
H = 64) this is what happens: cos reaches distance ~1e-7 at a nearly uniform q and recovers
about chance (0-14 % of 28 labels over two seeds), while l2, l1 and tag, which must also match
the magnitude that N fixes, recover 100 % in 100 steps. The magnitude-matching distances are
the ones that recover labels; cos is the one that is blind to a rescaled gradient (a defence that
multiplies g_t by a constant changes nothing for cos, and for l2 turns the problem into "push q as
far as the simplex allows", which with a scale > 1 still lands on the labels' vertex).

Knowledge. The proxy is the *pretrained* Top, the public checkpoint's weights, not the client's
fine-tuned Top, which the server never sees; the attack is only as good as the pretrained Top is
close to the fine-tuned one. The proxy is frozen: no parameter of it is stepped and no ``.grad``
of it is written (the gradients are taken with respect to h and Z only). The caller puts it in
evaluation mode (dropout would make g(Z) random).

Attention kernel. Fused SDPA kernels (flash, memory-efficient) have backward passes that are not
themselves differentiable: on the CPU, torch 2.13 picks flash attention and the double backward
fails with "derivative for aten::_scaled_dot_product_flash_attention_for_cpu_backward is not
implemented". The proxy is therefore run under ``sdpa_kernel(SDPBackend.MATH)``, whose backward
is made of ordinary differentiable ops.

Separability. The distance is computed per document and summed, and N is a constant the
attacker knows from the mask (with full supervision N = n * (T - 1) over the whole capture), so
each document's Z only affects its own term: documents are processed in chunks of ``batch``
with the same N, and a document's prediction does not depend on which chunk it lands in (only
the stopping step, decided per chunk, can differ).

The default distance is "cos" as the interface specifies; pass ``distance="l2"`` when the
returned gradient's scale is trusted (see above).

Defaults that are ours, not the paper's: the distances' exact forms below, ``tag_alpha=0.01``,
Adam with ``lr=0.1`` for at most ``steps=400`` steps, the stopping rule (relative improvement
of the chunk's summed distance over the last ``patience=20`` steps below ``tol=1e-5``),
standard-normal initial logits, and the logits given to a token-id initialisation (the given
token gets probability ``INIT_TOKEN_PROB = 0.9``, whatever V).

Knowing the defence (``AwareGMASL``, ``gma-sl-aware``). GMA-SL assumes the full-label loss; Gradient
Mirage's defences expose another one (003 §4). Kerckhoffs gives the server their mechanism and public
arguments, so the aware attack matches under the exposed loss they declare: the proxy's gradient is
J^T (S * (p - q)) / N with a factor S per target, the public scale divided out or fitted within its
public range (0 allowed where sas drops targets), zeroed coordinates left out, seq-dp's clip applied.
The range's upper end is what keeps a fitted scale from cosine's blindness above.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
from pydantic import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt
from torch.nn.attention import SDPBackend, sdpa_kernel

from splitleak.attacks.base import Attack, Reconstruction
from splitleak.errors import ConfigError
from splitleak.progress import Progress, Silent

DISTANCES = ("cos", "l1", "l2", "tag")
# a token-id initialisation puts this much probability on the given token (ours)
INIT_TOKEN_PROB = 0.9


def _distance(g_hat: torch.Tensor, g_obs: torch.Tensor, distance: str, tag_alpha: float) -> torch.Tensor:
    """Per-document distance between [m, T, H] gradients, as [m] (float32)."""
    a = g_hat.float().flatten(1)
    b = g_obs.float().flatten(1)
    if distance == "cos":
        dot = (a * b).sum(1)
        norms = a.norm(dim=1) * b.norm(dim=1)
        return 1.0 - dot / norms.clamp_min(1e-30)
    diff = a - b
    l2 = diff.pow(2).sum(1)
    if distance == "l2":
        return l2
    l1 = diff.abs().sum(1)
    if distance == "l1":
        return l1
    return l2 + tag_alpha * l1  # tag


def _check_inputs(
    h_t: torch.Tensor,
    g_t: torch.Tensor,
    distance: str,
    n_norm: float | None,
    steps: int,
    lr: float,
    tol: float,
    patience: int,
    batch: int,
    tag_alpha: float,
) -> None:
    if not isinstance(h_t, torch.Tensor) or not isinstance(g_t, torch.Tensor):
        raise ConfigError("GMA-SL: h_t and g_t must be torch tensors [n, T, H]")
    if h_t.dim() != 3:
        raise ConfigError(
            f"GMA-SL: h_t must be the trunk output [n, T, H]; got shape {tuple(h_t.shape)}; "
            "add the batch dimension for a single document (h_t.unsqueeze(0))"
        )
    if tuple(g_t.shape) != tuple(h_t.shape):
        raise ConfigError(
            f"GMA-SL: g_t {tuple(g_t.shape)} must have the shape of h_t {tuple(h_t.shape)} "
            "(the gradient the client returns for the trunk output); pair each h_t with its own g_t"
        )
    if h_t.shape[0] < 1 or h_t.shape[1] < 2:
        raise ConfigError(
            f"GMA-SL: need at least one document of at least 2 tokens (one next-token target); got {tuple(h_t.shape)}"
        )
    for name, t in (("h_t", h_t), ("g_t", g_t)):
        if not t.is_floating_point():
            raise ConfigError(f"GMA-SL: {name} must be floating point; got {t.dtype}")
        if not torch.isfinite(t).all():
            bad = int((~torch.isfinite(t)).sum())
            raise ConfigError(
                f"GMA-SL: {name} has {bad} non-finite value(s) (NaN or Inf); drop the affected documents "
                "or fix the capture before attacking"
            )
    if distance not in DISTANCES:
        raise ConfigError(f"GMA-SL: unknown distance {distance!r}; choose one of {', '.join(DISTANCES)}")
    if n_norm is not None and not (math.isfinite(n_norm) and n_norm > 0):
        raise ConfigError(f"GMA-SL: n_norm must be a positive number of supervised targets; got {n_norm}")
    if steps < 0:
        raise ConfigError(f"GMA-SL: steps must be >= 0; got {steps}")
    if not lr > 0:
        raise ConfigError(f"GMA-SL: lr must be > 0; got {lr}")
    if not tol >= 0:
        raise ConfigError(f"GMA-SL: tol must be >= 0; got {tol}")
    if patience < 1:
        raise ConfigError(f"GMA-SL: patience must be >= 1; got {patience}")
    if batch < 1:
        raise ConfigError(f"GMA-SL: batch must be >= 1 document; got {batch}")
    if not tag_alpha >= 0:
        raise ConfigError(f"GMA-SL: tag_alpha must be >= 0; got {tag_alpha}")


def _initial_logits(init: torch.Tensor | None, n: int, T: int, V: int, seed: int) -> torch.Tensor:
    if init is None:
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(n, T - 1, V, generator=gen, dtype=torch.float32)
    if not isinstance(init, torch.Tensor):
        raise ConfigError("GMA-SL: init must be None, logits [n, T-1, V] or token ids [n, T-1] (torch tensors)")
    if init.is_floating_point():
        if tuple(init.shape) != (n, T - 1, V):
            raise ConfigError(f"GMA-SL: initial logits must be [n, T-1, V] = {(n, T - 1, V)}; got {tuple(init.shape)}")
        if not torch.isfinite(init).all():
            raise ConfigError("GMA-SL: initial logits contain NaN or Inf")
        return init.detach().to("cpu", torch.float32).clone()
    if init.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        if tuple(init.shape) != (n, T - 1):
            raise ConfigError(f"GMA-SL: initial token ids must be [n, T-1] = {(n, T - 1)}; got {tuple(init.shape)}")
        ids = init.detach().to("cpu", torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
            raise ConfigError(
                f"GMA-SL: initial token ids must lie in [0, {V}) (the proxy's vocabulary); "
                f"got [{int(ids.min())}, {int(ids.max())}]"
            )
        z = torch.zeros(n, T - 1, V, dtype=torch.float32)
        peak = math.log(INIT_TOKEN_PROB * (V - 1) / (1 - INIT_TOKEN_PROB)) if V > 1 else 0.0
        return z.scatter_(-1, ids.unsqueeze(-1), peak)
    raise ConfigError(f"GMA-SL: init must be float logits or integer token ids; got dtype {init.dtype}")


def _vocab_of(top, h_t: torch.Tensor) -> int:
    """The vocabulary size of the proxy Top's logits, checked on one document: it must map [b, T, H] to [b, T, V]."""
    T = h_t.shape[1]
    with sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        probe = top(h_t[:1].detach())
    if probe.dim() != 3 or tuple(probe.shape[:2]) != (1, T):
        raise ConfigError(
            f"GMA-SL: top must map [b, T, H] to logits [b, T, V]; for [1, {T}, H] it gave {tuple(probe.shape)}"
        )
    return int(probe.shape[-1])


def match_labels(
    top: Callable[[torch.Tensor], torch.Tensor],
    h_t: torch.Tensor,
    g_t: torch.Tensor,
    *,
    n_norm: float | None = None,
    distance: str = "cos",
    steps: int = 400,
    lr: float = 0.1,
    init: torch.Tensor | None = None,
    tol: float = 1e-5,
    patience: int = 20,
    seed: int = 0,
    batch: int = 8,
    progress: Progress | None = None,
    tag_alpha: float = 0.01,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """GMA-SL: the label tokens whose gradient through the pretrained Top best matches ``g_t``.

    top: the attacker's proxy, [b, T, H] -> logits [b, T, V], frozen and in evaluation mode.
    h_t, g_t: the observed trunk output and the gradient returned for it, both [n, T, H].
    n_norm: the loss normaliser N; None = n * (T - 1), n = h_t.shape[0] (full supervision over the
        whole capture, whatever ``batch`` is).
    distance: per document, over the flattened [T, H] gradient: "cos" (1 - cosine similarity),
        "l1", "l2" (squared Euclidean) or "tag" (l2 + tag_alpha * l1, after TAG; tag_alpha=0.01 is
        our default). cos is invariant to a scaling of g_t; l1, l2 and tag are not.
    init: None = standard-normal logits drawn from ``seed``; float logits [n, T-1, V] (e.g. from
        another attack); or token ids [n, T-1], turned into logits that give the token
        probability INIT_TOKEN_PROB.
    Optimisation: Adam on Z with ``lr``; a chunk of ``batch`` documents stops when its summed
    distance improved by less than ``tol`` (relative) over the last ``patience`` steps, or after
    ``steps`` steps. The l1/l2/tag objectives are divided by a per-chunk constant (the chunk's
    distance from a zero gradient, e.g. the sum of ||g_t||^2 for l2) before Adam sees them, so that
    Adam's epsilon does not swamp the tiny gradients of a 1/N-scaled loss (measured on tiny-gpt2:
    with N 30 times larger and g_t 30 times smaller, raw l2 recovered 1 of 28 labels in 100 steps,
    normalised l2 all 28); that changes neither the minimiser nor the reported distances.
    Deterministic under ``seed`` on a given machine and thread count.

    A document whose g_t is all zero carries no information about its labels: it is left out of
    the optimisation and its prediction is the argmax of its initial logits (random under the
    noise init). Its index is listed in ``info["zero_gradient_docs"]``.

    Returns (token ids [n, T-1], the predicted y[:, 1:]) and info: ``steps`` (steps taken per
    chunk), ``distance`` (final distance per document, a list), ``seconds``, ``n_norm``,
    ``distance_name``, ``zero_gradient_docs``.
    """
    _check_inputs(h_t, g_t, distance, n_norm, steps, lr, tol, patience, batch, tag_alpha)
    started = time.perf_counter()
    n, T, _ = h_t.shape
    N = float(n_norm) if n_norm is not None else float(n * (T - 1))
    progress = progress or Silent()

    V = _vocab_of(top, h_t)
    z_all = _initial_logits(init, n, T, V, seed)

    zero_docs = [i for i in range(n) if not bool(g_t[i].ne(0).any())]
    zero_set = set(zero_docs)
    chunk_steps: list[int] = []
    final = torch.zeros(n, dtype=torch.float32)
    preds = torch.empty(n, T - 1, dtype=torch.long)
    task = progress.start("GMA-SL label matching", n)
    for s in range(0, n, batch):
        e = min(n, s + batch)
        active = torch.tensor([i not in zero_set for i in range(s, e)])
        steps_taken, dist, z = _match_chunk(
            top, h_t[s:e], g_t[s:e], z_all[s:e], active, N, distance, tag_alpha, steps, lr, tol, patience
        )
        chunk_steps.append(steps_taken)
        final[s:e] = dist
        preds[s:e] = z.argmax(-1).cpu()
        progress.advance(task, e - s)
    progress.finish(task)
    info: dict[str, Any] = {
        "steps": chunk_steps,
        "distance": [float(x) for x in final],
        "seconds": time.perf_counter() - started,
        "n_norm": N,
        "distance_name": distance,
        "zero_gradient_docs": zero_docs,
    }
    return preds, info


def _match_chunk(
    top: Callable[[torch.Tensor], torch.Tensor],
    h: torch.Tensor,
    g_obs: torch.Tensor,
    z0: torch.Tensor,
    active: torch.Tensor,
    N: float,
    distance: str,
    tag_alpha: float,
    steps: int,
    lr: float,
    tol: float,
    patience: int,
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Optimise one chunk's Z; returns (steps taken, final per-document distance, final Z)."""
    with sdpa_kernel(SDPBackend.MATH), torch.enable_grad():
        h = h.detach().clone().requires_grad_(True)
        logits = top(h)[:, :-1]  # the proxy's forward graph, kept for every step's vector-Jacobian product
        p = torch.softmax(logits.detach().float(), dim=-1)
        g_obs = g_obs.detach().to(h.device)
        z = z0.to(h.device).clone().requires_grad_(True)
        opt = torch.optim.Adam([z], lr=lr)
        weight = active.to(h.device, torch.float32)
        if distance == "cos":
            scale = 1.0
        else:
            ref = _distance(torch.zeros_like(g_obs), g_obs, distance, tag_alpha)
            scale = float((ref * weight).sum()) or 1.0
        history: list[float] = []
        t = 0
        while True:
            q = torch.softmax(z, dim=-1)
            grad_logits = ((p - q) / N).to(logits.dtype)
            (g_hat,) = torch.autograd.grad(logits, h, grad_outputs=grad_logits, create_graph=True, retain_graph=True)
            per_doc = _distance(g_hat, g_obs, distance, tag_alpha)
            objective = (per_doc * weight).sum() / scale
            value = float(objective.detach())
            history.append(value)
            if t >= steps or not bool(active.any()):
                break
            if t >= patience:
                before = history[-1 - patience]
                if before - value <= tol * abs(before):
                    break
            (gz,) = torch.autograd.grad(objective, z)
            opt.zero_grad(set_to_none=True)
            z.grad = gz
            opt.step()
            t += 1
    return t, per_doc.detach().cpu(), z.detach()


class GMASL(Attack):
    """``gma-sl`` as a registered attack (``splitleak.attacks.registry``): fits on the pretrained Top
    (``Knowledge.top``), reads a label-shielded run's trunk output and output gradient, and recovers each
    document's labels, the tokens 1 … T-1. The attacker assumes full supervision, so the normaliser of a
    frame is its rows times (T - 1), counted from the mask that crosses with it; documents are matched
    frame by frame. Token 0 is never a label: the reconstruction puts the calibration documents' most
    frequent first token there (scores that need the whole document say so; ``label_recovery`` does not
    count it). ``distance`` defaults to l2 (ours): cosine cannot tell the labels from a faint tilt of the
    proxy's own prediction towards them (see the module docstring)."""

    name = "gma-sl"
    uses_gradients = True

    def __init__(
        self,
        distance: str = "l2",
        steps: NonNegativeInt = 400,
        lr: PositiveFloat = 0.1,
        batch: PositiveInt = 8,
        tag_alpha: NonNegativeFloat = 0.01,
        seed: int = 0,
    ):
        if distance not in DISTANCES:
            raise ConfigError(f"gma-sl: unknown distance {distance!r}; use one of {', '.join(DISTANCES)}")
        self.distance, self.steps, self.lr, self.batch, self.tag_alpha, self.seed = (
            distance,
            steps,
            lr,
            batch,
            tag_alpha,
            seed,
        )

    def params(self) -> dict[str, Any]:
        return {
            "distance": self.distance,
            "steps": self.steps,
            "lr": self.lr,
            "batch": self.batch,
            "tag_alpha": self.tag_alpha,
            "seed": self.seed,
        }

    def channels_read(self) -> tuple[str, ...]:
        return ("trunk-output", "output-gradient")

    def fit(self, knowledge) -> "GMASL":
        if knowledge.top is None:
            raise ConfigError(
                f"{self.name} fits on the pretrained Top: load the knowledge with with_top=True (run_attack does)"
            )
        self.knowledge_ = knowledge
        return self

    def match(
        self, traffic, init: torch.Tensor | None = None, progress: Progress | None = None
    ) -> tuple[torch.Tensor, list[float], list[int]]:
        """The labels [n, T-1] of each row, matched frame by frame; ``init`` (token ids [n, T-1], e.g. SIP's
        reading for BiSR(b)) starts the soft labels there instead of at noise. Returns the labels, each row's
        final distance and the steps each chunk took."""
        if not hasattr(self, "knowledge_"):
            raise ConfigError(f"{self.name}: call fit(knowledge) before reconstruct(traffic)")
        if traffic.trunk_output is None or traffic.output_gradients is None:
            raise ConfigError(
                f"{self.name} reads the trunk output and the output gradient a label-shielded client returns; this "
                "traffic has none (inference traffic, or top-only training, which sends no gradient)"
            )
        top = self.knowledge_.top
        assert top is not None  # fit checked it
        h_t = traffic.trunk_output.to(top.device, top.dtype)
        g_t = traffic.output_gradients.to(top.device, top.dtype)
        n, t = h_t.shape[:2]
        frames = traffic.frames if traffic.frames is not None else tuple(range(n))
        labels = torch.empty(n, t - 1, dtype=torch.long)
        distance = [0.0] * n
        steps: list[int] = []
        for f in dict.fromkeys(frames):
            rows = [i for i, x in enumerate(frames) if x == f]
            pred, info = self._match_frame(
                top,
                h_t[rows],
                g_t[rows],
                float(len(rows) * (t - 1)),
                None if init is None else init[rows],
                self.seed + int(f),
                progress,
            )
            labels[rows] = pred
            for i, d in zip(rows, info["distance"]):
                distance[i] = d
            steps += info["steps"]
        return labels, distance, steps

    def _match_frame(self, top, h_t, g_t, n_norm: float, init, seed: int, progress) -> tuple[torch.Tensor, dict]:
        """One frame's labels (``match_labels`` with this attack's parameters)."""
        return match_labels(
            top,
            h_t,
            g_t,
            n_norm=n_norm,
            distance=self.distance,
            steps=self.steps,
            lr=self.lr,
            init=init,
            seed=seed,
            batch=self.batch,
            tag_alpha=self.tag_alpha,
            progress=progress,
        )

    def reconstruct(self, traffic, progress: Progress | None = None) -> Reconstruction:
        labels, distance, steps = self.match(traffic, progress=progress)
        n = labels.shape[0]
        first = self.knowledge_.calibration_ids()[:, 0]
        token0 = int(torch.mode(first).values) if first.numel() else 0
        tokens = torch.cat([torch.full((n, 1), token0, dtype=torch.long), labels], dim=1)
        return Reconstruction(tokens, {"labels": labels, "distance": distance, "steps": steps})


# ------------------------------------------------------------------ GMA-SL that knows the defence chain

AWARE_SCALES = ("auto", "none", "public", "fit")
AWARE_DISTANCES = ("auto", "l2", "row-l2", "row-cos")
AWARE_MASKS = ("auto", "on", "bound", "off")


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
    from splitleak.defences.masking import GradientDropout, GradientPruning
    from splitleak.defences.mirage import Mirage, ScaleBlinding, SelectiveSupervision, SequenceDP
    from splitleak.defences.vmf import VMFDirection

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
    for name, value, allowed in (
        ("scale", scale, AWARE_SCALES),
        ("distance", distance, AWARE_DISTANCES),
        ("mask", mask, AWARE_MASKS),
    ):
        if value not in allowed:
            raise ConfigError(f"gma-sl-aware: {name} must be one of {', '.join(allowed)}; got {value!r}")
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
        return _distance(g_hat, g_obs, "l2", 0.0)
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
    init: torch.Tensor | None = None,
    tol: float = 1e-5,
    patience: int = 20,
    seed: int = 0,
    batch: int = 8,
    progress: Progress | None = None,
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
    _check_inputs(h_t, g_t, "l2", n_norm, steps, lr, tol, patience, batch, 0.0)
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
    V = _vocab_of(top, h_t)
    z_all = _initial_logits(init, n, T, V, seed)
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
            top, h_t[s:e], g_t[s:e], z_all[s:e], active, N, objective, known, steps, lr, tol, patience
        )
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
        opt = torch.optim.Adam(params, lr=lr)
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
            settled = t - since >= patience and history[-1 - patience] - value <= tol * abs(history[-1 - patience])
            if ob.scale == "fit" and not fitting and (settled or t >= steps // 2):
                fitting, since, settled = True, t, False
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
    ):
        for name, value, allowed in (
            ("scale", scale, AWARE_SCALES),
            ("distance", distance, AWARE_DISTANCES),
            ("mask", mask, AWARE_MASKS),
        ):
            if value not in allowed:
                raise ConfigError(f"gma-sl-aware: {name} must be one of {', '.join(allowed)}; got {value!r}")
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
        super().__init__(distance="l2", steps=steps, lr=lr, batch=batch, seed=seed)
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
            init=init,
            seed=seed,
            batch=self.batch,
            progress=progress,
        )

    def reconstruct(self, traffic, progress: Progress | None = None) -> Reconstruction:
        rec = super().reconstruct(traffic, progress)
        rec.extra["summary"] = {"chain": list(self.model_.chain), "objective": self.objective_.as_dict()}
        return rec


def _build_chain(chain: Any) -> list[Any]:
    from splitleak.defences import build_defence

    if not isinstance(chain, (list, tuple)) or not all(isinstance(d, dict) and "name" in d for d in chain):
        raise ConfigError(
            'gma-sl-aware: chain must be a list of {"name": ..., "args": {...}} (the defences to model); got '
            f"{chain!r}"
        )
    return [build_defence(d["name"], d.get("args")) for d in chain if d["name"] != "none"]
