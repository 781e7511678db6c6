"""The papers' headline claims, one shipped YAML file per paper (``splitleak/reproduce/claims/NNN.yaml``).

Each claim names one number (or a range, or only a direction) the paper reports, where it reports it, the
setting it was measured on, the statistic that tests it in splitleak's vocabulary (the attack configurations a
results store holds, selected as ``protocol analyse`` selects them), and what agreement means: the paper's own
pass rule where it has one, else a rule of ours that the file says is ours.

A claims file is versioned (``version``) and hashed: ``CLAIMS.sha256.json`` beside the shipped files records
the SHA-256 of each file at each version, so a shipped file edited without a new version is refused (a reader
comparing two reports knows they judged against the same numbers), and every report names the hash it used.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from splitleak.errors import ConfigError, IntegrityError
from splitleak.files import read_yaml

SHIPPED_CLAIMS = Path(__file__).parent / "claims"
HASHES_FILE = SHIPPED_CLAIMS / "CLAIMS.sha256.json"
PAPERS = ("000", "002", "003")

Rule = Literal["pass-mark", "same-sign-overlap", "tolerance", "range", "sign", "qualitative", "equivalence"]


class PaperValue(BaseModel):
    """What the paper reports: a point with its interval where it gives one, or a range over conditions, or
    (``estimate`` null) only words; shares in [0, 1] where the paper wrote percentages (``unit`` says so)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    estimate: float | None
    low: float | None = None
    high: float | None = None
    range: tuple[float, float] | None = None
    unit: str
    #: the paper's own verdict in words, where it gives one ("passes", "at floor")
    verdict: str | None = None
    #: further numbers the paper gives beside the headline one (counts, the other arm's level)
    also: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _ordered(self) -> "PaperValue":
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"low {self.low} is above high {self.high}")
        if self.estimate is not None and self.low is not None and self.high is not None:
            if not self.low <= self.estimate <= self.high:
                raise ValueError(f"estimate {self.estimate} lies outside [{self.low}, {self.high}]")
        return self


Kind = Literal[
    "difference", "level", "ratio", "share", "family", "gate", "offload", "bound", "dose", "ranking", "other"
]


class MemberValue(BaseModel):
    """The paper's number for the members of a family whose treatment contains ``match`` (a table's cell)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    match: dict[str, Any]
    estimate: float
    note: str = ""


class Statistic(BaseModel):
    """How splitleak measures the claim. ``difference``: treatment minus control, paired over victim seeds and
    documents (crossed bootstrap); ``level``: the treatment's mean; ``ratio``: the treatment's mean over the
    control's (the same resampled units in both); ``share``: the share of the control's misses the treatment
    gets right, net of what it newly gets wrong, mean(treatment - control) / mean(1 - control) over the same
    resampled units (a metric that is a share, e.g. token recovery); ``family``: several configurations, each
    measured as a ``member`` (difference, level or ratio) and judged by the claim's rule, the claim agreeing only
    where every member does (``members``); ``gate``: 002's gate statistic G of a probe battery's view per seed,
    each seed's decision against the paper's side of its pass mark (``reproduce.latent``; with no arm, the
    protocol's threshold itself); ``offload``: 000 §5's partial-offloading tests of the store's runs, the
    treatment naming them by ``outcome`` and ``defence`` and ``form`` the reading (``variance``, ``heldout``,
    ``placement``: ``reproduce.offload``); ``bound``: a bound the paper proves for every realization of a defence,
    ours the extreme over every row its treatment's runs sent (``reproduce.wire``); ``dose``: 002's dose ladder, the
    ``onset`` of a metric or its ``effect`` at one dose (``reproduce.dose``); ``ranking``: the treatment reads more
    than every rival of ``controls`` at each condition of ``over``, one treatment field's list of values averaged
    (``reproduce.ranking``); ``other``: a form no reader of
    the store is built for yet (``form`` says which), reported as not run with that reason."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Kind
    metric: str
    treatment: dict[str, Any] | None = None
    control: dict[str, Any] | None = None
    form: str = ""
    #: family: the kind of each member, the treatments and controls it pairs (besides ``treatment`` and
    #: ``control``), the fields it varies, the members it leaves out, and the family size the paper's
    #: Bonferroni correction divides alpha by (each member's interval at alpha / size; none: uncorrected)
    member: Literal["difference", "level", "ratio"] | None = None
    treatments: list[dict[str, Any]] = Field(default_factory=list)
    controls: list[dict[str, Any]] = Field(default_factory=list)
    over: dict[str, list[Any]] = Field(default_factory=dict)
    exclude: list[dict[str, dict[str, Any]]] = Field(default_factory=list)
    bonferroni: int | None = Field(None, ge=1)
    #: family: the paper's number per member where it gives one (a table's cells); a member none matches is judged
    #: against the claim's own ``paper``
    papers: list[MemberValue] = Field(default_factory=list)

    @model_validator(mode="after")
    def _arms(self) -> "Statistic":
        if (
            self.kind in ("difference", "level", "ratio", "share", "gate", "offload", "bound", "dose", "ranking")
            and not self.treatment
        ):
            raise ValueError(f"a {self.kind} names its treatment")
        if self.kind in ("difference", "ratio", "share") and not self.control:
            raise ValueError(f"a {self.kind} names its control")
        if self.kind == "family":
            if self.member is None:
                raise ValueError("a family names the kind of its members (member: difference, level or ratio)")
            if not (self.treatment or self.treatments):
                raise ValueError("a family names its treatment (or treatments)")
            if self.member != "level" and not (self.control or self.controls):
                raise ValueError(f"a family of {self.member}s names its control (or controls)")
            members = self.members()
            if not members:
                raise ValueError("the family has no member left once its exclusions are applied")
            for v in self.papers:
                hits = [m for m in members if _contains(m.treatment or {}, v.match)]
                if not hits:
                    raise ValueError(f"papers: {v.match} matches no member of the family")
                if any(len([w for w in self.papers if _contains(m.treatment or {}, w.match)]) > 1 for m in hits):
                    raise ValueError(f"papers: a member matches {v.match} and another entry; give each member one")
        elif self.kind == "ranking":
            if not self.controls:
                raise ValueError("a ranking names its rivals (controls)")
            if self.member or self.treatments or self.exclude or self.bonferroni is not None or self.papers:
                raise ValueError("a ranking takes a treatment, its rivals (controls) and conditions (over) only")
        elif (
            self.member
            or self.treatments
            or self.controls
            or self.over
            or self.exclude
            or self.bonferroni is not None
            or self.papers
        ):
            raise ValueError("member, treatments, controls, over, exclude, bonferroni and papers belong to a family")
        return self

    def member_paper(self, member: "Statistic") -> "MemberValue | None":
        """The paper's number for ``member`` of this family (``papers``), or None where it gives none."""
        return next((v for v in self.papers if _contains(member.treatment or {}, v.match)), None)

    def members(self) -> list["Statistic"]:
        """A family's members, in order: each treatment against each control at every combination of ``over``'s
        values. ``treatments`` are variants of ``treatment`` (its fields, theirs in place), ``controls`` of
        ``control``; without variants the one arm is the member's. A combination's value is set on a treatment
        unless it names the key itself; a member's control is its treatment with the control's fields in place
        (a control names what differs), so a control that names only ``defence: none`` pairs each treatment with
        itself undefended. Identical members are kept once. A member whose treatment and control contain the
        fields of an ``exclude`` entry's ``treatment`` and ``control`` is left out."""
        if self.kind != "family":
            return []
        assert self.member is not None
        base_t, base_c = self.treatment or {}, self.control or {}
        treatments = [{**base_t, **t} for t in self.treatments] or [base_t]
        controls: list[dict[str, Any] | None] = [{**base_c, **c} for c in self.controls] or [base_c or None]
        keys = list(self.over)
        out = []
        for values in itertools.product(*(self.over[k] for k in keys)):
            cond = dict(zip(keys, values))
            for t in treatments:
                arm_t = {**cond, **t}
                for c in controls:
                    arm_c = None if c is None or self.member == "level" else {**arm_t, **c}
                    if any(_contains(arm_t, e.get("treatment", {})) and _contains(arm_c or {}, e.get("control", {}))
                           for e in self.exclude):  # fmt: skip
                        continue
                    m = Statistic(kind=self.member, metric=self.metric, treatment=arm_t, control=arm_c)
                    if m not in out:  # a control without the varied key (k: null) pairs once per other combination
                        out.append(m)
        return out


def _contains(arm: dict[str, Any], part: dict[str, Any]) -> bool:
    return all(k in arm and arm[k] == v for k, v in part.items())


class Agreement(BaseModel):
    """What agreement means. ``pass-mark``: our interval's lower end above ``pass_mark`` (the paper's rule);
    ``same-sign-overlap``: our estimate of the paper's sign and the two intervals overlapping; ``tolerance``:
    ours within ``tolerance`` of the paper's point; ``range``: ours within the paper's range widened by
    ``tolerance``; ``sign``: our interval excludes zero on the paper's side (``direction``);
    ``qualitative``: ours on the paper's side (``direction``) of ``threshold``; ``equivalence``: ours within
    ``tolerance`` of zero (a claim that something does not change, which gives no number). ``ours``: the rule or its
    numbers are splitleak's choice, not the paper's (reports say so)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    rule: Rule
    pass_mark: float | None = None
    tolerance: float | None = None
    direction: Literal["above", "below"] | None = None
    threshold: float | None = None
    ours: bool = False
    note: str = ""

    @model_validator(mode="after")
    def _fields(self) -> "Agreement":
        need = {
            "pass-mark": ("pass_mark",),
            "tolerance": ("tolerance",),
            "range": ("tolerance",),
            "equivalence": ("tolerance",),
            "sign": ("direction",),
            "qualitative": ("direction", "threshold"),
        }.get(self.rule, ())
        missing = [f for f in need if getattr(self, f) is None]
        if missing:
            raise ValueError(f"rule {self.rule} needs {', '.join(missing)}")
        return self


class Claim(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    wording: str
    where: str
    paper: PaperValue
    setting: dict[str, Any] = Field(default_factory=dict)
    statistic: Statistic
    agreement: Agreement
    #: the shipped experiment spec whose jobs measure it (``splitleak/experiments/specs``), or a spec's path
    spec: str
    #: fields that turn the paper's reader into the strongest reader splitleak has for the claim (e.g.
    #: ``{attack: gma-sl-aware}``), applied to both arms; reported in a second column beside the paper's reader
    stronger: dict[str, Any] | None = None
    notes: str = ""

    def with_stronger(self) -> "Claim | None":
        """This claim read by the strongest reader (``stronger``), or None."""
        if not self.stronger:
            return None
        st, strong = self.statistic, self.stronger
        arms: dict[str, Any] = {
            k: None if a is None else {**a, **strong} for k, a in (("treatment", st.treatment), ("control", st.control))
        }
        arms.update(
            treatments=[{**a, **strong} for a in st.treatments], controls=[{**a, **strong} for a in st.controls]
        )
        return self.model_copy(update={"statistic": st.model_copy(update=arms), "stronger": None})


class Analogue(BaseModel):
    """A second setting every claim of ``base`` (a spec) is read on besides its own: the same selection with the
    fields of ``map`` translated (``depth: {3: 21, 6: 24}``: 000's client depths to the SmolLM2 cuts that leave
    the server as many blocks as GPT-2's), measured by ``spec``. Reported in a column of its own; a claim no job
    of ``spec`` measures reads "—" there, and is no error of the plan."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    base: str
    spec: str
    map: dict[str, dict[Any, Any]]
    note: str = ""

    def _value(self, field: str, v: Any) -> tuple[Any, bool]:
        table = self.map.get(field)
        if table is None:
            return v, False
        if isinstance(v, list):
            got = [self._value(field, x) for x in v]
            return [x for x, _ in got], any(m for _, m in got)
        return (table[v], True) if v in table else (v, False)

    def _arm(self, arm: dict[str, Any] | None, hits: list[bool]) -> dict[str, Any] | None:
        if arm is None:
            return None
        out = {}
        for k, v in arm.items():
            out[k], hit = self._value(k, v)
            hits.append(hit)
        return out

    def of(self, claim: "Claim") -> "Claim | None":
        """``claim`` on this analogue, or None where it is not ``base``'s or selects no field the map translates."""
        if claim.spec != self.base:
            return None
        st = claim.statistic
        hits: list[bool] = []
        update: dict[str, Any] = {"treatment": self._arm(st.treatment, hits), "control": self._arm(st.control, hits)}
        update["treatments"] = [self._arm(a, hits) for a in st.treatments]
        update["controls"] = [self._arm(a, hits) for a in st.controls]
        update["over"] = {k: self._value(k, v)[0] for k, v in st.over.items()}
        hits.extend(self._value(k, v)[1] for k, v in st.over.items())
        update["exclude"] = [{side: self._arm(a, hits) for side, a in e.items()} for e in st.exclude]
        if not any(hits):
            return None
        return claim.model_copy(update={"statistic": st.model_copy(update=update), "spec": self.spec})


class ClaimsFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    paper: str
    title: str
    version: int = Field(ge=1)
    source: str
    claims: list[Claim]
    analogues: list[Analogue] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique(self) -> "ClaimsFile":
        ids = [c.id for c in self.claims]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"claim ids are not unique: {', '.join(dup)}")
        return self


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def parse_claims(path: str | Path) -> ClaimsFile:
    path = Path(path)
    data = read_yaml(path, "claims", "paper: '000', title: ..., version: 1, source: ..., claims: [...]")
    try:
        return ClaimsFile(**data)
    except (ValidationError, TypeError) as exc:
        raise ConfigError(f"{path} is not a valid claims file: {exc}") from None


def recorded_hashes() -> dict[str, dict[str, str]]:
    """file name -> {version: sha256} for the shipped claims files."""
    return json.loads(HASHES_FILE.read_text()) if HASHES_FILE.is_file() else {}


def load_claims(paper_or_path: str | Path) -> tuple[ClaimsFile, str]:
    """A paper's shipped claims (``000``, ``002``, ``003``) or a claims file of one's own, with its SHA-256. A
    shipped file must hash as recorded for its version (``CLAIMS.sha256.json``); one's own file is read as it
    is, and the report names its hash."""
    text = str(paper_or_path)
    if text in PAPERS:
        path = SHIPPED_CLAIMS / f"{text}.yaml"
        claims, digest = parse_claims(path), file_sha256(path)
        recorded = recorded_hashes().get(path.name, {}).get(str(claims.version))
        if recorded != digest:
            raise IntegrityError(
                f"{path} (version {claims.version}) hashes to {digest}, but {HASHES_FILE.name} records "
                f"{recorded or 'no hash'} for that version: a shipped claims file changes only with a new version "
                "and its hash recorded (splitleak.reproduce.claims.record_hash)"
            )
        return claims, digest
    path = Path(text)
    if not path.is_file():
        raise ConfigError(f"{text!r} is neither a paper ({', '.join(PAPERS)}) nor a claims file")
    return parse_claims(path), file_sha256(path)


def record_hash(paper: str) -> str:
    """Record the SHA-256 of a shipped claims file at its version; refused where that version was recorded with
    another hash (bump ``version`` instead)."""
    path = SHIPPED_CLAIMS / f"{paper}.yaml"
    claims, digest = parse_claims(path), file_sha256(path)
    hashes = recorded_hashes()
    kept = hashes.setdefault(path.name, {})
    old = kept.get(str(claims.version))
    if old is not None and old != digest:
        raise IntegrityError(f"{path} version {claims.version} was recorded as {old}; bump its version")
    kept[str(claims.version)] = digest
    HASHES_FILE.write_text(json.dumps(hashes, indent=2, sort_keys=True) + "\n")
    return digest
