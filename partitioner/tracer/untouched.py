"""A trace leaves the user's module as it found it: the hooks and attributes a traced forward adds come off again.

Why it must be put back, not just left alone: a Hugging Face model (transformers 5) installs its output-capturing
forward hooks lazily, on the first forward that records something (`output_router_logits`, `output_hidden_states`),
and marks the model as hooked. The tracer runs forwards of the user's module and of shallow copies of it
(`blocks.truncated`, `block_kinds.recording`), and a shallow copy shares the user's hook dicts. So tracing the first
blocks installed hooks on the user's blocks while the mark went on the copy, and the next forward installed them
again: each of those blocks then recorded its router logits twice, in the traced graph and in the user's own eager
model afterwards (a Mixtral of 6 layers returned 9 router logits after `compile`, and its load-balancing loss moved).

`untouched(model)` snapshots, for every module reachable from `model`, its hook dicts and its attributes, and puts
them back on exit: each forward the tracer runs starts from the user's state, and ends leaving it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.nn as nn

__all__ = ["untouched"]


def _hook_dicts(module: nn.Module) -> dict[str, dict]:
    """The module's hook registries (`_forward_hooks`, `_forward_pre_hooks`, ...: every dict whose name says hook)."""
    return {k: v for k, v in vars(module).items() if "hook" in k and isinstance(v, dict)}


@contextlib.contextmanager
def untouched(model: nn.Module) -> Iterator[None]:
    """Run the body, then give every module of `model` back its hooks and attributes as they were.

    A hook dict is restored in place (a shallow copy shares it with the module it was copied from, and both must see
    the same hooks); an attribute added is removed, one rebound is bound back."""
    saved = []
    for m in model.modules():
        hooks = {name: dict(d) for name, d in _hook_dicts(m).items()}
        saved.append((m, dict(vars(m)), hooks))
    try:
        yield
    finally:
        for m, attrs, hooks in saved:
            state = vars(m)
            for key in [k for k in state if k not in attrs]:
                del state[key]
            for key, value in attrs.items():
                if key not in state or state[key] is not value:
                    state[key] = value
            for name, before in hooks.items():
                now = state[name]
                if now.keys() != before.keys():
                    now.clear()
                    now.update(before)
