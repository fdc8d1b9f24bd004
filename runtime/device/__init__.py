"""The rank's device: where every tensor a program trains with lives, and the audit that proves it.

- `placement.py` (read first): the one device per rank (`rank_device`, set once at start-up by the
  launcher: `cuda:LOCAL_RANK` under NCCL, `cpu` under Gloo), and the one way the runtime puts things there
  (`place`, `place_module`, `empty_on`); `synchronize` before a clock is read.
- `audit.py`: `device_audit()`, a test mode that fails on any op mixing a tensor the runtime placed with
  one it never placed (a factory without `device=`, a batch not moved), naming the op and the line: the
  proof, on CPU, that the same code puts nothing on the wrong device of a GPU.
- `host_memory.py`: `keep_freed_host_memory()`, called once at the start of a rank that computes on the CPU:
  glibc keeps the memory a step frees for the next step, as the CUDA caching allocator does on a GPU.

The bottom of the runtime: it imports only torch (and cost_models' base error).
"""

from runtime.device.host_memory import keep_freed_host_memory
from runtime.device.placement import (
    DeviceError,
    check_device,
    place,
    place_module,
    placing_on,
    rank_device,
    set_rank_device,
    synchronize,
)

__all__ = ["DeviceError", "check_device", "keep_freed_host_memory", "place", "place_module", "placing_on",
           "rank_device", "set_rank_device", "synchronize"]
