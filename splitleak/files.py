"""Reading the small text files a user writes (YAML configurations, specs, protocols): one reader,
one kind of error, a message in one line that names the file, the place and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from splitleak.errors import ConfigError


def read_yaml(path: str | Path, what: str, mapping_hint: str | None = None) -> Any:
    """The YAML document in ``path`` (safe loader: no Python objects). ``what`` names the file's role
    in errors (``experiment spec``); with ``mapping_hint`` the document must be a mapping, and the
    hint shows what its keys look like."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} file {path} does not exist" + (" (it is a directory)" if path.is_dir() else ""))
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text; save the {what} as UTF-8") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(
            f"{path} is not valid YAML{where}: {problem}; fix the {what} there "
            "(indentation, a missing ':' or an unclosed bracket or quote)"
        ) from None
    if mapping_hint is not None and not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping ({mapping_hint}), not {type(data).__name__}")
    return data


def json_default(o: Any) -> Any:
    """``json.dumps(..., default=json_default)``: numpy scalars and arrays, tensors and paths as plain
    JSON; anything else is refused (a TypeError naming the type), never written as its repr."""
    import numpy as np

    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, (np.ndarray, np.bool_)):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    if type(o).__module__.startswith("torch") and hasattr(o, "tolist"):
        return o.tolist()
    raise TypeError(f"{type(o).__name__} is not JSON serialisable")
