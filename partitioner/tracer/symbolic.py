"""Costs as polynomials in the microbatch size `b` and sequence length `s`.

One trace serves every candidate plan: the tracer marks the batch (and, for
token inputs, the sequence) dimension symbolic, so every shape, FLOP and byte
count it derives is a sympy expression in those symbols. Sympy is too slow to
evaluate inside the planner's search, so each expression is lowered once into
a `Poly`: frozen, hashable, JSON-able, evaluated with plain arithmetic.

>>> p = Poly.from_terms({(1, 2): 4.0, (1, 1): 24.0})   # 4*b*s^2 + 24*b*s
>>> p(b=2, s=3)
216.0
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import sympy

__all__ = ["Poly", "B", "S", "DataDependentSize", "to_poly"]

B = sympy.Symbol("b", positive=True, integer=True)
S = sympy.Symbol("s", positive=True, integer=True)

Monomial = tuple[int, int]  # (power of b, power of s)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Poly:
    """sum(coef * b**i * s**j) over `terms`, sorted by monomial, no zero coefficients."""

    terms: tuple[tuple[Monomial, float], ...] = ()

    @staticmethod
    def from_terms(terms: Mapping[Monomial, float]) -> "Poly":
        return Poly(terms=tuple(sorted((m, float(c)) for m, c in terms.items() if c != 0)))

    @staticmethod
    def const(value: float) -> "Poly":
        return Poly.from_terms({(0, 0): value})

    def __call__(self, b: float = 1, s: float = 1) -> float:
        return sum(c * b**i * s**j for (i, j), c in self.terms)

    def __add__(self, other: "Poly | float") -> "Poly":
        if not isinstance(other, Poly):
            other = Poly.const(other)
        acc = dict(self.terms)
        for m, c in other.terms:
            acc[m] = acc.get(m, 0.0) + c
        return Poly.from_terms(acc)

    __radd__ = __add__

    def __mul__(self, k: "Poly | float") -> "Poly":
        if isinstance(k, Poly):  # polynomial product: a shape's dims multiply to its numel
            acc: dict[Monomial, float] = {}
            for (i, j), c in self.terms:
                for (p, q), e in k.terms:
                    acc[(i + p, j + q)] = acc.get((i + p, j + q), 0.0) + c * e
            return Poly.from_terms(acc)
        return Poly.from_terms({m: c * k for m, c in self.terms})

    __rmul__ = __mul__

    @property
    def batch_degree(self) -> int:
        return max((i for (i, _), _ in self.terms), default=0)

    def __str__(self) -> str:
        if not self.terms:
            return "0"
        parts = []
        for (i, j), c in reversed(self.terms):
            sym = "*".join(x for x in ("b" if i == 1 else f"b^{i}" if i else "", "s" if j == 1 else f"s^{j}" if j else "") if x)
            parts.append(sym if sym and c == 1 else f"{c:.4g}" + (f"*{sym}" if sym else ""))
        return " + ".join(parts)

    def to_json(self) -> list:
        return [[i, j, c] for (i, j), c in self.terms]

    @staticmethod
    def from_json(data: list) -> "Poly":
        return Poly.from_terms({(int(i), int(j)): float(c) for i, j, c in data})


class DataDependentSize(ValueError):
    """A size that depends on the tensor values (export's unbacked symbols u0, u1, ...), not on b and s."""

    def __init__(self, symbols: list[str]) -> None:
        super().__init__(", ".join(symbols))
        self.symbols = symbols


def to_poly(expr: "sympy.Expr | int | float", *, s_value: int) -> Poly:
    """Lower a sympy expression in B and S to a Poly.

    An expression that is not polynomial in S (a model computing `s // 2`,
    say) is specialised at the traced sequence length `s_value`, so it stays
    exact for that length; batch must stay polynomial, since every op on a
    batch of independent samples is.
    """
    expr = sympy.sympify(expr)
    if expr.is_number:
        return Poly.const(float(expr))
    unknown = expr.free_symbols - {B, S}
    if unknown:  # an unbacked size (torch.where, nonzero, a boolean mask): no polynomial in b and s
        raise DataDependentSize(sorted(str(u) for u in unknown))
    try:
        p = sympy.Poly(expr, B, S)
    except sympy.PolynomialError:
        p = sympy.Poly(expr.subs(S, s_value), B, S)
    return Poly.from_terms({m: float(c) for m, c in p.terms()})
