"""Expert parallelism takes a MoE layer's experts for the runtime's batched ones only where they compute the same.

`partitioner.codegen.ep_region_check` runs the traced experts region on random tokens and routing against
down(gated(gate_up x)) weighted by the router, the gated unit as the rewrite read it off the region (SiLU(gate) * up
by default). Here: experts written another way (weights gathered per choice, einsums) that compute the same are
taken and train under ep2 like one process; experts whose names and activation match but whose arithmetic does
not (the halves of gate_up_proj swapped, a scale inside, the router's weights renormalised inside) are refused
before anything runs, where the rewrite would have trained them wrong; a clamped SwiGLU (DeepSeek-V4's) runs at
the limit its clamps name; Aria's experts, stored transposed, train like one process; so do GPT-OSS's (gate *
sigmoid(alpha gate) * (up + 1), gate and up interleaved, clamped, with biases, stored transposed) and MiniMax-M3's
(the same unit on the two halves, no biases), and a GPT-OSS whose gate and up trade places is refused.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from cost_models.errors import DeclarationError
from examples.hf_families import from_config
from examples.training import hf_loss, sgd
from partitioner import compile, trace
from ranks import assert_plan_trains_like_one_process

VOCAB, SEQ, BATCH, LIMIT = 128, 16, 8, 0.05


def _gathered(self, hidden_states, top_k_index, top_k_weights, variant="same"):
    """Each (token, choice) pair's expert weights gathered and applied by einsum: no sort, no grouped matmul."""
    h = torch.einsum("th,tkoh->tko", hidden_states, self.gate_up_proj[top_k_index])
    gate, up = h.chunk(2, dim=-1)
    if variant == "swapped":
        gate, up = up, gate
    if variant.startswith("clamped"):  # DeepSeek-V4's clamped SwiGLU, at a limit the tiny model's values reach
        gate, up = gate.clamp(max=LIMIT), up.clamp(min=-LIMIT, max=LIMIT * (2 if variant == "clamped_unequal" else 1))
    out = torch.einsum("tki,tkhi->tkh", F.silu(gate) * up, self.down_proj[top_k_index])
    if variant == "scaled":
        out = out * 2.0
    weights = top_k_weights / top_k_weights.sum(-1, keepdim=True) if variant == "renormalised" else top_k_weights
    return (out * weights.unsqueeze(-1)).sum(1)


def mixtral_gathered(variant: str = "same"):
    """A small Mixtral whose experts compute `_gathered(variant)` (a top-level builder: spawned ranks call it)."""
    model = from_config("MixtralConfig", "MixtralForCausalLM", vocab_size=VOCAB, num_hidden_layers=2,
                        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                        output_router_logits=False)
    for layer in model.model.layers:
        experts = layer.mlp.experts
        experts.forward = functools.partial(_gathered, experts, variant=variant)
    return model


aria = functools.partial(from_config, "AriaTextConfig", "AriaTextForCausalLM", vocab_size=VOCAB, num_hidden_layers=2,
                         num_key_value_heads=2, moe_num_experts=4, moe_topk=2, moe_intermediate_size=32,
                         moe_num_shared_experts=1)


gpt_oss = functools.partial(from_config, "GptOssConfig", "GptOssForCausalLM", vocab_size=VOCAB, num_hidden_layers=2,
                            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                            head_dim=16, layer_types=["sliding_attention", "full_attention"])
minimax_m3 = functools.partial(from_config, "MiniMaxM3VLTextConfig", "MiniMaxM3VLForCausalLM", vocab_size=VOCAB,
                               num_hidden_layers=2, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                               intermediate_size=32, head_dim=16)


def _odd_gate(self, gate_up):
    """GPT-OSS's unit with gate and up trading places: the odd columns gate, the even ones go up."""
    gate, up = gate_up[..., 1::2].clamp(max=self.limit), gate_up[..., ::2].clamp(min=-self.limit, max=self.limit)
    return (up + 1) * gate * torch.sigmoid(gate * self.alpha)


def gpt_oss_odd_gate():
    model = gpt_oss()
    for layer in model.model.layers:
        layer.mlp.experts._apply_gate = functools.partial(_odd_gate, layer.mlp.experts)
    return model


def _plan(build):
    return compile(trace(build(), (torch.randint(0, VOCAB, (2, SEQ)),)), "local:2", global_batch_size=BATCH,
                   precision="fp32", dp=2, ep=2, microbatch_size=BATCH // 2, alternatives=0)


def _batches(steps: int = 3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(steps)]


@pytest.mark.parametrize("variant, words", [
    ("swapped", "differs from down\\(gated\\(gate_up x\\)\\) weighted by the router"),
    ("scaled", "differs from"),
    ("renormalised", "differs from"),
])
def test_experts_that_compute_otherwise_are_refused_before_anything_runs(variant, words):
    with pytest.raises(DeclarationError, match=rf"the experts of model.layers.\d+.mlp.experts compute something "
                                               rf"else: on \d+ random tokens it {words}.*compile with ep=1"):
        _plan(functools.partial(mixtral_gathered, variant))


def test_a_clamped_swiglu_is_run_at_its_limit():
    """The limit is read off the two clamps (gate at most L, up within [-L, L]) and passed to ep_experts; the
    region is checked against the clamped formula. Clamps of another form are refused."""
    assert f"limit = {LIMIT}" in _plan(functools.partial(mixtral_gathered, "clamped")).program(rank=0).source
    with pytest.raises(DeclarationError, match=r"runs experts gated as SiLU\(gate\) \* up or as GPT-OSS's.* compute "
                                               r"\['aten.clamp.default', 'aten.silu.default'\]"):
        _plan(functools.partial(mixtral_gathered, "clamped_unequal"))


def test_experts_written_another_way_are_taken():
    plan = _plan(mixtral_gathered)
    assert plan.config.ep == 2
    src = plan.program(rank=0).source
    assert "ep_experts(" in src and "einsum" not in src  # the gathered einsums are what ep_experts replaces


def test_transposed_expert_weights_are_passed_transposed():
    src = _plan(aria).program(rank=0).source
    assert "ep_experts(" in src and "gate_up_proj_t," in src and "down_proj_t," in src


def test_gpt_oss_experts_are_run_in_their_own_form():
    """The unit's form is read off the region (the sigmoid's alpha, the clamps' limit, the interleaving slices, the
    biases) and passed to ep_experts; with gate and up the other way round the region check refuses it."""
    src = _plan(gpt_oss).program(rank=0).source
    call = next(line for line in src.splitlines() if "ep_experts(" in line)
    for part in ("limit = 7.0", "glu = 'sigmoid'", "alpha = 1.702", "interleaved = True",
                 "gate_up_bias = mlp_experts_gate_up_proj_bias", "down_bias = mlp_experts_down_proj_bias"):
        assert part in call, (part, call)
    call = next(line for line in _plan(minimax_m3).program(rank=0).source.splitlines() if "ep_experts(" in line)
    assert "glu = 'sigmoid'" in call and "interleaved" not in call and "bias" not in call
    with pytest.raises(DeclarationError, match=r"gated\(h\) = gate \* sigmoid\(1.702 gate\) \* \(up \+ 1\), gate and "
                                               r"up the even and odd columns of h, clamped at 7, with biases.* compute "
                                               r"something else"):
        _plan(gpt_oss_odd_gate)


@pytest.mark.slow
@pytest.mark.parametrize("build", [mixtral_gathered, functools.partial(mixtral_gathered, "clamped"), aria, gpt_oss,
                                   minimax_m3],
                         ids=["gathered", "clamped", "aria", "gpt_oss", "minimax_m3"])
def test_they_train_like_one_process(build):
    assert_plan_trains_like_one_process(_plan(build), build, sgd, hf_loss, _batches(), timeout_s=240)


def test_a_model_planned_on_the_meta_device_is_checked_and_keeps_ep():
    """Traced on the meta device, Hugging Face's experts count tokens with an integer histc (its non-CPU path),
    which the CPU lacks: the check runs it through float64, and the plan keeps ep."""
    with torch.device("meta"):
        model = from_config("MixtralConfig", "MixtralForCausalLM", vocab_size=VOCAB, num_hidden_layers=2,
                            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)
    plan = compile(trace(model, (torch.randint(0, VOCAB, (2, SEQ)),)), "local:2", global_batch_size=BATCH,
                   precision="fp32", dp=2, ep=2, microbatch_size=BATCH // 2, alternatives=0)
    assert plan.config.ep == 2 and "ep_experts(" in plan.program(rank=0).source
