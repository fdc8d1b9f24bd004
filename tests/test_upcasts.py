"""The model's own upcasts to fp32 are told from casts to the parameters' dtype (partitioner.tracer.upcasts).

(Traced with rewrite_attention=False: by default the tracer fuses this RMSNorm into aten.rms_norm,
tests/test_norms.py, and its casts go with it; models whose norms are spelled otherwise keep them.)

Traced with fp32 parameters, an RMSNorm's `x.to(torch.float32)` and its `.to(input_dtype)` are the same op; the
tracer exports again with fp64 parameters and keeps as fp32 the casts that still name fp32. Trained under
fp16-mixed on CPU ranks, a Llama's pipeline and tensor plans then train like one process
(tests/test_precision_runs.py); here, the marks, the rewired reads and the generated code.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from partitioner import compile, trace
from partitioner.tracer.cache import load_trace, save_trace
from partitioner.tracer.upcasts import cast_dtype, is_upcast


class Norm(nn.Module):
    """RMSNorm as Hugging Face writes it: statistics in fp32, the result in the input's dtype."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(dtype)


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm, self.fc = Norm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(self.norm(x))  # the residual reads x, which the norm's no-op upcast returned at fp32


class Toy(nn.Module):
    def __init__(self, d: int = 16, layers: int = 4, vocab: int = 64, fp64_branch: bool = False):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.norm, self.head = Norm(d), nn.Linear(d, vocab)
        self.fp64_branch = fp64_branch

    def forward(self, idx):
        x = self.emb(idx)
        if self.fp64_branch and x.dtype == torch.float64:  # code that runs other ops when the parameters are fp64
            x = x * 1.0
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def _tokens(b: int = 2, s: int = 8) -> torch.Tensor:
    return torch.randint(0, 64, (b, s), generator=torch.Generator().manual_seed(0))


def _trace(model: nn.Module):
    return trace(model, (_tokens(),), rewrite_attention=False)


def _casts(gm) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if cast_dtype(n) == torch.float32]


def test_the_norms_upcasts_are_marked_and_their_casts_back_are_not():
    torch.manual_seed(0)
    g = _trace(Toy())
    casts = _casts(g.graph_module)
    marked = [n for n in casts if is_upcast(n)]
    # each traced norm (the three traced blocks' and the final one) has one upcast and one cast back
    assert len(marked) == 4 and len(casts) == 8
    for n in marked:  # the upcast feeds the statistics: x.pow(2) and the product with rsqrt
        assert {u.target for u in n.users} == {torch.ops.aten.pow.Tensor_Scalar, torch.ops.aten.mul.Tensor}
    for n in set(casts) - set(marked):  # the cast back feeds the weight's product only
        assert [u.target for u in n.users] == [torch.ops.aten.mul.Tensor]


def test_the_residual_reads_the_block_input_not_the_norms_upcast():
    """At fp32, `x.to(torch.float32)` returns x itself, so export wrote the residual add as reading the cast; with
    the upcast kept fp32 the residual stream would turn fp32. It reads x, as the model does."""
    torch.manual_seed(0)
    g = _trace(Toy())
    adds = [n for n in g.graph_module.graph.nodes if n.target is torch.ops.aten.add.Tensor
            and any(a.target is torch.ops.aten.linear.default for a in n.args if isinstance(a, torch.fx.Node))]
    assert len(adds) == 3  # the traced blocks' residuals
    for n in adds:
        assert not any(isinstance(a, torch.fx.Node) and cast_dtype(a) is not None for a in n.args), n.args


def test_what_the_model_keeps_fp32_is_charged_at_fp32_under_16_bit_recipes():
    """The norm's upcast and its rsqrt, kept for backward, are fp32 at run time whatever the recipe: charged as
    fixed bytes (not halved under bf16-mixed); the cast back, in the compute dtype, is not."""
    torch.manual_seed(0)
    g = _trace(Toy())
    casts = [n for n in g.nodes if n.op == "to"]
    up = [n.cost for n in casts if n.cost.fixed_activation_bytes(2, 8) > 0]
    back = [n.cost for n in casts if n.cost.fixed_activation_bytes(2, 8) == 0]
    assert len(up) == len(back) == 5  # the four blocks' norms (three traced, one copied) and the final one
    assert all(c.activation_bytes(2, 8) == c.fixed_activation_bytes(2, 8) == 2 * 8 * 16 * 4 for c in up)
    assert all(c.activation_bytes(2, 8) == 2 * 8 * 16 * 4 for c in back)
    rsqrt = [n.cost for n in g.nodes if n.op == "rsqrt"]
    assert len(rsqrt) == 5 and all(c.fixed_activation_bytes(2, 8) == c.activation_bytes(2, 8) > 0 for c in rsqrt)


def test_the_marks_survive_the_trace_cache(tmp_path):
    """An elastic restart compiles from the cached trace: its code must keep the upcasts too."""
    torch.manual_seed(0)
    g = _trace(Toy())
    assert save_trace(g, tmp_path / "trace", "key")
    again = load_trace(tmp_path / "trace", "key")
    def marks(graph):
        return sorted(n.name for n in _casts(graph.graph_module) if is_upcast(n))
    assert marks(again) == marks(g) and len(marks(g)) == 4


def test_the_users_module_keeps_its_parameters_and_buffers():
    torch.manual_seed(0)
    model = Toy()
    model.register_buffer("table", torch.arange(4.0))
    before = {k: (v, v.clone()) for k, v in model.state_dict(keep_vars=True).items()}
    _trace(model)
    after = model.state_dict(keep_vars=True)
    for k, (v, copy) in before.items():
        assert after[k] is v and v.dtype == torch.float32 and torch.equal(v, copy), k


def test_stage_code_keeps_the_upcast_and_reads_the_parameters_dtype_for_the_cast_back():
    torch.manual_seed(0)
    g = _trace(Toy())
    plan = compile(g, "1x2xA100-80GB", global_batch_size=4, precision="bf16-mixed", pp=2, dp=1, tp=1,
                   microbatch_size=2)
    src = plan.program(0).source
    kept = src.count("torch.ops.aten.to.dtype(x, torch.float32)")
    back = [line for line in src.splitlines() if "torch.ops.aten.to.dtype(mul" in line]
    assert kept >= 2 and back and all("torch.float32" not in line for line in back), src
    assert plan.code.exact_casts and "stage.autocast = False" in src  # it runs as the model casts, no autocast


def test_code_that_traces_other_ops_at_fp64_warns_and_keeps_the_old_casts():
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = _trace(Toy(fp64_branch=True))
    said = [str(w.message) for w in caught if "own casts to fp32" in str(w.message)]
    assert len(said) == 1 and "different graph" in said[0] and "precision='fp32'" in said[0], said
    assert not any(is_upcast(n) for n in _casts(g.graph_module))
    plan = compile(g, "1x2xA100-80GB", global_batch_size=4, precision="bf16-mixed", pp=2, dp=1, tp=1,
                   microbatch_size=2)
    assert not plan.code.exact_casts and "stage.autocast = True" in plan.program(0).source  # autocast makes up


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_model_without_fp32_casts_is_exported_once(device, monkeypatch):
    from examples.gpt import gpt_tiny
    import partitioner.tracer.upcasts as upcasts

    calls = []
    real = upcasts._as_probe_dtype
    monkeypatch.setattr(upcasts, "_as_probe_dtype", lambda m: calls.append(m) or real(m))
    with torch.device(device):
        model = gpt_tiny(n_layer=2)
    trace(model, (torch.zeros(2, 8, dtype=torch.long, device=device),))
    assert calls == []
