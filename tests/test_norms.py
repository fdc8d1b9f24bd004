"""RMSNorms spelled as ops are fused into aten.rms_norm (partitioner.tracer.norms): the same arithmetic in fp32,
one kernel, and backward keeps x in its own dtype instead of its fp32 upcast. Every program runs the fused code,
data-parallel ones included, so what runs is what the cost model counts. Families that train under it:
tests/test_hf_families.py (Llama-style norms in Qwen3, DeepSeek-V3, Mistral, ...)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from cost_models.errors import DeclarationError
from examples import training
from partitioner import compile, trace
from partitioner.tracer.cache import load_trace, save_trace
from test_upcasts import Norm, Toy, _tokens


class GemmaNorm(Norm):
    """Gemma's spelling: the weight as 1 + w, multiplied in fp32 before the cast back; not rewritten."""

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (h * (1.0 + self.weight.float())).type_as(x)


class PlainNorm(Norm):
    """A norm written without casts, x * x for the square and the weight on the left."""

    def forward(self, x):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5) * self.weight


class OlmoNorm(Norm):
    """OLMo2's order: the weight applied in fp32, then the cast back."""

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (self.weight * h).to(dtype)


class StatsNorm(Norm):
    """A norm whose statistic is read again (added to the output): not a plain RMSNorm, left as traced."""

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + 1e-6)) + var


def _loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _ops(g, op: str) -> int:
    return sum(1 for n in g.nodes if n.op == op)


def _with(norm: type[Norm], seed: int = 0) -> Toy:
    torch.manual_seed(seed)
    model = Toy()
    for b in (*model.blocks, model):
        b.norm = norm(16)
        nn.init.normal_(b.norm.weight, 1.0, 0.2)  # not ones: the weight's place in the product must matter
    return model


def test_the_hugging_face_rmsnorm_becomes_one_fused_op():
    torch.manual_seed(0)
    fused, eager = trace(Toy(), (_tokens(),)), trace(Toy(), (_tokens(),), rewrite_attention=False)
    assert (_ops(fused, "rms_norm"), _ops(fused, "rsqrt"), _ops(fused, "pow"), _ops(fused, "to")) == (5, 0, 0, 0)
    assert (_ops(eager, "rms_norm"), _ops(eager, "rsqrt")) == (0, 5)
    assert fused.fused == {"rms_norm": 5} and fused.rewritten and not eager.rewritten
    # backward keeps x at the compute dtype (not fixed at fp32 as the eager upcast): 4 bytes an element in fp32,
    # 2 under bf16-mixed, where the eager norm keeps its fp32 upcast, rsqrt's output and the cast back
    norm = next(n for n in fused.nodes if n.op == "rms_norm")
    assert norm.cost.activation_bytes(2, 8) == 2 * 8 * 16 * 4 and norm.cost.fixed_activation_bytes(2, 8) == 0
    assert fused.activation_bytes(2, 8) < eager.activation_bytes(2, 8)


@pytest.mark.parametrize("norm, fused", [(GemmaNorm, 0), (StatsNorm, 0), (PlainNorm, 5), (OlmoNorm, 5)])
def test_only_what_computes_an_rmsnorm_is_fused(norm, fused):
    g = trace(_with(norm), (_tokens(),))
    assert _ops(g, "rms_norm") == fused and _ops(g, "rsqrt") == 5 - fused


@pytest.mark.parametrize("norm", [Norm, PlainNorm, OlmoNorm])
def test_the_fused_code_computes_what_the_module_computes(norm):
    """plan.verify runs every rank's program against the module's own forward and backward (fp32)."""
    g = trace(_with(norm), (_tokens(),))
    plan = compile(g, "local:2", global_batch_size=4, precision="fp32", pp=2, dp=1, tp=1, microbatch_size=2)
    assert "aten.rms_norm.default" in plan.program(0).source
    plan.verify(lambda: _with(norm), (_tokens(4),), lambda out: out.float().pow(2).mean())


def test_the_fused_norms_survive_the_trace_cache(tmp_path):
    """An elastic restart compiles from the cached trace: the same fused graph, so the same programs."""
    g = trace(_with(Norm), (_tokens(),))
    assert save_trace(g, tmp_path / "trace", "key")
    assert load_trace(tmp_path / "trace", "key").fused == {"rms_norm": 5}


def test_data_parallel_programs_run_the_fused_code_and_say_why():
    g = trace(_with(Norm), (_tokens(),))
    plan = compile(g, "local:2", global_batch_size=4, precision="fp32", dp=2, tp=1, pp=1, microbatch_size=2)
    src = plan.program(0).source
    assert plan.fused == "rms_norm x5" and "aten.rms_norm.default" in src
    assert "its rms_norm x5 run as one ATen op each" in src
    assert "rms_norm x5: each chain of ops" in str(plan)
    with pytest.raises(DeclarationError, match="trace the model with trace"):  # the graph is fused: say how not to
        compile(g, "local:2", global_batch_size=4, precision="fp32", dp=2, rewrite_attention=False)


@pytest.mark.slow
def test_data_parallel_with_fused_norms_trains_like_one_process():
    from runtime.launch.local import launch_local

    model_fn = functools.partial(_with, Norm)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 8), generator=g))
               for _ in range(3)]
    plan = compile(model_fn(), "local:2", example_inputs=(_tokens(),), global_batch_size=4, precision="fp32",
                   dp=2, tp=1, pp=1, zero_stage=1, microbatch_size=2)
    assert plan.code is not None
    loss_fn = _loss
    out = launch_local(plan, model_fn, training.sgd, loss_fn, batches)
    one = training.train_one_process(model_fn, training.sgd, loss_fn, batches)
    assert out.losses == pytest.approx(one.losses, rel=1e-6)
    for k, v in one.model.state_dict().items():
        torch.testing.assert_close(out.state_dict[k], v, rtol=1e-5, atol=1e-6)
