"""A rank's experts run on its received tokens, grouped by expert: one matmul chain per local expert.

`ep_moe` calls `local_experts_fn(tokens, counts)` with tokens (N, H) sorted by local expert and counts
(E_local,) summing to N (rows counts[0] go to the rank's first expert, and so on); it returns (N, H_out),
row for row. Two bodies:

- `batched_experts(gate_up_proj, down_proj)`: expert weights batched `[E_local, ...]` as Hugging Face's
  MoE classes keep them (Mixtral, Qwen3-MoE, DeepSeek-V3: `gate_up_proj` (E, 2I, H) with the gate rows
  first, `down_proj` (E, H, I)); each expert computes down(act(gate(x)) * up(x)), SiLU by default, or
  another gated unit of the two (`gated`: GPT-OSS's and MiniMax-M3's, clamped, interleaved, with biases);
- `module_experts(modules)`: a list of expert nn.Modules (a ModuleList of MLPs), each called on its rows.

An expert that receives no tokens runs on zero rows: its output is empty and its weights' gradient zero,
as in one process, and every rank still takes part in the collectives around it.

>>> E, I, H = 2, 3, 4
>>> gate_up, down = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
>>> fn = batched_experts(gate_up, down)
>>> fn(torch.randn(5, H), torch.tensor([2, 3])).shape     # 2 rows to expert 0, 3 to expert 1
torch.Size([5, 4])
>>> fn(torch.randn(0, H), torch.tensor([0, 0])).shape     # nothing routed here
torch.Size([0, 4])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LocalExpertsFn", "batched_experts", "gated", "module_experts"]

# tokens (N, H) sorted by local expert, counts (E_local,) -> outputs (N, H_out)
LocalExpertsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _splits(tokens: torch.Tensor, counts: torch.Tensor, n_experts: int) -> list[torch.Tensor]:
    sizes = [int(c) for c in counts.tolist()]
    if len(sizes) != n_experts or sum(sizes) != tokens.shape[0]:
        raise ValueError(f"counts {sizes} for {n_experts} local experts and {tokens.shape[0]} tokens: give one "
                         f"count per local expert, summing to the tokens' rows")
    return list(torch.split(tokens, sizes))


def gated(h: torch.Tensor, *, act: Callable[[torch.Tensor], torch.Tensor] = F.silu, glu: str = "silu",
          alpha: float = 1.0, limit: float | None = None, interleaved: bool = False) -> torch.Tensor:
    """An expert's gated unit of its gate_up projection h (..., 2I) -> (..., I).

    gate and up: the two halves of h, or (interleaved, GPT-OSS) its even and odd columns; with `limit`, the gate
    clamped to at most limit and up to [-limit, limit] first (DeepSeek-V4's and GPT-OSS's swiglu_limit). Then
    glu "silu": act(gate) * up (SwiGLU, act SiLU: Mixtral, Qwen3-MoE, DeepSeek-V3); "sigmoid": gate * sigmoid(alpha
    * gate) * (up + 1) (GPT-OSS and MiniMax-M3, alpha their swiglu_alpha).

    >>> h = torch.tensor([[1.0, -2.0, 3.0, 4.0]])
    >>> gated(h, glu="sigmoid", alpha=0.0, interleaved=True)   # gate (1, 3), up (-2, 4): gate / 2 * (up + 1)
    tensor([[-0.5000,  7.5000]])
    """
    gate, up = (h[..., ::2], h[..., 1::2]) if interleaved else h.chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    if glu == "silu":
        return act(gate) * up
    if glu == "sigmoid":
        return gate * torch.sigmoid(gate * alpha) * (up + 1)
    raise ValueError(f"glu={glu!r}: an expert's gated unit is 'silu' (act(gate) * up) or 'sigmoid' (gate * "
                     "sigmoid(alpha * gate) * (up + 1))")


def batched_experts(gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                    act: Callable[[torch.Tensor], torch.Tensor] = F.silu, limit: float | None = None, *,
                    glu: str = "silu", alpha: float = 1.0, interleaved: bool = False,
                    gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None) -> LocalExpertsFn:
    """This rank's experts from batched weights: gate_up_proj (E_local, 2I, H), down_proj (E_local, H, I), and
    where the model has them their biases (E_local, 2I) and (E_local, H); each expert computes
    down(gated(gate_up(x))) (`gated` with act, glu, alpha, limit and interleaved).

    Pass the rank's slice of the full `[E, ...]` parameters (experts `dispatch.local_experts(rank, ep, E)`),
    or leaves of those shapes that the rank owns; gradients flow into whichever is passed."""
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3 or gate_up_proj.shape[0] != down_proj.shape[0] \
            or gate_up_proj.shape[1] != 2 * down_proj.shape[2] or gate_up_proj.shape[2] != down_proj.shape[1]:
        raise ValueError(f"batched experts take gate_up_proj (E, 2I, H) and down_proj (E, H, I); got "
                         f"{tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)}: pass Hugging Face's "
                         f"experts.gate_up_proj and experts.down_proj (sliced to this rank's experts on dim 0)")

    def bias(b: torch.Tensor | None, e: int) -> torch.Tensor | None:
        return None if b is None else b[e]

    def run(tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        outs = []
        for e, rows in enumerate(_splits(tokens, counts, gate_up_proj.shape[0])):
            h = F.linear(rows, gate_up_proj[e], bias(gate_up_bias, e))                             # (n_e, 2I)
            unit = gated(h, act=act, glu=glu, alpha=alpha, limit=limit, interleaved=interleaved)  # (n_e, I)
            outs.append(F.linear(unit, down_proj[e], bias(down_bias, e)))                          # (n_e, H)
        return torch.cat(outs)                                                                     # (N, H)

    return run


def module_experts(modules: Sequence[nn.Module | Callable[[torch.Tensor], torch.Tensor]]) -> LocalExpertsFn:
    """This rank's experts as modules (its slice of a ModuleList of identical MLPs), or any callables from
    (n, H) rows to (n, H_out), each on its own rows."""
    modules = list(modules)
    if not modules:
        raise ValueError("module_experts got no modules: pass this rank's experts (E / ep of them, at least one)")

    def run(tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return torch.cat([m(rows) for m, rows in zip(modules, _splits(tokens, counts, len(modules)))])

    return run
