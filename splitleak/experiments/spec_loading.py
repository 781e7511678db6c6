"""Reading an experiment spec: finding its file, layering its profile and overrides, validating
the result against ``ExperimentSpec`` and saying what is wrong where.

Layers, applied in this order (later wins): the file's base keys, then the chosen profile's keys
(``profiles: {quick: {...}, full: {...}}``; mappings merge key by key, lists and scalars replace),
then ``--override KEY=VALUE`` items (dotted keys reach into mappings and, with an integer, into
lists; values are parsed as YAML, so ``depths=[3,6]`` is a list and ``steps=8`` an integer). In every
layer ``model: NAME`` (or a list) is accepted as the single-model form of ``models``.

Unknown keys are refused with the key and the file (and the profile or ``--override`` that brought
it) named. Paths inside a spec (``protocol``, ``data.path``) are relative to the spec file;
``protocol: shipped:NAME`` names a protocol shipped in ``splitleak/audit/protocols/``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from splitleak.audit.protocol import SHIPPED
from splitleak.errors import ConfigError
from splitleak.experiments.spec import ExperimentSpec, as_list
from splitleak.files import read_yaml

SPEC_SUFFIXES = (".yaml", ".yml")
DEFAULT_PROFILE = "full"


@dataclass
class LoadedSpec:
    """A validated spec with where it came from: the file, the profile and the overrides applied,
    and the resolved protocol and data paths."""

    spec: ExperimentSpec
    path: Path
    profile: str | None
    overrides: tuple[str, ...]
    protocol_path: Path
    data_path: Path | None
    model_path: Path | None = None
    merged: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.name or self.path.stem

    def default_store(self) -> Path:
        """``<spec stem>-results/`` beside the spec file; for a shipped spec (which lies inside the
        installed package), in the current directory."""
        if is_shipped(self.path):
            return Path.cwd() / f"{self.path.stem}-results"
        return self.path.with_name(f"{self.path.stem}-results")


# ------------------------------------------------------------------ finding files


#: the specs shipped with the package (package data, so a wheel install finds them too)
SHIPPED_SPECS = Path(__file__).parent / "specs"


def shipped_specs() -> list[Path]:
    """The spec files shipped with splitleak (``splitleak/experiments/specs/*.yaml``)."""
    return sorted(SHIPPED_SPECS.glob("*.yaml"))


def is_shipped(path: Path) -> bool:
    return path.resolve().parent == SHIPPED_SPECS.resolve()


def resolve_spec_path(name: str | Path) -> Path:
    """A spec file from a path, or from a short name (``paper_main``) looked up in ``./experiments/``
    (your own specs) and then among the shipped ones."""
    p = Path(name)
    if p.is_file():
        return p.resolve()
    tried = [p]
    if p.suffix not in SPEC_SUFFIXES and len(p.parts) == 1:
        for folder in (Path.cwd() / "experiments", SHIPPED_SPECS):
            for suffix in SPEC_SUFFIXES:
                cand = folder / f"{p.name}{suffix}"
                tried.append(cand)
                if cand.is_file():
                    return cand.resolve()
    shipped = ", ".join(s.stem for s in shipped_specs()) or "none found"
    raise ConfigError(
        f"experiment spec {str(name)!r} not found (looked at {', '.join(str(t) for t in dict.fromkeys(tried))}); "
        f"pass the path of a YAML spec, or a shipped name ({shipped})"
    )


def resolve_protocol_path(protocol: str, spec_path: Path) -> Path:
    """``shipped:NAME`` (a protocol in ``splitleak/audit/protocols``) or a path relative to the spec."""
    if protocol.startswith("shipped:"):
        name = protocol.split(":", 1)[1]
        p = SHIPPED / (name if name.endswith(SPEC_SUFFIXES) else f"{name}.yaml")
        if not p.is_file():
            have = ", ".join(x.stem for x in sorted(SHIPPED.glob("*.yaml")))
            raise ConfigError(f"{spec_path}: protocol {protocol!r} is not a shipped protocol; shipped: {have}")
        return p
    p = Path(protocol)
    if not p.is_absolute():
        p = spec_path.parent / p
    if not p.is_file():
        raise ConfigError(
            f"{spec_path}: protocol file {protocol!r} does not exist (resolved to {p}); paths are relative to "
            "the spec file, or write protocol: shipped:NAME for one in splitleak/audit/protocols"
        )
    return p.resolve()


# ------------------------------------------------------------------ layers


def _normalise_layer(layer: dict[str, Any]) -> dict[str, Any]:
    """``model`` (scalar or list) is the single-model spelling of ``models``; it replaces them."""
    layer = dict(layer)
    if "model" in layer:
        if "models" in layer:
            raise ConfigError("give either model or models in one layer, not both")
        layer["models"] = as_list(layer.pop("model"))
    return layer


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def parse_overrides(items: list[str] | tuple[str, ...]) -> list[tuple[list[str], Any]]:
    """``KEY=VALUE`` items into (dotted key parts, YAML-parsed value)."""
    out = []
    for item in items:
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ConfigError(f"--override {item!r} is not KEY=VALUE (e.g. --override model=tiny-gpt2)")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as exc:
            raise ConfigError(f"--override {item!r}: the value is not valid YAML ({exc})") from None
        out.append((key.split("."), value))
    return out


def _apply_override(data: dict[str, Any], parts: list[str], value: Any, item: str) -> None:
    if parts == ["model"]:
        data.pop("models", None)
        data["models"] = as_list(value)
        return
    cur: Any = data
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(cur, list):
            try:
                idx = int(part)
                cur[idx]  # noqa: B018 - bounds check
            except (ValueError, IndexError):
                raise ConfigError(
                    f"--override {item}: {'.'.join(parts[:i]) or 'the spec'} is a list of {len(cur)}; "
                    f"{part!r} is not an index into it"
                ) from None
            if last:
                cur[idx] = value
            else:
                cur = cur[idx]
        elif isinstance(cur, dict):
            if last:
                cur[part] = value
            else:
                if cur.get(part) is None:
                    cur[part] = {}
                cur = cur[part]
        else:
            raise ConfigError(f"--override {item}: {'.'.join(parts[:i])} is a value, not a mapping or list")


def _has_path(d: Any, loc: tuple) -> bool:
    cur = d
    for part in loc:
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and isinstance(part, int) and part < len(cur):
            cur = cur[part]
        else:
            return False
    return True


def _known_keys(loc: tuple) -> list[str]:
    """The field names allowed at the mapping that holds ``loc[-1]``."""
    model: Any = ExperimentSpec
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return []
        model = _inner_model(model.model_fields[part].annotation)
    if isinstance(model, type) and issubclass(model, BaseModel):
        return list(model.model_fields)
    return []


def _inner_model(ann: Any) -> Any:
    stack = [ann]
    while stack:
        a = stack.pop()
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
        if get_origin(a) is not None:
            stack.extend(get_args(a))
    return None


_TYPE_TAGS = {"int", "str", "float", "bool", "dict", "list", "none"}


def _user_loc(loc: tuple) -> tuple:
    """The error location without pydantic's union-member tags (``int``, ``literal['exhaustive']``)."""
    return tuple(
        x for x in loc if not (isinstance(x, str) and (x in _TYPE_TAGS or "[" in x or "-" in x and "function" in x))
    )


def _explain(exc: ValidationError, path: Path, layers: list[tuple[str, dict[str, Any]]]) -> str:
    msgs: list[str] = []
    seen: dict[tuple, int] = {}
    for e in exc.errors():
        loc = _user_loc(tuple(e["loc"]))
        if loc in seen and e["type"] != "extra_forbidden":  # one line per place; union members joined by "or"
            msgs[seen[loc]] += (
                f", or {str(e.get('ctx', {}).get('error', e['msg']))[0].lower()}"
                f"{str(e.get('ctx', {}).get('error', e['msg']))[1:]}"
            )
            continue
        seen[loc] = len(msgs)
        dotted = ".".join(str(x) for x in loc) or "spec"
        source = next((where for where, layer in reversed(layers) if _has_path(layer, loc)), None)
        src = f" (from {source})" if source and source != "the file" else ""
        if e["type"] == "extra_forbidden":
            known = _known_keys(loc)
            hint = f"; known keys here: {', '.join(known)}" if known else ""
            msgs.append(f"unknown key {dotted!r}{src}{hint}")
        else:
            msg = str(e.get("ctx", {}).get("error", e["msg"]))
            msgs.append(f"{dotted}{src}: {msg}")
    return f"{path}: invalid experiment spec: " + "; ".join(msgs)


def read_spec_file(path: Path) -> dict[str, Any]:
    return read_yaml(path, "experiment spec", "models: ..., depths: ..., attacks: ..., protocol: ...")


def load_spec(spec: str | Path, profile: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> LoadedSpec:
    """Read, layer and validate a spec; ``profile=None`` picks ``full`` when the spec defines it,
    ``profile="base"`` the file's keys without any profile.

    Raises ConfigError naming the file, the key and where it came from; nothing is written.
    """
    path = resolve_spec_path(spec)
    raw = read_spec_file(path)
    profiles = raw.get("profiles") or {}
    if not isinstance(profiles, dict) or not all(isinstance(v, dict) for v in profiles.values()):
        raise ConfigError(f"{path}: profiles must map each profile name to a mapping of spec keys")
    if profile is None and DEFAULT_PROFILE in profiles:
        profile = DEFAULT_PROFILE
    if profile == "base" and "base" not in profiles:  # the file's keys alone
        profile = None
    if profile is not None and profile not in profiles:
        have = ", ".join(profiles) or "none"
        raise ConfigError(f"{path}: no profile {profile!r}; the spec defines: {have}")
    base = _normalise_layer({k: v for k, v in raw.items() if k != "profiles"})
    layers: list[tuple[str, dict[str, Any]]] = [("the file", base)]
    merged = base
    if profile is not None:
        prof = profiles[profile]
        if "profiles" in prof:
            raise ConfigError(f"{path}: profile {profile!r} may not define profiles itself")
        try:
            prof = _normalise_layer(prof)
        except ConfigError as exc:
            raise ConfigError(f"{path}: profile {profile!r}: {exc}") from None
        layers.append((f"profile {profile!r}", prof))
        merged = _deep_merge(merged, prof)
    ov_layer: dict[str, Any] = {}
    for (parts, value), item in zip(parse_overrides(overrides), overrides):
        _apply_override(merged, parts, value, item)
        if not any(p.isdigit() for p in parts):  # kept only to say where a bad key came from
            _apply_override(ov_layer, parts, value, item)
    if overrides:
        layers.append(("--override", ov_layer))
    try:
        parsed = ExperimentSpec(**merged)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, path, layers)) from None
    except TypeError as exc:
        raise ConfigError(f"{path}: invalid experiment spec: {exc}") from None
    protocol_path = resolve_protocol_path(parsed.protocol, path)
    data_path = None
    if parsed.data.path is not None:
        dp = Path(parsed.data.path)
        data_path = (dp if dp.is_absolute() else path.parent / dp).resolve()
        if not data_path.exists():
            raise ConfigError(
                f"{path}: data.path {parsed.data.path!r} does not exist (resolved to {data_path}); "
                "paths are relative to the spec file; change it with --override data.path=DIR"
            )
    model_path = None
    if parsed.model_path is not None:
        mp = Path(parsed.model_path)
        model_path = (mp if mp.is_absolute() else path.parent / mp).resolve()
    return LoadedSpec(parsed, path, profile, tuple(overrides), protocol_path, data_path, model_path, merged)
