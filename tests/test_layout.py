"""The layout keeps its promises, read from the source with ``ast`` (nothing is imported): the attacks never
import the truth the scorer reads (``splitleak.runs.truth``), the wire imports no stage above it, modules and
functions stay short enough to read, and an import inside a function says why it is not at the top."""

from __future__ import annotations

import ast
import re
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


#: the files of a run only the scorer reads: the client's latent record and its per-run secret
PRIVATE_FILES = ("truth.safetensors", "secret.json")


def private_file_names(stage: str, package_root: Path = PACKAGE) -> list[str]:
    """``path:line`` of each string constant under ``package_root/stage`` that names a file only the scorer reads
    (a path built from it would reach the truth without importing ``splitleak.runs.truth``)."""
    return [
        f"{path.relative_to(package_root.parent)}:{node.lineno}"
        for path in sorted((package_root / stage).rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        if any(name in node.value for name in PRIVATE_FILES)
    ]


@pytest.mark.unit
def test_no_attack_names_a_file_only_the_scorer_reads(tmp_path):
    """Nor by its name: no string in attacks/ names the client's record or its secret (and the check sees one)."""
    found = private_file_names("attacks")
    assert not found, "attacks/ names a private file: " + "; ".join(found)
    (tmp_path / "splitleak" / "attacks").mkdir(parents=True)
    (tmp_path / "splitleak" / "attacks" / "a.py").write_text('x = 1\nP = "latent/" + "truth.safetensors"\n')
    assert flagged(private_file_names("attacks", tmp_path / "splitleak")) == ["a.py:2"]


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


# ------------------------------------------------------------------ sizes a reader can hold in their head

MODULE_LINES = 600
FUNCTION_LINES = 100
WIRE_LINES = 2000


def body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of a function's body, from its first statement after the docstring to its end: a CLI command's
    typer option list (its signature) and its docstring do not count."""
    body = fn.body
    if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    end = fn.end_lineno if fn.end_lineno is not None else body[-1].lineno
    return end - body[0].lineno + 1


def oversized(package_root: Path = PACKAGE) -> list[str]:
    """Modules over ``MODULE_LINES`` lines and functions whose body is over ``FUNCTION_LINES`` lines."""
    found = []
    for path in sorted(package_root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(package_root.parent).as_posix()
        if len(text.splitlines()) > MODULE_LINES:
            found.append(f"{rel}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and body_lines(node) > FUNCTION_LINES:
                found.append(f"{rel}:{node.lineno} {node.name}: a body of {body_lines(node)} lines")
    return found


@pytest.mark.unit
def test_no_module_or_function_is_too_long_to_read():
    assert oversized() == []
    wire = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in (PACKAGE / "wire").glob("*.py"))
    assert wire < WIRE_LINES, f"splitleak/wire/ holds {wire} lines: it should keep only what crosses"


@pytest.mark.unit
def test_the_size_check_sees_a_long_module_and_a_long_function(tmp_path):
    pkg = tmp_path / "splitleak"
    pkg.mkdir()
    long_fn = "def f():\n    '''doc'''\n" + "".join(f"    x{i} = {i}\n" for i in range(FUNCTION_LINES + 1))
    (pkg / "long_function.py").write_text(long_fn)
    (pkg / "long_module.py").write_text("".join(f"y{i} = {i}\n" for i in range(MODULE_LINES + 1)))
    ok = "def g():\n    '''doc'''\n" + "".join(f"    x{i} = {i}\n" for i in range(FUNCTION_LINES))
    (pkg / "fine.py").write_text(ok)
    assert oversized(pkg) == [
        f"splitleak/long_function.py:1 f: a body of {FUNCTION_LINES + 1} lines",
        f"splitleak/long_module.py: {MODULE_LINES + 1} lines",
    ]


# ------------------------------------------------------------------ imports inside functions say why

#: the one form of the reason an import inside a function carries: ``# lazy: <why, in a few words>``
LAZY = re.compile(r"#\s*lazy:\s*(\S+\s+\S.*)")


def unexplained_lazy_imports(package_root: Path = PACKAGE) -> list[str]:
    """``path:line`` of each import inside a function (a method, a nested function) that gives no reason: a
    ``# lazy: <reason>`` comment on one of its lines or alone on the line above it, where a comment above
    covers the run of imports that follows it without a blank line. An import stays in a function only
    where it keeps a heavy or optional dependency out of a module that loads without it."""
    found = []
    for path in sorted(package_root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines, tree = text.splitlines(), ast.parse(text, str(path))
        inner = sorted(
            (node.lineno, node.end_lineno or node.lineno, node.col_offset)
            for fn in ast.walk(tree)
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(fn)
            if isinstance(node, (ast.Import, ast.ImportFrom))
        )
        if not inner:
            continue
        # lines inside a string that spans lines: a '#' there is no comment (an import's own lines hold no string)
        in_string = {
            line
            for s in ast.walk(tree)
            if isinstance(s, (ast.Constant, ast.JoinedStr)) and s.end_lineno
            for line in range(s.lineno + 1, s.end_lineno + 1)
        }
        run = (-1, -1)  # (last line, column) of the run of explained imports just above
        for first, last, col in dict.fromkeys(inner):  # a nested function's imports are walked twice
            own = any(LAZY.search(lines[i - 1]) for i in range(first, last + 1))
            above = lines[first - 2].lstrip() if first > 1 else ""
            heads = above.startswith("#") and first - 1 not in in_string and LAZY.match(above)
            if own or heads or run == (first - 1, col):
                run = (last, col)
            else:
                found.append(f"{path.relative_to(package_root.parent).as_posix()}:{first}")
                run = (-1, -1)
    return found


@pytest.mark.unit
def test_every_import_inside_a_function_says_why():
    found = unexplained_lazy_imports()
    assert not found, "an import inside a function without '# lazy: <reason>' (hoist it, or say why): " + ", ".join(
        found
    )


@pytest.mark.unit
def test_the_lazy_import_check_sees_an_import_without_a_reason(tmp_path):
    pkg = tmp_path / "splitleak"
    pkg.mkdir()
    sources = {
        "top.py": "import json\n\n\ndef f():\n    return json\n",  # module level: no reason needed
        "bare.py": "def f():\n    import json\n",
        "method.py": "class C:\n    def m(self):\n        from splitleak import errors\n",
        "nested.py": "def f():\n    def g():\n        # lazy: torch stays out of this module\n        import torch\n"
        "    import json\n",
        "trailing.py": "def f():\n    import torch  # lazy: torch stays out of `splitleak --help`\n",
        "above.py": "def f():\n    x = 1\n    # lazy: ray is optional\n    import ray\n    import ray.util\n\n"
        "    import ray.util.queue\n",
        "empty.py": "def f():\n    import ray  # lazy:\n    import optuna  # lazy: optuna\n",
        "wrapped.py": "def f():\n    from splitleak.errors import (  # lazy: on the first of its lines\n"
        "        ConfigError,\n    )\n",
        "text.py": 'def f():\n    s = """\n# lazy: inside a string, not a comment"""\n    import json\n    return s\n',
        "other.py": "def f():\n    # lazy matplotlib, not the form\n    import matplotlib\n",
    }
    for name, text in sources.items():
        (pkg / name).write_text(text)
    assert unexplained_lazy_imports(pkg) == [
        "splitleak/above.py:7",  # a blank line ends the run the comment heads
        "splitleak/bare.py:2",
        "splitleak/empty.py:2",  # no reason
        "splitleak/empty.py:3",  # one word is no reason
        "splitleak/method.py:3",
        "splitleak/nested.py:5",  # the nested function's reason is not its parent's (another column)
        "splitleak/other.py:3",  # not the form
        "splitleak/text.py:4",  # a string is no comment
    ]
