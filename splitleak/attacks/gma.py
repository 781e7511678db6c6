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

Defaults that are ours, not the paper's: the distances' exact forms (``gma_core.gradient_distance``), ``tag_alpha=0.01``,
Adam with ``lr=0.1`` for at most ``steps=400`` steps, the stopping rule (relative improvement
of the chunk's summed distance over the last ``patience=20`` steps below ``tol=1e-5``),
standard-normal initial logits, and the logits given to a token-id initialisation (the given
token gets probability ``INIT_TOKEN_PROB = 0.9``, whatever V).

The variant that knows the defence chain (``gma-sl-aware``) is ``splitleak.attacks.gma_aware``.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch
from pydantic import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt
from torch.nn.attention import SDPBackend, sdpa_kernel

from splitleak.attacks.base import Attack, Reconstruction
from splitleak.attacks.gma_candidates import match_chunk_candidates
from splitleak.attacks.gma_core import Rules, check_label_patience, optimise_soft_labels
from splitleak.errors import ConfigError
from splitleak.progress import Progress, Silent

DISTANCES = ("cos", "l1", "l2", "tag")
# a token-id initialisation puts this much probability on the given token (ours)
INIT_TOKEN_PROB = 0.9


def check_inputs(
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


def initial_logits(init: torch.Tensor | str | None, n: int, T: int, V: int, seed: int) -> torch.Tensor:
    if init is None:
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(n, T - 1, V, generator=gen, dtype=torch.float32)
    if isinstance(init, str) and init == "uniform":
        return torch.zeros(n, T - 1, V, dtype=torch.float32)
    if not isinstance(init, torch.Tensor):
        raise ConfigError(
            "GMA-SL: init must be None (noise), 'uniform', logits [n, T-1, V] or token ids [n, T-1] (torch tensors); "
            f"got {init!r}"
        )
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


def vocab_of(top, h_t: torch.Tensor) -> int:
    """The vocabulary size of the proxy Top's logits, checked on one document: it must map [b, T, H] to [b, T, V]."""
    T = h_t.shape[1]
    with sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        probe = top(h_t[:1].detach())
    if probe.dim() != 3 or tuple(probe.shape[:2]) != (1, T):
        raise ConfigError(
            f"GMA-SL: top must map [b, T, H] to logits [b, T, V]; for [1, {T}, H] it gave {tuple(probe.shape)}"
        )
    return int(probe.shape[-1])


STARTS = ("noise", "uniform")


def check_start(start: str, name: str) -> str:
    if start not in STARTS:
        raise ConfigError(f"{name}: start must be one of {', '.join(STARTS)}; got {start!r}")
    return start


def match_labels(
    top: Callable[[torch.Tensor], torch.Tensor],
    h_t: torch.Tensor,
    g_t: torch.Tensor,
    *,
    n_norm: float | None = None,
    distance: str = "cos",
    steps: int = 400,
    lr: float = 0.1,
    init: torch.Tensor | str | None = None,
    tol: float = 1e-5,
    patience: int = 20,
    seed: int = 0,
    batch: int = 8,
    progress: Progress | None = None,
    tag_alpha: float = 0.01,
    label_patience: int = 0,
    candidates: int = 0,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """GMA-SL: the label tokens whose gradient through the pretrained Top best matches ``g_t``.

    top: the attacker's proxy, [b, T, H] -> logits [b, T, V], frozen and in evaluation mode.
    h_t, g_t: the observed trunk output and the gradient returned for it, both [n, T, H].
    n_norm: the loss normaliser N; None = n * (T - 1), n = h_t.shape[0] (full supervision over the
        whole capture, whatever ``batch`` is).
    distance: per document, over the flattened [T, H] gradient: "cos" (1 - cosine similarity),
        "l1", "l2" (squared Euclidean) or "tag" (l2 + tag_alpha * l1, after TAG; tag_alpha=0.01 is
        our default). cos is invariant to a scaling of g_t; l1, l2 and tag are not.
    init: None = standard-normal logits drawn from ``seed``; "uniform" = zero logits, q uniform (ours:
        the first steps then move Z along the gradient, where noise logits hide the labels until Adam
        has climbed them over the noise's maximum, about 4 for V = 49,152: measured in
        benchmarks/RESULTS.md, "GMA-SL from a uniform start"); float logits [n, T-1, V] (e.g. from another
        attack); or token ids [n, T-1], turned into logits that give the token probability INIT_TOKEN_PROB.
    Optimisation: Adam on Z with ``lr``; a chunk of ``batch`` documents stops when its summed
    distance improved by less than ``tol`` (relative) over the last ``patience`` steps, when its labels
    (the argmax of Z) have not changed for ``label_patience`` steps (0: this rule is off), or after
    ``steps`` steps. The l1/l2/tag objectives are divided by a per-chunk constant (the chunk's
    distance from a zero gradient, e.g. the sum of ||g_t||^2 for l2) before Adam sees them, so that
    Adam's epsilon does not swamp the tiny gradients of a 1/N-scaled loss (measured on tiny-gpt2:
    with N 30 times larger and g_t 30 times smaller, raw l2 recovered 1 of 28 labels in 100 steps,
    normalised l2 all 28); that changes neither the minimiser nor the reported distances.
    candidates: 0 (the default) matches soft labels over the whole vocabulary; K > 0 over K tokens per position
        chosen from the traffic at the uniform start (``splitleak.attacks.gma_candidates``; ours): a step then costs
        the Top's blocks, not its head. It needs ``init="uniform"`` and a proxy that exposes its body and head.
    Deterministic under ``seed`` on a given machine and thread count.

    A document whose g_t is all zero carries no information about its labels: it is left out of
    the optimisation and its prediction is the argmax of its initial logits (random under the
    noise init). Its index is listed in ``info["zero_gradient_docs"]``.

    Returns (token ids [n, T-1], the predicted y[:, 1:]) and info: ``steps`` (steps taken per
    chunk), ``distance`` (final distance per document, a list), ``seconds``, ``n_norm``,
    ``distance_name``, ``zero_gradient_docs``.
    """
    check_inputs(h_t, g_t, distance, n_norm, steps, lr, tol, patience, batch, tag_alpha)
    if isinstance(candidates, bool) or not isinstance(candidates, int) or candidates < 0:
        raise ConfigError(f"GMA-SL: candidates must be an integer >= 0 (0: the whole vocabulary); got {candidates!r}")
    if candidates and not (isinstance(init, str) and init == "uniform"):
        raise ConfigError(
            "GMA-SL: candidates > 0 chooses them at the uniform start; pass init='uniform' (start=uniform), or "
            "candidates=0 to start from noise, logits or token ids"
        )
    started = time.perf_counter()
    n, T, _ = h_t.shape
    N = float(n_norm) if n_norm is not None else float(n * (T - 1))
    progress = progress or Silent()

    V = vocab_of(top, h_t)
    # over candidates the logits are K per position, made per chunk (gma_candidates)
    z_all = initial_logits(init, n, T, V, seed) if not candidates else torch.empty(0)

    rules = Rules(distance, tag_alpha, steps, lr, tol, patience, check_label_patience(label_patience, "GMA-SL"))
    zero_docs = [i for i in range(n) if not bool(g_t[i].ne(0).any())]
    zero_set = set(zero_docs)
    chunk_steps: list[int] = []
    final = torch.zeros(n, dtype=torch.float32)
    preds = torch.empty(n, T - 1, dtype=torch.long)
    task = progress.start("GMA-SL label matching", n)
    for s in range(0, n, batch):
        e = min(n, s + batch)
        active = torch.tensor([i not in zero_set for i in range(s, e)])
        if candidates:
            steps_taken, dist, labels = match_chunk_candidates(top, h_t[s:e], g_t[s:e], active, N, candidates, rules)
        else:
            steps_taken, dist, z = _match_chunk(top, h_t[s:e], g_t[s:e], z_all[s:e], active, N, rules)
            labels = z.argmax(-1).cpu()
        chunk_steps.append(steps_taken)
        final[s:e] = dist
        preds[s:e] = labels
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
    rules: Rules,
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Optimise one chunk's Z; returns (steps taken, final per-document distance, final Z)."""
    with sdpa_kernel(SDPBackend.MATH), torch.enable_grad():
        h = h.detach().clone().requires_grad_(True)
        logits = top(h)[:, :-1]  # the proxy's forward graph, kept for every step's vector-Jacobian product
        p = torch.softmax(logits.detach().float(), dim=-1)
        return optimise_soft_labels(logits, h, lambda q: ((p - q) / N).to(logits.dtype), z0, g_obs, active, rules)


class GMASL(Attack):
    """``gma-sl`` as a registered attack (``splitleak.attacks.registry``): fits on the pretrained Top
    (``Knowledge.top``), reads a label-shielded run's trunk output and output gradient, and recovers each
    document's labels, the tokens 1 … T-1. The attacker assumes full supervision, so the normaliser of a
    frame is its rows times (T - 1), counted from the mask that crosses with it; documents are matched
    frame by frame. Token 0 is never a label: the reconstruction puts the calibration documents' most
    frequent first token there (scores that need the whole document say so; ``label_recovery`` does not
    count it). ``distance`` defaults to l2 (ours): cosine cannot tell the labels from a faint tilt of the
    proxy's own prediction towards them (see the module docstring). ``start``: "noise" (standard-normal
    logits, the default) or "uniform" (zero logits); ``label_patience``: stop a chunk once its labels have
    not changed for that many steps (0, the default: off); ``candidates``: K > 0 matches over K tokens per position
    chosen from the traffic at the uniform start (``splitleak.attacks.gma_candidates``; needs ``start=uniform``;
    a caller's initial labels, BiSR's, are matched over the whole vocabulary). All three are ours, and the
    defaults keep the matching that grids stored before them (a job's key holds the parameters it was given)."""

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
        start: str = "noise",
        label_patience: NonNegativeInt = 0,
        candidates: NonNegativeInt = 0,
    ):
        if distance not in DISTANCES:
            raise ConfigError(f"gma-sl: unknown distance {distance!r}; use one of {', '.join(DISTANCES)}")
        if candidates and start != "uniform":
            raise ConfigError("gma-sl: candidates > 0 are chosen at the uniform start; pass start=uniform with them")
        self.candidates = candidates
        self.distance, self.steps, self.lr, self.batch, self.tag_alpha, self.seed = (
            distance,
            steps,
            lr,
            batch,
            tag_alpha,
            seed,
        )
        self.start = check_start(start, self.name)
        self.label_patience = check_label_patience(label_patience, self.name)

    def params(self) -> dict[str, Any]:
        return {
            "distance": self.distance,
            "steps": self.steps,
            "lr": self.lr,
            "batch": self.batch,
            "tag_alpha": self.tag_alpha,
            "seed": self.seed,
            "start": self.start,
            "label_patience": self.label_patience,
            "candidates": self.candidates,
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
            pred, info = self._read_frame(
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

    def _read_frame(self, top, h_t, g_t, n_norm: float, init, seed: int, progress) -> tuple[torch.Tensor, dict]:
        """``_match_frame``, once per frame content (``Knowledge.memo_content``): the matching is a function of the
        frame's tensors, the normaliser, the initial labels, the seed and the attack's parameters on its
        knowledge, so a frame read again (the mis-paired twin reads the arm's frames under other documents'
        ids) gives back what matching it again gives, bit for bit (tests/test_shielded.py), without the work. A
        reader that starts from the labels of the ids it is given starts its twin elsewhere: the initial labels
        are part of the key."""
        key = ("gma-sl frame", type(self).__name__, repr(sorted(self.params().items())), n_norm, seed)
        pred, info = self.knowledge_.memo_content(
            key, (h_t, g_t, init), lambda: self._match_frame(top, h_t, g_t, n_norm, init, seed, progress)
        )
        return pred.clone(), dict(info)

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
            init=self.initial(init),
            seed=seed,
            batch=self.batch,
            tag_alpha=self.tag_alpha,
            progress=progress,
            label_patience=self.label_patience,
            candidates=self.candidates if init is None else 0,
        )

    def initial(self, init: torch.Tensor | None) -> torch.Tensor | str | None:
        """What the matching starts from: ``init`` where a caller gives one (BiSR: SIP's reading), else the
        ``start``."""
        if init is not None:
            return init
        return "uniform" if self.start == "uniform" else None

    def reconstruct(self, traffic, progress: Progress | None = None) -> Reconstruction:
        labels, distance, steps = self.match(traffic, progress=progress)
        n = labels.shape[0]
        first = self.knowledge_.calibration_ids()[:, 0]
        token0 = int(torch.mode(first).values) if first.numel() else 0
        tokens = torch.cat([torch.full((n, 1), token0, dtype=torch.long), labels], dim=1)
        return Reconstruction(tokens, {"labels": labels, "distance": distance, "steps": steps})
