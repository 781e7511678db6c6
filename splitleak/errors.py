"""Errors that reach a user carry the problem and the fix in one message."""

from __future__ import annotations


class SplitleakError(Exception):
    """A problem the user can fix; the CLI prints it without a traceback and exits 2."""


class ConfigError(SplitleakError, ValueError):
    """An unknown name or a value out of range in a configuration."""


class ModelError(SplitleakError):
    """A model that cannot be found, loaded or cut."""


class DataError(SplitleakError, ValueError):
    """Documents that cannot be read or do not fit the requested sets."""


class NonFiniteError(SplitleakError, FloatingPointError):
    """NaN or Inf in a tensor where a finite value is required."""


class IntegrityError(SplitleakError):
    """A run directory whose files or journal do not match what was recorded."""


class UndeclaredChannelError(SplitleakError):
    """Something crossed the wire that no declaration of the split mode or its defences names: an
    undeclared channel is where a privacy evaluation passes while the data leaks (Politis & Pappas 2026, §3)."""
