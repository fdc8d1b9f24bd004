"""Low-rank adapters (LoRA, Hu et al. 2021) on a frozen model: what a fine-tuning run trains.

`LoRALinear` wraps a linear layer whose parameters it freezes (requires_grad=False) and adds the trainable
low-rank update x A^T B^T, B zero at the start as in the paper, so the wrapped model computes what the base
one does until the first step. `lora_llama_seeded` puts adapters on every attention's q and v projections of a
small Hugging Face Llama, as peft's default for Llama does; every other parameter stays frozen.

The planner counts a frozen parameter as held and nothing else (no gradient, master or optimizer state); under
ZeRO the data-parallel engine keeps frozen parameters whole on every replica and shards the adapters alone.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["LoRALinear", "lora_llama_seeded"]


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int = 4, alpha: float = 8.0):
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) / rank)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t() * self.scale


def lora_llama_seeded(layers: int = 4, hidden: int = 64, rank: int = 4) -> nn.Module:
    """examples.training.hf_llama_seeded's Llama (at `hidden`), frozen, with adapters on q_proj and v_proj."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                   max_position_embeddings=64, use_cache=False, tie_word_embeddings=False,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg)
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in model.model.layers:
        layer.self_attn.q_proj = LoRALinear(layer.self_attn.q_proj, rank)
        layer.self_attn.v_proj = LoRALinear(layer.self_attn.v_proj, rank)
    return model
