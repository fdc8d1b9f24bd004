"""Every Triton kernel in the runtime reads only what compiled Triton accepts from its module.

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1), which resolves any Python global. Compiled
Triton does not: a kernel that reads a plain global (a float constant, say) fails to compile with "Cannot access
global variable ... from within @jit'ed function" the first time it meets a GPU. The fused fp8 cast did exactly
that on a lent H200 (its rounding constant was a module float). This test reads each kernel's source and checks the
rule on CPU: the names a kernel loads from its module are modules, other kernels, or `tl.constexpr` values.
"""
from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pathlib
import types

import pytest
import triton
import triton.language as tl

ROOT = pathlib.Path(__file__).resolve().parent.parent
_KERNEL_MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts)
    for p in (ROOT / "runtime").rglob("*.py") if "triton.jit" in p.read_text())


def _kernels(module):
    return [(name, obj) for name, obj in vars(module).items() if isinstance(obj, triton.runtime.jit.KernelInterface)]


def _bad_globals(source: str, module_globals: dict) -> list[str]:
    tree = ast.parse(source).body[0]
    local = {a.arg for a in tree.args.args} | {n.id for n in ast.walk(tree)
                                               if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    bad = []
    for n in ast.walk(tree):
        if not isinstance(n, ast.Name) or not isinstance(n.ctx, ast.Load) or n.id in local:
            continue
        if n.id not in module_globals:
            if not hasattr(builtins, n.id):
                bad.append(f"{n.id} (undefined)")
        elif not isinstance(module_globals[n.id], (types.ModuleType, triton.runtime.jit.KernelInterface, tl.constexpr)):
            bad.append(f"{n.id} ({type(module_globals[n.id]).__name__})")
    return sorted(set(bad))


def test_the_kernel_modules_are_found():
    assert "runtime.engines.fp8_cast" in _KERNEL_MODULES and len(_KERNEL_MODULES) >= 3, _KERNEL_MODULES


@pytest.mark.parametrize("module", _KERNEL_MODULES)
def test_kernels_read_no_plain_module_globals(module):
    kernels = _kernels(importlib.import_module(module))
    assert kernels, f"{module} mentions triton.jit but defines no kernel"
    for name, kernel in kernels:
        bad = _bad_globals(inspect.getsource(kernel.fn).lstrip(), kernel.fn.__globals__)
        assert not bad, (
            f"{module}.{name} reads module globals that compiled Triton refuses: {bad}; "
            f"pass them as `tl.constexpr` arguments or define them as `tl.constexpr(...)`")


def test_the_check_sees_a_plain_float_global():
    """The rule's own tripwire: the fp8 cast's first form (a float constant read from the module) is caught, and
    the same constant as a `tl.constexpr` or a kernel argument is not."""
    body = "def k(x_ptr, M: tl.constexpr):\n    v = tl.load(x_ptr)\n    return (v + {m}) - {m}\n"
    assert _bad_globals(body.format(m="_M"), {"tl": tl, "_M": 12582912.0}) == ["_M (float)"]
    assert _bad_globals(body.format(m="_M"), {"tl": tl, "_M": tl.constexpr(12582912.0)}) == []
    assert _bad_globals(body.format(m="M"), {"tl": tl}) == []
