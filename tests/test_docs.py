"""The docs never rot: README.md and docs/*.md are checked against the code they describe.

- every relative link (and `#anchor` into a page) points to something that exists, and so does every
  `docs/PAGE.md#anchor` a source file cites;
- every ```python block whose first line is `# runs in tests/test_docs.py` runs: the blocks of one page in
  order, in one namespace (a later block may use what an earlier one made), in a temporary directory;
- docs/cli.md is what `python docs/make_cli_reference.py` writes from partitioner/cli/;
- docs/architecture.md names every package and top-level module of partitioner/ and runtime/;
- the README keeps the two commands CI and newcomers run, as they are.

Runnable blocks stay small (tiny models, CPU, one process, a few seconds each): whole file well under 30 s.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import io
import re
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNS = "# runs in tests/test_docs.py"

FENCE = re.compile(r"^(```+|~~~+)(.*)$")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
CITATION = re.compile(r"\bdocs/([\w.-]+\.md)(?:#([\w-]+))?")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def blocks(path: Path) -> list[tuple[int, str, str]]:
    """(line of the opening fence, info string, body) of every fenced block of a Markdown file."""
    out, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info, start, body = m.group(1), m.group(2).strip(), i + 1, []
        i += 1
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        out.append((start, info, "\n".join(body)))
        i += 1
    return out


def prose(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced blocks, inline code spans blanked."""
    out, inside = [], None
    for n, line in enumerate(path.read_text().splitlines(), 1):
        m = FENCE.match(line)
        if inside is None and m:
            inside = m.group(1)
        elif inside is not None and line.startswith(inside):
            inside = None
        elif inside is None:
            out.append((n, re.sub(r"`[^`]*`", "``", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a page's headings (outside fenced blocks), numbered as GitHub numbers repeats."""
    seen: dict[str, int] = {}
    out = set()
    inside = None
    for line in path.read_text().splitlines():
        m = FENCE.match(line)
        if inside is None and m:
            inside = m.group(1)
            continue
        if inside is not None:
            if line.startswith(inside):
                inside = None
            continue
        h = HEADING.match(line)
        if h:
            base = slug(h.group(2))
            k = seen.get(base, 0)
            seen[base] = k + 1
            out.add(base if k == 0 else f"{base}-{k}")
    return out


# ---- (a) links ------------------------------------------------------------------------------------------


def _check_target(page: Path, target: str) -> str | None:
    """None if `target` (a link in `page`) resolves, else why not."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
        return None
    path_part, _, fragment = target.partition("#")
    dest = (page.parent / path_part).resolve() if path_part else page
    if not dest.exists():
        return f"{path_part} does not exist"
    try:
        dest.relative_to(ROOT)
    except ValueError:
        return f"{path_part} is outside the repository: docs cite only what a clone has"
    if fragment and dest.suffix == ".md" and fragment not in anchors(dest):
        return f"{rel(dest)} has no heading with anchor #{fragment}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_relative_link_points_to_something_that_exists(page):
    broken = []
    for n, line in prose(page):
        for target in LINK.findall(line):
            why = _check_target(page, target)
            if why:
                broken.append(f"{rel(page)}:{n}: ({target}) {why}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_docs_cited_by_the_code_exist():
    """A source file that points a reader at `docs/PAGE.md#anchor` points at a heading that is there."""
    broken = []
    for pkg in ("partitioner", "runtime", "cost_models", "examples", "bench", "tests", ".ci"):
        for path in sorted((ROOT / pkg).rglob("*")):
            if not path.is_file() or path.suffix not in (".py", "") or path == Path(__file__).resolve():
                continue
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                for page, fragment in CITATION.findall(line):
                    dest = ROOT / "docs" / page
                    if not dest.exists():
                        broken.append(f"{rel(path)}:{n}: docs/{page} does not exist")
                    elif fragment and fragment not in anchors(dest):
                        broken.append(f"{rel(path)}:{n}: docs/{page} has no heading with anchor #{fragment}")
    assert not broken, "citations of missing docs:\n" + "\n".join(broken)


def test_the_slugs_are_githubs():
    assert slug("torch's parallel wrappers on CPU") == "torchs-parallel-wrappers-on-cpu"
    assert slug("Locally: launch_local") == "locally-launch_local"
    assert slug("Capturing models: torch.fx and torch.export") == "capturing-models-torchfx-and-torchexport"
    assert slug("`partitioner run`") == "partitioner-run"


# ---- (b) runnable examples ------------------------------------------------------------------------------


def runnable(page: Path) -> list[tuple[int, str]]:
    return [(line, body) for line, info, body in blocks(page)
            if info.split()[:1] == ["python"] and body.lstrip().startswith(RUNS)]


RUNNABLE_PAGES = [p for p in PAGES if runnable(p)]


def test_the_docs_run_enough_examples():
    """At least five runnable blocks, covering the calls a newcomer makes first."""
    code = [body for p in PAGES for _, body in runnable(p)]
    assert len(code) >= 5, f"only {len(code)} runnable blocks in the docs"
    text = "\n".join(code)
    for call in ("compile(", "print(plan)", ".explain()", "trace(", "Topology", ".program(0)", ".verify("):
        assert call in text, f"no runnable block in the docs calls {call}"


@pytest.mark.parametrize("page", RUNNABLE_PAGES, ids=rel)
def test_the_examples_run(page, tmp_path, monkeypatch):
    """Each page's runnable blocks, in order, in one namespace, in an empty directory, stdout captured."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for line, body in runnable(page):
        # pad so a traceback names the page and the line in it
        code = compile("\n" * line + body, str(page), "exec")
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                exec(code, namespace)
            except Exception as e:
                raise AssertionError(f"the example at {rel(page)}:{line} fails: {type(e).__name__}: {e}") from e
        took = time.perf_counter() - start
        # a slow example makes the whole file slow: keep them to a few seconds (generous for a loaded machine)
        assert took < 60, f"the example at {rel(page)}:{line} took {took:.1f} s: make it smaller"


# ---- (c) the CLI reference ------------------------------------------------------------------------------


def test_cli_reference_is_generated_from_the_parser():
    spec = importlib.util.spec_from_file_location("make_cli_reference", ROOT / "docs" / "make_cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    expected = module.render()
    actual = (ROOT / "docs" / "cli.md").read_text()
    if actual != expected:
        diff = "".join(list(difflib.unified_diff(actual.splitlines(True), expected.splitlines(True),
                                                 "docs/cli.md", "generated"))[:40])
        pytest.fail("docs/cli.md is out of date with partitioner/cli/: regenerate it with "
                    f"`python docs/make_cli_reference.py` and commit the result.\n{diff}")


# ---- (d) the architecture map ---------------------------------------------------------------------------


def test_architecture_names_every_package_and_module():
    text = (ROOT / "docs" / "architecture.md").read_text()
    missing = []
    for pkg in ("partitioner", "runtime"):
        for init in sorted((ROOT / pkg).glob("*/__init__.py")):
            name = f"{pkg}/{init.parent.name}/"
            if name not in text:
                missing.append(name)
        for module in sorted((ROOT / pkg).glob("*.py")):
            name = f"{pkg}/{module.name}"
            if module.name != "__init__.py" and name not in text:
                missing.append(name)
    assert not missing, ("docs/architecture.md does not name " + ", ".join(missing) +
                         ": the tree changed; add each to the map (what it owns, where it sits in the flow)")


# ---- the README's two commands ------------------------------------------------------------------------


def test_readme_starts_with_the_two_commands():
    """CI and every newcomer run these two lines as they are: set up and compile, set up and test."""
    bash = [body for _, info, body in blocks(ROOT / "README.md") if info == "bash"][:2]
    setup = "python -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e '.[test]' && "
    assert bash == [setup + "partitioner compile examples/gpt.py:gpt_small --topology local:4 --global-batch-size 32",
                    setup + "python -m pytest -q -n 3"]


def test_the_plan_shown_in_seeing_plans_is_the_golden_file():
    """docs/seeing-plans.md prints a whole plan: the golden file tests/test_plan_text.py holds the code to."""
    golden = (ROOT / "tests" / "golden" / "plan_gpt_small_2x4xA100.txt").read_text().rstrip("\n")
    shown = [body for _, info, body in blocks(ROOT / "docs" / "seeing-plans.md") if not info]
    assert golden in shown, ("docs/seeing-plans.md shows another plan than tests/golden/plan_gpt_small_2x4xA100.txt: "
                             "copy the golden file into its first plain ``` block")
