"""Rule-based span annotator for running text (WikiText-2 and the user's own files).

``annotate(text)`` returns non-overlapping ``(label, char_start, char_end)`` triples, sorted by
start. WikiText-2 raw writes in-word punctuation as `` @-@ ``, `` @,@ `` and `` @.@ ``; the
patterns accept those forms as well as plain ``-``, ``,`` and ``.``. The rules, applied in
this order (a later rule never claims characters an earlier one claimed):

1. identifier
   a. the code after ``ISBN`` or ``ISSN`` (optionally ``-10``/``-13`` and ``:``): digit groups
      joined by hyphens, ``X`` allowed (``ISBN 978 @-@ 0062023117`` -> ``978 @-@ 0062023117``);
      the ``ISBN-13:`` prefix itself is no span;
   b. hyphenated codes that start with a capital letter, whose parts are capitals and digits and
      that contain at least one digit (``M-11``, ``B @-@ 52``, ``UB @-@ 1``, ``SR-71A``);
   c. single ASCII words mixing letters and digits (``A4``, ``T4``, ``31B``, ``x86``), except
      ordinals and decades (``19th``, ``1990s``) and squared/cubed units (``km2``, ``m3``).
2. number: digits with ``,``/``.`` separators between digit groups (``1,234``, ``3.5``,
   ``1 @,@ 000``, ``3 @.@ 5``, years), optionally followed by ``st``/``nd``/``rd``/``th``/``s``
   (``19th``, ``1990s``); not preceded by a letter, digit, ``_``, ``@``, ``.`` or ``,`` and
   not followed by a letter, digit or ``_``.
3. name (proper names of people, places, organisations and works; not persons only):
   a. a capitalised word is an alphabetic word of >= 2 letters whose first letter is upper case
      and that holds at least one lower-case letter (``Boulter``, ``McDonald``, ``O'Neill``);
      all-caps words (``NASA``) and single letters (``I``, ``A``) are not; a trailing ``'s`` is
      not part of the word;
   b. a run is a maximal sequence of capitalised words joined by one space, ``-`` or `` @-@ ``,
      where the lower-case connectors ``of de da del der di du la le van von`` may stand between
      two capitalised words (``Bank of England``, ``Ludwig van Beethoven``);
   c. month and weekday names (``January`` .. ``December``, ``Monday`` .. ``Sunday``) split a run
      and are never part of a name;
   d. leading words from a stoplist of sentence openers, determiners, pronouns and titles
      (``The``, ``In``, ``He``, ``However``, ``Mr``, ``Dr`` ...; see ``STOPWORDS``) are removed
      from a run, then connectors left at either end;
   e. a run of one word that starts a sentence is dropped (``Boulter starred`` at the start of a
      sentence is not annotated); a run of two or more words is kept there. A word starts a
      sentence when, skipping spaces and opening quotes or brackets, nothing or one of ``. ! ?
      :`` precedes it, unless the ``.`` ends an abbreviation from the title stoplist (``Dr.``).
"""

from __future__ import annotations

import re

from splitleak.data.documents import LABELS  # the one definition of the span classes

__all__ = ["LABELS", "STOPWORDS", "CONNECTORS", "annotate"]

CONNECTORS = frozenset({"of", "de", "da", "del", "der", "di", "du", "la", "le", "van", "von"})

MONTHS_AND_DAYS = frozenset(
    "January February March April May June July August September October November December "
    "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
)

TITLES = frozenset("Mr Mrs Ms Miss Dr Prof St Mt Jr Sr Gen Col Lt Capt Sgt Rev Hon".split())

STOPWORDS = (
    frozenset(
        (
            "The A An This That These Those There Here Its It He She They We You Him Her His Their "
            "Our My Your Them Us Me In On At Of For By With From To As Into Onto Upon Under Over "
            "After Before During Since Until Through Throughout Between Among Against About Around "
            "Following According Despite Although Though While When Whereas Where Whether Which Who "
            "Whom Whose What Why How If Unless Because So But And Or Nor Yet Also Then Thus Hence "
            "Therefore However Moreover Furthermore Meanwhile Nevertheless Later Earlier Finally "
            "Eventually Initially Originally Today Tomorrow Yesterday Once Some Many Most Much More "
            "Several Few All Both Each Every Either Neither No Not None One Two Three Four Five Six "
            "Seven Eight Nine Ten First Second Third Last Next Other Another Such Only Even Still "
            "Only Just Now Please Dear Hi Hello Yes Oh"
        ).split()
    )
    | TITLES
)

_WORD = re.compile(r"(?<![\w'’])[^\W\d_]+(?:['’][^\W\d_]+)*(?![\w])")
_JOINERS = (" ", "-", " @-@ ")
_SENTENCE_END = ".!?:"
_OPENERS = "\"'“‘([{"

_ISBN = re.compile(r"\b(?:ISBN|ISSN)(?:(?:-| @-@ )1[03])?\s*:?\s+(\d[\dX]*(?:(?:-| @-@ )[\dX]+)*)(?![\w])")
_CODE = re.compile(r"(?<![\w@])[A-Z][A-Z0-9]*(?:(?:-| @-@ )[A-Z0-9]+)+(?![\w])")
_MIXED = re.compile(r"(?<![A-Za-z0-9_])[A-Za-z0-9]+(?![A-Za-z0-9_])")
_ORDINAL_OR_DECADE = re.compile(r"\d+(?:st|nd|rd|th|s)")
_UNIT = re.compile(r"(?:km|mi|m|cm|mm|ft|in|sq)[23]")
_NUMBER = re.compile(r"(?<![\w@.,])\d+(?:(?:[.,]| @[.,]@ )\d+)*(?:st|nd|rd|th|s)?(?![\w])")


def annotate(text: str) -> list[tuple[str, int, int]]:
    """Return the ``(label, char_start, char_end)`` spans of ``text`` by the module's rules."""
    taken: list[tuple[str, int, int]] = []

    def claim(label: str, start: int, end: int) -> None:
        if start < end and not any(s < end and start < e for _, s, e in taken):
            taken.append((label, start, end))

    for m in _ISBN.finditer(text):
        claim("identifier", m.start(1), m.end(1))
        claim("", m.start(), m.start(1))  # the "ISBN-13:" prefix is no span of its own
    for m in _CODE.finditer(text):
        if any(c.isdigit() for c in m.group()):
            claim("identifier", m.start(), m.end())
    for m in _MIXED.finditer(text):
        word = m.group()
        has_digit = any(c.isdigit() for c in word)
        has_alpha = any(c.isalpha() for c in word)
        if has_digit and has_alpha and not _ORDINAL_OR_DECADE.fullmatch(word) and not _UNIT.fullmatch(word):
            claim("identifier", m.start(), m.end())
    for m in _NUMBER.finditer(text):
        claim("number", m.start(), m.end())
    for start, end in _names(text):
        claim("name", start, end)
    return sorted((t for t in taken if t[0]), key=lambda t: (t[1], t[2]))


def _words(text: str) -> list[tuple[int, int]]:
    """Alphabetic words as ``(start, end)``, with a trailing possessive ``'s`` cut off."""
    out = []
    for m in _WORD.finditer(text):
        start, end = m.start(), m.end()
        if end - start > 2 and text[end - 2] in "'’" and text[end - 1] == "s":
            end -= 2
        out.append((start, end))
    return out


def _is_capitalised(word: str) -> bool:
    if len(word) < 2 or not word[0].isupper():
        return False
    letters = [c for c in word if c.isalpha()]
    return len(letters) >= 2 and any(c.islower() for c in letters)


def _starts_sentence(text: str, start: int) -> bool:
    i = start - 1
    while i >= 0 and (text[i].isspace() or text[i] in _OPENERS):
        i -= 1
    if i < 0:
        return True
    if text[i] not in _SENTENCE_END:
        return False
    if text[i] == ".":
        j = i
        while j > 0 and text[j - 1].isalpha():
            j -= 1
        if text[j:i] in TITLES:
            return False
    return True


def _names(text: str) -> list[tuple[int, int]]:
    """Name spans by rule 3 of the module docstring."""
    words = _words(text)
    runs: list[list[tuple[int, int, str]]] = []
    run: list[tuple[int, int, str]] = []
    for start, end in words:
        word = text[start:end]
        if _is_capitalised(word) and word not in MONTHS_AND_DAYS:
            kind = "cap"
        elif word in CONNECTORS:
            kind = "conn"
        else:
            kind = "break"
        joined = bool(run) and text[run[-1][1] : start] in _JOINERS
        if kind == "break" or not joined:
            if run:
                runs.append(run)
            run = []
        if kind == "cap" or (kind == "conn" and run):
            run.append((start, end, kind))
    if run:
        runs.append(run)

    spans = []
    for run in runs:
        while run and (run[0][2] == "conn" or text[run[0][0] : run[0][1]] in STOPWORDS):
            run = run[1:]
        while run and run[-1][2] == "conn":
            run = run[:-1]
        if not run:
            continue
        if len(run) == 1 and _starts_sentence(text, run[0][0]):
            continue
        spans.append((run[0][0], run[-1][1]))
    return spans
