"""GMA-SL label matching (splitleak.attacks.gma.match_labels).

The integration tests use the Top of the random tiny-gpt2 (blocks 2-3, final norm, LM head of a
U-shape with offload_start=1, offload_length=1): V = 615, H = 64, 4 documents of 8 tokens, so 28
labels per capture and a random guess recovers about 1/615 of them. The true gradient is the
client's: hard-label cross-entropy summed over the 28 targets, divided by N = 28.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from splitleak.attacks.gma import INIT_TOKEN_PROB, match_labels
from splitleak.errors import ConfigError

N_DOCS, T = 4, 8


@pytest.fixture(autouse=True)
def _one_thread():
    """These tensors are too small for intra-op threads to help (measured: 100 steps take 0.75 s on
    1 or 2 threads), and on a busy 2-core machine 2 threads made a 1 s test take up to 60 s: every
    parallel region waited for a descheduled partner thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def true_gradient(top, h: torch.Tensor, y: torch.Tensor, n_norm: float) -> torch.Tensor:
    """What the client returns: d/dh of the hard-label next-token loss / N."""
    hh = h.detach().clone().requires_grad_(True)
    with sdpa_kernel(SDPBackend.MATH):
        logits = top(hh)[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"
        ) / float(n_norm)
        (g,) = torch.autograd.grad(loss, hh)
    return g


# ------------------------------------------------------------------ a toy Top (unit tests)


def toy_top(seed: int = 0, H: int = 8, V: int = 20) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(H, 16), torch.nn.Tanh(), torch.nn.Linear(16, V))


def toy_capture(top, seed: int, n: int = 3, T_: int = 4, H: int = 8, V: int = 20):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, T_, H, generator=g)
    y = torch.randint(0, V, (n, T_ - 1), generator=g)
    return h, true_gradient(top, h, y, n * (T_ - 1)), y


@pytest.mark.unit
@pytest.mark.parametrize(
    "case, needle",
    [
        ("shape", "must have the shape of h_t"),
        ("rank", "trunk output [n, T, H]"),
        ("short", "at least 2 tokens"),
        ("nan_h", "h_t has 1 non-finite"),
        ("inf_g", "g_t has 2 non-finite"),
        ("distance", "choose one of cos, l1, l2, tag"),
        ("n_norm", "n_norm must be a positive"),
        ("init_shape", "initial logits must be [n, T-1, V]"),
        ("init_ids", "must lie in [0, 20)"),
        ("batch", "batch must be >= 1"),
        ("init_word", "init must be None (noise), 'uniform'"),
        ("label_patience", "label_patience must be an integer >= 0"),
    ],
)
def test_rejects_bad_inputs(case, needle):
    top = toy_top()
    h, g, _ = toy_capture(top, seed=0)
    kw: dict = {}
    if case == "shape":
        g = g[:, :-1]
    elif case == "rank":
        h, g = h[0], g[0]
    elif case == "short":
        h, g = h[:, :1], g[:, :1]
    elif case == "nan_h":
        h = h.clone()
        h[1, 2, 3] = float("nan")
    elif case == "inf_g":
        g = g.clone()
        g[0, 0, :2] = float("inf")
    elif case == "distance":
        kw["distance"] = "cosine"
    elif case == "n_norm":
        kw["n_norm"] = 0
    elif case == "init_shape":
        kw["init"] = torch.zeros(3, 4, 20)
    elif case == "init_ids":
        kw["init"] = torch.full((3, 3), 20, dtype=torch.long)
    elif case == "batch":
        kw["batch"] = 0
    elif case == "init_word":
        kw["init"] = "zeros"
    elif case == "label_patience":
        kw["label_patience"] = -1
    with pytest.raises(ConfigError) as err:
        match_labels(top, h, g, steps=2, **kw)
    assert needle in str(err.value)


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1])
def test_zero_gradient_document_keeps_its_init(seed):
    top = toy_top(seed)
    h, g, y = toy_capture(top, seed)
    g[1] = 0.0
    start = torch.randint(0, 20, (3, 3), generator=torch.Generator().manual_seed(seed + 10))
    before, info0 = match_labels(top, h, g, distance="l2", init=start, steps=0)
    # a token-id init is a distribution with INIT_TOKEN_PROB on the token: its argmax is the token
    assert torch.equal(before, start)
    assert info0["steps"] == [0]
    after, info = match_labels(top, h, g, distance="l2", init=start, steps=60)
    assert info["zero_gradient_docs"] == [1]
    assert torch.equal(after[1], start[1])  # nothing to match: the init stands
    for d in (0, 2):  # the informative documents moved towards a match
        assert info["distance"][d] < 0.5 * info0["distance"][d]


@pytest.mark.unit
def test_token_init_probability_is_independent_of_vocabulary():
    top = toy_top(0, V=50)
    h, g, _ = toy_capture(top, 0, V=50)
    ids = torch.zeros(3, 3, dtype=torch.long)
    # with steps=0 and l2, the distance is that of q = INIT_TOKEN_PROB on token 0, rest spread evenly
    _, info = match_labels(top, h, g, distance="l2", init=ids, steps=0)
    q = torch.full((3, 3, 50), (1 - INIT_TOKEN_PROB) / 49)
    q[..., 0] = INIT_TOKEN_PROB
    _, info_q = match_labels(top, h, g, distance="l2", init=q.log(), steps=0)
    assert info["distance"] == pytest.approx(info_q["distance"], rel=1e-4)


@pytest.mark.unit
def test_proxy_is_not_stepped_nor_given_grads():
    top = toy_top(0)
    h, g, _ = toy_capture(top, 0)
    before = [p.detach().clone() for p in top.parameters()]
    match_labels(top, h, g, distance="l2", steps=10)
    for p, b in zip(top.parameters(), before):
        assert p.grad is None
        assert torch.equal(p.detach(), b)


# ------------------------------------------------------------------ the tiny-gpt2 Top


@pytest.fixture(scope="module")
def tiny_top():
    from splitleak.models import load_model
    from splitleak.models.split import SplitModel

    lm = load_model("tiny-gpt2", seed=0)
    lm.model.eval()
    split = SplitModel(lm, offload_start=1, offload_length=1)
    assert split.spec.server_end == 2 and split.spec.n_blocks == 4  # the Top is blocks 2-3 + norm + head
    V = split.head.weight.shape[0]
    H = split.head.weight.shape[1]
    return TinyTop(split), V, H


class TinyTop:
    """The tiny model's Top as the attacks' proxy (``PublicTop``'s face: called for logits, ``hidden`` and
    ``head`` for the matching over candidates)."""

    softcap = None

    def __init__(self, split):
        self.split, self.head, self.contexts = split, split.head, {}

    def _ctx(self, h: torch.Tensor):
        key = (h.shape[0], h.shape[1])
        if key not in self.contexts:
            self.contexts[key] = self.split.context(*key)
        return self.contexts[key]

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self.split.head_logits(h, self._ctx(h))

    def hidden(self, h: torch.Tensor) -> torch.Tensor:
        return self.split.head_hidden(h, self._ctx(h))


def tiny_capture(tiny_top, seed: int):
    top, V, H = tiny_top
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(N_DOCS, T, H, generator=gen)
    y = torch.randint(0, V, (N_DOCS, T - 1), generator=gen)
    return h, true_gradient(top, h, y, N_DOCS * (T - 1)), y


def recovery(pred: torch.Tensor, y: torch.Tensor) -> float:
    return float((pred == y).float().mean())


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("distance", ["l2", "tag", "l1"])
def test_magnitude_matching_recovers_labels(tiny_top, distance, seed):
    top, V, _ = tiny_top
    h, g, y = tiny_capture(tiny_top, seed)
    pred, info = match_labels(top, h, g, distance=distance, steps=150, seed=seed)
    # measured: 28/28 for every distance and seed at 100 steps (60 % at 50); chance is 1/615
    assert recovery(pred, y) >= 0.9
    assert pred.shape == (N_DOCS, T - 1)
    assert info["n_norm"] == N_DOCS * (T - 1)
    assert len(info["distance"]) == N_DOCS


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
def test_l2_recovers_labels_at_a_large_normaliser(tiny_top, seed):
    # N = 28000 (a capture of ~1000 times more targets): the gradient is 1000 times smaller; without
    # the per-chunk normalisation of the objective Adam's epsilon stalls it (measured 0/28)
    top, V, _ = tiny_top
    h, g, y = tiny_capture(tiny_top, seed)
    k = 1000
    pred, info = match_labels(top, h, g / k, n_norm=N_DOCS * (T - 1) * k, distance="l2", steps=150, seed=seed)
    assert info["n_norm"] == N_DOCS * (T - 1) * k
    assert recovery(pred, y) >= 0.9


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
def test_gradient_of_another_document_gives_chance(tiny_top, seed):
    top, V, _ = tiny_top
    h, g, y = tiny_capture(tiny_top, seed)
    shuffled = g[torch.roll(torch.arange(N_DOCS), 1)]  # each h paired with another document's gradient
    pred, _ = match_labels(top, h, shuffled, distance="l2", steps=100, seed=seed)
    assert recovery(pred, y) <= 0.1  # measured 0/28; the matched labels of the same run are >= 0.9


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("c", [0.01, 0.5])
def test_cos_cannot_see_how_far_q_leans_towards_the_labels(tiny_top, seed, c):
    """q = (1 - c) p + c y gives exactly c times the true gradient: a perfect cosine match for any
    c, while l2 sees the (1 - c) of the magnitude that is missing."""
    top, V, _ = tiny_top
    h, g, y = tiny_capture(tiny_top, seed)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        p = torch.softmax(top(h)[:, :-1].float(), dim=-1)
    q = (1 - c) * p + c * torch.nn.functional.one_hot(y, V).float()
    _, cos = match_labels(top, h, g, distance="cos", init=q.log(), steps=0)
    _, l2 = match_labels(top, h, g, distance="l2", init=q.log(), steps=0)
    assert max(cos["distance"]) < 1e-4
    rel = torch.tensor(l2["distance"]) / g.flatten(1).pow(2).sum(1)
    assert rel.tolist() == pytest.approx([(1 - c) ** 2] * N_DOCS, rel=1e-3)


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
def test_scaling_the_gradient(tiny_top, seed):
    top, V, _ = tiny_top
    h, g, y = tiny_capture(tiny_top, seed)
    cos1, i1 = match_labels(top, h, g, distance="cos", steps=120, seed=seed)
    cosk, ik = match_labels(top, h, 1750 * g, distance="cos", steps=120, seed=seed)
    # cos is scale-invariant: the same matches (measured identical), both perfect (measured ~5e-7)
    assert float((cos1 == cosk).float().mean()) >= 0.95
    assert max(i1["distance"] + ik["distance"]) < 1e-4
    # l2 must match the magnitude: at scale 1 it does; at 1750 no soft label on the simplex comes
    # near (the best, q = y, leaves (1749/1750)^2 of the squared norm)
    _, l1 = match_labels(top, h, g, distance="l2", steps=100, seed=seed)
    _, lk = match_labels(top, h, 1750 * g, distance="l2", steps=100, seed=seed)
    ref = g.flatten(1).pow(2).sum(1)
    assert (torch.tensor(l1["distance"]) / ref).max() < 1e-2
    assert (torch.tensor(lk["distance"]) / (1750**2 * ref)).min() > 0.99


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
def test_deterministic_under_the_seed(tiny_top, seed):
    top, V, _ = tiny_top
    h, g, _ = tiny_capture(tiny_top, seed)
    a, ia = match_labels(top, h, g, distance="cos", steps=20, seed=seed)
    b, ib = match_labels(top, h, g, distance="cos", steps=20, seed=seed)
    c, _ = match_labels(top, h, g, distance="cos", steps=20, seed=seed + 100)
    assert torch.equal(a, b)
    assert ia["distance"] == ib["distance"] and ia["steps"] == ib["steps"]
    assert float((a == c).float().mean()) < 0.5  # another seed, another noise init


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
def test_chunks_share_the_capture_normaliser(tiny_top, seed):
    top, V, _ = tiny_top
    h, g, y = tiny_capture(tiny_top, seed)
    kw = dict(distance="l2", steps=100, seed=seed, tol=0.0, patience=1000)
    one, i1 = match_labels(top, h, g, batch=1, **kw)
    allin, ia = match_labels(top, h, g, batch=N_DOCS, **kw)
    assert i1["steps"] == [100] * N_DOCS and ia["steps"] == [100]
    assert i1["n_norm"] == ia["n_norm"] == N_DOCS * (T - 1)
    assert torch.equal(one, allin)
    assert i1["distance"] == pytest.approx(ia["distance"], rel=1e-2)
    assert recovery(one, y) >= 0.9


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
def test_a_uniform_start_reads_the_labels_in_a_few_steps_and_the_label_rule_stops_there(tiny_top, seed):
    """From noise logits the labels come out only once Adam has lifted them over the noise's maximum (measured on
    these captures: 2-3 % of the labels after 20 steps, 100 % after 80); from uniform logits the first steps move Z
    along the gradient (measured: 100 % after one step). The label rule then stops each chunk once its labels have
    held for ``label_patience`` steps."""
    top, V, _ = tiny_top
    h, g, y = tiny_capture(tiny_top, seed)
    noise, _ = match_labels(top, h, g, distance="l2", steps=20, seed=seed, tol=0.0)
    uniform, _ = match_labels(top, h, g, distance="l2", steps=20, seed=seed, tol=0.0, init="uniform")
    assert recovery(noise, y) < 0.2 and recovery(uniform, y) >= 0.9
    stopped, info = match_labels(
        top, h, g, distance="l2", steps=400, seed=seed, tol=0.0, init="uniform", label_patience=10, batch=2
    )
    assert torch.equal(stopped, uniform) and all(s <= 20 for s in info["steps"]), info["steps"]
    # labels that cannot move (a learning rate too small to change any argmax) stop after exactly label_patience
    _, still = match_labels(
        top, h, g, distance="l2", steps=400, lr=1e-12, seed=seed, tol=0.0, patience=1000, label_patience=7
    )
    assert still["steps"] == [7]
    # off (0, the default), the same matching runs to its step cap
    _, off = match_labels(top, h, g, distance="l2", steps=30, lr=1e-12, seed=seed, tol=0.0, patience=1000)
    assert off["steps"] == [30]


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
def test_over_candidates_it_reads_the_labels_of_the_whole_vocabulary_and_nothing_from_another_gradient(tiny_top, seed):
    """Matching over K candidates per position, chosen at the uniform start from the traffic alone, reads the
    labels that matching over the whole vocabulary reads (K = V: the same soft labels in another order of sums;
    K = 16 of V = 615), and a document paired with another's gradient reads about nothing, as the full matching."""
    top, V, _ = tiny_top
    h, g, y = tiny_capture(tiny_top, seed)
    kw = dict(distance="l2", steps=60, seed=seed, init="uniform", label_patience=10)
    full, _ = match_labels(top, h, g, **kw)
    assert recovery(full, y) >= 0.9
    for k in (V, 16):
        over, info = match_labels(top, h, g, candidates=k, **kw)
        assert torch.equal(over, full), (k, recovery(over, y), recovery(full, y))
        assert all(s < 60 for s in info["steps"])  # the label rule stopped it
    other, _ = match_labels(top, h, g[torch.roll(torch.arange(N_DOCS), 1)], candidates=16, **kw)
    assert recovery(other, y) <= 0.1
    # one candidate per position is the first step's choice alone: the labels read without any matching
    one, _ = match_labels(top, h, g, candidates=1, **kw)
    assert recovery(one, y) >= 0.5


@pytest.mark.integration
def test_over_candidates_a_document_without_a_gradient_reads_what_the_uniform_start_reads(tiny_top):
    top, _, _ = tiny_top
    h, g, y = tiny_capture(tiny_top, 0)
    g = g.clone()
    g[1] = 0.0
    pred, info = match_labels(top, h, g, distance="l2", steps=60, init="uniform", label_patience=10, candidates=16)
    full, _ = match_labels(top, h, g, distance="l2", steps=60, init="uniform", label_patience=10)
    assert info["zero_gradient_docs"] == [1] and torch.equal(pred[1], full[1]) and not pred[1].any()
    others = [0, 2, 3]
    assert torch.equal(pred[others], full[others]) and recovery(pred[others], y[others]) >= 0.9


@pytest.mark.unit
def test_candidates_are_refused_without_a_uniform_start_a_body_and_head_or_a_linear_head(tiny_top):
    from splitleak.attacks.gma import GMASL

    top, _, _ = tiny_top
    h, g, _ = tiny_capture(tiny_top, 0)
    with pytest.raises(ConfigError, match="init='uniform'"):
        match_labels(top, h, g, candidates=8)
    with pytest.raises(ConfigError, match="candidates must be an integer >= 0"):
        match_labels(top, h, g, candidates=-1, init="uniform")
    with pytest.raises(ConfigError, match="exposes its body and linear head"):
        match_labels(lambda x: top(x), h, g, candidates=8, init="uniform", steps=1)
    capped = TinyTop(top.split)
    capped.softcap = 30.0
    with pytest.raises(ConfigError, match="caps its logits"):
        match_labels(capped, h, g, candidates=8, init="uniform", steps=1)
    with pytest.raises(ConfigError, match="pass start=uniform"):
        GMASL(candidates=8)
    assert GMASL(candidates=8, start="uniform").params()["candidates"] == 8


@pytest.mark.unit
def test_the_attacks_defaults_keep_the_noise_start_and_no_label_rule():
    """A grid's job key holds the parameters it was given: the defaults must stay the matching stored before."""
    from splitleak.attacks.gma import GMASL
    from splitleak.attacks.gma_aware import AwareGMASL

    for cls in (GMASL, AwareGMASL):
        assert cls().params()["start"] == "noise" and cls().params()["label_patience"] == 0
        with pytest.raises(ConfigError, match="start must be one of noise, uniform"):
            cls(start="zeros")
    for cls in (GMASL, AwareGMASL):
        with pytest.raises(ConfigError, match="label_patience must be an integer >= 0"):
            cls(label_patience=-2)
