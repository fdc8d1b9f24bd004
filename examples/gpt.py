"""A nanoGPT-style GPT, written the way people write it (not trace-friendly on purpose).

Imitates Karpathy's nanoGPT ``model.py``: one fused qkv ``Linear``, the manual
attention path with a causal-mask buffer sliced per call (so the attention
FLOPs are visible to a tracer, unlike SDPA), ``nn.ModuleDict``/``nn.ModuleList``
containers, a token embedding tied to the LM head, and an optional ``targets``
argument. One deliberate difference: without targets, ``forward`` returns the
logits of every position (nanoGPT keeps only the last one, an inference-time
shortcut that would hide the LM-head FLOPs of a training step).

Unique parameters (the tied embedding counted once), for ``L`` layers, width
``h``, vocabulary ``V`` and context ``T`` with ``bias=True``::

    L * (12 h^2 + 13 h) + (V + T) h + 2 h

per block: ln_1 2h, c_attn 3h^2+3h, attn.c_proj h^2+h, ln_2 2h, c_fc 4h^2+4h,
mlp.c_proj 4h^2+h; then wte V h (= lm_head), wpe T h, ln_f 2h.

>>> model = gpt_tiny()
>>> logits, loss = model(*example_batch(model, batch_size=2))
>>> tuple(logits.shape), round(loss.item())      # loss ~ ln(1024) = 6.93 at init
((2, 128, 1024), 7)

Big configs build on the meta device without allocating anything::

    with torch.device("meta"):
        model = gpt3_175b()                           # 174,615,846,912 parameters
    model.to_empty(device="cuda"); model.init_weights()   # to materialise later
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 1024
    """Context length: the longest sequence the model accepts (positions in ``wpe``)."""
    vocab_size: int = 50304
    """Token vocabulary; GPT-2's 50257 padded up to a multiple of 64 for speed."""
    n_layer: int = 12
    """Number of transformer blocks."""
    n_head: int = 12
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 768
    """Model width (hidden size)."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention weights and residual branches."""
    bias: bool = True
    """Bias in Linears and LayerNorms, like GPT-2. False is a bit better and faster."""
    local_window: int | None = None
    """When set, blocks 1, 3, 5, ... attend only to the last ``local_window`` positions (locally
    banded attention, alternating with dense blocks as in GPT-3, Brown et al. 2020 sec. 2.1);
    None (default): every block attends to the whole causal context. No parameters change."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}) so every "
                f"head gets n_embd // n_head dimensions; pick n_head among the divisors of "
                f"{self.n_embd}, e.g. {_nearest_divisor(self.n_embd, self.n_head)}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.local_window is not None and self.local_window < 1:
            raise ValueError(f"local_window must be None or >= 1 (positions a local block sees), got {self.local_window}")


def _nearest_divisor(n: int, near: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: abs(d - near))


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's ``nn.LayerNorm`` has no ``bias=False``
    before 2.1; nanoGPT keeps its own)."""

    def __init__(self, ndim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):

    def __init__(self, config: GPTConfig, window: int | None = None):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # key, query, value projections for all heads, in a batch
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        # output projection
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # regularization
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.window = window  # None: dense causal attention; w: each position sees the last w positions
        # causal mask to ensure that attention is only applied to the left in the input sequence
        self.register_buffer(
            "bias",
            torch.tril(torch.ones(config.block_size, config.block_size)).view(
                1, 1, config.block_size, config.block_size
            ),
        )

    def forward(self, x):
        B, T, C = x.size()  # batch size, sequence length, embedding dimensionality (n_embd)

        # calculate query, key, values for all heads in batch and move head forward to be the batch dim
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)

        # manual implementation of attention
        # causal self-attention; Self-attend: (B, nh, T, hs) x (B, nh, hs, T) -> (B, nh, T, T)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = self.bias[:, :, :T, :T]  # (1, 1, T, T), 1 on and below the diagonal
        if self.window is not None:
            mask = mask.triu(1 - self.window)  # and 0 more than window - 1 positions back
        att = att.masked_fill(mask == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v  # (B, nh, T, T) x (B, nh, T, hs) -> (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side

        # output projection
        y = self.resid_dropout(self.c_proj(y))
        return y


class MLP(nn.Module):

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        x = self.c_fc(x)
        x = self.gelu(x)
        x = self.c_proj(x)
        x = self.dropout(x)
        return x


class Block(nn.Module):

    def __init__(self, config: GPTConfig, window: int | None = None):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, window)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):

    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.vocab_size is not None
        assert config.block_size is not None
        self.config = config

        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config, config.local_window if i % 2 else None) for i in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # with weight tying when using torch.compile() some warnings get generated:
        # "UserWarning: functional_call was passed multiple values for tied weights.
        # This behavior is deprecated and will be an error in future versions"
        # not 100% sure what this is, so far seems to be harmless. TODO investigate
        self.transformer.wte.weight = self.lm_head.weight  # https://paperswithcode.com/method/weight-tying

        # Built under `with torch.device("meta")` there is no storage to initialise:
        # skip it, so a 175B model costs nothing; call init_weights() after to_empty().
        if not self.lm_head.weight.is_meta:
            self.init_weights()

    def init_weights(self) -> None:
        """Initialise every parameter (and the causal masks) in place, like nanoGPT.

        Weights ~ N(0, 0.02), biases 0, LayerNorms (1, 0); the residual projections
        (``c_proj``) get std 0.02 / sqrt(2 * n_layer), per GPT-2. Also refills the
        causal-mask buffers and re-ties ``wte`` to ``lm_head`` (``to_empty`` moves the two
        modules' parameters separately and unties them), so
        ``model.to_empty(device=...); model.init_weights()`` turns a meta-device model
        into a usable one.
        """
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        # apply special scaled init to the residual projections, per GPT-2 paper
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, LayerNorm):
            torch.nn.init.ones_(module.weight)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, CausalSelfAttention):
            with torch.no_grad():
                module.bias.copy_(torch.tril(torch.ones_like(module.bias)))

    def get_num_params(self, non_embedding: bool = True) -> int:
        """Return the number of parameters in the model.

        For non-embedding count (default), the position embeddings get subtracted.
        The token embeddings would too, except due to the parameter sharing these
        params are actually used as weights in the final layer, so we include them.
        """
        n_params = sum(p.numel() for p in self.parameters())  # parameters() skips the tied duplicate
        if non_embedding:
            n_params -= self.transformer.wpe.weight.numel()
        return n_params

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()
        assert t <= self.config.block_size, f"Cannot forward sequence of length {t}, block size is only {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)  # shape (t)

        # forward the GPT model itself
        tok_emb = self.transformer.wte(idx)  # token embeddings of shape (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos)  # position embeddings of shape (t, n_embd)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)

        logits = self.lm_head(x)  # (b, t, vocab_size)
        if targets is not None:
            # if we are given some desired targets also calculate the loss
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            loss = None
        return logits, loss


# --- named configurations ----------------------------------------------------------------
# GPT-2 sizes from the GPT-2 paper (vocab padded to 50304 like nanoGPT), GPT-3 sizes from
# Brown et al. 2020 Table 2.1 (13B with d=5120, as Megatron uses), 1T from Narayanan et
# al. 2021 (Megatron-LM scaling) Table 1. The GPT-3-sized models train with dropout 0.1, as
# Megatron-LM does by default (--hidden-dropout 0.1 --attention-dropout 0.1): their masks are
# part of the activation memory a planner must fit (Korthikanti et al. 2022 count them).

CONFIGS: dict[str, GPTConfig] = {
    "gpt_tiny": GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=128, vocab_size=1024),
    "gpt_small": GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=128, vocab_size=8192),
    "gpt2_124m": GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304),
    "gpt2_medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024, block_size=1024, vocab_size=50304),
    "gpt2_large": GPTConfig(n_layer=36, n_head=20, n_embd=1280, block_size=1024, vocab_size=50304),
    "gpt2_xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600, block_size=1024, vocab_size=50304),
    "gpt3_1_3b": GPTConfig(n_layer=24, n_head=16, n_embd=2048, block_size=2048, vocab_size=51200, dropout=0.1),
    "gpt3_2_7b": GPTConfig(n_layer=32, n_head=32, n_embd=2560, block_size=2048, vocab_size=51200, dropout=0.1),
    "gpt3_6_7b": GPTConfig(n_layer=32, n_head=32, n_embd=4096, block_size=2048, vocab_size=51200, dropout=0.1),
    "gpt3_13b": GPTConfig(n_layer=40, n_head=40, n_embd=5120, block_size=2048, vocab_size=51200, dropout=0.1),
    "gpt3_175b": GPTConfig(n_layer=96, n_head=96, n_embd=12288, block_size=2048, vocab_size=51200, dropout=0.1),
    "gpt_1t": GPTConfig(n_layer=128, n_head=160, n_embd=25600, block_size=2048, vocab_size=51200, dropout=0.1),
}


def _build(name: str, overrides: dict) -> GPT:
    # No device argument: the model lands on the current default device, so a
    # caller's `with torch.device("meta"):` builds it without allocating.
    return GPT(replace(CONFIGS[name], **overrides))


def gpt_tiny(**overrides) -> GPT:
    """2 layers, d=128, 4 heads, seq 128, vocab 1024: 0.54M parameters, fast on CPU."""
    return _build("gpt_tiny", overrides)


def gpt_small(**overrides) -> GPT:
    """4 layers, d=256, 4 heads, seq 128, vocab 8192: 5.29M unique parameters
    (7.39M if the tied embedding/LM-head matrix is counted twice)."""
    return _build("gpt_small", overrides)


def gpt2_124m(**overrides) -> GPT:
    """GPT-2 small: 12 layers, d=768, 12 heads, seq 1024: 124.48M (123.69M non-embedding)."""
    return _build("gpt2_124m", overrides)


def gpt2_medium(**overrides) -> GPT:
    """GPT-2 medium: 24 layers, d=1024, 16 heads, seq 1024: 354.9M parameters."""
    return _build("gpt2_medium", overrides)


def gpt2_large(**overrides) -> GPT:
    """GPT-2 large: 36 layers, d=1280, 20 heads, seq 1024: 774.1M parameters."""
    return _build("gpt2_large", overrides)


def gpt2_xl(**overrides) -> GPT:
    """GPT-2 XL: 48 layers, d=1600, 25 heads, seq 1024: 1.558B parameters."""
    return _build("gpt2_xl", overrides)


def gpt3_1_3b(**overrides) -> GPT:
    """GPT-3 XL: 24 layers, d=2048, 16 heads, seq 2048, vocab 51200: 1.318B parameters."""
    return _build("gpt3_1_3b", overrides)


def gpt3_2_7b(**overrides) -> GPT:
    """GPT-3 2.7B: 32 layers, d=2560, 32 heads, seq 2048, vocab 51200: 2.654B parameters."""
    return _build("gpt3_2_7b", overrides)


def gpt3_6_7b(**overrides) -> GPT:
    """GPT-3 6.7B: 32 layers, d=4096, 32 heads, seq 2048, vocab 51200: 6.662B parameters."""
    return _build("gpt3_6_7b", overrides)


def gpt3_13b(**overrides) -> GPT:
    """GPT-3 13B: 40 layers, d=5120, 40 heads, seq 2048, vocab 51200: 12.858B parameters."""
    return _build("gpt3_13b", overrides)


def gpt3_175b(**overrides) -> GPT:
    """GPT-3 175B: 96 layers, d=12288, 96 heads, seq 2048, vocab 51200: 174.616B parameters."""
    return _build("gpt3_175b", overrides)


def gpt_1t(**overrides) -> GPT:
    """Megatron 1T: 128 layers, d=25600, 160 heads, seq 2048, vocab 51200: 1.008T parameters."""
    return _build("gpt_1t", overrides)


# --- example inputs ----------------------------------------------------------------------


def _random_tokens(model: GPT, batch_size: int, seq_len: int | None, seed: int) -> torch.Tensor:
    cfg = model.config
    t = cfg.block_size if seq_len is None else seq_len
    if not 1 <= t <= cfg.block_size:
        raise ValueError(
            f"seq_len={t} is outside 1..block_size={cfg.block_size}: the position embedding "
            f"has block_size rows; pass a shorter seq_len or build the model with "
            f"block_size={t}"
        )
    device = next(model.parameters()).device
    if device.type == "meta":
        return torch.empty(batch_size, t, dtype=torch.long, device="meta")
    g = torch.Generator(device="cpu").manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (batch_size, t), generator=g, device="cpu")
    return idx.to(device)


def example_inputs(model: GPT, batch_size: int = 2, seq_len: int | None = None, *, seed: int = 0) -> tuple[torch.Tensor]:
    """``(idx,)``: random token ids, shape ``(batch_size, seq_len or block_size)``, on the
    model's device (an empty meta tensor when the model is on meta)."""
    return (_random_tokens(model, batch_size, seq_len, seed),)


def example_batch(
    model: GPT, batch_size: int, seq_len: int | None = None, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(idx, targets)`` for a training step: targets are idx shifted left by one
    (the next token), the last position predicting a fresh random token."""
    tokens = _random_tokens(model, batch_size, None if seq_len is None else seq_len, seed)
    if tokens.is_meta:
        return tokens, torch.empty_like(tokens)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    nxt = torch.randint(0, model.config.vocab_size, (batch_size, 1), generator=g).to(tokens.device)
    return tokens, torch.cat([tokens[:, 1:], nxt], dim=1)
