"""The data-parallel engine's interface for a rank with no replicas (dp = 1) training in fp32.

A pipeline or tensor-parallel plan with dp = 1 has nothing to reduce across
replicas: gradients stay in each parameter's `.grad`, the optimizer steps
the parameters themselves, and no process group is needed. (With mixed
precision the `DataParallel` engine is used even at dp = 1: it keeps the
fp32 master weights.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from runtime.device import place_module, rank_device

__all__ = ["Unreplicated"]


class Unreplicated:
    """What `runtime.pipeline.runner.PipelineRunner` calls on `DataParallel`, for dp = 1."""

    zero_stage = 0

    def __init__(self, model: nn.Module):
        self.module = place_module(model)  # a no-op after StageModel placed it; a model run as it is needs it
        self._params = dict(model.named_parameters())

    def optimizer_params(self) -> list[nn.Parameter]:
        return [p for p in self._params.values() if p.requires_grad]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield

    def finish_gradients(self) -> None:
        pass

    @torch.no_grad()
    def grad_square_sum(self, weight: Callable[[str], float]) -> torch.Tensor:
        sq = torch.zeros((), dtype=torch.float64, device=rank_device())
        for n, p in self._params.items():
            if p.grad is not None:
                sq += weight(n) * torch.linalg.vector_norm(p.grad, dtype=torch.float64) ** 2
        return sq

    @torch.no_grad()
    def scale_grads_(self, coef: torch.Tensor) -> None:
        for p in self.optimizer_params():
            if p.grad is not None:
                p.grad.mul_(coef)

    def after_step(self) -> None:
        pass

    def copy_masters(self) -> None:
        pass  # fp32: the parameters are what the optimizer steps

    def unshard(self) -> None:
        pass  # nothing is sharded

    def reshard(self) -> None:
        pass

    def zero_grad(self) -> None:
        for p in self._params.values():
            p.grad = None

    def master_pieces(self) -> list[tuple[torch.Tensor, tuple[tuple[str, tuple[int, ...], int, int, int], ...]]]:
        """As DataParallel.master_pieces: every parameter holds itself whole."""
        return [(p, ((n, tuple(p.shape), 0, p.numel(), 0),)) for n, p in self._params.items()]

    def refresh_params(self) -> None:
        pass  # the parameters are what the optimizer steps

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().float().clone() if v.is_floating_point() else v.detach().clone()
                for k, v in self.module.state_dict().items()}

    def held_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        def total(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors if t is not None)

        params = total(self._params.values())
        grads = total(p.grad for p in self._params.values())
        state = total(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)) \
            if optimizer is not None else 0
        return {"params": params, "grads": grads, "optimizer": state, "total": params + grads + state}
