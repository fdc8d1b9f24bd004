"""Small Hugging Face models of the families whose layers are not all alike, built from configs.

Each is what a new user would try: a `...ForCausalLM` from a config (no
download), four layers, hidden 64, vocabulary 512. Between them they hold
what a plan must not get wrong:

- per-head q/k RMSNorm applied to head-sharded q and k (Qwen3, Qwen3-MoE, Gemma3);
- layers alternating sliding-window and full attention, with a window shorter
  than the sequence (GPT-OSS, Gemma3): same parameters, different behaviour;
- a dense first layer before MoE layers (DeepSeek-V3, `first_k_dense_replace=1`);
- constants created inside forward, lifted by torch.export (Falcon with multi-query attention).

`ALIBI_FAMILIES` adds the families whose attention adds a bias per head (ALiBi) made inside forward: under
tensor parallelism each rank must read its own heads' part of it (MPT; BLOOM, whose heads are merged into
the batch dim around `baddbmm`).

`FAMILIES` maps a short name to its builder; `hf_loss` (examples.training) is their loss.
"""

from __future__ import annotations

import torch

__all__ = ["FAMILIES", "qwen3_seeded", "qwen3_moe_seeded", "gemma3_seeded", "gpt_oss_seeded", "deepseek_v3_seeded",
           "falcon_seeded", "ALIBI_FAMILIES", "mpt_seeded", "bloom_seeded"]

_COMMON = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, max_position_embeddings=64, use_cache=False,
               bos_token_id=0, eos_token_id=0, pad_token_id=0)


def qwen3_seeded():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(**_COMMON, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, tie_word_embeddings=False)
    return transformers.Qwen3ForCausalLM(cfg)


def qwen3_moe_seeded():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(**_COMMON, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                      num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      tie_word_embeddings=False, output_router_logits=False)
    return transformers.Qwen3MoeForCausalLM(cfg)


def gemma3_seeded():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(**_COMMON, intermediate_size=128, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16, sliding_window=4,
                                        layer_types=["sliding_attention", "full_attention"] * 2)
    return transformers.Gemma3ForCausalLM(cfg)


def gpt_oss_seeded():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(**_COMMON, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                                    layer_types=["sliding_attention", "full_attention"] * 2,
                                    tie_word_embeddings=False, output_router_logits=False)
    return transformers.GptOssForCausalLM(cfg)


def deepseek_v3_seeded():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(**_COMMON, intermediate_size=128, moe_intermediate_size=32,
                                        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                                        num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
                                        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                        tie_word_embeddings=False, rope_scaling=None)
    return transformers.DeepseekV3ForCausalLM(cfg)


def falcon_seeded():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.FalconConfig(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                    multi_query=True, new_decoder_architecture=False, parallel_attn=True,
                                    alibi=False, bias=False, use_cache=False, max_position_embeddings=64,
                                    bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.FalconForCausalLM(cfg)


FAMILIES = {"qwen3": qwen3_seeded, "qwen3_moe": qwen3_moe_seeded, "gemma3": gemma3_seeded,
            "gpt_oss": gpt_oss_seeded, "deepseek_v3": deepseek_v3_seeded, "falcon": falcon_seeded}


def mpt_seeded():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MptConfig(vocab_size=512, d_model=64, n_heads=4, n_layers=4, max_seq_len=64,
                                 expansion_ratio=4, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.MptForCausalLM(cfg)


def bloom_seeded():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BloomConfig(vocab_size=512, hidden_size=64, n_layer=4, n_head=4, use_cache=False,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.BloomForCausalLM(cfg)


ALIBI_FAMILIES = {"mpt": mpt_seeded, "bloom": bloom_seeded}
