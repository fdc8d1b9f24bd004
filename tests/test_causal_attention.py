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
from partitioner.tracer.attention import causal_attention, causal_shape_mask, shape_mask_key
from runtime.pipeline.attention import mask_verdict, shape_mask_attention

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


class _Window(torch.nn.Module):
    """Attention under a mask built from the length: causal, and within `window` positions when given."""

    def __init__(self, window: int | None = None, offset: int = 0):
        super().__init__()
        self.window, self.offset = window, offset

    def forward(self, x):                                          # (B, H, T, D)
        i = torch.arange(x.shape[2], device=x.device)
        mask = i[:, None] + self.offset >= i[None, :]
        if self.window is not None:
            mask = mask & (i[:, None] - i[None, :] < self.window)
        return F.scaled_dot_product_attention(x, x, x, attn_mask=mask)


@pytest.mark.parametrize("window, offset, exact", [(None, 0, True), (SEQ, 0, True), (4, 0, False), (None, 1, False)],
                         ids=["causal", "window-longer-than-traced", "window", "shifted"])
def test_a_shape_only_mask_is_causal_only_where_its_values_are_the_causal_one(window, offset, exact):
    """causal_shape_mask evaluates the mask at the traced sizes: a window shorter than the sequence or a shifted
    diagonal is not the causal mask, though both read as causal to causal_attention."""
    x = torch.randn(1, 2, SEQ, 8)
    ep = torch.export.export(_Window(window, offset), (x,))
    sdpa = next(n for n in ep.graph.nodes if "scaled_dot_product" in str(n.target))
    examples = {n: x for n in ep.graph.nodes if n.op == "placeholder"}
    assert causal_attention(sdpa)
    assert causal_shape_mask(sdpa, examples) is exact


@pytest.mark.parametrize("window, exact", [(None, True), (4096, False)], ids=["causal", "window"])
def test_a_mask_too_long_to_evaluate_is_judged_at_a_shorter_length(window, exact):
    """At 32K tokens the mask is 1 GiB of bools: causal_shape_mask evaluates it at the same sizes over 2 (16K, 256
    MiB), where a causal mask is still the causal one and a window of 4K still is not. A trace whose length is
    baked into its aranges (no symbol for it) cannot be shortened: charged as kept."""
    x = torch.empty(1, 1, 32768, 8)
    dim = torch.export.Dim("seq", min=2, max=65536)
    ep = torch.export.export(_Window(window), (x,), dynamic_shapes=({2: dim},))
    sdpa = next(n for n in ep.graph.nodes if "scaled_dot_product" in str(n.target))
    examples = {n: x for n in ep.graph.nodes if n.op == "placeholder"}
    assert causal_shape_mask(sdpa, examples) is exact
    static = torch.export.export(_Window(window), (x,))
    sdpa = next(n for n in static.graph.nodes if "scaled_dot_product" in str(n.target))
    assert causal_shape_mask(sdpa, {n: x for n in static.graph.nodes if n.op == "placeholder"}) is False


@pytest.mark.parametrize("window, offset", [(None, 0), (4, 0), (None, 1), (SEQ, 0)])
def test_shape_mask_attention_is_the_masked_attention(window, offset):
    """The runtime's attention under a shape-only mask: is_causal where the mask is causal, the mask as it is
    otherwise; the same values and gradients as the masked call either way."""
    q, k, v = (torch.randn(2, 2, SEQ, 8, requires_grad=True) for _ in range(3))
    i = torch.arange(SEQ)
    mask = (i[:, None] + offset >= i[None, :]) & (i[:, None] - i[None, :] < (window or SEQ + 1))
    mask = mask.view(1, 1, SEQ, SEQ).expand(2, 1, SEQ, SEQ)
    site = f"test {window} {offset}"  # one site per mask: a site's mask is a function of its shape
    got = shape_mask_attention(q, k, v, mask, site=site)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got, want)
    g_got = torch.autograd.grad(got.square().sum(), (q, k, v))
    g_want = torch.autograd.grad(want.square().sum(), (q, k, v))
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b)
    assert mask_verdict(mask, site) == ("causal" if window in (None, SEQ) and offset == 0 else "other")
    assert mask_verdict(torch.ones(1, 1, 3, 5, dtype=torch.bool), site) == "full"


def test_two_sites_with_masks_of_one_shape_keep_their_own_verdicts():
    """Layers that alternate a sliding window and full causal attention compute different masks of one shape:
    the verdict is per call site, so the window's site never runs as is_causal."""
    i = torch.arange(SEQ)
    causal = (i[:, None] >= i[None, :]).view(1, 1, SEQ, SEQ)
    window = causal & (i[:, None] - i[None, :] < 4).view(1, 1, SEQ, SEQ)
    q = torch.randn(1, 2, SEQ, 8)
    for site, mask in (("full layer", causal), ("window layer", window), ("full layer", causal)):
        torch.testing.assert_close(shape_mask_attention(q, q, q, mask, site=site),
                                   F.scaled_dot_product_attention(q, q, q, attn_mask=mask))
    assert (mask_verdict(causal, "full layer"), mask_verdict(window, "window layer")) == ("causal", "other")


def test_a_site_names_how_its_mask_is_computed():
    """shape_mask_key digests a mask's computation: the same in two traces of one model, different for another
    window or a shifted diagonal."""
    x = torch.randn(1, 2, SEQ, 8)

    def key(window=None, offset=0):
        ep = torch.export.export(_Window(window, offset), (x,))
        sdpa = next(n for n in ep.graph.nodes if "scaled_dot_product" in str(n.target))
        return shape_mask_key(sdpa.args[3] if len(sdpa.args) > 3 else sdpa.kwargs["attn_mask"])

    assert key() == key() and key(4) == key(4)
    assert len({key(), key(4), key(8), key(None, 1)}) == 4


def test_two_models_in_one_process_keep_their_own_verdicts():
    """Programs of two models run in one process (two compiles, plan.verify, a notebook) may name a call site
    alike: Llama's causal mask and Mistral's sliding window of 8 over 16 tokens, both `block: scaled_dot_product
    _attention...` with masks of one shape. The site carries a digest of the mask's computation, so Mistral's
    window is never run as Llama's is_causal (it was, after Llama's verdict: plan.verify found o_proj off by
    22 %)."""
    from examples.hf_families import MORE_FAMILIES
    from examples.training import hf_loss
    from partitioner import compile

    x = torch.randint(1, 512, (2, SEQ))
    for build in (hf_llama_seeded, MORE_FAMILIES["mistral"]):
        plan = compile(trace(build(), (x,)), "local:2", global_batch_size=2, microbatch_size=2, precision="fp32",
                       tp=2, sp=False)
        plan.verify(build, (x,), hf_loss, targets=x)


def test_hf_llama_s_causal_mask_is_not_kept_and_its_code_attends_with_is_causal():
    """HF Llama's mask from shapes is the causal one: the attention's cost keeps no mask (the padded model's
    keeps its (b, 1, s, s) mask, made float per call), and the generated tensor-parallel code attends through
    shape_mask_attention. The padded model's mask is the data's: the code passes it to the plain call."""
    from partitioner import compile

    model, ids = hf_llama_seeded(layers=2), torch.randint(0, 512, (2, SEQ))
    causal = _attention(trace(model, (ids,)))
    padded = _attention(trace(model, (ids,), example_kwargs={"attention_mask": torch.ones(2, SEQ, dtype=torch.long)}))
    b, s = 2, SEQ
    for c, p in zip(causal, padded):
        kept_mask = p.cost.activation_bytes(b, s) - c.cost.activation_bytes(b, s)
        assert kept_mask == b * s * s * 4  # a float32 (b, 1, s, s) mask per call, counted only where padded
    plan = compile(model, "local:2", example_inputs=(ids,), global_batch_size=2, tp=2)
    source = plan.program(0).source
    assert "shape_mask_attention(" in source and "scaled_dot_product_attention.default(" not in source
    assert "from runtime.pipeline.attention import shape_mask_attention" in source


@pytest.mark.slow
def test_hf_llama_pipeline_under_torch_compile_trains_like_one_process():
    """pp 2 over HF Llama's generated code, each block under torch.compile (aot_eager): shape_mask_attention's
    verdict runs outside the compiled graph, and the two ranks train like one process (SGD, fp32)."""
    from examples.training import hf_loss, sgd, train_one_process
    from partitioner import compile
    from runtime.launch.local import launch_local

    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(1, 512, (4, SEQ), generator=g), torch.randint(0, 512, (4, SEQ), generator=g))
            for _ in range(2)]
    plan = compile(hf_llama_seeded(), "local:2", example_inputs=(data[0][0][:2],), global_batch_size=4,
                   precision="fp32", pp=2, tp=1, dp=1, microbatch_size=2, schedule="1f1b", torch_compile="aot_eager")
    assert "shape_mask_attention(" in plan.program(0).source
    out = launch_local(plan, hf_llama_seeded, sgd, hf_loss, data, timeout_s=300)
    want = train_one_process(hf_llama_seeded, sgd, hf_loss, data)
    torch.testing.assert_close(torch.tensor(out.losses), torch.tensor(want.losses), rtol=1e-5, atol=1e-6)
    for name, p in want.model.state_dict().items():
        torch.testing.assert_close(out.state_dict[name], p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_the_example_gpt_s_tril_buffer_mask_runs_causal_and_is_costed_so():
    """nanoGPT's attention masks with a registered tril buffer sliced to the sequence (the example GPT's
    `bias`): a mask of a buffer the graph never writes. Built on the CPU, the tracer evaluates it from the
    buffer's values: causal, half the products run and no mask kept; the generated code passes the buffer to
    shape_mask_attention. On the meta device there are no values to read: charged as a kept full mask."""
    from examples import gpt as gpt_mod
    from examples.training import gpt_tiny_seeded
    from partitioner import compile

    model = gpt_tiny_seeded()
    example = (gpt_mod.example_batch(model, 2, seq_len=SEQ)[0],)
    real = _attention(trace(model, example))
    with torch.device("meta"):
        meta_model = gpt_tiny_seeded()
    meta = _attention(trace(meta_model, (example[0].to("meta"),)))
    assert real and all(n.cost.causal for n in real) and not any(n.cost.causal for n in meta)
    b, s = 2, SEQ
    for c, m in zip(real, meta):
        assert m.cost.activation_bytes(b, s) > c.cost.activation_bytes(b, s)  # the mask kept where unknown
    plan = compile(model, "local:2", example_inputs=example, global_batch_size=2, pp=2, precision="fp32")
    source = plan.program(1).source
    assert "shape_mask_attention(" in source and "sources = (attn_bias,)" in source, source
    plan.verify(gpt_tiny_seeded)


def test_a_verdict_from_a_buffer_is_read_again_once_the_buffer_changes():
    """The verdict for a mask made from a buffer is cached per buffer storage and version: written in place
    (version moves) or replaced, the mask is checked again, and the attention follows its new values."""
    q = torch.randn(1, 2, SEQ, 8)
    bias = torch.ones(SEQ, SEQ).tril()
    site = "test: buffer"
    def attend(buf):
        return shape_mask_attention(q, q, q, buf[:SEQ, :SEQ] != 0, site=site, sources=(buf,))
    torch.testing.assert_close(attend(bias), F.scaled_dot_product_attention(q, q, q, is_causal=True))
    assert mask_verdict(bias != 0, site, (bias,)) == "causal"
    bias.fill_(1.0)  # every position now: the verdict must not stay causal
    torch.testing.assert_close(attend(bias), F.scaled_dot_product_attention(q, q, q))
    other = torch.ones(SEQ, SEQ).triu()
    torch.testing.assert_close(attend(other), F.scaled_dot_product_attention(q, q, q, attn_mask=other != 0))


def test_a_new_buffer_at_a_freed_one_s_address_gets_its_own_verdict():
    """Two models' buffers, one causal and one all-true, made without writes torch sees (version 0 both), may
    come to live at the same address one after the other: the verdict is the buffer object's own, not its
    address's. (Here the memory is a bytearray both tensors are made over, filled by Python in between.)"""
    import array
    q = torch.randn(1, 2, SEQ, 8)
    site = "test: two buffers"
    raw = bytearray(SEQ * SEQ * 4)
    for values, want in ((torch.ones(SEQ, SEQ).tril(), dict(is_causal=True)), (torch.ones(SEQ, SEQ), {}),
                         (torch.ones(SEQ, SEQ).tril(), dict(is_causal=True))):
        raw[:] = array.array("f", values.flatten().tolist()).tobytes()
        buf = torch.frombuffer(raw, dtype=torch.float32).view(SEQ, SEQ)
        assert buf._version == 0 and torch.equal(buf, values)
        got = shape_mask_attention(q, q, q, buf != 0, site=site, sources=(buf,))
        torch.testing.assert_close(got, F.scaled_dot_product_attention(q, q, q, **want))
        del buf
