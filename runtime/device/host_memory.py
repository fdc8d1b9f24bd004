"""A CPU rank keeps the host memory it frees, for its next step to reuse (glibc's malloc, told once at start-up).

Every training step allocates and frees the same tensors: activations, the logits and their gradient, the
gradients themselves (zero_grad(set_to_none=True) frees them). glibc's malloc serves a large allocation from the
top of its heap or from a fresh mmap, and hands freed memory back to the kernel (an munmap, or a trim of the heap's
top once the free top passes its trim threshold); the next step takes the same memory back one page fault and one
zeroed 4 KiB page at a time. Its thresholds move with the program's history (a freed mmap raises them), so two
programs doing the same work can fault at twice the rate of each other. Measured on the pp2-gpipe row of
bench/runtime_3d.py (the example GPT, 8 MiB logits per microbatch): the last stage's rank regrew its heap by
~70 MiB a step in 8 MiB pieces, 17k page faults and ~35 ms of a 440 ms step. The CUDA caching allocator keeps freed
blocks for reuse on a GPU; `keep_freed_host_memory` asks glibc for the same on a rank that computes on the CPU:
allocations below 1 GiB come from the heap (not a fresh mmap each) and the heap is never trimmed, so a rank's
resident memory stays at its peak, as a caching allocator's does, and a step in steady state takes no new pages.

Left as the user set it: a process whose environment tunes malloc itself (any MALLOC_*_ variable, or
GLIBC_TUNABLES naming malloc) or preloads another allocator (LD_PRELOAD: jemalloc, tcmalloc, ...); any C library
but glibc. PARTITIONER_HOST_MALLOC=default leaves glibc's defaults too.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Mapping

__all__ = ["HOST_MALLOC", "keep_freed_host_memory"]

HOST_MALLOC = "PARTITIONER_HOST_MALLOC"  # "default": leave malloc as it is

# mallopt(3) parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int: 2 GiB of free top before a trim, in effect never
_MMAP_ABOVE = (2**30, 32 * 2**20)  # the largest glibc accepts: 1 GiB where it may, else its cap of 32 MiB


def _user_tuned(environ: Mapping[str, str]) -> str | None:
    """What in the environment already chooses the allocator or its settings, or None."""
    if environ.get(HOST_MALLOC, "") == "default":
        return f"{HOST_MALLOC}=default"
    tuned = sorted(k for k in environ if k.startswith("MALLOC_") and k.endswith("_"))
    if tuned:
        return tuned[0]
    if "malloc" in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    if environ.get("LD_PRELOAD", "").strip():
        return "LD_PRELOAD"
    return None


def keep_freed_host_memory(environ: Mapping[str, str] | None = None) -> str:
    """Tell glibc's malloc to keep freed memory in this process (the module docstring says why). Process-wide and
    for the rest of the process: call it once, at a rank's start, on ranks that compute on the CPU. Returns what
    it did, in words: "kept" or why it left malloc alone.

    >>> keep_freed_host_memory({"PARTITIONER_HOST_MALLOC": "default"})
    'left as set: PARTITIONER_HOST_MALLOC=default'
    """
    env = os.environ if environ is None else environ
    why = _user_tuned(env)
    if why is not None:
        return f"left as set: {why}"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return f"left as set: {platform.system()} {platform.libc_ver()[0] or 'libc'} is not glibc"
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError as exc:
        return f"left as set: libc.so.6 not loadable ({exc})"
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    if not libc.mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM):
        return "left as set: mallopt(M_TRIM_THRESHOLD) refused"
    if not any(libc.mallopt(_M_MMAP_THRESHOLD, size) for size in _MMAP_ABOVE):
        return "kept (heap never trimmed; mmap threshold left)"
    return "kept"
