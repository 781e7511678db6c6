"""000's span claims (§4.5, Table 4): the share of a class's annotated spans (names, numbers, identifiers) an
attack recovers exactly, pooled over the spans as the paper counts them.

A store's attack row holds, per document, how many spans of each class it counted and how many of them the
attack recovered exactly (``span_counts_<class>``, ``span_hits_<class>``; ``splitleak.metrics.scores``). The
share is the ratio of their sums; its interval is the crossed bootstrap of that ratio (``paired_ratio_ci``,
victim seeds x documents, attack seeds averaged, the same draws for both), so a document without a span of the
class weighs nothing and one with three weighs three.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from splitleak.audit.analysis import score_matrix
from splitleak.data.documents import LABELS

#: metric -> span class
SPAN_RECOVERY = {f"{label}_span_recovery": label for label in LABELS}


def span_matrices(rows: Sequence[dict[str, Any]], metric: str) -> tuple[np.ndarray, np.ndarray, list[Any], list[int]]:
    """(hits, counts, seeds, documents): two (victim seeds x documents) matrices of one configuration's rows, each
    cell averaged over attack seeds; raises ``ConfigError`` where the rows hold several configurations (as
    ``score_matrix`` does)."""
    label = SPAN_RECOVERY[metric]
    _, seeds, docs = score_matrix(rows, "token_recovery")  # the configuration check and the cells' order
    hits, counts = np.zeros((len(seeds), len(docs))), np.zeros((len(seeds), len(docs)))
    n = np.zeros((len(seeds), len(docs)))
    for r in rows:
        i, j = seeds.index(r["victim_seed"]), docs.index(int(r["doc_id"]))
        hits[i, j] += float(r.get(f"span_hits_{label}") or 0)
        counts[i, j] += float(r.get(f"span_counts_{label}") or 0)
        n[i, j] += 1
    return hits / n, counts / n, seeds, docs
