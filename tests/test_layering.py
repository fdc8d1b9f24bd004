"""Imports run one way, down the flow: no file imports a stage above its own, and no files import each other.

The flow (docs/architecture.md): cost_models at the bottom (it imports nothing of the project), then the
runtime (it never imports the planner: collectives, compression, engines, pipeline stages, checkpoints,
verification, launch), then the partitioner's stages tracer -> planner -> code generator and
presentations (siblings: neither imports the other) -> compile -> tune -> the command line. Imports are read
with `ast` from every file, those inside functions included; imports under `if TYPE_CHECKING:` are for type
checkers only and never run, so they are left out. The one sanctioned way up is a convenience method of
the plan that hands it to a stage above when called (CONVENIENCES), as pandas' `DataFrame.plot` does.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cost_models", "runtime", "partitioner")

# Bottom to top. Modules in the same entry are one room: they may import each other (without circles).
# Two rooms on the same level (a tuple) are siblings: neither imports the other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("cost_models",),
    ("runtime.device",),  # the rank's device: where everything above puts its tensors
    ("runtime.comm",),
    ("runtime.compression", "runtime.context"),  # gradient compression; context parallelism's attention
    # a backward split into input and weight gradients (zero bubble); the log of when each action ran
    ("runtime.pipeline.split_backward", "runtime.pipeline.action_trace"),
    # the interpreter of action lists (cost_models.actions): pipeline runners and the data-parallel step drive it
    ("runtime.pipeline.executor",),
    ("runtime.engines",),
    ("runtime.pipeline",),
    ("runtime.experts",),  # expert parallelism's MoE layer (its load-balancing loss all-reduces as Megatron's g)
    ("runtime.checkpoint",),
    ("runtime.verify",),
    ("runtime.launch",),
    ("runtime.moved",),
    ("runtime.run", "runtime"),
    ("partitioner.loading",),  # FILE.py:fn -> the user's model: where the flow starts
    ("partitioner.tracer",),
    ("partitioner.planner",),
    ("partitioner.codegen", "partitioner.show"),
    ("partitioner.compile",),
    ("partitioner.tune", "partitioner.probe"),  # both measure with the runtime and produce cost_models data
    ("partitioner.elastic",),
    ("partitioner.cli",),
    ("partitioner.__main__", "partitioner"),
)

# (importing module, function) -> the rooms above it that function may import when called.
CONVENIENCES = {
    ("partitioner.planner.plan", "program"): ("partitioner.codegen",),
    ("partitioner.planner.plan", "write_programs"): ("partitioner.codegen",),
    ("partitioner.planner.plan", "explain"): ("partitioner.show",),
    ("partitioner.planner.plan", "__str__"): ("partitioner.show",),
    ("partitioner.planner.plan", "to_html"): ("partitioner.show",),
    ("partitioner.planner.plan", "timeline"): ("partitioner.show",),
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room(module: str) -> tuple[int, str]:
    """(level, room) of a module: the longest room name that is the module or a package above it."""
    best = None
    for level, rooms in enumerate(LAYERS):
        for r in rooms:
            if (module == r or module.startswith(r + ".")) and (best is None or len(r) > len(best[1])):
                best = (level, r)
    if best is None:
        raise AssertionError(f"{module} is in no layer of tests/test_layering.py LAYERS: a new file must be placed "
                             "in the flow (add its package to the level it belongs to)")
    return best


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports(tree: ast.Module, modules: set[str], here: str) -> list[tuple[str, str | None, int]]:
    """(imported project module, enclosing function or None, line) for every import that runs."""
    out: list[tuple[str, str | None, int]] = []

    def visit(node: ast.AST, fn: str | None) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child, fn)
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            fn = node.name if fn is None else fn
        if isinstance(node, ast.Import):
            out.extend((a.name, fn, node.lineno) for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"{here} line {node.lineno}: a relative import; the house writes imports "
                                     "absolute, so a reader sees the stage each comes from")
            base = node.module or ""
            for a in node.names:
                sub = f"{base}.{a.name}"
                target = sub if sub in modules else base
                if target in modules:
                    out.append((target, fn, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, fn)

    visit(tree, None)
    return out


def read_tree(root: Path, packages=PACKAGES) -> dict[str, ast.Module]:
    return {module_name(p, root): ast.parse(p.read_text(), str(p))
            for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}


def violations(trees: dict[str, ast.Module]) -> tuple[list[str], list[list[str]]]:
    """(imports against the flow, import circles) of a tree of modules."""
    modules = set(trees)
    against: list[str] = []
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for m, tree in trees.items():
        lm, rm = room(m)
        for target, fn, line in imports(tree, modules, m):
            if target == m:
                continue
            lt, rt = room(target)
            if rt == rm or lt < lm:
                edges[m].add(target)
                continue
            if any(rt == r or rt.startswith(r + ".") for r in CONVENIENCES.get((m, fn), ())):
                continue  # a convenience that hands the plan upward, called by the user
            where = f"in {fn}()" if fn else "at module level"
            against.append(f"{m} (line {line}, {where}) imports {target}: {rm} may not import "
                           f"{'its sibling ' if lt == lm else 'the stage above, '}{rt}")
    return against, _circles(edges)


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def test_imports_follow_the_flow_and_form_no_circle():
    against, circles = violations(read_tree(ROOT))
    assert not against, "imports against the flow:\n" + "\n".join(against)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_every_file_has_a_place_in_the_flow():
    for m in read_tree(ROOT):
        room(m)


def _tree(**sources: str) -> dict[str, ast.Module]:
    return {m.replace("__", "."): ast.parse(src) for m, src in sources.items()}


@pytest.mark.parametrize("case", ["upward", "upward-inside-a-function", "siblings", "circle", "runtime-to-planner"])
def test_the_check_finds_each_kind_of_wrong_import(case):
    """The checker itself, on small made-up trees: each breaks the rule once, and is found."""
    trees = {
        "upward": _tree(partitioner__tracer__trace="from partitioner.planner.plan import Plan\n",
                        partitioner__planner__plan=""),
        "upward-inside-a-function": _tree(partitioner__planner__costing="def f():\n    import partitioner.tune.db\n",
                                          partitioner__tune__db=""),
        "siblings": _tree(partitioner__show__text="from partitioner.codegen.program import program\n",
                          partitioner__codegen__program=""),
        "circle": _tree(partitioner__planner__a="import partitioner.planner.b\n",
                        partitioner__planner__b="def f():\n    from partitioner.planner.a import x\n"),
        "runtime-to-planner": _tree(runtime__launch="from partitioner.planner import plan\n",
                                    partitioner__planner__plan=""),
    }[case]
    against, circles = violations(trees)
    assert (against if case != "circle" else circles), case
    fine = _tree(partitioner__planner__plan="from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                            "    from partitioner.codegen.program import program\n"
                                            "def program(self):\n    from partitioner.codegen.program import p\n",
                 partitioner__codegen__program="from partitioner.planner.plan import Plan\n")
    assert violations(fine) == ([], [])  # a type-only import and a sanctioned convenience are not violations


def test_generated_programs_import_the_runtime_by_its_current_names(meta_gpt_graph):
    """Every module a generated program imports is a file of the runtime today, not an old name kept for
    programs written by an older release."""
    from partitioner import compile
    from runtime.moved import MOVED

    plans = [compile(meta_gpt_graph, "local:4", global_batch_size=8, **pins) for pins in (
        dict(pp=1, tp=1, zero_stage=3), dict(pp=2, tp=2, dp=1), dict(pp=1, tp=1, async_sgd=dict(every=2), precision="fp32"))]
    for plan in plans:
        tree = ast.parse(plan.program(0).source)
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        runtime_names = {n for n in names if n.split(".")[0] == "runtime"}
        assert runtime_names and not runtime_names & set(MOVED), runtime_names
        for n in runtime_names:
            assert (ROOT / (n.replace(".", "/") + ".py")).exists() or (ROOT / n.replace(".", "/")).is_dir(), n


def test_old_runtime_module_names_still_load_the_moved_module_with_a_warning():
    import importlib
    import sys

    from runtime.moved import MOVED

    for old, new in MOVED.items():
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=f"{old} is now {new}.*regenerate"):
            assert importlib.import_module(old) is importlib.import_module(new)
