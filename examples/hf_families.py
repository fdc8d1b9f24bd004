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

import functools

import torch

__all__ = ["FAMILIES", "qwen3_seeded", "qwen3_moe_seeded", "gemma3_seeded", "gpt_oss_seeded", "deepseek_v3_seeded",
           "falcon_seeded", "ALIBI_FAMILIES", "mpt_seeded", "bloom_seeded", "MORE_FAMILIES",
           "from_config"]

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


def from_config(config: str, model: str, **kw):
    """`transformers.<model>(transformers.<config>(...))`, seeded, with the small common sizes; bound to a family
    with functools.partial, which a spawned rank can unpickle (a closure it cannot)."""
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, config)(**{**_COMMON, "num_attention_heads": 4, "intermediate_size": 128, **kw})
    return getattr(transformers, model)(cfg)


def _from_config(config: str, model: str, **kw):
    return functools.partial(from_config, config, model, **kw)


_GPT_STYLE = dict(n_embd=64, n_layer=4, n_head=4, n_positions=64)  # GPT-2's config names, as GPT-J, CodeGen use

# More families a new user tries, each with its own way to lay out attention and the residual stream; plan.verify
# checks their programs against the module (tests/test_hf_verify_families.py).
MORE_FAMILIES = {
    # sliding-window attention shorter than the sequence, grouped-query attention
    "mistral": _from_config("MistralConfig", "MistralForCausalLM", num_key_value_heads=2, sliding_window=8),
    # partial rotary, attention and MLP side by side off one layer norm, a biased LM head
    "phi": _from_config("PhiConfig", "PhiForCausalLM"),
    # one fused qkv linear laid out per head ([q_h; k_h; v_h] for each head h)
    "gpt_neox": _from_config("GPTNeoXConfig", "GPTNeoXForCausalLM"),
    # parallel residual, rotary on interleaved pairs of a head's first dims
    "gptj": _from_config("GPTJConfig", "GPTJForCausalLM", rotary_dim=8, **_GPT_STYLE),
    # a fused qkv in mp_num groups, CodeGen's own layout
    "codegen": _from_config("CodeGenConfig", "CodeGenForCausalLM", rotary_dim=8, n_ctx=64, **_GPT_STYLE),
    # multi-query attention in one fused c_attn (h + 2 head dims wide)
    "gpt_bigcode": _from_config("GPTBigCodeConfig", "GPTBigCodeForCausalLM", **_GPT_STYLE),
    # layer norms on q and k per head, a fused qkv, partial rotary
    "persimmon": _from_config("PersimmonConfig", "PersimmonForCausalLM"),
    # norms after attention and MLP as well as before, logit soft-capping, alternating sliding windows
    "gemma2": _from_config("Gemma2Config", "Gemma2ForCausalLM", num_key_value_heads=2, head_dim=16, sliding_window=8),
    # attention and MLP in parallel, bias-free layer norm, scaled logits
    "cohere": _from_config("CohereConfig", "CohereForCausalLM", num_key_value_heads=2),
    # RMSNorm over all of q and of k (not per head) after their projections
    "olmo2": _from_config("Olmo2Config", "Olmo2ForCausalLM", num_key_value_heads=2),
    # a mixture of experts in every layer
    "mixtral": _from_config("MixtralConfig", "MixtralForCausalLM", num_key_value_heads=2, num_local_experts=4,
                            num_experts_per_tok=2),
    # learned positions offset by 2, tokens flattened to (b s, h) inside each layer
    "opt": _from_config("OPTConfig", "OPTForCausalLM", ffn_dim=128, word_embed_proj_dim=64),
    # a router that samples its experts while training (sparsemixer: exponential_ and rand_like in forward), and
    # a torch.autograd.Function with its own backward (its gradient estimator): pipeline and tensor plans refused
    "phimoe": _from_config("PhimoeConfig", "PhimoeForCausalLM", num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2),
    # scalar multipliers on the embeddings, each residual branch, the attention scores and the logits
    "granite": _from_config("GraniteConfig", "GraniteForCausalLM", num_key_value_heads=2, embedding_multiplier=12.0,
                            residual_multiplier=0.22, attention_multiplier=0.0078, logits_scaling=8.0),
    # one fused qkv_proj (q, k, v stacked, grouped-query) and one fused gate_up_proj (gate and up halves)
    "phi3": _from_config("Phi3Config", "Phi3ForCausalLM", num_key_value_heads=2),
    # experts beside a shared expert whose output a sigmoid gate scales per token
    "qwen2_moe": _from_config("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_key_value_heads=2, num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64),
    # a fused gate_up_proj, rotary on interleaved pairs of half of each head
    "glm": _from_config("GlmConfig", "GlmForCausalLM", num_key_value_heads=2, head_dim=16),
    # a router one module deeper (mlp.gate.wg), q/k layer norms, a shared MLP beside the experts
    "hunyuan_moe": _from_config("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", num_key_value_heads=2, num_experts=4,
                                moe_topk=2, head_dim=16),
    # sliding and full attention, the embeddings scaled by sqrt(hidden), norms on q, k and v: its fp32 rounding grows
    # past rtol over four layers, so plan.verify holds it to the module's own rounding (its fp32 against its fp64)
    "gemma4_unified_text": _from_config("Gemma4UnifiedTextConfig", "Gemma4UnifiedForCausalLM", num_key_value_heads=2,
                                        head_dim=16, sliding_window=8, tie_word_embeddings=False,
                                        layer_types=["sliding_attention", "full_attention"] * 2),
    # DeepSeek sparse attention over latent (MLA) attention: a no_grad indexer picks each query's top-k keys, and
    # export hands the size it computes, min(top-k, tokens), from the first layer to every later one
    "glm_moe_dsa": _from_config("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", num_key_value_heads=4, head_dim=8,
                                kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                index_head_dim=16, index_n_heads=4, index_topk=8, n_routed_experts=4,
                                num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
                                topk_group=1, n_shared_experts=1),
    # HunYuan v4: four residual streams mixed by hyper-connections, and top-k indices that a layer with an indexer
    # hands to the layers after it, which reuse them (layers 2, 3): a value besides the hidden state crosses the
    # cuts (partitioner.codegen.segment_carry). index_topk under the sequence length, so a wrong hand-off shows
    "hy_v4": _from_config("HYV4Config", "HYV4ForCausalLM", kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                          qk_nope_head_dim=8, v_head_dim=16, index_head_dim=16, index_n_heads=4, index_topk=8,
                          n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                          pad_token_id=0, bos_token_id=0, eos_token_id=0),
    # Gemma 4 (E2B, E4B) with per-layer inputs: the root's layer loop slices each layer's input out of a tensor the
    # prefix made, per_layer_inputs[:, :, i, :], between the blocks; those ops run in the block they feed, with its
    # index (partitioner.codegen.segment_glue), and the tensor crosses the cuts (segment_carry)
    "gemma4_text": _from_config("Gemma4TextConfig", "Gemma4ForCausalLM", num_key_value_heads=2, head_dim=16,
                                sliding_window=8, tie_word_embeddings=False, hidden_size_per_layer_input=16,
                                vocab_size_per_layer_input=512, layer_types=["sliding_attention", "full_attention"] * 2),
}
