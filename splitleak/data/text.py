"""The user's own text files as passages: one per paragraph.

``data_path`` is a UTF-8 file or a folder whose ``*.txt`` files (not recursive) are read in
sorted name order. A paragraph is a run of non-blank lines, joined with ``\\n``; blank
(whitespace-only) lines separate paragraphs. Trailing whitespace of the paragraph is dropped.
The origin is ``text:<file name>:line <n>`` with n the paragraph's first line (1-based). Spans
come from ``splitleak.data.spans.annotate``, the same rule as WikiText.
"""

from __future__ import annotations

from pathlib import Path

from splitleak.data.documents import Passage, read_utf8
from splitleak.errors import DataError

__all__ = ["paragraphs", "read_text_files"]


def paragraphs(text: str, name: str) -> list[Passage]:
    """Passages of one file's text, split at blank lines."""
    out = []
    block: list[str] = []
    first = 0
    for n, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            if not block:
                first = n
            block.append(line)
        elif block:
            out.append(Passage(text="\n".join(block).rstrip(), origin=f"text:{name}:line {first}"))
            block = []
    if block:
        out.append(Passage(text="\n".join(block).rstrip(), origin=f"text:{name}:line {first}"))
    return out


def read_text_files(data_path: str | Path | None) -> tuple[list[Passage], str]:
    """Passages of a file or of a folder's ``*.txt`` files, and a description of them."""
    if data_path is None:
        raise DataError(
            "source 'text' needs data_path (--data-path PATH): a UTF-8 text file or a folder of *.txt files"
        )
    path = Path(data_path)
    if not path.exists():
        raise DataError(
            f"text data_path {path} does not exist; pass an existing UTF-8 text file or a "
            "folder of *.txt files (--data-path PATH)"
        )
    if path.is_dir():
        files = sorted(p for p in path.glob("*.txt") if p.is_file())
        if not files:
            raise DataError(
                f"no *.txt files in folder {path}; put UTF-8 text files named *.txt there or pass one file as data_path"
            )
        where = f"{len(files)} *.txt file(s) in {path}"
    else:
        files = [path]
        where = str(path)
    passages: list[Passage] = []
    for f in files:
        text = read_utf8(f, "convert it to UTF-8 or remove it from the folder")
        if not text.strip():
            raise DataError(f"text file {f} is empty; add text to it or remove it from data_path")
        passages.extend(paragraphs(text, f.name))
    return passages, where
