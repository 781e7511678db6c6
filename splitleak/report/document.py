"""A report as a list of blocks (headings, paragraphs, tables, figures), rendered twice: as Markdown
that reads well in a terminal (aligned table columns, figures linked beside it) and as one
self-contained HTML page (CSS inline, figures embedded as base64 PNG, no scripts, no external
assets).

Inline markup in paragraphs and table cells is deliberately small: ``code`` and **bold**.
"""

from __future__ import annotations

import base64
import html
import os
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union


@dataclass
class Heading:
    level: int
    text: str
    anchor: str = ""

    def __post_init__(self):
        self.anchor = self.anchor or slug(self.text)


@dataclass
class Para:
    text: str
    kind: str = "p"  # "p", "note" (a short line in a muted box), "caption"


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]
    caption: str = ""
    numeric: list[bool] | None = None  # right-align these columns; default: guessed from the cells
    kv: bool = False  # two columns (name, value): a list in Markdown, a table without a header in HTML


@dataclass
class Figure:
    png: Path  # written beside the report; the SVG twin has the same stem
    caption: str
    alt: str = ""


@dataclass
class TokenLine:
    """One line of a text comparison: a label and the text token by token."""

    label: str
    tokens: list[str]  # decoded token strings, leading spaces kept
    wrong: list[bool]  # per token: not the true token (all False on the true line)
    spans: list[str | None]  # per token: the annotated span class it lies in, or None


@dataclass
class TextComparison:
    """A document's true text beside each attack's reconstruction (What Gradients Add, Figure 1b):
    wrong tokens struck through, annotated spans underlined by class."""

    title: str
    lines: list[TokenLine]


@dataclass
class Contents:
    """A table of contents of the level-2 headings that follow it."""


Block = Union[Heading, Para, Table, Figure, Contents, TextComparison]


@dataclass
class Document:
    title: str
    blocks: list[Block] = field(default_factory=list)

    def add(self, *blocks: Block) -> None:
        self.blocks.extend(blocks)

    def sections(self) -> list[Heading]:
        return [b for b in self.blocks if isinstance(b, Heading) and b.level == 2]


def slug(text: str) -> str:
    """A GitHub-style anchor: lower case, punctuation dropped, spaces to hyphens."""
    t = unicodedata.normalize("NFKD", text).lower()
    t = re.sub(r"[^\w\- ]", "", t)
    return re.sub(r" ", "-", t.strip())


_NUMERIC = re.compile(r"^[+\-−]?(\d[\d,.]*|n/a|—|)(\s*\[.*\])?(\s*%)?$")


def _guess_numeric(table: Table) -> list[bool]:
    if table.numeric is not None:
        return table.numeric
    out = []
    for j in range(len(table.header)):
        cells = [r[j].strip() for r in table.rows if j < len(r)]
        filled = [c for c in cells if c and c not in ("n/a", "—")]
        out.append(all(_NUMERIC.match(c) for c in filled) and (bool(filled) or "n/a" in cells))
    return out


# ------------------------------------------------------------------ Markdown


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(doc: Document, base: Path | None = None) -> str:
    """The document as Markdown; tables padded so that their columns line up in a terminal. Figures
    are linked by name (they lie beside the report), or relative to ``base``, the report's folder."""
    out: list[str] = []
    for b in doc.blocks:
        if isinstance(b, Heading):
            out += ["#" * b.level + " " + b.text, ""]
        elif isinstance(b, Para):
            if b.kind == "note":
                out += ["> " + b.text, ""]
            elif b.kind == "caption":
                out += ["*" + b.text + "*", ""]
            else:
                out += [b.text, ""]
        elif isinstance(b, Contents):
            out += ["**Contents**", ""]
            out += [f"{i}. [{h.text}](#{h.anchor})" for i, h in enumerate(doc.sections(), 1)]
            out.append("")
        elif isinstance(b, Table):
            if b.caption:
                out += ["*" + b.caption + "*", ""]
            if b.kv:
                out += [f"- **{k}**: {v}" if k else f"- {v}" for k, v in b.rows]
            else:
                out += _md_table(b)
            out.append("")
        elif isinstance(b, TextComparison):
            out += _md_comparison(b)
        elif isinstance(b, Figure):
            png = b.png.name if base is None else Path(os.path.relpath(b.png, base)).as_posix()
            svg = png[: -len(b.png.suffix)] + ".svg"
            out += [
                f"![{b.alt or b.caption}]({png})",
                "",
                f"*{b.caption}* (also as [{b.png.with_suffix('.svg').name}]({svg}))",
                "",
            ]
    return "\n".join(out).rstrip() + "\n"


def _visible(token: str) -> str:
    """A token as it shows inside one line of text: line breaks and tabs become visible marks."""
    return token.replace("\r", "").replace("\n", "⏎").replace("\t", "⇥")


def _md_comparison(c: TextComparison) -> list[str]:
    """A fenced block, one line per reading: wrong tokens in ⟦ ⟧, spans as [class: …] on every line."""
    width = max(len(line.label) for line in c.lines)
    rows = []
    for line in c.lines:
        text, open_span = "", None
        for tok, bad, span in zip(line.tokens, line.wrong, line.spans):
            if span != open_span:
                if open_span is not None:
                    text += "]"
                if span is not None:
                    text += f"[{span}:"
                open_span = span
            text += f"⟦{_visible(tok)}⟧" if bad else _visible(tok)
        if open_span is not None:
            text += "]"
        rows.append(f"{line.label.ljust(width)} | {text}")
    return [f"*{c.title}*", "", "```text", *rows, "```", ""]


def _md_table(t: Table) -> list[str]:
    numeric = _guess_numeric(t)
    header = [_md_cell(h) for h in t.header]
    rows = [[_md_cell(c) for c in r] + [""] * (len(header) - len(r)) for r in t.rows]
    widths = [max([len(header[j])] + [len(r[j]) for r in rows] + [3]) for j in range(len(header))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(cells, widths, numeric)) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if n else ("-" * (w + 2)) for w, n in zip(widths, numeric)) + "|"
    return [line(header), rule] + [line(r) for r in rows]


# ------------------------------------------------------------------ HTML

CSS = """
:root { --fg: #1d232b; --muted: #5b6570; --rule: #d8dde3; --zebra: #f5f7f9; --accent: #0b5cad; }
* { box-sizing: border-box; }
body { margin: 0; color: var(--fg); background: #fff;
       font: 15px/1.5 -apple-system, "Segoe UI", "DejaVu Sans", Helvetica, Arial, sans-serif; }
main { max-width: 1180px; margin: 0 auto; padding: 24px 32px 64px; }
h1 { font-size: 26px; margin: 8px 0 16px; }
h2 { font-size: 21px; margin: 40px 0 12px; padding-top: 12px; border-top: 2px solid var(--rule); }
h3 { font-size: 17px; margin: 28px 0 8px; }
p { margin: 8px 0; max-width: 900px; }
code { font: 13px/1.4 "DejaVu Sans Mono", Menlo, Consolas, monospace; background: var(--zebra);
       padding: 1px 4px; border-radius: 3px; overflow-wrap: anywhere; }
a { color: var(--accent); }
nav.toc { background: var(--zebra); border: 1px solid var(--rule); border-radius: 6px; padding: 10px 20px;
          display: inline-block; min-width: 360px; }
nav.toc ol { margin: 6px 0; padding-left: 22px; }
p.note { background: #fff8e6; border-left: 4px solid #e0a800; padding: 6px 12px; }
p.caption, figcaption, .table-caption { color: var(--muted); font-size: 13.5px; max-width: 900px; }
.table-wrap { overflow-x: auto; margin: 6px 0 18px; max-width: 100%; }
table { border-collapse: collapse; font-size: 13.5px; font-variant-numeric: tabular-nums; }
th, td { border-bottom: 1px solid var(--rule); padding: 4px 10px; text-align: left; vertical-align: top; }
th { background: #eef1f4; font-weight: 600; border-bottom: 2px solid #b9c1ca; position: sticky; top: 0; }
table.kv th { position: static; border-bottom: 1px solid var(--rule); text-align: left; }
td.num, th.num { text-align: right; white-space: nowrap; }
td.nw, th.nw { white-space: nowrap; }
tbody tr:nth-child(even) td { background: var(--zebra); }
figure { margin: 12px 0 28px; }
figure img { max-width: 100%; height: auto; border: 1px solid var(--rule); border-radius: 4px; }
.pass { color: #11722f; font-weight: 700; }
table.recon td.text { font: 14px/1.9 "DejaVu Sans Mono", Menlo, Consolas, monospace; white-space: pre-wrap; }
table.recon th { position: static; background: none; border-bottom: 1px solid var(--rule); font-weight: 600; }
table.recon th, table.recon td { vertical-align: baseline; }
table.recon span.w { background: #fbd5d2; color: #8c1d18; text-decoration: line-through; }
table.recon span.s-name { border-bottom: 3px solid #0b5cad; }
table.recon span.s-number { border-bottom: 3px solid #e0a800; }
table.recon span.s-identifier { border-bottom: 3px solid #7b3fb5; }
span.key { padding: 0 4px; margin-right: 10px; }
span.key.w { background: #fbd5d2; color: #8c1d18; text-decoration: line-through; }
span.key.s-name { border-bottom: 3px solid #0b5cad; }
span.key.s-number { border-bottom: 3px solid #e0a800; }
span.key.s-identifier { border-bottom: 3px solid #7b3fb5; }
.fail { color: #b3261e; font-weight: 700; }
"""


def _inline(text: str) -> str:
    """Escape, then ``code`` and **bold**; PASS/FAIL words get a colour."""
    parts = re.split(r"(`[^`]*`)", str(text))
    out = []
    for p in parts:
        if p.startswith("`") and p.endswith("`") and len(p) >= 2:
            out.append(f"<code>{html.escape(p[1:-1])}</code>")
            continue
        e = html.escape(p)
        e = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", e)
        e = re.sub(r"\b(PASS(?:ES)?)\b", r'<span class="pass">\1</span>', e)
        e = re.sub(r"\b(FAIL(?:S)?)\b", r'<span class="fail">\1</span>', e)
        out.append(e)
    return "".join(out)


def render_html(doc: Document) -> str:
    """The document as one self-contained HTML page (figures embedded as base64 PNG)."""
    body: list[str] = []
    for b in doc.blocks:
        if isinstance(b, Heading):
            body.append(f'<h{b.level} id="{html.escape(b.anchor)}">{_inline(b.text)}</h{b.level}>')
        elif isinstance(b, Para):
            cls = {"note": ' class="note"', "caption": ' class="caption"'}.get(b.kind, "")
            body.append(f"<p{cls}>{_inline(b.text)}</p>")
        elif isinstance(b, Contents):
            items = "".join(
                f'<li><a href="#{html.escape(h.anchor)}">{_inline(h.text)}</a></li>' for h in doc.sections()
            )
            body.append(f'<nav class="toc"><strong>Contents</strong><ol>{items}</ol></nav>')
        elif isinstance(b, Table):
            body.append(_html_table(b))
        elif isinstance(b, TextComparison):
            body.append(_html_comparison(b))
        elif isinstance(b, Figure):
            data = base64.b64encode(b.png.read_bytes()).decode("ascii")
            body.append(
                f'<figure><img alt="{html.escape(b.alt or b.caption)}" src="data:image/png;base64,{data}">'
                f"<figcaption>{_inline(b.caption)}</figcaption></figure>"
            )
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{html.escape(doc.title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n<main>\n"
        + "\n".join(body)
        + "\n</main>\n</body>\n</html>\n"
    )


def _html_comparison(c: TextComparison) -> str:
    rows = []
    for line in c.lines:
        toks = []
        for tok, bad, span in zip(line.tokens, line.wrong, line.spans):
            cls = html.escape(" ".join(x for x in ("w" if bad else "", f"s-{span}" if span else "") if x))
            attr = f' class="{cls}"' if cls else ""
            toks.append(f"<span{attr}>{html.escape(_visible(tok))}</span>")
        rows.append(
            f'<tr><th class="nw" scope="row">{_inline(line.label)}</th><td class="text">{"".join(toks)}</td></tr>'
        )
    present = sorted({s for line in c.lines for s in line.spans if s})
    keys = '<span class="key w">wrong token</span>' + "".join(
        f'<span class="key s-{html.escape(s)}">{html.escape(s)}</span>' for s in present
    )
    return (
        f'<figure class="recon"><figcaption>{_inline(c.title)} {keys}</figcaption>'
        f'<div class="table-wrap"><table class="recon"><tbody>{"".join(rows)}</tbody></table></div></figure>'
    )


def _td_class(cell: str, numeric: bool) -> str:
    if numeric:
        return ' class="num"'
    return ' class="nw"' if len(str(cell)) <= 36 else ""  # short labels stay on one line


def _html_table(t: Table) -> str:
    numeric = _guess_numeric(t)
    cap = f'<div class="table-caption">{_inline(t.caption)}</div>' if t.caption else ""
    head = "".join(f"<th{_td_class(h, n)}>{_inline(h)}</th>" for h, n in zip(t.header, numeric))
    if t.kv:
        body = "".join(f'<tr><th class="nw" scope="row">{_inline(k)}</th><td>{_inline(v)}</td></tr>' for k, v in t.rows)
        return f'{cap}<div class="table-wrap"><table class="kv"><tbody>{body}</tbody></table></div>'
    rows = []
    for r in t.rows:
        cells = list(r) + [""] * (len(t.header) - len(r))
        rows.append(
            "<tr>" + "".join(f"<td{_td_class(c, n)}>{_inline(c)}</td>" for c, n in zip(cells, numeric)) + "</tr>"
        )
    return (
        f'{cap}<div class="table-wrap"><table><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table></div>"
    )
