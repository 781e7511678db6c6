"""``mixup-history``: undo secret mixup without probe rows (``correction=cached`` or ``none``; it ignores them where
they cross) from the traffic the server saw before (the mixup of What Gradients Add §4.5; this attack is ours).

Every mixed row is x = λh + (1 − λ)d, where d is a clean activation row of an earlier training step of the same
run, drawn from the client's pool (its latest ``pool_rows`` rows, FIFO) without replacement per document; the
first ``warmup`` training steps cross unmixed and fill the pool. λ, ``warmup`` and ``pool_rows`` are the
defence's public arguments, so the server knows the warm-up's pool rows in clear and keeps the same pool. For
each later training frame, in step order:

1. candidates per position: the ridge estimate of (x − (1 − λ)d̄)/λ (d̄: the mean pool row), cosine top ``k``;
2. a beam search (width ``width``) scoring a candidate whose recomputed activation is ĥ by the distance from
   x to its nearest possible mix, min over pool rows d of ||x − λĥ − (1 − λ)d|| (``torch.cdist``): the
   true token leaves the residual (x − λĥ)/(1 − λ) on its decoy;
3. for the chosen tokens, the pool row nearest that residual is taken as the decoy, and the unmixed row
   (x − (1 − λ)d)/λ (the client's own row, exactly, where the decoy is right) joins the pool as the
   client's did. A decoy counts as *identified* (reported, not used) when it is at most ``ratio`` times as
   far as the second nearest; keeping the ĥ of the rows that are not was measured to read less
   (experiments/PILOTS.md).

The capture pass's mixed rows are unmixed the same way against the pool as training left it, and read by
the activation attacker (its ridge map, candidates and beam) as undefended rows.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import PositiveInt

from splitleak.attacks.base import Candidates, Reconstruction, Share
from splitleak.attacks.beam import ActivationBeam
from splitleak.attacks.knowledge import Traffic
from splitleak.attacks.ridge import cosine_topk
from splitleak.attacks.search import beam_search
from splitleak.errors import ConfigError
from splitleak.progress import Progress


class _Pool:
    """The attacker's copy of the client's decoy pool: rows of earlier training steps with their provenance
    (step, document id, position), FIFO of ``pool_rows`` rows as ``SecretMixup.remember`` keeps it."""

    def __init__(self, pool_rows: int):
        self.pool_rows = pool_rows
        self.parts: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add(self, rows: torch.Tensor, prov: torch.Tensor) -> None:
        self.parts.append((rows, prov))
        while sum(p[0].shape[0] for p in self.parts) - self.parts[0][0].shape[0] >= self.pool_rows:
            self.parts.pop(0)

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([p[0] for p in self.parts]), torch.cat([p[1] for p in self.parts])


def _provenance(step: int, doc_ids, T: int) -> torch.Tensor:
    return torch.tensor([[step, int(doc), t] for doc in doc_ids for t in range(T)], dtype=torch.long)


class MixupHistory(ActivationBeam):
    """Unmix mixup's rows against the earlier rows the server saw (module docstring), then the activation
    attacker. ``ratio``: how much nearer than the second-nearest pool row a decoy must be to count as
    identified (reported only)."""

    name = "mixup-history"

    def __init__(
        self,
        k: Candidates = 32,
        width: PositiveInt = 2,
        seed: int = 0,
        chunk_docs: PositiveInt = 64,
        ratio: Share = 0.5,
    ):
        super().__init__(k=k, width=width, seed=seed, chunk_docs=chunk_docs)
        self.ratio = ratio

    def params(self):
        return {**super().params(), "ratio": self.ratio}

    def _mixup(self):
        found = [d for d in self.knowledge_.chain() if d.name == "mixup"]
        if not found:
            raise ConfigError(
                "mixup-history reads the traffic of mixup with correction=cached or none, and this run's chain has "
                "no mixup; run the ordinary attacks instead"
            )
        return found[0]  # with correction=probe too (mixup-unmix reads that more simply: the decoys cross)

    # ------------------------------------------------------------------ one frame
    def _unmix_frame(
        self, x: torch.Tensor, pool: torch.Tensor, lam: float, given: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Rows x [m, T, d] against pool rows [N, d]: (clean rows, the pool index of each decoy [m, T], which
        decoys were identified [m, T], the joint search's tokens or None). ``given``: the decoys' pool
        indices (the client's record; a positive control), used instead of the search."""
        m, T, width = x.shape
        if given is not None:
            h = (x - (1 - lam) * pool[given.reshape(-1)].view(m, T, width).to(x.dtype)) / lam
            return h, given, torch.ones(m, T, dtype=torch.bool), None
        client = self.knowledge_.client
        xd, pd = x.to(client.device, client.dtype), pool.to(client.device, client.dtype)
        est = self.ridge_((xd - (1 - lam) * pd.mean(0)) / lam)
        cand = cosine_topk(est, client.embedding, self.k).cpu()
        mixes = (1 - lam) * pd

        def distance(h: torch.Tensor, rows: torch.Tensor, t: int) -> torch.Tensor:
            r = xd[rows.to(xd.device), t].unsqueeze(1) - lam * h  # [a, c, d]
            return torch.cdist(r.reshape(-1, width), mixes).amin(dim=-1).view(r.shape[:2])

        res = beam_search(client, xd, cand, self.width, self.chunk_docs, distance=distance)
        recomputed = client.activations(res.tokens)
        residual = ((xd - lam * recomputed) / (1 - lam)).reshape(-1, width)
        idx, identified = [], []
        for s in range(0, residual.shape[0], 4096):
            near = torch.cdist(residual[s : s + 4096], pd).topk(min(2, pd.shape[0]), dim=-1, largest=False)
            idx.append(near.indices[:, 0].cpu())
            second = near.values[:, -1] if pd.shape[0] > 1 else torch.full_like(near.values[:, 0], float("inf"))
            identified.append((near.values[:, 0] <= self.ratio * second).cpu())
        index, ok = torch.cat(idx).view(m, T), torch.cat(identified).view(m, T)
        unmixed = (xd - (1 - lam) * pd[index.reshape(-1).to(pd.device)].view(m, T, width)) / lam
        return unmixed.cpu().to(x.dtype), index, ok, res.tokens

    @staticmethod
    def _given(log: list[dict], phase: str, step: int, doc_ids, prov: torch.Tensor) -> torch.Tensor:
        """The pool indices of the decoys the client's record names for one frame's documents."""
        where = {tuple(p): i for i, p in enumerate(prov.tolist())}
        entries = {(e["phase"], e["step"], e["doc_id"]): e["sources"] for e in log}
        try:
            return torch.tensor([[where[tuple(s)] for s in entries[(phase, step, int(d))]] for d in doc_ids])
        except KeyError as exc:
            raise ConfigError(f"mixup-history: the decoy record names a row the pool does not hold ({exc})") from None

    # ------------------------------------------------------------------ the run
    def unmix(self, traffic: Traffic, log: list[dict] | None = None) -> tuple[Traffic, dict[str, Any]]:
        """The traffic with every mixed row unmixed, and what was found: the decoys' provenance (step,
        document id, position) per row of ``traffic``, which were identified, counts. ``log``: the client's
        record of its decoys (``client/mixup_decoys.json``), for the positive control only."""
        mix = self._mixup()
        lam = float(mix.lam)
        hist = self.knowledge_.history()
        if hist is None or hist.steps is None:
            raise ConfigError(
                "mixup-history reads the training traffic the observer saw before this traffic, and this knowledge "
                "carries none (load it with load_knowledge from the run, or from the server's capture)"
            )
        T, width = hist.activations.shape[1:]
        pool = _Pool(mix.pool_rows)
        seen: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        counts = {"history_mixed_rows": 0, "history_identified": 0}
        for i, step in enumerate(sorted(set(hist.steps))):
            rows = [j for j, s in enumerate(hist.steps) if s == step]
            docs = [hist.doc_ids[j] for j in rows]
            x = hist.activations[rows]
            if i < mix.warmup or lam == 1.0:  # the warm-up crosses unmixed
                h, index, ok, toks = x, torch.full(x.shape[:2], -1), torch.zeros(x.shape[:2], dtype=torch.bool), None
            else:
                rows_p, prov = pool.rows()
                given = None if log is None else self._given(log, "train", step, docs, prov)
                h, index, ok, toks = self._unmix_frame(x, rows_p, lam, given)
                index = prov[index.reshape(-1)].view(*index.shape, 3)
                counts["history_mixed_rows"] += ok.numel()
                counts["history_identified"] += int(ok.sum())
            for r, doc in enumerate(docs):
                seen[(step, doc)] = (h[r], index[r], ok[r], None if toks is None else toks[r])
            pool.add(h.reshape(-1, width), _provenance(step, docs, T))
        info_tokens: dict[str, torch.Tensor] = {}
        if traffic.phase == "train":
            if traffic.steps is None:
                raise ConfigError("mixup-history: this training traffic does not say which step each row crossed in")
            got = [seen[(s, d)] for s, d in zip(traffic.steps, traffic.doc_ids)]
            h = torch.stack([g[0] for g in got])
            sources = torch.stack([g[1] if g[1].dim() == 2 else torch.full((T, 3), -1) for g in got])
            ok = torch.stack([g[2] for g in got])
        else:
            rows_p, prov = pool.rows()
            given = None if log is None else self._given(log, traffic.phase, -1, traffic.doc_ids, prov)
            h, index, ok, joint = self._unmix_frame(traffic.activations, rows_p, lam, given)
            sources = prov[index.reshape(-1)].view(*index.shape, 3)
            if joint is not None:
                info_tokens = {"joint search": joint}
        info = {
            "stage_tokens": info_tokens,
            "decoy_sources": sources,
            "decoy_identified": ok,
            "summary": {
                "lambda": lam,
                "history_frames": len(set(hist.steps)),
                **counts,
                "rows": int(ok.numel()),
                "identified": int(ok.sum()),
            },
        }
        return traffic.replace(activations=h.to(traffic.activations.dtype)), info

    def reconstruct(self, traffic: Traffic, progress: Progress | None = None) -> Reconstruction:
        self._check(traffic)
        unmixed, info = self.unmix(traffic)
        rec = super().reconstruct(unmixed, progress)
        rec.extra.update(info)
        rec.extra["stage_tokens"] = {**info["stage_tokens"], "unmixed, activation attacker": rec.tokens}
        return rec
