"""Where the generated code first differs from the module: plan.verify's diagnosis, run after a mismatch.

The end-to-end comparison (runtime.verify.check) says *that* something differs; an
error in block 1 changes every later activation and every earlier gradient,
so it cannot say *where*. Here each segment (the prefix, every block, the
suffix) is checked in isolation, on both sides:

- forward: every block gets the module's own input to that block (a forward
  pre-hook swaps it in), the suffix the module's last hidden state;
- backward: each segment's output gets the module's gradient of that output,
  segment by segment from the suffix back (every slice in the same order, so
  the tensor-parallel collectives of backward pair up).

The first segment in model order whose output, input gradient or parameter
gradients differ is the culprit. Inside a block whose forward differs, the
module's sub-modules that own parameters (Linear, LayerNorm, Embedding...)
are hooked, and the generated function's local values (named after the
exported graph's nodes) are read with a line tracer; the first sub-module,
in execution order, whose output no generated value reproduces (shards put
back together along any split dim) is named, with the nearest generated node.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from runtime.pipeline.tensor_parallel import unshard_parameter
from runtime.pipeline.vocab_logits import VocabSplitLogits, full_logits
from runtime.verify.compare import Diff, compare, gathered_grads, leaves
from runtime.verify.no_randomness import NoRandomness
from runtime.verify.run import Setup, call_module, on_slices, zero_grads

__all__ = ["locate"]

_SHOWN = 4  # differing gradients listed per segment
# matching a sub-module's output with a generated value: same inputs on both sides, so only
# reordering roundoff separates them; a hint, so a little looser than the verdict
_MATCH_RTOL, _MATCH_ATOL = 1e-4, 1e-5


def locate(st: Setup, bad: list[Diff]) -> str:
    """The VerifyError message: a first line naming the place (the CLI shows only that line), then details."""
    stack = next(iter(st.ranks.values())).stage.stack
    try:
        headline, details = _isolate(st, stack)
    except Exception as exc:  # the diagnosis is a hint: never hide the verdict behind its failure
        headline, details = "(where could not be found)", f"Locating it failed: {type(exc).__name__}: {exc}"
    end_to_end = f"End to end, {len(bad)} comparisons differ, first: {bad[0]}" + \
        (f"; then {bad[1]}" if len(bad) > 1 else "") + "."
    return (f"plan.verify: the generated programs (pp{st.facts.pp} tp{st.facts.tp}, {st.num_stages} stages) differ "
            f"from the module, {headline}\n{end_to_end}\n{details}\nFix the code generation there (partitioner "
            "segments / segment_tp / codegen_pipeline); to launch anyway pass verify=False (--no-verify).")


# ---- the isolated runs -----------------------------------------------------------------------


def _blocks_of(model: nn.Module, stack: str | None) -> nn.Module | None:
    return model.get_submodule(stack) if stack is not None else None


def _hidden(args: tuple, kwargs: dict) -> tuple[torch.Tensor, Any]:
    """The hidden state a block is called with, and how to put a replacement back."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0], lambda new: ((new, *args[1:]), kwargs)
    key = "hidden_states" if "hidden_states" in kwargs else next(k for k, v in kwargs.items()
                                                                  if isinstance(v, torch.Tensor))
    return kwargs[key], lambda new: (args, {**kwargs, key: new})


def _first(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[0]


def _with_first(out: Any, new: torch.Tensor) -> Any:
    return new if isinstance(out, torch.Tensor) else type(out)((new, *out[1:]))


class _State:
    """The segment a run is in: "prefix", a block index, or "suffix" (set by the block hooks)."""

    def __init__(self) -> None:
        self.segment: Any = "prefix"


class _Cut:
    """Hooks that cut one model at each of its blocks: inputs swapped for leaves (the module's own values,
    or `feed`'s), outputs recorded; the last block's output swapped for a leaf too (`last`'s value)."""

    def __init__(self, blocks: nn.Module | None, indices: list[int], n: int, state: _State,
                 feed: dict[int, torch.Tensor] | None = None, last: torch.Tensor | None = None):
        self.ins: dict[int, torch.Tensor] = {}   # block input leaves
        self.outs: dict[int, torch.Tensor] = {}  # block outputs (the hidden state)
        self.prefix_out: torch.Tensor | None = None
        self.last_leaf: torch.Tensor | None = None  # the suffix's input leaf
        self.handles = []
        for i in indices if blocks is not None else ():
            def pre(mod, args, kwargs, i=i):
                h, put = _hidden(args, kwargs)
                if i == 0:
                    self.prefix_out = h
                src = feed[i] if feed is not None else h
                self.ins[i] = src.detach().clone().requires_grad_(h.is_floating_point())
                state.segment = i
                return put(self.ins[i])

            def post(mod, args, kwargs, out, i=i):
                self.outs[i] = _first(out)
                if i != n - 1:
                    return None
                state.segment = "suffix"
                src = last if last is not None else _first(out)
                self.last_leaf = src.detach().clone().requires_grad_(True)
                return _with_first(out, self.last_leaf)

            self.handles.append(blocks[i].register_forward_pre_hook(pre, with_kwargs=True))
            self.handles.append(blocks[i].register_forward_hook(post, with_kwargs=True))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class _Cuts:
    """The cuts of one tensor slice's pipeline ranks (or of the module), read as one."""

    def __init__(self, cuts: list[_Cut]):
        self.cuts = cuts

    def remove(self) -> None:
        for c in self.cuts:
            c.remove()

    def input(self, seg: Any) -> torch.Tensor | None:
        """The leaf a segment starts from (None for the prefix: the model inputs)."""
        if seg == "suffix":
            return next((c.last_leaf for c in self.cuts if c.last_leaf is not None), None)
        return next((c.ins[seg] for c in self.cuts if seg in c.ins), None)

    def output(self, seg: Any) -> torch.Tensor | None:
        if seg == "prefix":
            return next((c.prefix_out for c in self.cuts if c.prefix_out is not None), None)
        return next((c.outs[seg] for c in self.cuts if seg in c.outs), None)


def _owned_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if n and any(p is not None for p in m._parameters.values())]


def _backward(cuts: _Cuts, seg: Any, n: int, loss: torch.Tensor, grad_in: dict[Any, torch.Tensor | None]
              ) -> torch.Tensor | None:
    """Backward of one segment from `grad_in` (the gradient of the next segment's input); its input's gradient."""
    if seg == "suffix":
        loss.backward()
    else:
        y = cuts.output(seg)
        nxt = 0 if seg == "prefix" else (seg + 1 if seg + 1 < n else "suffix")
        g = grad_in.get(nxt)
        if y is not None and y.requires_grad and g is not None:
            y.backward(g)
    leaf = cuts.input(seg)
    return None if leaf is None or leaf.grad is None else leaf.grad.clone()


def _reference(st: Setup, stack: str | None, n: int) -> dict[str, Any]:
    """The module cut at every block: per segment its values, parameter and input gradients, and its
    sub-modules' outputs in execution order."""
    zero_grads(st)
    ref, state = st.reference, _State()
    cuts = _Cuts([_Cut(_blocks_of(ref, stack), list(range(n)), n, state)])
    subs: dict[Any, list[tuple[str, torch.Tensor]]] = {}
    handles = []
    for name, mod in _owned_modules(ref):
        def hook(m, args, out, name=name):
            if isinstance(out, torch.Tensor) or (isinstance(out, (tuple, list)) and out
                                                 and isinstance(out[0], torch.Tensor)):
                seg, inside = state.segment, f"{stack}.{state.segment}."
                rel = name[len(inside):] if name.startswith(inside) else name  # relative to its block
                subs.setdefault(seg, []).append((rel, _first(out).detach().clone()))
        handles.append(mod.register_forward_hook(hook))
    grads: dict[Any, dict[str, torch.Tensor]] = {}
    in_grads: dict[Any, torch.Tensor | None] = {}
    try:
        with NoRandomness():
            out = call_module(ref, st.inputs)
            loss = st.loss(out)
            for seg in _order(stack, n)[::-1]:
                in_grads[seg] = _backward(cuts, seg, n, loss, in_grads)
                grads[seg] = {k: p.grad.clone() for k, p in ref.named_parameters() if p.grad is not None}
                zero_grads(st)
    finally:
        cuts.remove()
        for h in handles:
            h.remove()
    return {"cuts": cuts, "out": out, "loss": loss.detach(), "grads": grads, "in_grads": in_grads, "subs": subs}


def _order(stack: str | None, n: int) -> list[Any]:
    """The segments in model order."""
    return ["prefix", *range(n), "suffix"] if stack is not None else ["suffix"]


def _piece(st: Setup, x: torch.Tensor | None, t: int) -> torch.Tensor | None:
    """Slice t's part of a hidden state at a cut: all of it, or under sequence parallelism its tokens."""
    d = st.facts.cut_dim
    return x if x is None or d is None else x.chunk(st.facts.tp, d)[t]


def _gen_forward(st: Setup, stack: str | None, n: int, ref: dict[str, Any], t: int) -> dict[str, Any]:
    """Slice t's stages with every block fed the module's input, the generated functions' values traced by name."""
    rc: _Cuts = ref["cuts"]
    feed = {i: _piece(st, rc.input(i), t) for i in range(n)}
    state = _State()
    mine = [rk for (_, tt), rk in sorted(st.ranks.items()) if tt == t and stack is not None]
    cuts = _Cuts([_Cut(_blocks_of(rk.stage.module, stack),
                       sorted(i for a, b, _, _ in rk.stage.stages.values() for i in range(a, b)), n, state, feed,
                       _piece(st, rc.input("suffix"), t)) for rk in mine])
    traced: dict[Any, dict[str, torch.Tensor]] = {}

    def local(frame, event, arg):
        if event in ("line", "return"):
            rec = traced.setdefault(state.segment, {})
            code = frame.f_code
            args = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
            for k, v in frame.f_locals.items():
                if isinstance(v, torch.Tensor) and k not in rec and k not in args:
                    # vocab-split logits as the slice they are, as the other split values: read outside the thread
                    rec[k] = (v.to_local() if isinstance(v, VocabSplitLogits) else v).detach().clone()
        return local

    def tracer(frame, event, arg):  # only the generated functions: verify_run compiles them under this file name
        return local if frame.f_code.co_filename.startswith("<program of rank") else None

    x = None
    previous = sys.gettrace()  # a coverage tool's or debugger's, put back after
    sys.settrace(tracer)
    try:
        for s in range(st.num_stages):
            a, b, _, _ = st.stage_of(s, t).stages[s]
            # the module's hidden state where the stage starts (a block's pre-hook swaps it in anyway)
            src = None if s == 0 else x if stack is None else _piece(st, rc.input(a) if b > a else rc.input("suffix"), t)
            x = st.stage_of(s, t).stage_callable(s)(None if src is None else src.detach().clone().requires_grad_(),
                                                   st.inputs)
    finally:
        sys.settrace(previous)
        cuts.remove()
    loss = st.loss(x)
    with torch.no_grad():  # vocab-split logits gathered in the slice's thread: they are compared outside it
        x = full_logits(x)
    return {"cuts": cuts, "out": x, "loss": loss, "traced": traced}


def _isolate(st: Setup, stack: str | None) -> tuple[str, str]:
    n = len(_blocks_of(st.reference, stack)) if stack is not None else 0
    ref = _reference(st, stack, n)
    fwd = on_slices(st, lambda t: _gen_forward(st, stack, n, ref, t))
    names = [name for name, _ in st.reference.named_parameters()]
    seg_grads: dict[Any, tuple[dict[str, torch.Tensor | None], list[Diff]]] = {}
    in_grads: dict[Any, list[torch.Tensor | None]] = {}
    for seg in _order(stack, n)[::-1]:
        in_grads[seg] = on_slices(st, lambda t, seg=seg: _backward(
            fwd[t]["cuts"], seg, n, fwd[t]["loss"], {k: _piece(st, g, t) for k, g in ref["in_grads"].items()}))
        seg_grads[seg] = gathered_grads(st, names)
        zero_grads(st)
    for seg in _order(stack, n):
        verdict = _segment_verdict(st, stack, seg, ref, fwd, *seg_grads[seg], in_grads[seg])
        if verdict is not None:
            return verdict
    return ("though no single segment does on its own", "Fed the module's own values, every segment (prefix, each "
            "block, suffix) matches on its own: the differences come from how the segments are joined (the hidden "
            "state handed between stages, tied parameters' gradients summed over their holders), or accumulate "
            "over the layers beyond rtol.")


# ---- verdicts --------------------------------------------------------------------------------


def _label(st: Setup, stack: str | None, seg: Any) -> str:
    if stack is None:
        return "the model (no layer stack: one segment)"
    if isinstance(seg, int):
        s = next(s for s in range(st.num_stages) if seg in range(*st.stage_of(s, 0).stages[s][:2]))
        return f"block {stack}.{seg} (virtual stage {s}, pipeline rank {st.stage_pp[s]})"
    s = 0 if seg == "prefix" else st.num_stages - 1
    return f"the {seg} (the code {'before' if seg == 'prefix' else 'after'} {stack}; virtual stage {s}, " \
           f"pipeline rank {st.stage_pp[s]})"


def _segment_verdict(st: Setup, stack: str | None, seg: Any, ref: dict[str, Any], fwd: list[dict[str, Any]],
                     grads: dict[str, torch.Tensor | None], disagree: list[Diff],
                     in_grads: list[torch.Tensor | None]) -> tuple[str, str] | None:
    """(headline, details) when segment `seg` differs on its own; None when it matches."""
    tol = dict(rtol=st.rtol, atol=st.atol)
    forward: list[Diff] = []
    for t, f in enumerate(fwd):
        if seg == "suffix":
            want, got = leaves(ref["out"]), leaves(f["out"])
            forward += [compare(f"model output {i} (tensor slice {t})", a, b, **tol) for i, (a, b) in
                        enumerate(zip(got, want))]
            forward.append(compare(f"loss (tensor slice {t})", f["loss"], ref["loss"], **tol))
        else:
            forward.append(compare(f"output (tensor slice {t})", f["cuts"].output(seg),
                                   _piece(st, ref["cuts"].output(seg), t), **tol))
    forward = [d for d in forward if not d.ok]
    ref_grads = ref["grads"][seg]
    params = [compare(f"gradient of {name}", g, ref_grads.get(name), **tol)
              for name, g in grads.items() if g is not None or name in ref_grads]
    params = [d for d in params if not d.ok] + [d for d in disagree if not d.ok]
    want_in = ref["in_grads"].get(seg)
    inputs = [d for t, g in enumerate(in_grads)
              for d in [compare(f"gradient of its input (tensor slice {t})", g, _piece(st, want_in, t), **tol)]
              if not d.ok and want_in is not None]
    if not (forward or params or inputs):
        return None
    where = _label(st, stack, seg)
    lines = []
    if forward:
        path, inside = _inside(seg, ref, fwd)
        headline = f"first in the forward of {where}" + (f", at sub-module {path}" if path else "") + \
            f" (fed the module's own input there): {forward[0]}"
        lines.append(f"The forward of {where}, fed the module's own input, differs: {forward[0]}.")
        if inside:
            lines.append(inside)
    else:
        first = (params or inputs)[0]
        headline = f"first in the backward of {where} (its forward matches): {first}"
        lines.append(f"The forward of {where} matches the module; its backward, given the module's gradient of "
                     "its output, does not.")
    if params:
        shown = "; ".join(str(d) for d in params[:_SHOWN]) + (f"; and {len(params) - _SHOWN} more" if
                                                               len(params) > _SHOWN else "")
        lines.append(f"Parameters whose gradients differ there, first in model order: {shown}.")
    if inputs:
        lines.append(f"The gradient it passes back to its input differs too: {inputs[0]}.")
    return headline, "\n".join(lines)


def _inside(seg: Any, ref: dict[str, Any], fwd: list[dict[str, Any]]) -> tuple[str, str]:
    """(path, sentence) of the first sub-module (owning parameters) whose output no generated value reproduces,
    with the nearest generated node; ("", "") when every one is reproduced."""
    subs = ref["subs"].get(seg, [])
    per_slice = [f["traced"].get(seg, {}) for f in fwd]
    names = [k for k in per_slice[0] if all(k in s for s in per_slice)]
    if not subs or not names:
        return "", ""
    cands = [(k, c) for k in names for c in _candidates([s[k] for s in per_slice])]
    last = -1
    for path, want in subs:
        hits = [j for j, (_, c) in enumerate(cands) if c.shape == want.shape and
                torch.allclose(c, want, rtol=_MATCH_RTOL, atol=_MATCH_ATOL)]
        if hits:
            last = max(last, min(hits))
            continue
        same = [(j, k, c) for j, (k, c) in enumerate(cands) if c.shape == want.shape]
        after = [x for x in same if x[0] > last] or same
        near = ""
        if after:
            j, k, c = min(after, key=lambda x: float((x[2] - want).abs().max()))
            near = f" (nearest generated value: node `{k}`, max abs error {float((c - want).abs().max()):.3g})"
        return path, (f"Inside it, sub-module {path} is the first (in execution order) whose output the generated "
                      f"code does not reproduce{near}.")
    return "", ""


def _candidates(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """A traced value as the module would hold it: slice 0's, or the slices' shards put back together along
    each dim they could be split on (fused in 1, 2 or 3 chunks)."""
    out = [values[0]]
    if len(values) > 1 and all(v.shape == values[0].shape for v in values) and values[0].dim() > 0:
        for d in range(values[0].dim()):
            for fused in (1, 2, 3):
                if values[0].shape[d] % fused == 0:
                    try:
                        out.append(unshard_parameter(values, f"S({d})", fused))
                    except ValueError:
                        pass
    return out
