"""Frozen dataclasses <-> JSON, driven by their type hints.

Plans are saved as JSON, never pickle: this turns a tree of frozen
dataclasses, tuples, mappings, enums and Polys into plain JSON values and
back, exactly (`decode(T, encode(x)) == x`), raising `PlanFormatError`
naming the path of the first value that does not fit its declared type.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from typing import Any, Literal, Union

from cost_models.errors import PartitionerError
from partitioner.planner.schedule import Schedule
from partitioner.tracer.symbolic import Poly

__all__ = ["encode", "decode", "PlanFormatError"]


class PlanFormatError(PartitionerError):
    """A plan file whose content does not match the plan format."""


def encode(x: Any) -> Any:
    if isinstance(x, Schedule):
        return str(x)  # the compact instruction lists ("0F0 0SEND_F0 ..."), which Schedule.parse reads back
    if isinstance(x, Poly):
        return x.to_json()
    if dataclasses.is_dataclass(x):
        # a field added after plans were written may be left out at its default, so older plans keep their hashes
        return {f.name: encode(getattr(x, f.name)) for f in dataclasses.fields(x) if f.metadata.get("json", True)
                and not (f.metadata.get("omit_default") and getattr(x, f.name) == f.default)}
    if isinstance(x, enum.Enum):
        return x.value
    if isinstance(x, (tuple, list)):
        return [encode(v) for v in x]
    if isinstance(x, typing.Mapping):
        return {str(k): encode(v) for k, v in x.items()}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"cannot encode {type(x).__name__} in a plan")


def decode(tp: Any, data: Any, path: str = "plan") -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return data
    if origin in (Union, types.UnionType):
        if data is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return decode(a, data, path)
            except PlanFormatError as e:
                errors.append(str(e))
        raise PlanFormatError(errors[0] if errors else f"{path}: unexpected null")
    if origin is Literal:
        if data not in args:
            raise PlanFormatError(f"{path}: {repr(data)[:80]} is not one of {list(args)}")
        return data
    if tp is Schedule:
        _check(isinstance(data, str), path, "a schedule in its compact text form", data)
        try:
            return Schedule.parse(data)
        except ValueError as e:
            raise PlanFormatError(f"{path}: {e}") from None
    if tp is Poly:
        _check(isinstance(data, list) and all(isinstance(t, list) and len(t) == 3 and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in t) for t in data),
            path, "a polynomial [[i, j, coef], ...]", data)
        return Poly.from_json(data)
    if dataclasses.is_dataclass(tp):
        _check(isinstance(data, dict), path, f"an object ({tp.__name__})", data)
        hints = typing.get_type_hints(tp)
        fields = {f.name: f for f in dataclasses.fields(tp) if f.init and f.metadata.get("json", True)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise PlanFormatError(f"{path}: unknown field(s) {unknown} in {tp.__name__}; expected {sorted(fields)}")
        kwargs = {}
        for name, f in fields.items():
            if name not in data:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise PlanFormatError(f"{path}: missing field {name!r} of {tp.__name__}")
                continue
            kwargs[name] = decode(hints[name], data[name], f"{path}.{name}")
        try:
            return tp(**kwargs)
        except (TypeError, ValueError) as e:
            raise PlanFormatError(f"{path}: invalid {tp.__name__}: {e}") from e
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(data)
        except ValueError:
            raise PlanFormatError(f"{path}: {repr(data)[:80]} is not one of {[m.value for m in tp]}") from None
    if origin is tuple:
        _check(isinstance(data, list), path, "a list", data)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(decode(args[0], v, f"{path}[{i}]") for i, v in enumerate(data))
        _check(len(data) == len(args), path, f"a list of {len(args)}", data)
        return tuple(decode(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, data)))
    if origin in (dict, typing.Mapping) or (origin is not None and origin.__name__ == "Mapping"):
        _check(isinstance(data, dict), path, "an object", data)
        kt, vt = args if args else (str, Any)
        return {decode(kt, k, path): decode(vt, v, f"{path}[{k!r}]") for k, v in data.items()}
    if tp is float:
        _check(isinstance(data, (int, float)) and not isinstance(data, bool), path, "a number", data)
        # an int beyond float's range (10**400) does not convert; NaN is never a value a plan holds
        _check(not isinstance(data, int) or abs(data) <= 1e308, path, "a number within float range", data)
        _check(not (isinstance(data, float) and math.isnan(data)), path, "a number, not NaN", data)
        return float(data)
    if tp is int:
        _check(isinstance(data, int) and not isinstance(data, bool), path, "an integer", data)
        return data
    if tp is bool:
        _check(isinstance(data, bool), path, "true or false", data)
        return data
    if tp is str:
        _check(isinstance(data, str), path, "a string", data)
        return data
    raise PlanFormatError(f"{path}: cannot decode type {tp}")


def _check(ok: bool, path: str, what: str, data: Any) -> None:
    if not ok:
        shown = repr(data)
        raise PlanFormatError(f"{path}: expected {what}, got {shown[:80]}")
