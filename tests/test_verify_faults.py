"""plan.verify catches each silent fault the code generator once had, naming where it appears.

Each test switches one fix off (the test-only switches of partitioner.codegen.segments and
partitioner.codegen.segment_tp), compiles the plan that was wrong before the fix, and
checks that `plan.verify` refuses it, naming the block and the parameter or
segment; with the fix on, the same plan verifies. In one process, no process group.
"""

from __future__ import annotations

import pytest
import torch

from examples.hf_families import FAMILIES
from examples.training import gpt_4l_seeded
from partitioner import compile, trace
from partitioner.codegen import segment_tp, segments
from runtime.verify.check import VerifyError

VOCAB, SEQ = 512, 16


def _plan(model_fn, *, on="cpu", **degrees):
    with torch.device(on):
        model = model_fn()
    world = degrees.get("pp", 1) * degrees.get("tp", 1)
    return compile(model, f"local:{world}", example_inputs=(torch.randint(0, VOCAB, (2, SEQ), device=on),),
                   global_batch_size=4, precision="fp32", dp=1, microbatch_size=2, **degrees)


def test_partial_gradients_of_a_replicated_per_head_norm(monkeypatch):
    """Qwen3's q/k RMSNorm weights see head-sharded q and k: without f each rank has its heads' share."""
    monkeypatch.setattr(segment_tp, "SUM_REPLICATED_GRADS", False)
    with pytest.raises(VerifyError, match=r"(?s)model\.layers\.0.*model\.layers\.0\.self_attn\.[qk]_norm\.weight"):
        _plan(FAMILIES["qwen3"], tp=2).verify(FAMILIES["qwen3"])
    monkeypatch.setattr(segment_tp, "SUM_REPLICATED_GRADS", True)
    _plan(FAMILIES["qwen3"], tp=2).verify(FAMILIES["qwen3"])


def test_a_model_that_amplifies_rounding_is_still_held_to_the_fault(monkeypatch):
    """Gemma 4's fp32 rounding grows past rtol over its layers, and verify then measures the module's own rounding
    (its fp32 against its fp64 result) and allows 16 times it; the missing f on its per-head norms is far beyond."""
    from examples.hf_families import MORE_FAMILIES

    gemma4 = MORE_FAMILIES["gemma4_unified_text"]
    monkeypatch.setattr(segment_tp, "SUM_REPLICATED_GRADS", False)
    with pytest.raises(VerifyError, match=r"(?s)model\.layers\.0.*model\.layers\.0\.self_attn\.[qk]_norm\.weight"):
        _plan(gemma4, tp=2).verify(gemma4)
    monkeypatch.setattr(segment_tp, "SUM_REPLICATED_GRADS", True)
    assert "the module's own fp32 rounding" in str(_plan(gemma4, tp=2).verify(gemma4))


def test_one_template_for_blocks_of_different_kinds(monkeypatch):
    """GPT-OSS alternates sliding-window (block 0) and full attention (block 1, the old template for all)."""
    monkeypatch.setattr(segments, "TEMPLATE_PER_KIND", False)
    with pytest.raises(VerifyError, match=r"(?s)model\.layers\.0\b.*model\.layers\.0\."):
        _plan(FAMILIES["gpt_oss"], pp=2).verify(FAMILIES["gpt_oss"])
    monkeypatch.setattr(segments, "TEMPLATE_PER_KIND", True)
    _plan(FAMILIES["gpt_oss"], pp=2).verify(FAMILIES["gpt_oss"])


def test_factories_on_the_trace_device(monkeypatch):
    """Compiled on meta, the example GPT's position arange ran on meta: the prefix is wrong."""
    monkeypatch.setattr(segments, "DEVICE_NEUTRAL", False)
    with pytest.raises(VerifyError, match=r"(?s)prefix.*transformer\.wpe\.weight"):
        _plan(gpt_4l_seeded, on="meta", pp=2).verify(gpt_4l_seeded)
    monkeypatch.setattr(segments, "DEVICE_NEUTRAL", True)
    _plan(gpt_4l_seeded, on="meta", pp=2).verify(gpt_4l_seeded)


def test_constants_looked_up_on_the_module(monkeypatch):
    """Falcon's index constants, lifted by export, were read from the user's module by their exported name."""
    monkeypatch.setattr(segments, "CONSTANTS_IN_CODE", False)
    with pytest.raises(VerifyError, match=r"(?s)transformer\.h\.0\b.*lifted_tensor"):
        _plan(FAMILIES["falcon"], tp=2).verify(FAMILIES["falcon"])
    monkeypatch.setattr(segments, "CONSTANTS_IN_CODE", True)
    _plan(FAMILIES["falcon"], tp=2).verify(FAMILIES["falcon"])


def test_an_alternating_stack_copied_from_six_traced_blocks_verifies_from_meta(monkeypatch):
    """The example GPT with GPT-3's alternating banded attention, 8 layers: traced as three periods of two
    blocks and copied, compiled on meta; its two templates run the right blocks. With one template for
    both kinds, the banded blocks run dense attention and verify says so."""
    import dataclasses

    from examples.gpt import GPT
    from examples.training import gpt_4l_seeded as base

    cfg = dataclasses.replace(base().config, n_layer=8, local_window=4)

    def model_fn():
        torch.manual_seed(0)
        return GPT(cfg)

    with torch.device("meta"):
        traced = trace(model_fn(), (torch.randint(0, VOCAB, (2, SEQ), device="meta"),))
    assert traced.expanded_from == 6 and [b.kind for b in traced.blocks] == [0, 1] * 4
    plan = _plan(model_fn, on="meta", pp=2, tp=2)
    assert plan.block_kinds == (0, 1) * 4
    plan.verify(model_fn)
    monkeypatch.setattr(segments, "TEMPLATE_PER_KIND", False)
    with pytest.raises(VerifyError, match=r"(?s)transformer\.h\.[0-7]\b"):
        _plan(model_fn, on="meta", pp=2, tp=2).verify(model_fn)
