"""CUDA-event timing shared by the GPU benchmarks (bench/fp8_gemm.py, bench/compression.py).

Each benchmark imports it from its own folder (a script's folder is first on sys.path), so it needs no
package. Times are seconds per call on the current stream, measured between two recorded events after a
few warm-up calls; the caller reduces them (the median, or the best).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["cuda_seconds"]


def cuda_seconds(fn: Callable[[], Any], reps: int = 20, warmup: int = 5) -> list[float]:
    """Seconds of each of `reps` calls of fn() on the current CUDA stream, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return out
