"""Print, one per line as NAME==VERSION, the distributions splitleak needs at run time that the device
machine's image does not hold: the closure of splitleak's requirements, not followed into packages the
image already has (its own versions bring their own needs). The image's package list is read from the
device tool's KINDS.md (its "Packages:" line). Used by prepare.sh; run with the project's .venv python.

    .venv/bin/python benchmarks/device/missing.py [PATH/TO/KINDS.md]
"""

from __future__ import annotations

import importlib.metadata as md
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# The image holds these, but at versions older than what pydantic 2.x asks for: carried anyway.
ALWAYS = ("typing-extensions",)
# Needed by one command the device's grid never runs (`splitleak tune` imports optuna lazily), left out
# with everything only it brings (SQLAlchemy, Alembic, ...) to keep a call's 64 MiB for the weights.
SKIP = ("optuna",)


def image_packages(kinds: Path) -> set[str]:
    found = re.search(r"Packages: (.*?)\.\n", kinds.read_text())
    if not found:
        sys.exit(f"{kinds} has no 'Packages: ...' line: read the device image's package list there by hand")
    return {canonicalize_name(p) for p in found.group(1).split(", ")}


def missing(have: set[str]) -> list[str]:
    seen: set[str] = set()
    need: list[str] = []
    todo = ["splitleak"]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen or name in SKIP:
            continue
        seen.add(name)
        if name in have and name not in ALWAYS:
            continue
        if name != "splitleak":
            need.append(f"{name}=={md.version(name)}")
        for r in md.requires(name) or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return sorted(need)


if __name__ == "__main__":
    kinds = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parents[3] / ".library/device/KINDS.md")
    print("\n".join(missing(image_packages(kinds))))
