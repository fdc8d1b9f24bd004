"""A generated rank program executed as a module of its own, registered in `sys.modules`.

The source of `rank_R.py` runs with `exec`, and its functions name their module in `__module__`. Code that
looks a function's module up by that name fails unless it is importable: torch 2.11's dynamo does, under
`compile(..., torch_compile=True)` (`InternalTorchDynamoError: ModuleNotFoundError: No module named 'rank_0'`,
seen on a lent H200). So each executed program is a real module object under a name unique in the process
(`rank_R`, then `rank_R_2`, ... when several programs of one rank run in one process: plan.verify, tests),
and the namespace returned is that module's dictionary.

The source is also put in `linecache` under `filename`: tracebacks then show the generated lines, and
`inspect.getsourcefile` finds a file for its functions. torch before 2.13 wraps a function without one in a
shared frame (`torch._dynamo.external_utils.wrap_inline`'s `inner`) when it is compiled, so every segment
function of a program recompiled that one frame, and after dynamo's cache limit (8) the rest ran eagerly,
silently (seen on torch 2.11: 8 graphs for 10 functions).

>>> ns = exec_program("def build():\\n    return 1\\n", "<rank_0.py>", rank=0)
>>> import importlib
>>> importlib.import_module(ns["build"].__module__).build() == ns["build"]()
True
>>> import inspect; inspect.getsourcefile(ns["build"])
'<rank_0.py>'
"""

from __future__ import annotations

import itertools
import linecache
import sys
import threading
import types
from typing import Any

__all__ = ["exec_program"]

_lock = threading.Lock()
_serial = itertools.count(2)


def _fresh_name(rank: int) -> str:
    with _lock:
        name = f"rank_{rank}"
        while name in sys.modules:
            name = f"rank_{rank}_{next(_serial)}"
        sys.modules[name] = types.ModuleType(name)
        return name


def exec_program(source: str, filename: str, *, rank: int, **extra: Any) -> dict[str, Any]:
    """Execute `source` (tracebacks show `filename`) as a new module; its namespace, with `extra` names set
    before it runs (`__file__`, for instance)."""
    module = sys.modules[_fresh_name(rank)]
    module.__dict__.update(extra)
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102 - the plan's generated program
    return module.__dict__
