"""Load a model named on the command line: `path/to/file.py:factory` or `pkg.module:factory`.

The factory is called with no arguments and returns an `nn.Module` (a module
attribute that already is an `nn.Module` is used as is). Example inputs come
from the module's `example_inputs(model, batch_size=...)` when it has one.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from cost_models.errors import PartitionerError

__all__ = ["load_model", "load_module"]


def load_module(spec: str) -> tuple[ModuleType, str]:
    if ":" not in spec:
        raise PartitionerError(f"model {spec!r}: expected FILE.py:FACTORY or package.module:FACTORY, "
                               "e.g. examples/gpt.py:gpt_small")
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py") or "/" in where:
        path = Path(where)
        if not path.is_file():
            raise PartitionerError(f"model {spec!r}: file {where} does not exist")
        # Let the file import its siblings and its package (examples/gpt.py -> examples.gpt).
        root = str(path.resolve().parent.parent)
        if root not in sys.path:
            sys.path.insert(0, root)
        modname = f"{path.resolve().parent.name}.{path.stem}" if (path.parent / "__init__.py").exists() else path.stem
        try:
            module = importlib.import_module(modname)
        except ImportError:
            loader_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise PartitionerError(f"model {spec!r}: cannot import {where}: {exc}") from exc
    return module, name


def load_model(spec: str, *, device: str | None = None, batch_size: int = 2) -> tuple[torch.nn.Module, tuple[Any, ...], ModuleType]:
    """(model, example inputs, the module it came from)."""
    module, name = load_module(spec)
    if not hasattr(module, name):
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        raise PartitionerError(f"model {spec!r}: {module.__name__} has no {name!r}; callables there: {', '.join(names)}")
    obj = getattr(module, name)
    with torch.device(device) if device else _nullcontext():
        model = obj if isinstance(obj, torch.nn.Module) else obj()
    if not isinstance(model, torch.nn.Module):
        raise PartitionerError(f"model {spec!r}: {name}() returned {type(model).__name__}, not a torch.nn.Module")
    if hasattr(module, "example_batch"):
        inputs = tuple(module.example_batch(model, batch_size))
    elif hasattr(module, "example_inputs"):
        inputs = tuple(module.example_inputs(model, batch_size=batch_size))
    else:
        raise PartitionerError(f"model {spec!r}: {module.__name__} defines no example_inputs(model, batch_size) "
                               "to trace with; add one returning a tuple of inputs")
    return model, inputs, module


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
