"""Synthetic PII documents: clinical notes, bank messages and HR e-mails written with Faker.

Text ``index`` (0, 1, ...) belongs to family ``FAMILIES[index % 3]``; one ``faker.Faker("en_US")``
is reseeded with ``seed_instance(seed * 1_000_003 + index)`` before the text is written, so each
text depends only on ``seed`` and ``index`` (and, if it must be lengthened, the tokenizer). The
template is drawn by that Faker; every ``{field}`` it fills is recorded with its exact character
span and label while the text is built:

- name: person names (``{patient}`` = "First Last", ``{patient.first}``, ``{patient.last}``);
- number: dates (``MM/DD/YYYY``), times (``H:MM``), ages, amounts (digits only, the ``$`` is
  template text), phone numbers, vital signs, lab values, counts, rates;
- identifier: MRN, policy, account, IBAN, SSN, card digits, employee, claim, loan and
  transaction ids, e-mail addresses.

Fields with the same name share one value within the template; while the text has fewer than
``doc_len`` tokens, a continuation sentence of the same family is appended, which reuses the
template's values and draws fresh ones for its other fields.
"""

from __future__ import annotations

import string
from collections.abc import Callable
from typing import Any

from splitleak.data.documents import Passage, encode
from splitleak.errors import DataError

__all__ = [
    "FAMILIES",
    "TEMPLATES",
    "CONTINUATIONS",
    "faker_seed",
    "generate_text",
    "synthetic_passages",
]

FAMILIES = ("clinical", "bank", "hr")

TEMPLATES: dict[str, tuple[str, ...]] = {
    "clinical": (
        "Clinical note, {date}. Patient {patient} (MRN {mrn}), a {age}-year-old {sex}, presented "
        "with {complaint}. BP {sys}/{dia} mmHg, HR {hr} bpm. Seen by Dr. {doctor}; started "
        "{medication} {dose} mg daily.",
        "Discharge summary for {patient}, DOB {dob}, MRN {mrn}. Admitted on {date} under "
        "Dr. {doctor} with {complaint}; discharged on {date2} after {days} days. Follow-up: "
        "call {phone}.",
        "Referral from Dr. {doctor} to Dr. {doctor2}: please see {patient} (age {age}, "
        "insurance policy {policy}) regarding {complaint}. Contact the patient at {phone}.",
        "Lab results for {patient}, MRN {mrn}, collected {date}: glucose {glucose} mg/dL, "
        "cholesterol {chol} mg/dL, weight {weight} kg. Reviewed by Dr. {doctor}.",
        "{patient.first}, your appointment with Dr. {doctor.last} is on {date} at {time}. "
        "Bring your insurance card (policy {policy}) and your list of medicines, including "
        "{medication}.",
    ),
    "bank": (
        "Dear {holder}, a payment of ${amount} to {payee} from account {account} was made on "
        "{date}. If you did not authorise it, call us at {phone} and quote reference {ref}.",
        "Transfer confirmation {ref}: {amount} USD sent on {date} from IBAN {iban} ({holder}) "
        "to {payee}, IBAN {iban2}. Fee charged: ${fee}.",
        "Hi {holder.first}, your card ending in {last4} was declined for ${amount} on {date}. "
        "Your available balance is ${amount2}. Questions? Reply to this message or call "
        "{phone}.",
        "Loan application {loan} for {holder}, SSN {ssn}: requested ${amount} over {months} "
        "months at {rate}% APR. Your advisor {officer} can be reached at {phone}.",
        "Fraud alert for account {account}: {holder}, we blocked {count} transactions "
        "totalling ${amount} between {date} and {date2}. Contact {officer} at {phone}.",
    ),
    "hr": (
        "From: {sender} <{sender.email}>\nTo: {recipient} <{recipient.email}>\nSubject: "
        "Onboarding {employee}\n\nHi {recipient.first}, please set up payroll for {employee} "
        "(employee ID {empid}) starting {date} at an annual salary of ${salary}.",
        "Subject: Performance review for {employee} ({empid})\n\n{manager.first}, the review "
        "for {employee.first} is scheduled for {date}. Current rating {score} out of {scale}, "
        "salary ${salary}, {pto} days of leave left.",
        "Hi team, {employee} (ID {empid}) will be on leave from {date} to {date2}. Please send "
        "urgent requests to {manager} at {manager.email} or {phone}, extension {ext}.",
        "Reminder to {employee}: your expense claim {claim} for ${amount} submitted on {date} "
        "is waiting for approval by {manager}. Employee ID {empid}, cost centre {costcentre}.",
        "Confidential: {employee}, SSN {ssn}, employee ID {empid}, has given notice effective "
        "{date}. Final pay of ${amount} goes to account {account}. Questions to {manager} "
        "({phone}).",
    ),
}

CONTINUATIONS: dict[str, tuple[str, ...]] = {
    "clinical": (
        " Follow-up visit with Dr. {doctor3} on {date3}; the patient can be reached at {phone}.",
        " Repeat bloods on {date4} (MRN {mrn}); weight {weight2} kg, pulse {hr2} bpm.",
        " Prescription {rx} issued to {patient} for {medication} {dose2} mg.",
    ),
    "bank": (
        " Statement for account {account} dated {date3}: closing balance ${amount3}.",
        " A card payment of ${amount4} to {payee2} is pending since {date4}.",
        " We never ask for your SSN {ssn} or PIN by e-mail; call {phone} if in doubt.",
    ),
    "hr": (
        " Please confirm with {manager} (ID {empid2}) by {date3}.",
        " Payroll reference {ref} covers ${salary2} for {employee}.",
        " Contact {recipient} on {phone2} with any questions.",
    ),
}

PERSONS = frozenset(
    "patient doctor doctor2 doctor3 holder payee payee2 officer sender recipient employee manager".split()
)

_PHONE_FORMATS = ("(###) ###-####", "###-###-####", "###.###.####", "+1 ###-###-####")
_COMPLAINTS = (
    "chest pain",
    "shortness of breath",
    "a persistent cough",
    "lower back pain",
    "dizziness",
    "abdominal pain",
    "a rash on both arms",
    "headaches for two weeks",
)
_MEDICATIONS = ("metformin", "lisinopril", "atorvastatin", "amoxicillin", "ibuprofen", "sertraline")
_UPPER = string.ascii_uppercase


def _date(f: Any, first_year: int = 2016, last_year: int = 2025) -> str:
    month, day = f.random_int(1, 12), f.random_int(1, 28)
    return f"{month:02d}/{day:02d}/{f.random_int(first_year, last_year)}"


def _money(f: Any, lo: int, hi: int) -> str:
    return f"{f.random_int(lo, hi) / 100:,.2f}"


_FIELDS: dict[str, tuple[str | None, Callable[[Any], str]]] = {
    "date": ("number", _date),
    "dob": ("number", lambda f: _date(f, 1935, 2005)),
    "time": ("number", lambda f: f"{f.random_int(8, 17)}:{f.random_int(0, 3) * 15:02d}"),
    "age": ("number", lambda f: str(f.random_int(18, 94))),
    "sys": ("number", lambda f: str(f.random_int(98, 168))),
    "dia": ("number", lambda f: str(f.random_int(58, 104))),
    "hr": ("number", lambda f: str(f.random_int(52, 118))),
    "dose": ("number", lambda f: str(f.random_element((5, 10, 20, 25, 40, 50, 100, 250, 500)))),
    "days": ("number", lambda f: str(f.random_int(2, 21))),
    "glucose": ("number", lambda f: str(f.random_int(68, 260))),
    "chol": ("number", lambda f: str(f.random_int(120, 290))),
    "weight": ("number", lambda f: f"{f.random_int(450, 1300) / 10:.1f}"),
    "phone": ("number", lambda f: f.numerify(f.random_element(_PHONE_FORMATS))),
    "amount": ("number", lambda f: _money(f, 500, 2_500_000)),
    "fee": ("number", lambda f: _money(f, 100, 4_500)),
    "salary": ("number", lambda f: f"{f.random_int(38, 240) * 1000:,}"),
    "months": ("number", lambda f: str(f.random_element((12, 24, 36, 48, 60, 72, 84)))),
    "rate": ("number", lambda f: f"{f.random_int(25, 189) / 10:.1f}"),
    "count": ("number", lambda f: str(f.random_int(2, 9))),
    "score": ("number", lambda f: f"{f.random_int(10, 50) / 10:.1f}"),
    "scale": ("number", lambda f: "5"),
    "pto": ("number", lambda f: str(f.random_int(0, 30))),
    "ext": ("number", lambda f: f.numerify("####")),
    "mrn": ("identifier", lambda f: f.numerify("########")),
    "policy": ("identifier", lambda f: f.bothify("???-#######", letters=_UPPER)),
    "account": ("identifier", lambda f: f.numerify("##########")),
    "iban": ("identifier", lambda f: f.iban()),
    "ssn": ("identifier", lambda f: f.ssn()),
    "last4": ("identifier", lambda f: f.numerify("####")),
    "ref": ("identifier", lambda f: f.bothify("TX########", letters=_UPPER)),
    "loan": ("identifier", lambda f: f.numerify("LN-####-####")),
    "empid": ("identifier", lambda f: f.bothify("E?-#####", letters=_UPPER)),
    "claim": ("identifier", lambda f: f.numerify("CLM-######")),
    "costcentre": ("identifier", lambda f: f.bothify("CC-###?", letters=_UPPER)),
    "rx": ("identifier", lambda f: f.bothify("RX-??#####", letters=_UPPER)),
    "sex": (None, lambda f: f.random_element(("man", "woman"))),
    "complaint": (None, lambda f: f.random_element(_COMPLAINTS)),
    "medication": (None, lambda f: f.random_element(_MEDICATIONS)),
}


def faker_seed(seed: int, index: int) -> int:
    """The Faker seed of text ``index``: ``seed * 1_000_003 + index``."""
    return seed * 1_000_003 + index


Values = dict[str, tuple[str | None, str]]


def _field(name: str, fake: Any, values: Values) -> tuple[str | None, str]:
    """Label and value of a template field; one value per field name and text."""
    if name in values:
        return values[name]
    base, _, part = name.partition(".")
    if base in PERSONS:
        if base + ".first" not in values:
            first, last = fake.first_name(), fake.last_name()
            values[base + ".first"] = ("name", first)
            values[base + ".last"] = ("name", last)
            values[base] = ("name", f"{first} {last}")
        if part == "email":
            first, last = values[base + ".first"][1], values[base + ".last"][1]
            local = "".join(c for c in f"{first}.{last}".lower() if c.isalnum() or c == ".")
            values[name] = ("identifier", f"{local}@{fake.free_email_domain()}")
        if name not in values:
            raise KeyError(name)
        return values[name]
    kind = base if base in _FIELDS else base.rstrip("0123456789")
    if kind not in _FIELDS or part:
        raise KeyError(name)
    label, make = _FIELDS[kind]
    values[name] = (label, make(fake))
    return values[name]


def _append(
    template: str,
    fake: Any,
    values: dict[str, tuple[str | None, str]],
    parts: list[str],
    spans: list[tuple[str, int, int]],
    length: int,
) -> int:
    """Append the filled template to ``parts`` and its spans to ``spans``; return new length."""
    for literal, name, _spec, _conv in string.Formatter().parse(template):
        parts.append(literal)
        length += len(literal)
        if name is None:
            continue
        label, value = _field(name, fake, values)
        if label is not None:
            spans.append((label, length, length + len(value)))
        parts.append(value)
        length += len(value)
    return length


def generate_text(fake: Any, seed: int, index: int, long_enough: Callable[[str], bool] | None = None) -> Passage:
    """Text ``index`` for ``seed``, lengthened until ``long_enough(text)`` holds."""
    fake.seed_instance(faker_seed(seed, index))
    family = FAMILIES[index % len(FAMILIES)]
    t = fake.random_int(0, len(TEMPLATES[family]) - 1)
    values: dict[str, tuple[str | None, str]] = {}
    parts: list[str] = []
    spans: list[tuple[str, int, int]] = []
    length = _append(TEMPLATES[family][t], fake, values, parts, spans, 0)
    base = set(values)
    added = 0
    while long_enough is not None and not long_enough("".join(parts)):
        if added >= 1000:
            raise DataError(
                f"synthetic text {index} still too short after {added} continuation sentences; "
                "use a smaller doc_len or check that the tokenizer produces tokens for English text"
            )
        more = fake.random_element(CONTINUATIONS[family])
        fresh = {k: v for k, v in values.items() if k in base}  # new values for new fields
        length = _append(more, fake, fresh, parts, spans, length)
        added += 1
    return Passage(
        text="".join(parts),
        origin=f"synthetic-pii:{family}:template {t}:text {index}",
        spans=tuple(spans),
    )


def synthetic_passages(tokenizer: Any, *, seed: int, count: int, doc_len: int) -> list[Passage]:
    """``count`` texts for ``seed``, each of at least ``doc_len`` tokens under ``tokenizer``."""
    # lazy: faker stays out of `splitleak --help`, which loads splitleak.data
    import faker

    fake = faker.Faker("en_US")

    def long_enough(text: str) -> bool:
        return len(encode(tokenizer, [text])[0][0]) >= doc_len

    return [generate_text(fake, seed, i, long_enough) for i in range(count)]
