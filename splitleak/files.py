"""Files without run semantics: reading the small text files a user writes (YAML configurations,
specs, protocols) and the JSON and Parquet files splitleak writes, with one kind of error, a message
in one line that names the file, the place and the fix; hashing bytes, files and configurations
(canonical JSON); and the atomic write every writer uses (the run directory, ``splitleak.runs``,
builds its journal on these)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from splitleak.errors import ConfigError, IntegrityError


def sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def config_hash(config: dict[str, Any]) -> str:
    return sha256_bytes(canonical_json(config))


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to a hidden temporary file beside ``path`` (named by this process), flush it to
    disk and rename it over ``path``: a reader or a crash sees the whole file or none of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:  # a full disk, a size limit, an interrupt: no half-written file stays behind
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename is None:
            exc.filename = str(path)  # a failed write names no file by itself
        raise


def read_yaml(path: str | Path, what: str, mapping_hint: str | None = None) -> Any:
    """The YAML document in ``path`` (safe loader: no Python objects). ``what`` names the file's role
    in errors (``experiment spec``); with ``mapping_hint`` the document must be a mapping, and the
    hint shows what its keys look like."""
    # lazy: yaml stays out of `splitleak --help`, which loads files.py
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


def read_json(path: str | Path, what: str, fix: str, *, mapping: bool = True) -> Any:
    """The JSON document in ``path``, or an IntegrityError in one line that names the file, what is wrong
    (missing, a directory, not UTF-8, not JSON with line and column, or with ``mapping`` not an object)
    and ``fix``. ``what`` names the file's role (``attack result``)."""
    path = Path(path)
    if path.is_dir():
        raise IntegrityError(f"{path} is a directory where a JSON file ({what}) belongs; {fix}")
    if not path.is_file():
        raise IntegrityError(f"{path} does not exist; {fix}")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise IntegrityError(f"{path} is not UTF-8 text (byte {exc.start}); {fix}") from None
    except json.JSONDecodeError as exc:
        raise IntegrityError(
            f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); {fix}"
        ) from None
    except RecursionError:
        raise IntegrityError(f"{path} nests too deep to be a {what}; {fix}") from None
    if mapping and not isinstance(data, dict):
        raise IntegrityError(f"{path} holds a JSON {type(data).__name__}, not an object; {fix}")
    return data


def validated(model: Any, data: Any, path: str | Path, fix: str) -> Any:
    """``model.model_validate(data)`` (a pydantic model of the fields a reader relies on), or an
    IntegrityError in one line naming the file, the first wrong field and ``fix``."""
    # lazy: pydantic stays out of `splitleak --help`, which loads files.py
    from pydantic import ValidationError

    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise IntegrityError(f"{path}: field {where}: {err['msg']}{more}; {fix}") from None


DIGEST_KEY = b"splitleak.content_sha256"


def table_digest(table: Any) -> str:
    """SHA-256 of a table's column names and values (canonical JSON of its rows), independent of how
    Parquet lays it out: what ``read_parquet`` compares with the digest ``parquet_bytes`` recorded."""
    body = {"names": list(table.column_names), "rows": table.to_pylist()}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def read_parquet(
    path: str | Path,
    what: str,
    fix: str,
    *,
    columns: list[str] | None = None,
    schema: Any = None,
    optional: tuple[str, ...] = (),
) -> Any:
    """The ``pyarrow.Table`` in the Parquet file ``path``, or an IntegrityError in one line that names
    the file, what is wrong (missing, a directory, not Parquet, a damaged page, a column missing or of
    another type, content that does not hash to the digest its writer recorded) and ``fix``. Page
    checksums are verified where the writer recorded them, and the content digest of ``parquet_bytes``
    (which also covers the footer: a changed row count or column chunk offset) where it is there. ``optional``:
    columns of ``schema`` that a file written before they existed lacks, read as null."""
    # lazy: pyarrow stays out of `splitleak --help`, which loads files.py
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    if path.is_dir():
        raise IntegrityError(f"{path} is a directory where the {what} (Parquet) belongs; {fix}")
    if not path.is_file():
        raise IntegrityError(f"{what} {path} does not exist; {fix}")
    try:
        table = pq.read_table(path, page_checksum_verification=True)
        recorded = (table.schema.metadata or {}).get(DIGEST_KEY)
        if recorded is not None and recorded.decode("ascii", "replace") != table_digest(table):
            raise IntegrityError(f"{path} does not hash to the content digest its writer recorded; {fix}")
        if schema is not None:
            for name in optional:  # a column the schema gained after the file was written: null in its rows
                if name not in table.column_names:
                    table = table.append_column(schema.field(name), pa.nulls(table.num_rows, schema.field(name).type))
            table = table.select(schema.names).cast(schema)
        return table if columns is None else table.select(columns)
    except (pa.ArrowException, OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise IntegrityError(f"{path} is not a readable {what} ({why}); {fix}") from None


def parquet_bytes(table: Any) -> bytes:
    """``table`` as Parquet bytes with page checksums and a content digest in its metadata, so that
    ``read_parquet`` notices a damaged page or footer."""
    # lazy: pyarrow stays out of `splitleak --help`, which loads files.py
    import pyarrow as pa
    import pyarrow.parquet as pq

    meta = {**(table.schema.metadata or {}), DIGEST_KEY: table_digest(table).encode()}
    sink = pa.BufferOutputStream()
    pq.write_table(table.replace_schema_metadata(meta), sink, write_page_checksum=True)
    return bytes(sink.getvalue().to_pybytes())
