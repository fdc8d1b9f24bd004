"""`FILE.py:NAME` or `package.module:NAME` -> the object: the one loader every command line uses.

`partitioner compile examples/gpt.py:gpt_small`, `python -m runtime.run ... --model toy.py:model` and
autotune trials all name models, data, optimizers and losses this way. A file inside a package is
imported as the module of its package (examples/gpt.py -> `examples.gpt`, with the package's parent on
sys.path), a loose file by its stem (its directory on sys.path): so a file loads as one module however
many specs name it, and spawned workers, which unpickle a factory by its module's name, import the same.

>>> load_callable("torch.nn.functional:mse_loss").__name__
'mse_loss'
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from runtime.launch.env import LaunchError

__all__ = ["load_module", "load_object", "load_callable"]


def load_module(where: str, what: str) -> ModuleType:
    """The module `where` names (a dotted name, or a path ending in .py); `what` leads every error."""
    if not (where.endswith(".py") or "/" in where):
        try:
            return importlib.import_module(where)
        except ImportError as exc:
            raise LaunchError(f"{what}: cannot import {where}: {exc}") from exc
    path = Path(where).resolve()
    if not path.is_file():
        raise LaunchError(f"{what}: file {where} does not exist")
    for module in list(sys.modules.values()):  # loaded already (say, --model and --data from one file)
        if getattr(module, "__file__", None) == str(path):
            return module
    top, parts = path.parent, [path.stem]
    while (top / "__init__.py").is_file():  # the file's package, and the packages above it
        parts.insert(0, top.name)
        top = top.parent
    if str(top) not in sys.path:
        sys.path.insert(0, str(top))
    name = ".".join(parts)
    try:
        module = importlib.import_module(name)
    except ImportError:
        module = None
    if module is None or getattr(module, "__file__", None) != str(path):  # that name is another module
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules.setdefault(name, module)
        spec.loader.exec_module(module)
    return module


def load_object(spec: str, what: str) -> tuple[ModuleType, str, Any]:
    """(module, name, object) of `WHERE:NAME`."""
    if ":" not in spec:
        raise LaunchError(f"{what} {spec!r}: expected path/to/file.py:NAME or package.module:NAME, "
                          "e.g. examples/gpt.py:gpt_small")
    where, name = spec.rsplit(":", 1)
    module = load_module(where, f"{what} {spec!r}")
    if not hasattr(module, name):
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        raise LaunchError(f"{what} {spec!r}: {module.__name__} has no {name!r}; callables there: "
                          f"{', '.join(names[:20]) or 'none'}")
    return module, name, getattr(module, name)


def load_callable(spec: str, what: str = "callable") -> Callable:
    """The callable `spec` names (an nn.Module instance becomes a factory returning it)."""
    _, name, obj = load_object(spec, what)
    if isinstance(obj, torch.nn.Module):
        return lambda: obj
    if not callable(obj):
        raise LaunchError(f"{what} {spec!r}: {name} is a {type(obj).__name__}, not callable")
    return obj
