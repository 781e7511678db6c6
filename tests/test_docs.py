"""The docs cannot rot: the site builds with warnings as errors (`make docs`), a broken link fails that build, the
generated reference lists every command, option and registered name, and every command block marked runnable in
the docs (and the README's Python example) runs as written, on the tiny model, in a fresh folder."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
#: the line before a fenced block that the suite runs as written
RUNNABLE = "<!-- runnable -->"
FENCE = re.compile(r"^```(\w+)\s*$")


def runnable_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced block right after a ``<!-- runnable -->`` line, in page order."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        if lines[i].strip() == RUNNABLE:
            m = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
            if m is None:
                raise AssertionError(f"{RUNNABLE} at line {i + 1} is not followed by a fenced block")
            end = lines.index("```", i + 2)
            blocks.append((m.group(1), "\n".join(lines[i + 2 : end]) + "\n"))
            i = end
        i += 1
    return blocks


def pages_with_runnable_blocks() -> list[Path]:
    return sorted(p for p in [REPO / "README.md", *DOCS.rglob("*.md")] if RUNNABLE in p.read_text())


def run_blocks(page: Path, where: Path, timeout: float = 300) -> None:
    """Run a page's runnable blocks in order in one folder, as a reader would in a fresh shell with the package
    installed (its ``splitleak`` and ``python`` first on PATH); every process a block starts is ended after it."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    for n, (lang, code) in enumerate(runnable_blocks(page.read_text()), 1):
        argv = ["bash", "-euo", "pipefail", "-c", code] if lang in ("bash", "sh") else [sys.executable, "-c", code]
        proc = subprocess.Popen(
            argv,
            cwd=where,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # a server a block left behind, or the block itself on timeout
            except ProcessLookupError:
                pass
        assert proc.returncode == 0, f"{shown(page)}, runnable block {n} exited {proc.returncode}:\n{out[-3000:]}"


def shown(page: Path) -> str:
    return str(page.relative_to(REPO)) if page.is_relative_to(REPO) else str(page)


def make_docs(src: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "-s", "-C", str(REPO), "docs", f"DOCS_SRC={src}", f"DOCS_OUT={out}"],
        capture_output=True,
        text=True,
        timeout=600,
    )


def copy_docs(tmp: Path) -> Path:
    """The docs folder and what it includes from beside it, copied, so a build writes nothing into the checkout."""
    shutil.copytree(DOCS, tmp / "docs", ignore=shutil.ignore_patterns("_build"))
    shutil.copy(REPO / "RELIABILITY.md", tmp / "RELIABILITY.md")
    return tmp / "docs"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("docs")
    src = copy_docs(tmp)
    done = make_docs(src, tmp / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    return src, tmp / "site"


def commands(group, prefix=("splitleak",)):
    """(command path, its option names) for every command of the typer app, groups included (typer's click is
    its own: the tree is read by its attributes)."""
    for name, cmd in sorted(getattr(group, "commands", {}).items()):
        path = (*prefix, name)
        opts = [o for p in cmd.params for o in p.opts if o.startswith("--") and o != "--help"]
        yield " ".join(path), opts
        yield from commands(cmd, path)


@pytest.mark.integration
def test_the_command_line_reference_lists_every_command_and_option(built):
    import typer.main

    from splitleak.cli import app

    src, site = built
    text = (src / "reference" / "cli.md").read_text()
    sections = dict(re.findall(r"^#+ `([^`]+)`\n(.*?)(?=^#+ `|\Z)", text, flags=re.M | re.S))
    seen = 0
    for path, opts in commands(typer.main.get_command(app)):
        assert path in sections, f"{path} is not in the command-line reference"
        for opt in opts:
            assert f"`{opt}" in sections[path], f"{path} {opt} is not in the command-line reference"
            seen += 1
    assert seen > 150  # every command of the CLI (185 options today), not an empty tree
    assert (site / "reference" / "cli.html").is_file()


@pytest.mark.integration
def test_the_registry_reference_lists_every_attack_defence_model_and_protocol(built):
    from splitleak.attacks.registry import REGISTRY
    from splitleak.audit.protocol import shipped_protocols
    from splitleak.defences import DEFENCES
    from splitleak.models import PRESETS

    src, site = built
    text = (src / "reference" / "registries.md").read_text()
    names = [*REGISTRY, *DEFENCES, *PRESETS]
    missing = [n for n in names if f"| `{n}` |" not in text]
    missing += [p.name for p in shipped_protocols() if f"`{p.name}`" not in text]
    assert not missing, f"not in the registry reference: {missing}"
    html = (site / "reference" / "registries.html").read_text()
    assert all(n in html for n in REGISTRY)
    assert "run_audit" in (site / "reference" / "api.html").read_text()  # the API page is not empty


@pytest.mark.integration
def test_a_broken_link_or_reference_fails_the_build(tmp_path):
    src = copy_docs(tmp_path)
    page = src / "concepts" / "channels.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    done = make_docs(src, tmp_path / "site")
    assert done.returncode != 0
    assert "no-such-page.md" in done.stdout + done.stderr


@pytest.mark.unit
def test_runnable_blocks_are_found_and_a_marker_without_a_block_is_refused():
    text = "a\n<!-- runnable -->\n```bash\necho one\necho two\n```\n\n```bash\nnot this\n```\n"
    assert runnable_blocks(text) == [("bash", "echo one\necho two\n")]
    with pytest.raises(AssertionError, match="not followed by a fenced block"):
        runnable_blocks("<!-- runnable -->\ntext\n")
    assert len(pages_with_runnable_blocks()) >= 6  # the tutorials and the README keep theirs


@pytest.mark.unit
def test_no_issue_number_in_the_readme_or_the_docs():
    pages = [REPO / "README.md", *DOCS.rglob("*.md")]
    hits = [
        f"{p.relative_to(REPO)}: {m.group(0)}" for p in pages for m in re.finditer(r"(?i)issue #?\d+", p.read_text())
    ]
    assert not hits
    assert len((REPO / "README.md").read_text().splitlines()) <= 200


@pytest.mark.unit
def test_the_readme_counts_what_is_registered():
    from splitleak.attacks.registry import REGISTRY
    from splitleak.defences import DEFENCES

    text = (REPO / "README.md").read_text()
    assert f"| attacks ({len(REGISTRY)}) |" in text and f"| attacks on text | {len(REGISTRY)}, above |" in text
    assert f"| defences ({len(DEFENCES)}) |" in text


@pytest.mark.e2e
@pytest.mark.parametrize("page", pages_with_runnable_blocks(), ids=shown)
def test_the_runnable_blocks_run_as_written(page, tmp_path):
    run_blocks(page, tmp_path)


@pytest.mark.unit
def test_a_failing_runnable_block_names_its_page_and_its_output(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- runnable -->\n```bash\necho reached\nfalse\necho never\n```\n")
    with pytest.raises(AssertionError, match=r"(?s)block 1 exited 1.*reached") as err:
        run_blocks(page, tmp_path)
    assert "never" not in str(err.value)
