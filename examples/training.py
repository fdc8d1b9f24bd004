"""Module-level training pieces for running plans: picklable, so worker processes can import them.

    from runtime import launch_local
    from examples.training import gpt_tiny_seeded, adamw, gpt_loss
    out = launch_local(plan, gpt_tiny_seeded, adamw, gpt_loss, batches)

Every factory seeds torch before building, so every rank (and the
single-process reference, `train_one_process`) starts from the same weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from examples import gpt

__all__ = ["gpt_tiny_seeded", "gpt_small_seeded", "gpt_4l_seeded", "gpt_8l_seeded", "hf_gpt2_seeded",
           "hf_gpt2_4l_seeded", "hf_llama_seeded", "adamw", "sgd", "warmup_cosine", "gpt_loss", "hf_loss",
           "in_model_loss", "labelled_tokens", "target_tokens", "Trained", "global_microbatches", "train_one_process"]


def gpt_tiny_seeded() -> gpt.GPT:
    torch.manual_seed(0)
    return gpt.gpt_tiny()


def gpt_small_seeded() -> gpt.GPT:
    torch.manual_seed(0)
    return gpt.gpt_small()


def gpt_4l_seeded() -> gpt.GPT:
    """The example GPT, 4 blocks of width 64: small enough for 8-process pipeline x tensor tests."""
    torch.manual_seed(0)
    return gpt.GPT(gpt.GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=64, vocab_size=512))


def gpt_8l_seeded() -> gpt.GPT:
    """8 blocks: 4 pipeline ranks x 2 virtual stages (interleaved 1F1B) need 8 to cut."""
    torch.manual_seed(0)
    return gpt.GPT(gpt.GPTConfig(n_layer=8, n_head=4, n_embd=64, block_size=64, vocab_size=512))


def hf_gpt2_4l_seeded():
    """hf_gpt2_seeded with 4 blocks, for 4 pipeline stages."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=512, n_positions=64, use_cache=False,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def hf_gpt2_seeded(dropout: float = 0.0):
    """A small Hugging Face GPT-2 built from a config (no download), dropout off (or `dropout` on embeddings,
    residuals and attention)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64, use_cache=False,
                                  resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0,
                                  eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def hf_gpt2_dropout_seeded():
    """`hf_gpt2_seeded` with Hugging Face's default dropout, 0.1: what an evaluation must turn off, as model.eval()
    does."""
    return hf_gpt2_seeded(dropout=0.1)


# eps 1e-6, not torch's 1e-8: some gradients here are exactly zero in exact arithmetic (a
# key bias cannot change a softmax), and with eps 1e-8 Adam turns the rounding noise of the
# gradient reduction into full lr-sized steps, so no two reduction orders agree to 1e-5 (torch's
# own DDP differs from one process by 1.1e-5 after 4 steps). With 1e-6 the noise step is at most
# lr * noise / eps (tests/ranks.py adam_atol).
ADAMW_LR, ADAMW_EPS = 5e-4, 1e-6


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=ADAMW_LR, eps=ADAMW_EPS, weight_decay=0.1)


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def warmup_cosine(optimizer, warmup: int = 2, total: int = 6) -> torch.optim.lr_scheduler.LRScheduler:
    """A learning-rate schedule as large runs use: linear warmup over `warmup` steps, then cosine decay to 10 %
    of the peak at step `total` (a different rate every step, so a step taken at the wrong one shows)."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * t))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def gpt_loss(output, targets) -> torch.Tensor:
    """Mean next-token cross entropy of the example GPT's (logits, loss) output."""
    logits = output[0]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def hf_loss(output, targets) -> torch.Tensor:
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def hf_llama_seeded(layers: int = 4):
    """A small Hugging Face Llama built from a config: untied vocab-parallel embedding, rotary, SwiGLU, GQA."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=64, use_cache=False,
                                   tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def hf_llama_8l_seeded():
    """`hf_llama_seeded` with 8 layers: enough blocks for 4 pipeline ranks of 2 virtual stages each."""
    return hf_llama_seeded(layers=8)


def in_model_loss(output, targets) -> torch.Tensor:
    """The loss a model computed itself (the example GPT's (logits, loss) when called with targets)."""
    return output[1]


def hf_model_loss(output, targets=None) -> torch.Tensor:
    """The loss a Hugging Face model computed itself, called with labels (its output's `loss`)."""
    return output.loss


def labelled_tokens(inputs, targets=None) -> torch.Tensor:
    """The tokens a Hugging Face causal LM's own loss averages over on a batch: its labels after the shift to the
    next token, those not -100 (for `runtime.per_token(hf_model_loss, labelled_tokens)`)."""
    return (inputs["labels"][..., 1:] != -100).sum()


def target_tokens(inputs, targets) -> torch.Tensor:
    """The tokens `hf_loss` (a cross entropy, ignore_index -100) averages over: the targets not -100."""
    return (targets != -100).sum()


class Trained(NamedTuple):
    losses: list[float]
    model: torch.nn.Module
    grad_norms: list[float]  # before clipping, each step; empty without clipping


def global_microbatches(x: Any, y: Any, *, dp: int, num_microbatches: int) -> list[tuple[Any, Any]]:
    """A global batch (x, y) as a plan with `dp` replicas and `num_microbatches` microbatches a step runs it:
    microbatch i is the i-th microbatch of every replica's rows (replica r holds rows [r*B/dp, (r+1)*B/dp),
    runtime.engines.step.replica_microbatches), in replica order.

    >>> x = torch.arange(8)
    >>> [mb[0].tolist() for mb in global_microbatches(x, x, dp=2, num_microbatches=2)]
    [[0, 1, 4, 5], [2, 3, 6, 7]]
    """
    import torch.utils._pytree as pytree

    rows = pytree.tree_leaves(x)[0].shape[0]
    per = rows // dp
    mb = per // num_microbatches
    idx = [torch.cat([torch.arange(r * per + i * mb, r * per + (i + 1) * mb) for r in range(dp)])
           for i in range(num_microbatches)]
    take = lambda t, i: pytree.tree_map(lambda v: v[i] if isinstance(v, torch.Tensor) else v, t)  # noqa: E731
    return [(take(x, i), take(y, i)) for i in idx]


def _forward(model: torch.nn.Module, x: Any) -> Any:
    """The model on one batch: a dict of inputs as keywords (a Hugging Face model's input_ids, labels), as the
    runtime calls it."""
    return model(**x) if isinstance(x, dict) else model(x)


@torch.no_grad()
def evaluate_one_process(model: torch.nn.Module, loss_fn: Callable, batches: Iterable[tuple[Any, Any]]) -> float:
    """The truth of an evaluation: the mean over `batches` of loss_fn on each whole batch in eval mode (the
    model's modes are put back after)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        losses = [float(loss_fn(_forward(model, x), y)) for x, y in batches]
    finally:
        for m, was in modes:
            m.training = was
    return sum(losses) / len(losses)


def train_one_process(model_fn: Callable[[], torch.nn.Module], optimizer_fn: Callable[[Any], torch.optim.Optimizer],
                      loss_fn: Callable, batches: Iterable[tuple[Any, Any]], *,
                      clip_grad_norm: float | None = None, dp: int = 1, num_microbatches: int = 1,
                      scheduler_fn: Callable | None = None) -> Trained:
    """The truth every plan must reproduce: the same seed and data, each whole global batch, in one process.
    `scheduler_fn(optimizer)`: a learning-rate scheduler, stepped after each optimizer step.

    With num_microbatches > 1, each batch as that plan's global microbatches (`global_microbatches` of its `dp`
    replicas), each microbatch's loss divided by their number and the gradients accumulated: one process
    training as a plan does whose loss holds statistics of each microbatch (a router's load-balancing loss,
    computed per microbatch as the plan states: Plan.load_balancing_loss). The loss of a batch of means
    over equal microbatches (a cross entropy) is the same either way."""
    model = model_fn()
    opt = optimizer_fn(model.parameters())
    scheduler = scheduler_fn(opt) if scheduler_fn is not None else None
    losses, norms = [], []
    for x, y in batches:
        if num_microbatches > 1:
            loss = torch.zeros(())
            for mx, my in global_microbatches(x, y, dp=dp, num_microbatches=num_microbatches):
                part = loss_fn(_forward(model, mx), my) / num_microbatches
                part.backward()
                loss = loss + part.detach()
        else:
            loss = loss_fn(_forward(model, x), y)
            loss.backward()
        if clip_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)))
        opt.step()
        if scheduler is not None:
            scheduler.step()
        opt.zero_grad()
        losses.append(loss.item())
    return Trained(losses, model, norms)
