"""The layout keeps its promises, read from the source with ``ast`` (nothing is imported): the attacks never
import the truth the scorer reads (``splitleak.runs.truth``), and the wire imports no stage above it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "splitleak"
TRUTH = "splitleak.runs.truth"
#: the stages above the wire that it must not reach back up to (DESIGN's order)
ABOVE_WIRE = ("splitleak.runs", "splitleak.deploy", "splitleak.training", "splitleak.attacks")


def imports_of(path: Path, package_root: Path) -> list[tuple[int, str, str | None]]:
    """Every import in ``path``, module-level or inside a function: (line, module, name imported from it or
    None for ``import module``); relative imports resolved against the module's package."""
    package = ".".join(path.relative_to(package_root.parent).with_suffix("").parts[:-1])
    out: list[tuple[int, str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            out.extend((node.lineno, base, alias.name) for alias in node.names)
    return out


def truth_names(package_root: Path = PACKAGE) -> set[str]:
    """The public names ``splitleak.runs.truth`` defines (functions, classes, constants)."""
    tree = ast.parse((package_root / "runs" / "truth.py").read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return {n for n in names if not n.startswith("_")}


def reaches_truth(module: str, name: str | None, truth: set[str]) -> bool:
    """Whether one import names the truth module, or a name of it (from there or re-exported elsewhere)."""
    if module == TRUTH or module.startswith(TRUTH + "."):
        return True
    if name is not None and f"{module}.{name}" == TRUTH:  # from splitleak.runs import truth
        return True
    return name in truth


def truth_imports(stage: str, package_root: Path = PACKAGE) -> list[str]:
    """``path:line imports module.name`` for each import under ``package_root/stage`` that reaches the truth."""
    truth = truth_names(package_root)
    return [
        f"{path.relative_to(package_root.parent)}:{line} imports {module}" + (f".{name}" if name else "")
        for path in sorted((package_root / stage).rglob("*.py"))
        for line, module, name in imports_of(path, package_root)
        if reaches_truth(module, name, truth)
    ]


def back_up_imports(stage: str, package_root: Path = PACKAGE) -> list[str]:
    """``path:line imports module.name`` for each import under ``package_root/stage`` of a stage above the wire."""
    return [
        f"{path.relative_to(package_root.parent)}:{line} imports {module}" + (f".{name}" if name else "")
        for path in sorted((package_root / stage).rglob("*.py"))
        for line, module, name in imports_of(path, package_root)
        if any(
            target == stage or target.startswith(stage + ".")
            for stage in ABOVE_WIRE
            for target in (module, f"{module}.{name}" if name else module)
        )
    ]


@pytest.mark.unit
def test_no_attack_imports_the_truth_the_scorer_reads():
    """An attack reads what crossed and what its threat model gives it; the evaluation text, the training
    text and the latent mode's real-row record reach only the scorer (metrics, audit, experiments)."""
    assert truth_names() >= {"eval_token_ids", "phase_documents", "read_documents", "load_truth", "TRUTH_FILE"}
    found = truth_imports("attacks")
    assert not found, "attacks/ reaches the truth: " + "; ".join(found)


@pytest.mark.unit
def test_the_wire_imports_no_stage_above_it():
    """wire/ holds only what crosses: it imports none of the run directory, the deployment node, training or
    the attacks (the tap writes through ``RunSink``, which ``RunStore`` satisfies)."""
    found = back_up_imports("wire")
    assert not found, "wire/ imports a stage above it: " + "; ".join(found)


def flagged(found: list[str]) -> list[str]:
    """``file:line`` of each import a check reports."""
    return [f.split(" ")[0].rsplit("/", 1)[-1] for f in found]


@pytest.mark.unit
def test_the_checks_see_an_import_of_the_truth_and_one_back_up(tmp_path):
    """Both checks fail on the imports they are for, at module level or inside a function, and pass what
    is allowed (the attacks read the manifest; the wire imports itself)."""
    root = tmp_path / "splitleak"
    sources = {
        "runs/truth.py": (PACKAGE / "runs" / "truth.py").read_text(encoding="utf-8"),
        "attacks/a.py": "from splitleak.runs.truth import load_truth\n",
        "attacks/b.py": "def f():\n    from splitleak.runs import truth\n",
        "attacks/c.py": "def f():\n    from splitleak.training.latent import TRUTH_FILE\n",
        "attacks/d.py": "from splitleak.runs.manifest import read_manifest\n",
        "attacks/e.py": "import splitleak.runs.truth as t\n",
        "wire/x.py": "import splitleak.runs.store\nfrom splitleak.wire.frames import Frame\n",
        "wire/y.py": "def f():\n    from splitleak import deploy\n",
        "wire/z.py": "from .frames import Frame\nfrom ..attacks import knowledge\n",
    }
    for rel, text in sources.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    assert flagged(truth_imports("attacks", root)) == ["a.py:1", "b.py:2", "c.py:2", "e.py:1"]
    assert flagged(back_up_imports("wire", root)) == ["x.py:1", "y.py:2", "z.py:2"]
