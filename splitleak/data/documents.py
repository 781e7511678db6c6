"""Documents (windows of ``doc_len`` token ids with annotated spans) and the three disjoint sets.

A passage is one source text (a paragraph, or one generated text) with character spans. Each
passage is tokenised on its own, without special tokens; windows are consecutive,
non-overlapping runs of ``doc_len`` tokens from token 0 of a passage, and a trailing partial
window is dropped. All windows of all passages form the pool; ``numpy.random.default_rng(seed)``
permutes it and the first ``n_calib``, next ``n_train`` and next ``n_eval`` windows become the
calibration, train and evaluation sets. ``doc_id`` counts 0, 1, ... in that order.

A character span ``[s, e)`` covers the tokens whose non-empty offset range overlaps it
(``tok_start < e and tok_end > s``); it is kept in a window only if all those tokens lie inside
the window.
"""

from __future__ import annotations

import hashlib
import json
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from splitleak.errors import DataError

__all__ = [
    "read_utf8",
    "LABELS",
    "FORMAT",
    "Span",
    "Document",
    "DocumentSets",
    "Passage",
    "check_tokenizer",
    "check_request",
    "encode",
    "cut_windows",
    "draw_sets",
]

LABELS = ("name", "number", "identifier")
FORMAT = "splitleak.document-sets/1"

Annotator = Callable[[str], Sequence[tuple[str, int, int]]]


@dataclass(frozen=True)
class Span:
    """An annotated name, number or identifier inside one document."""

    label: str
    char_start: int
    char_end: int
    token_start: int
    token_end: int
    text: str

    def __post_init__(self) -> None:
        if self.label not in LABELS:
            raise DataError(f"span label {self.label!r} is unknown; use one of {', '.join(LABELS)}")
        if not (0 <= self.char_start < self.char_end and 0 <= self.token_start < self.token_end):
            raise DataError(
                f"span {self.text!r} has an empty or negative range (chars "
                f"{self.char_start}-{self.char_end}, tokens {self.token_start}-"
                f"{self.token_end}); build spans with start < end, both >= 0"
            )


@dataclass(frozen=True)
class Document:
    """A window of token ids, the source characters it covers and its spans."""

    doc_id: int
    token_ids: tuple[int, ...]
    text: str
    spans: tuple[Span, ...]
    source: str
    #: instruction documents: the first token of the answer (answer-only supervision predicts the targets
    #: from here on); None for plain text, where every target is supervised
    answer_start: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        object.__setattr__(self, "spans", tuple(self.spans))
        if self.answer_start is not None and not 0 <= self.answer_start <= len(self.token_ids):
            raise DataError(
                f"document {self.doc_id}: answer_start {self.answer_start} is outside its "
                f"{len(self.token_ids)} tokens; give 0 <= answer_start <= the document's length"
            )
        for span in self.spans:
            if span.token_end > len(self.token_ids) or span.char_end > len(self.text):
                raise DataError(
                    f"document {self.doc_id}: span {span.text!r} reaches past the document "
                    f"(tokens up to {span.token_end} of {len(self.token_ids)}, chars up to "
                    f"{span.char_end} of {len(self.text)}); keep spans inside their window"
                )
            if self.text[span.char_start : span.char_end] != span.text:
                raise DataError(
                    f"document {self.doc_id}: span text {span.text!r} differs from the "
                    f"document text at {span.char_start}-{span.char_end} "
                    f"({self.text[span.char_start : span.char_end]!r}); set Span.text to "
                    "Document.text[char_start:char_end]"
                )


@dataclass(frozen=True)
class DocumentSets:
    """Disjoint calibration, train and evaluation documents drawn from one source and seed."""

    calibration: tuple[Document, ...]
    train: tuple[Document, ...]
    evaluation: tuple[Document, ...]
    source: str
    seed: int
    doc_len: int

    def __post_init__(self) -> None:
        for name in ("calibration", "train", "evaluation"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        seen: set[int] = set()
        for doc in self.calibration + self.train + self.evaluation:
            if len(doc.token_ids) != self.doc_len:
                raise DataError(
                    f"document {doc.doc_id} has {len(doc.token_ids)} token ids but doc_len is "
                    f"{self.doc_len}; every document must hold exactly doc_len ids"
                )
            if doc.doc_id in seen:
                raise DataError(
                    f"doc_id {doc.doc_id} occurs twice; give every document of the three sets its own doc_id"
                )
            seen.add(doc.doc_id)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON-ready dict (lists, str, int) holding every field."""

        def doc(d: Document) -> dict[str, Any]:
            return {
                "doc_id": d.doc_id,
                "token_ids": list(d.token_ids),
                "text": d.text,
                "source": d.source,
                "spans": [
                    {
                        "label": s.label,
                        "char_start": s.char_start,
                        "char_end": s.char_end,
                        "token_start": s.token_start,
                        "token_end": s.token_end,
                        "text": s.text,
                    }
                    for s in d.spans
                ],
                # only instruction documents carry it: other sources' JSON (and fingerprint) is unchanged
                **({} if d.answer_start is None else {"answer_start": d.answer_start}),
            }

        return {
            "format": FORMAT,
            "source": self.source,
            "seed": self.seed,
            "doc_len": self.doc_len,
            "calibration": [doc(d) for d in self.calibration],
            "train": [doc(d) for d in self.train],
            "evaluation": [doc(d) for d in self.evaluation],
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> DocumentSets:
        """Rebuild from ``to_json`` output; raise DataError on anything else."""
        if not isinstance(d, Mapping) or d.get("format") != FORMAT:
            got = d.get("format") if isinstance(d, Mapping) else type(d).__name__
            raise DataError(
                f"not a DocumentSets JSON object (format {got!r}, expected {FORMAT!r}); "
                "pass the dict written by DocumentSets.to_json()"
            )
        try:
            sets = {
                name: tuple(
                    Document(
                        doc_id=int(doc["doc_id"]),
                        token_ids=tuple(int(t) for t in doc["token_ids"]),
                        text=str(doc["text"]),
                        source=str(doc["source"]),
                        spans=tuple(
                            Span(
                                label=str(s["label"]),
                                char_start=int(s["char_start"]),
                                char_end=int(s["char_end"]),
                                token_start=int(s["token_start"]),
                                token_end=int(s["token_end"]),
                                text=str(s["text"]),
                            )
                            for s in doc["spans"]
                        ),
                        answer_start=None if doc.get("answer_start") is None else int(doc["answer_start"]),
                    )
                    for doc in d[name]
                )
                for name in ("calibration", "train", "evaluation")
            }
            return cls(**sets, source=str(d["source"]), seed=int(d["seed"]), doc_len=int(d["doc_len"]))
        except DataError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(
                f"DocumentSets JSON is missing or mistypes a field ({type(exc).__name__}: "
                f"{exc}); pass the dict written by DocumentSets.to_json() unchanged"
            ) from exc

    def fingerprint(self) -> str:
        """sha256 hex digest of the canonical JSON (sorted keys, no spaces, UTF-8)."""
        blob = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Passage:
    """One source text in which windows are cut.

    ``origin`` names it (``"wikitext2:test:line 12"``); ``spans`` are ``(label, start, end)``
    character spans, or None to annotate ``text`` with the annotator given to ``draw_sets``.
    """

    text: str
    origin: str
    spans: tuple[tuple[str, int, int], ...] | None = field(default=None)
    answer_start: int | None = None  # instruction texts: the character where the answer begins


Encoding = tuple[list[int], list[tuple[int, int]]]


def check_request(*, seed: int, n_calib: int, n_train: int, n_eval: int, doc_len: int) -> None:
    """Raise DataError unless seed and counts are ints >= 0 and doc_len is an int >= 2."""
    for name, value in (
        ("seed", seed),
        ("n_calib", n_calib),
        ("n_train", n_train),
        ("n_eval", n_eval),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise DataError(f"{name} must be an integer >= 0, got {value!r}; pass e.g. {name}=0")
    if isinstance(doc_len, bool) or not isinstance(doc_len, (int, np.integer)) or doc_len < 2:
        raise DataError(
            f"doc_len must be an integer >= 2 (a document needs a token to predict from and one "
            f"to predict), got {doc_len!r}; pass doc_len=32 or another value >= 2"
        )


def check_tokenizer(tokenizer: Any) -> None:
    """Raise DataError unless ``tokenizer`` returns token ids with character offsets."""
    fix = (
        "load a fast tokenizer, e.g. transformers.AutoTokenizer.from_pretrained(name, "
        "use_fast=True) with a tokenizer.json"
    )
    if getattr(tokenizer, "is_fast", True) is False:
        raise DataError(
            f"tokenizer {type(tokenizer).__name__} is not a fast tokenizer and gives no character offsets; {fix}"
        )
    try:
        probe = tokenizer("a b", add_special_tokens=False, return_offsets_mapping=True)
        offsets = probe["offset_mapping"]
        ids = probe["input_ids"]
    except (NotImplementedError, TypeError, ValueError, KeyError, AttributeError) as exc:
        raise DataError(
            f"tokenizer {type(tokenizer).__name__} cannot return offsets ({type(exc).__name__}: {exc}); {fix}"
        ) from exc
    if len(offsets) != len(ids) or not ids:
        raise DataError(
            f"tokenizer {type(tokenizer).__name__} returned {len(ids)} ids but {len(offsets)} offsets for 'a b'; {fix}"
        )


def encode(tokenizer: Any, texts: Sequence[str]) -> list[Encoding]:
    """Token ids and character offsets of each text, without special tokens."""
    if not texts:
        return []
    enc = tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    return [
        (list(ids), [(int(a), int(b)) for a, b in offs])
        for ids, offs in zip(enc["input_ids"], enc["offset_mapping"], strict=True)
    ]


def cut_windows(encodings: Sequence[Encoding], doc_len: int, *, first_only: bool = False) -> list[tuple[int, int]]:
    """Pool of ``(passage index, first token)`` for every full window, in passage order.

    ``first_only`` keeps only the window at token 0 of each passage.
    """
    pool = []
    for k, (ids, _) in enumerate(encodings):
        n = len(ids) // doc_len
        for w in range(min(n, 1) if first_only else n):
            pool.append((k, w * doc_len))
    return pool


def _token_ranges(
    offsets: list[tuple[int, int]], spans: Sequence[tuple[str, int, int]]
) -> list[tuple[str, int, int, int, int]]:
    """``(label, char_start, char_end, token_start, token_end)`` of each span with a token."""
    ends = [b for _, b in offsets]
    monotone = all(ends[i] <= ends[i + 1] for i in range(len(ends) - 1))
    out = []
    for label, s, e in spans:
        j = bisect_right(ends, s) if monotone else 0
        first: int | None = None
        last: int | None = None
        while j < len(offsets) and (not monotone or offsets[j][0] < e):
            a, b = offsets[j]
            if a < b and a < e and b > s:
                first = j if first is None else first
                last = j
            j += 1
        if first is not None:
            assert last is not None  # set together with first
            out.append((label, s, e, first, last + 1))
    return out


def _document(
    doc_id: int,
    passage: Passage,
    encoding: Encoding,
    ranges: list[tuple[str, int, int, int, int]],
    start: int,
    doc_len: int,
) -> Document:
    ids, offsets = encoding
    stop = start + doc_len
    window = offsets[start:stop]
    c0 = min(a for a, _ in window)
    c1 = max(b for _, b in window)
    spans = tuple(
        Span(
            label=label,
            char_start=s - c0,
            char_end=e - c0,
            token_start=t0 - start,
            token_end=t1 - start,
            text=passage.text[s:e],
        )
        for label, s, e, t0, t1 in ranges
        if start <= t0 and t1 <= stop and c0 <= s and e <= c1
    )
    answer = None
    if passage.answer_start is not None:  # the first token that begins at or after the answer's first character
        answer = next((j for j, (a, _) in enumerate(window) if a >= passage.answer_start), len(window))
    return Document(
        doc_id=doc_id,
        token_ids=tuple(ids[start:stop]),
        text=passage.text[c0:c1],
        spans=spans,
        source=f"{passage.origin}:tokens {start}-{stop}",
        answer_start=answer,
    )


def draw_sets(
    passages: Sequence[Passage],
    encodings: Sequence[Encoding],
    pool: Sequence[tuple[int, int]],
    *,
    source: str,
    seed: int,
    n_calib: int,
    n_train: int,
    n_eval: int,
    doc_len: int,
    annotator: Annotator | None = None,
    where: str = "",
) -> DocumentSets:
    """Shuffle ``pool`` with ``default_rng(seed)`` and cut calibration, train, evaluation.

    ``where`` describes the input for the error raised when the pool is too small.
    """
    total = n_calib + n_train + n_eval
    if len(pool) < total:
        raise DataError(
            f"found {len(pool)} windows of {doc_len} tokens in {where or source}, but "
            f"n_calib + n_train + n_eval = {n_calib} + {n_train} + {n_eval} = {total} are "
            "needed; ask for fewer documents, use a smaller doc_len, or give more text"
        )
    order = np.random.default_rng(seed).permutation(len(pool))[:total]
    ranges: dict[int, list[tuple[str, int, int, int, int]]] = {}
    docs = []
    for doc_id, pick in enumerate(order.tolist()):
        k, start = pool[pick]
        if k not in ranges:
            passage = passages[k]
            if passage.spans is not None:
                char_spans: Sequence[tuple[str, int, int]] = passage.spans
            elif annotator is not None:
                char_spans = annotator(passage.text)
            else:
                char_spans = ()
            ranges[k] = _token_ranges(encodings[k][1], char_spans)
        docs.append(_document(doc_id, passages[k], encodings[k], ranges[k], start, doc_len))
    return DocumentSets(
        calibration=tuple(docs[:n_calib]),
        train=tuple(docs[n_calib : n_calib + n_train]),
        evaluation=tuple(docs[n_calib + n_train :]),
        source=source,
        seed=int(seed),
        doc_len=int(doc_len),
    )


def read_utf8(path, fix: str) -> str:
    """The text of ``path``, or a DataError naming the file, the cause and ``fix``."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {path} as UTF-8 text ({type(exc).__name__}: {exc}); {fix}") from exc
