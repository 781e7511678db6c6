"""What the fuzzing tests share (issue 17): how a file is damaged, how a folder is fingerprinted, the
hypothesis settings of a fuzzing test and the check of the CLI's one-line error. A helper module, not a
test module (pytest puts ``tests/`` on the path, so tests import it as ``damage``)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from hypothesis import HealthCheck, Phase, settings

#: what ``damage`` does to a file's bytes, by name
OPS = ("truncate", "flip", "insert", "delete", "empty", "directory", "link-out")


def damaged(data: bytes, op: str, at: float, byte: int) -> bytes:
    """``data`` truncated, with one byte flipped (xor ``byte``), inserted or deleted at ``at`` (0 … 1), or
    emptied."""
    i = min(len(data) - 1, int(at * len(data)))
    if op == "truncate":
        return data[:i]
    if op == "flip":
        return data[:i] + bytes([data[i] ^ (byte or 1)]) + data[i + 1 :]
    if op == "insert":
        return data[:i] + bytes([byte]) + data[i:]
    if op == "delete":
        return data[:i] + data[i + 1 :]
    if op == "empty":
        return b""
    raise ValueError(f"unknown byte damage {op!r}")


def damage(path: Path, op: str, at: float, byte: int, outside: Path) -> None:
    """Damage the file ``path`` in place: one of ``OPS`` (``directory`` puts a folder in its place,
    ``link-out`` a link to a copy of it in ``outside``)."""
    data = path.read_bytes()
    if op == "directory":
        path.unlink()
        path.mkdir()
    elif op == "link-out":
        target = outside / ("elsewhere" + path.suffix)
        target.write_bytes(data)
        path.unlink()
        path.symlink_to(target)
    else:
        path.write_bytes(damaged(data, op, at, byte))


def digests(root: Path) -> dict[str, str]:
    """Every path under ``root`` with the SHA-256 of its bytes ("dir" for a folder)."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


def fuzz(examples: int):
    """Settings of a fuzzing test: ``examples`` examples, the same on every run and machine (derandomised),
    no deadline and no shrinking (each example is a whole command run), fixtures shared across examples."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )


def one_line_error(result) -> None:
    """A CliRunner result that ended in the project's one-line ``error:`` (exit 2 through SystemExit),
    with no traceback."""
    assert isinstance(result.exception, SystemExit), f"{type(result.exception).__name__}: {result.output}"
    assert "Traceback" not in result.output
    assert result.output.lstrip().startswith("error:"), result.output
