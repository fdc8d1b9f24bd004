"""Causal attention read off the traced graph (partitioner.tracer.attention.causal_attention), and its time.

A fused attention is causal when it says is_causal=True, or when its mask is computed from shapes alone
through an ordering comparison of positions (Hugging Face's create_causal_mask); its FLOPs still count the
full L x S products (model FLOPs, as MFU is quoted), and the time model runs half of them (OpCost.executed).
A mask read from the inputs (padding) is the data's: not discounted. Nothing is matched by model name.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from examples.training import hf_llama_seeded
from partitioner import trace
from partitioner.tracer.attention import causal_attention

SEQ = 16


class _Attend(torch.nn.Module):
    """One attention over x's tokens with the mask `kind` builds: "arange" (i >= j from aranges), "ones" (every
    position), "causal" (is_causal=True), "none"."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, x):                                          # (B, H, T, D)
        t = x.shape[2]
        if self.kind == "causal":
            return F.scaled_dot_product_attention(x, x, x, is_causal=True)
        mask = None
        if self.kind == "arange":
            i = torch.arange(t, device=x.device)
            mask = i[:, None] >= i[None, :]                        # (T, T), built from the length
        elif self.kind == "ones":
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device)
        return F.scaled_dot_product_attention(x, x, x, attn_mask=mask)


@pytest.mark.parametrize("kind, causal", [("arange", True), ("causal", True), ("ones", False), ("none", False)])
def test_causal_attention_reads_the_mask_s_dataflow(kind, causal):
    ep = torch.export.export(_Attend(kind), (torch.randn(2, 2, SEQ, 8),))
    sdpa = [n for n in ep.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert len(sdpa) == 1 and causal_attention(sdpa[0]) is causal


def _attention(g):
    return [n for n in g.nodes if n.op == "scaled_dot_product_attention"]


def test_hf_llama_s_mask_from_shapes_runs_half_the_products_and_a_padding_mask_all():
    """HF Llama (tiny, 2 layers) builds its causal mask from the length: each attention counts the full
    L x S products and runs half; given an attention_mask input the mask is the data's, run whole."""
    model, ids = hf_llama_seeded(layers=2), torch.randint(0, 512, (2, SEQ))
    causal = _attention(trace(model, (ids,)))
    padded = _attention(trace(model, (ids,), example_kwargs={"attention_mask": torch.ones(2, SEQ, dtype=torch.long)}))
    assert len(causal) == len(padded) == 2
    for c, p in zip(causal, padded):
        assert c.cost.causal and not p.cost.causal
        assert c.cost.forward_flops == p.cost.forward_flops  # the model FLOPs: full products either way
        b, s = 2, SEQ
        run_c = c.cost.forward_flops(b, s) * c.cost.executed
        run_p = p.cost.forward_flops(b, s) * p.cost.executed
        assert run_c == pytest.approx(run_p / 2)
