"""A small offline instruction set: templated questions answered by synthetic PII texts.

Text ``index`` is ``"Question: <q>\\nAnswer: <a>"``. The answer ``a`` is synthetic-PII text ``index``
(``splitleak.data.synthetic``: same family, template, Faker seed and spans, shifted by the question's
length); the question ``q`` asks for a text of that family and is drawn from ``QUESTIONS[family]`` with
``numpy.random.default_rng([seed, index, 0x1A5])``. The passage records where its answer begins, so
every document cut from it carries ``answer_start`` (its first answer token), which answer-only
supervision uses (Gradient Mirage, 003 §2 and App. E: the user supervises the answer tokens only).
This set is ours; the paper fine-tunes on CodeAlpaca, GSM8K and PIQA, which are not available offline.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from splitleak.data.documents import Passage, encode
from splitleak.data.synthetic import FAMILIES, generate_text
from splitleak.errors import DataError

__all__ = ["QUESTIONS", "instruction_passages"]

QUESTIONS: dict[str, tuple[str, ...]] = {
    "clinical": ("Write the clinical note.", "Summarise the patient record.", "Draft the patient letter."),
    "bank": ("Write the account notice.", "Draft the payment message.", "Summarise the bank alert."),
    "hr": ("Write the HR e-mail.", "Draft the staff note.", "Summarise the employee record."),
}


def _prefix(seed: int, index: int) -> str:
    family = FAMILIES[index % len(FAMILIES)]
    pick = int(np.random.default_rng([seed, index, 0x1A5]).integers(len(QUESTIONS[family])))
    return f"Question: {QUESTIONS[family][pick]}\nAnswer:"


def instruction_passages(tokenizer: Any, *, seed: int, count: int, doc_len: int) -> list[Passage]:
    """``count`` question/answer texts for ``seed``, each of at least ``doc_len`` tokens under ``tokenizer``."""
    # lazy: faker stays out of `splitleak --help`, which loads splitleak.data
    import faker

    fake = faker.Faker("en_US")
    out = []
    for i in range(count):
        prefix = _prefix(seed, i)

        def long_enough(text: str, prefix: str = prefix) -> bool:
            return len(encode(tokenizer, [prefix + " " + text])[0][0]) >= doc_len

        if len(encode(tokenizer, [prefix])[0][0]) + 2 > doc_len:
            raise DataError(
                f"instruction text {i}: its question fills {doc_len} tokens and leaves no answer to supervise; "
                "use a larger --doc-len (32 or more)"
            )
        answer = generate_text(fake, seed, i, long_enough)
        shift = len(prefix) + 1  # the answer is " " + the text: its first token carries the space
        spans = tuple((label, s + shift, e + shift) for label, s, e in answer.spans or ())
        out.append(
            Passage(
                text=prefix + " " + answer.text,
                origin=answer.origin.replace("synthetic-pii:", "instructions:", 1),
                spans=spans,
                answer_start=len(prefix),
            )
        )
    return out
