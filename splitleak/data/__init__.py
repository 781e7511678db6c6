"""Documents and their annotations: ``doc_len``-token windows in three disjoint, seeded sets.

``load_documents(source, tokenizer, seed=...)`` reads or generates passages, cuts them into
non-overlapping windows, annotates names, numbers and identifiers, and draws the calibration,
train and evaluation sets with ``numpy.random.default_rng(seed)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from splitleak.data.documents import (
    LABELS,
    Document,
    DocumentSets,
    Span,
    check_request,
    check_tokenizer,
    cut_windows,
    draw_sets,
    encode,
)
from splitleak.data.instructions import instruction_passages
from splitleak.data.spans import annotate
from splitleak.data.synthetic import synthetic_passages
from splitleak.data.text import read_text_files
from splitleak.data.wikitext import read_wikitext
from splitleak.errors import DataError

__all__ = ["SOURCES", "LABELS", "Span", "Document", "DocumentSets", "annotate", "load_documents"]

SOURCES = ("wikitext2", "synthetic-pii", "instructions", "text")


#: the document counts of What Gradients Add (32 calibration, 128 training, 256 evaluation documents of 32
#: tokens): the one place every default of the package (configurations, CLI, specs) takes them from
N_CALIB, N_TRAIN, N_EVAL, DOC_LEN = 32, 128, 256, 32


def load_documents(
    source: str,
    tokenizer: Any,
    *,
    seed: int,
    n_calib: int = N_CALIB,
    n_train: int = N_TRAIN,
    n_eval: int = N_EVAL,
    doc_len: int = DOC_LEN,
    data_path: str | Path | None = None,
) -> DocumentSets:
    """Draw calibration, train and evaluation documents of ``doc_len`` tokens from ``source``.

    ``source`` is ``"wikitext2"`` (``data_path``: folder of ``wiki.*.raw`` files, or None for
    the ``datasets`` library), ``"synthetic-pii"`` or ``"instructions"`` (generated; no ``data_path``) or ``"text"``
    (``data_path``: a UTF-8 file or a folder of ``*.txt``). ``tokenizer`` is a Hugging Face
    fast tokenizer. Raises DataError on any input that cannot give the requested sets.
    """
    if source not in SOURCES:
        raise DataError(f"unknown source {source!r}; choose one of {', '.join(SOURCES)}")
    check_request(seed=seed, n_calib=n_calib, n_train=n_train, n_eval=n_eval, doc_len=doc_len)
    check_tokenizer(tokenizer)
    seed, doc_len = int(seed), int(doc_len)
    counts = {"n_calib": int(n_calib), "n_train": int(n_train), "n_eval": int(n_eval)}

    if source in ("synthetic-pii", "instructions"):
        if data_path is not None:
            raise DataError(
                f"source {source!r} generates its documents and reads no data_path; drop "
                "data_path (--data-path) or use source 'text' for your own files"
            )
        generate = synthetic_passages if source == "synthetic-pii" else instruction_passages
        passages = generate(tokenizer, seed=seed, count=sum(counts.values()), doc_len=doc_len)
        encodings = encode(tokenizer, [p.text for p in passages])
        pool = cut_windows(encodings, doc_len, first_only=True)
        where = f"{source} texts"
    else:
        passages, where = (read_wikitext if source == "wikitext2" else read_text_files)(data_path)
        encodings = encode(tokenizer, [p.text for p in passages])
        pool = cut_windows(encodings, doc_len)

    return draw_sets(
        passages,
        encodings,
        pool,
        source=source,
        seed=seed,
        doc_len=doc_len,
        annotator=annotate,
        where=where,
        **counts,
    )
