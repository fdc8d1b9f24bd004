"""The example models: forward and backward on CPU, parameter counts against closed
formulas, meta-device construction of the big GPTs, determinism, and the CNN's
hand-counted FLOPs. Big configs are only ever built on the meta device."""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from examples import cnn, gpt, mlp


def gpt_unique_params(cfg: gpt.GPTConfig) -> int:
    """Unique parameters of examples.gpt.GPT (bias=True), the tied wte/lm_head counted once.

    Per block: ln_1 2h + c_attn (3h^2 + 3h) + attn.c_proj (h^2 + h) + ln_2 2h
    + c_fc (4h^2 + 4h) + mlp.c_proj (4h^2 + h) = 12h^2 + 13h.
    Outside: wte V*h (= lm_head.weight) + wpe T*h + ln_f 2h.
    """
    L, h, V, T = cfg.n_layer, cfg.n_embd, cfg.vocab_size, cfg.block_size
    return L * (12 * h * h + 13 * h) + (V + T) * h + 2 * h


def unique_numel(model: torch.nn.Module) -> int:
    params = [p for _, p in model.named_parameters(remove_duplicate=False)]
    return sum(p.numel() for p in set(params))


def _forward_backward(model, inputs):
    out = model(*inputs)
    out = out[1] if isinstance(out, tuple) and out[1] is not None else out
    out = out[0] if isinstance(out, tuple) else out
    assert torch.isfinite(out).all()
    out.float().sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), name


# --- forward and backward on CPU -----------------------------------------------------------


@pytest.mark.parametrize("factory", [gpt.gpt_tiny, gpt.gpt_small])
def test_gpt_forward_backward(factory):
    torch.manual_seed(0)
    model = factory()
    (idx,) = gpt.example_inputs(model, batch_size=2, seq_len=32)
    logits, loss = model(idx)
    assert loss is None
    assert logits.shape == (2, 32, model.config.vocab_size)
    _forward_backward(model, (idx,))


def test_gpt_example_inputs_default_to_block_size():
    model = gpt.gpt_tiny()
    (idx,) = gpt.example_inputs(model)
    assert idx.shape == (2, model.config.block_size) and idx.dtype == torch.long
    assert 0 <= idx.min() and idx.max() < model.config.vocab_size
    with pytest.raises(ValueError, match="block_size=128"):
        gpt.example_inputs(model, seq_len=129)


def test_gpt_loss_at_init_is_about_ln_vocab():
    torch.manual_seed(0)
    model = gpt.gpt_tiny()
    idx, targets = gpt.example_batch(model, batch_size=4, seq_len=64)
    assert targets.shape == idx.shape
    assert torch.equal(targets[:, :-1], idx[:, 1:])
    logits, loss = model(idx, targets)
    assert logits.shape == (4, 64, 1024)
    assert torch.isfinite(loss)
    assert loss.item() == pytest.approx(math.log(1024), abs=0.1)
    loss.backward()
    assert model.lm_head.weight.grad is not None


def test_mlp_forward_backward():
    model = mlp.mlp()
    (x,) = mlp.example_inputs(model)
    assert x.shape == (8, 784)
    assert model(x).shape == (8, 10)
    _forward_backward(model, (x,))
    assert unique_numel(model) == 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10


def test_cnn_forward_backward():
    model = cnn.cnn()
    (x,) = cnn.example_inputs(model)
    assert x.shape == (8, 3, 32, 32)
    assert model(x).shape == (8, 10)
    _forward_backward(model, (x,))
    # the repeated blocks are identical in structure
    assert len({str(b) for b in model.blocks}) == 1 and len(model.blocks) == 4


def test_cnn_hand_counted_flops_match_flop_counter():
    model = cnn.cnn().eval()
    for batch in (1, 3):
        with FlopCounterMode(display=False) as counter:
            model(torch.randn(batch, 3, 32, 32))
        assert counter.get_total_flops() == batch * cnn.FORWARD_FLOPS_PER_IMAGE == batch * 79_037_696


# --- parameters ----------------------------------------------------------------------------


def test_gpt_tied_weights_are_one_tensor():
    model = gpt.gpt_tiny()
    assert model.transformer.wte.weight is model.lm_head.weight
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" in names or "transformer.wte.weight" in names
    assert len(list(model.named_parameters(remove_duplicate=False))) == len(list(model.parameters())) + 1


@pytest.mark.parametrize("name", ["gpt_tiny", "gpt_small"])
def test_gpt_small_param_counts_on_cpu(name):
    model = getattr(gpt, name)()
    assert unique_numel(model) == gpt_unique_params(gpt.CONFIGS[name])
    assert model.get_num_params(non_embedding=False) == unique_numel(model)


def test_gpt2_124m_param_count():
    with torch.device("meta"):
        model = gpt.gpt2_124m()
    n = unique_numel(model)
    assert n == gpt_unique_params(gpt.CONFIGS["gpt2_124m"]) == 124_475_904
    # nanoGPT prints "number of parameters: 123.69M" (position embeddings excluded)
    assert model.get_num_params() == n - 1024 * 768 == 123_689_472


def test_gpt3_175b_on_meta_allocates_nothing():
    with torch.device("meta"):
        model = gpt.gpt3_175b()
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())
    n = unique_numel(model)
    assert n == gpt_unique_params(gpt.CONFIGS["gpt3_175b"]) == 174_615_846_912
    (idx,) = gpt.example_inputs(model, batch_size=1)
    assert idx.is_meta and idx.shape == (1, 2048)


def test_all_named_configs_match_formula_on_meta():
    for name, cfg in gpt.CONFIGS.items():
        if name == "gpt3_175b":
            continue  # counted above
        with torch.device("meta"):
            model = getattr(gpt, name)()
        assert model.config == cfg
        assert unique_numel(model) == gpt_unique_params(cfg), name
        assert all(p.is_meta for p in model.parameters()), name


def test_factory_overrides_and_config_errors():
    model = gpt.gpt_tiny(n_layer=1, dropout=0.1)
    assert len(model.transformer.h) == 1 and model.config.dropout == 0.1
    assert gpt.CONFIGS["gpt_tiny"].n_layer == 2  # the named config is untouched
    with pytest.raises(ValueError, match="divisible by n_head"):
        gpt.gpt_tiny(n_head=5)


def test_meta_model_materialises_with_init_weights():
    with torch.device("meta"):
        model = gpt.gpt_tiny()
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    mask = model.transformer.h[0].attn.bias
    assert torch.equal(mask[0, 0], torch.tril(torch.ones(128, 128)))
    assert model.transformer.wte.weight is model.lm_head.weight
    _, loss = model(*gpt.example_batch(model, batch_size=2, seq_len=16))
    assert loss.item() == pytest.approx(math.log(1024), abs=0.1)


# --- determinism ---------------------------------------------------------------------------


def test_gpt_deterministic_under_seed_with_dropout_zero():
    def run():
        torch.manual_seed(1234)
        model = gpt.gpt_tiny(dropout=0.0).train()
        idx, targets = gpt.example_batch(model, batch_size=2, seq_len=32)
        logits, loss = model(idx, targets)
        loss.backward()
        return model, logits, loss

    m1, logits1, loss1 = run()
    m2, logits2, loss2 = run()
    assert torch.equal(logits1, logits2) and torch.equal(loss1, loss2)
    for (n, p1), (_, p2) in zip(m1.named_parameters(), m2.named_parameters()):
        assert torch.equal(p1, p2), n
        assert torch.equal(p1.grad, p2.grad), n
    # with dropout 0, train mode is repeatable call to call, and equals eval mode
    idx = gpt.example_inputs(m1, seq_len=32)[0]
    again = m1(idx)[0]
    assert torch.equal(again, m1(idx)[0])
    assert torch.equal(again, m1.eval()(idx)[0])
