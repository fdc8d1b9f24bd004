"""The docstring examples of every module of partitioner, runtime, cost_models and examples run, as written.

- one test per module that has examples: `doctest.testmod` with ELLIPSIS and NORMALIZE_WHITESPACE,
  in the repository root (examples name models by path, "examples/gpt.py:gpt_tiny");
- no example hides behind `doctest: +SKIP` except those in ALLOWED_SKIPS, each with why it cannot
  run here.

Examples stay small (tiny models, CPU, a 2-rank world where processes start): the whole file takes
under a minute on two cores, about 35 s without the autotune module's (marked slow: it tunes twice).
"""

from __future__ import annotations

import contextlib
import doctest
import importlib
import io
import pkgutil
import re
from pathlib import Path

import pytest
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("partitioner", "runtime", "cost_models", "examples")
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

# module -> (skipped examples allowed, why they cannot run in a test)
ALLOWED_SKIPS = {
    "partitioner.tune.autotune": (1, "launcher='srun' runs srun, which needs a SLURM allocation: no test machine "
                                     "has one (the torchrun example beside it runs, on local:2)"),
}

# Module docs that start processes again and again: the autotune module's tunes twice (local, torchrun), ~20 s.
SLOW = {"partitioner.tune.autotune"}

SKIP = re.compile(r"doctest:.*\+SKIP")


def _module_names() -> list[str]:
    names = []
    for pkg in PACKAGES:
        names.append(pkg)
        path = importlib.import_module(pkg).__path__
        names += [m.name for m in pkgutil.walk_packages(path, prefix=f"{pkg}.")
                  if m.name.rpartition(".")[2] != "__main__"]  # __main__ runs the CLI when imported
    return names


def _has_examples(name: str) -> bool:
    return any(t.examples for t in doctest.DocTestFinder().find(importlib.import_module(name)))


MODULES = _module_names()
WITH_EXAMPLES = [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                 for n in MODULES if _has_examples(n)]


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_docstring_examples_run(name, monkeypatch):
    monkeypatch.chdir(REPO)
    module = importlib.import_module(name)
    report = io.StringIO()
    try:
        with contextlib.redirect_stdout(report):
            result = doctest.testmod(module, optionflags=FLAGS, verbose=False, report=True)
    finally:
        leaked = dist.is_initialized()
        if leaked:  # an example failed before destroying its group: later tests need none
            dist.destroy_process_group()
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed\n{report.getvalue()}"
    assert not leaked, f"{name}: an example left a default process group initialised"


def _sources() -> dict[str, Path]:
    """module name -> its file, for every .py file of the packages (__main__ too)."""
    return {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
            for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def _skips() -> dict[str, list[str]]:
    """module -> its lines that skip an example."""
    found: dict[str, list[str]] = {}
    for name, path in _sources().items():
        lines = [f"{path.relative_to(REPO)}:{i}: {line.strip()}"
                 for i, line in enumerate(path.read_text().splitlines(), 1) if SKIP.search(line)]
        if lines:
            found[name] = lines
    return found


def test_no_example_is_skipped_outside_the_allow_list():
    found = _skips()
    extra = {n: lines for n, lines in found.items() if len(lines) > ALLOWED_SKIPS.get(n, (0, ""))[0]}
    assert not extra, ("examples skipped with `doctest: +SKIP`: make them run (setup lines, a tiny model, ... for "
                       "what varies), or add the module to ALLOWED_SKIPS with why it cannot run in a test:\n"
                       + "\n".join(line for lines in extra.values() for line in lines))
    stale = sorted(n for n, (count, _) in ALLOWED_SKIPS.items() if len(found.get(n, [])) < count)
    assert not stale, f"ALLOWED_SKIPS allows more skips than these modules have: lower or drop {stale}"


def test_the_walk_finds_every_source_file():
    """A directory without __init__.py is no package to pkgutil: its modules' examples would never run."""
    files = {n for n in _sources() if n.rpartition(".")[2] != "__main__"}
    assert sorted(files - set(MODULES)) == []
