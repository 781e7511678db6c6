"""WikiText-2 raw as passages: one per non-empty, non-heading line.

Files: every ``wiki.*.raw`` in ``data_path``, in sorted name order (``wiki.test.raw``,
``wiki.train.raw``, ``wiki.valid.raw``). Without ``data_path``: the ``datasets`` library's
``Salesforce/wikitext`` / ``wikitext-2-raw-v1`` splits test, train, validation in that order,
named ``test``, ``train``, ``valid`` like the files; row i is line i + 1.

A line is a heading when, stripped, it starts with ``= `` and ends with `` =``
(`` = Title = ``, `` = = Section = = ``). A passage keeps its line's leading space and loses
trailing whitespace; its origin is ``wikitext2:<split>:line <n>`` (1-based). Spans come from
``splitleak.data.spans.annotate``.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from pathlib import Path

from splitleak.data.documents import Passage, read_utf8
from splitleak.errors import DataError

__all__ = ["HF_DATASET", "HF_CONFIG", "is_heading", "passages_from_lines", "read_wikitext"]

HF_DATASET = "Salesforce/wikitext"
HF_CONFIG = "wikitext-2-raw-v1"
_HF_SPLITS = (("test", "test"), ("train", "train"), ("validation", "valid"))


def is_heading(line: str) -> bool:
    """True for WikiText headings such as `` = Title = `` and `` = = Section = = ``."""
    s = line.strip()
    return len(s) >= 3 and s.startswith("= ") and s.endswith(" =")


def passages_from_lines(lines: Iterable[str], split: str) -> list[Passage]:
    """Passages of one split: non-empty, non-heading lines, trailing whitespace removed."""
    out = []
    for n, line in enumerate(lines, start=1):
        if line.strip() and not is_heading(line):
            out.append(Passage(text=line.rstrip(), origin=f"wikitext2:{split}:line {n}"))
    return out


def read_wikitext(data_path: str | Path | None) -> tuple[list[Passage], str]:
    """Passages of all splits and a description of where they came from."""
    if data_path is None:
        return _from_hub(), f"{HF_DATASET} ({HF_CONFIG}) via datasets"
    folder = Path(data_path)
    if not folder.exists():
        raise DataError(
            f"WikiText folder {folder} does not exist; pass data_path (--data-path DIR) as a "
            "folder holding wiki.test.raw / wiki.valid.raw / wiki.train.raw from "
            "wikitext-2-raw-v1"
        )
    if not folder.is_dir():
        raise DataError(
            f"WikiText data_path {folder} is a file, not a folder; pass the folder that holds "
            "the wiki.*.raw files (--data-path DIR)"
        )
    files = sorted(folder.glob("wiki.*.raw"))
    if not files:
        raise DataError(
            f"no wiki.*.raw files in {folder}; pass a folder holding wiki.test.raw, "
            "wiki.valid.raw or wiki.train.raw from wikitext-2-raw-v1 (--data-path DIR)"
        )
    passages: list[Passage] = []
    for path in files:
        split = path.name[len("wiki.") : -len(".raw")]
        text = read_utf8(path, "replace it with the original wikitext-2-raw-v1 file")
        passages.extend(passages_from_lines(text.split("\n"), split))
    return passages, f"{', '.join(p.name for p in files)} in {folder}"


def _from_hub() -> list[Passage]:
    fix = "or pass data_path (--data-path DIR) with a folder of wiki.*.raw files from wikitext-2-raw-v1"
    try:
        datasets = importlib.import_module("datasets")
    except ImportError as exc:
        raise DataError(
            "reading WikiText-2 without data_path needs the 'datasets' library, which is not "
            f"installed; pip install datasets, {fix}"
        ) from exc
    try:
        ds = datasets.load_dataset(HF_DATASET, HF_CONFIG)
        passages: list[Passage] = []
        for hf_split, split in _HF_SPLITS:
            passages.extend(passages_from_lines(ds[hf_split]["text"], split))
    except DataError:
        raise
    except Exception as exc:  # the hub, the cache or the dataset layout failed
        raise DataError(
            f"could not load {HF_DATASET} ({HF_CONFIG}) through datasets "
            f"({type(exc).__name__}: {exc}); check the network or the Hugging Face cache, {fix}"
        ) from exc
    return passages
