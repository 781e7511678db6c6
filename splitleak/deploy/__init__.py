"""The untrusted node as a process (``splitleak serve``): the server session over TLS, its limits and its own
capture. It sits above ``training`` (its sessions answer with the training roles) and ``wire`` (the
transport); nothing below imports it.

Names are imported lazily (as in ``splitleak.experiments``) so that ``splitleak.deploy.limits``, which
``serve --help`` reads, does not load torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from splitleak.deploy.server import ServerNode, Session, SessionRecord

__all__ = ["ServerNode", "Session", "SessionRecord"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'splitleak.deploy' has no attribute {name!r}")
    return getattr(importlib.import_module("splitleak.deploy.server"), name)


def __dir__() -> list[str]:
    return __all__
