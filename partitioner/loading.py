"""Load a model named on the command line: `path/to/file.py:factory` or `pkg.module:factory`.

The factory is called with no arguments and returns an `nn.Module` (a module
attribute that already is an `nn.Module` is used as is). Example inputs come
from the module's `example_inputs(model, batch_size=...)` when it has one.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from cost_models.errors import PartitionerError
from runtime.launch.loading import load_object

__all__ = ["load_model", "load_module"]


def load_module(spec: str) -> tuple[ModuleType, str]:
    """(the module, the name) of `FILE.py:FACTORY` or `package.module:FACTORY`, loaded as
    runtime.launch.loading loads every spec (so a run of the same spec finds the same module)."""
    module, name, _ = load_object(spec, "model")
    return module, name


def load_model(spec: str, *, device: str | None = None, batch_size: int = 2) -> tuple[torch.nn.Module, tuple[Any, ...], ModuleType]:
    """(model, example inputs, the module it came from)."""
    module, name, obj = load_object(spec, "model")
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
