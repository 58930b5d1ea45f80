"""Tiny configs of the families released in 2025-26 (Qwen3.5 / Qwen3-Next, Gemma 4, DeepSeek-V3.2, GLM-5, Llama 4,
OLMo 3, GLM-4.5, MiniMax-M2, DeepSeek-V4), built in code, each with the shapes that make its family what it is: hybrid
linear / full attention layers, sliding and global layers with heads of their own size, latent attention with an
indexer, interleaved dense and MoE layers, shared experts, router biases, compressed attention, hash routing and
hyper-connections. Head counts divide by 2 and 3 wherever the family
allows, so TP=2 and TP=3 cut whole heads; MLP widths (160) and the vocabulary (101) do not divide by 3.
"""

from __future__ import annotations

from typing import Any

#: Sizes every family here shares: the vocabulary and width of demo/models.py's tiny configs.
COMMON: dict[str, Any] = dict(vocab_size=101, hidden_size=64, max_position_embeddings=64, tie_word_embeddings=False)


def _hybrid_qwen(model_type: str) -> dict[str, Any]:
    """Qwen3.5 / Qwen3-Next: three gated-DeltaNet layers, then full attention (the releases' cycle of 4)."""
    settings: dict[str, Any] = dict(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                                    num_attention_heads=6, num_key_value_heads=3, head_dim=8,
                                    linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)
    if model_type == "qwen3_5_text":  # dense: two value heads per key head
        settings.update(intermediate_size=160, linear_num_key_heads=6, linear_num_value_heads=12)
    elif model_type == "qwen3_5_moe_text":
        settings.update(linear_num_key_heads=6, linear_num_value_heads=12, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=48, shared_expert_intermediate_size=80)
    else:  # qwen3_next: its fused projections, one value head per key head, 12 attention heads over 6 KV heads
        settings.update(num_attention_heads=12, num_key_value_heads=6, intermediate_size=160,
                        linear_num_key_heads=6, linear_num_value_heads=6, num_experts=6, num_experts_per_tok=2,
                        moe_intermediate_size=32, shared_expert_intermediate_size=96)
    return settings


def _mla_indexer(model_type: str) -> dict[str, Any]:
    """DeepSeek-V3.2 / GLM-5: one dense layer, then MoE layers; latent attention with a sparse-attention indexer
    that keeps 8 keys per query (fewer than the sequence, so the choice matters)."""
    settings: dict[str, Any] = dict(num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=160,
                                    n_shared_experts=1, num_experts_per_tok=2, index_topk=8, q_lora_rank=32,
                                    kv_lora_rank=16)
    if model_type == "deepseek_v32":  # 8 experts in 2 groups, top-1 group
        settings.update(num_attention_heads=6, num_key_value_heads=6, n_routed_experts=8, n_group=2, topk_group=1,
                        moe_intermediate_size=48, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                        index_n_heads=4, index_head_dim=8)
    else:  # glm_moe_dsa: no groups, wider heads
        settings.update(num_attention_heads=4, num_key_value_heads=4, n_routed_experts=6, n_group=1, topk_group=1,
                        moe_intermediate_size=32, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=16,
                        index_n_heads=2, index_head_dim=16)
    return settings


#: Each family's settings beyond COMMON (the registry's spelling).
SETTINGS: dict[str, Any] = {
    "qwen3.5": lambda: _hybrid_qwen("qwen3_5_text"),
    "qwen3.5-moe": lambda: _hybrid_qwen("qwen3_5_moe_text"),
    "qwen3-next": lambda: _hybrid_qwen("qwen3_next"),
    "deepseek-v3.2": lambda: _mla_indexer("deepseek_v32"),
    "glm-5": lambda: _mla_indexer("glm_moe_dsa"),
    # Five sliding layers and a global one whose heads are twice as wide; per-layer inputs (E2B / E4B); tied.
    "gemma4": lambda: dict(num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"],
                           num_attention_heads=6, num_key_value_heads=3, head_dim=8,
                           per_layer_config={"05": {"head_dim": 16}}, intermediate_size=160, sliding_window=8,
                           vocab_size_per_layer_input=101, hidden_size_per_layer_input=8, tie_word_embeddings=True),
    # Dense, MoE, dense, MoE (interleave step 2); RoPE left out of the 4th layer; attention in chunks of 8 tokens.
    "llama4": lambda: dict(num_hidden_layers=4, interleave_moe_layer_step=2, no_rope_layer_interval=4,
                           attention_chunk_size=8, num_attention_heads=12, num_key_value_heads=6, head_dim=8,
                           intermediate_size=48, intermediate_size_mlp=160, num_local_experts=4,
                           num_experts_per_tok=1),
    # Three sliding-window layers and a global one; q/k norms over the whole projection.
    "olmo3": lambda: dict(num_hidden_layers=4, layer_types=["sliding_attention"] * 3 + ["full_attention"],
                          sliding_window=8, num_attention_heads=8, num_key_value_heads=2, intermediate_size=160,
                          pad_token_id=0, eos_token_id=1),
    # One dense layer then MoE layers (router bias, a shared expert); q/k/v biases, per-head q/k norms, half rotary.
    "glm-4.5": lambda: dict(num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=12,
                            num_key_value_heads=6, head_dim=8, attention_bias=True, use_qk_norm=True,
                            partial_rotary_factor=0.5, intermediate_size=160, moe_intermediate_size=48,
                            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1),
    # Every layer MoE (router bias, sigmoid scores); q/k norms over the whole projection; partial rotary.
    "minimax-m2": lambda: dict(num_hidden_layers=2, num_attention_heads=12, num_key_value_heads=6, head_dim=8,
                               rotary_dim=4, intermediate_size=48, num_local_experts=6, num_experts_per_tok=2,
                               bos_token_id=1, eos_token_id=2),
    # A heavily compressed layer, a compressed sparse one (its indexer keeps 2 of the 4 compressed entries of a
    # 16-token sequence) and a sliding-window one; a hash-routed MoE layer, then top-k ones; one shared KV head,
    # 12 query heads in 6 output groups; 4 hyper-connection streams. Compression every 4 / 8 tokens, so the test's
    # sequences fill whole windows of both. Expert widths of 32: whole blocks of the release's FP4 experts.
    "deepseek-v4": lambda: dict(num_hidden_layers=3, layer_types=["heavily_compressed_attention",
                                                                  "compressed_sparse_attention", "sliding_attention"],
                                mlp_layer_types=["hash_moe", "moe", "moe"], sliding_window=8,
                                compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                                num_attention_heads=12, num_key_value_heads=1, head_dim=16, partial_rotary_factor=0.25,
                                q_lora_rank=32, o_groups=6, o_lora_rank=8, index_n_heads=4, index_head_dim=8,
                                index_topk=2, moe_intermediate_size=32, n_routed_experts=6, num_experts_per_tok=2,
                                n_shared_experts=1),
}


def _maxtext_hybrid_qwen(head_dim: int, **settings: Any) -> dict[str, Any]:
    """Qwen3-Next / Qwen3.5-MoE at the MaxText sizes: two value heads per DeltaNet key head, key and value heads of
    different widths, a quarter of each attention head rotated."""
    return dict(num_attention_heads=64 // head_dim, num_key_value_heads=32 // head_dim, head_dim=head_dim,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
                linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=32, vocab_size=256, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                **settings)


#: The MaxText sizes of the families deepspeed-ext maps to MaxText (heads of ``head_dim``: 64 / it query heads, 32 /
#: it KV heads, vocabulary 256, MLP 128), with the family's constants as MaxText's config sets them.
MAXTEXT_SETTINGS: dict[str, Any] = {
    # One whole cycle of MaxText's fixed pattern (three sliding-window layers, one global); plain RoPE.
    "olmo3": lambda head_dim: dict(num_hidden_layers=4, layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                   sliding_window=4, num_attention_heads=64 // head_dim,
                                   num_key_value_heads=32 // head_dim, intermediate_size=128, vocab_size=256,
                                   rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1,
                                   rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    # DeepSeek-V3's MaxText sizes (one dense layer, two MoE layers, MLA) and an indexer keeping 6 of the 12 tokens.
    "deepseek-v3.2": lambda head_dim: dict(num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=64 // head_dim,
                                           num_key_value_heads=64 // head_dim, intermediate_size=128,
                                           moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                                           num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=32,
                                           kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=head_dim,
                                           v_head_dim=head_dim, index_n_heads=4, index_head_dim=16, index_topk=6,
                                           vocab_size=256, rms_norm_eps=1e-6,
                                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # Dense, MoE, dense, MoE-without-RoPE: one whole cycle; attention in chunks of 4 of the test's 12 tokens.
    "llama4": lambda head_dim: dict(num_hidden_layers=4, interleave_moe_layer_step=2, no_rope_layer_interval=4,
                                    attention_chunk_size=4, num_attention_heads=64 // head_dim,
                                    num_key_value_heads=32 // head_dim, head_dim=head_dim, intermediate_size=32,
                                    intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1,
                                    vocab_size=256, rms_norm_eps=1e-5,
                                    rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    # Gemma 4 as the 31B is (MaxText's gemma4 decoder, which scans): one cycle of five sliding layers and a global
    # one with twice-wide heads, fewer KV heads and its keys as values; no per-layer inputs (the training config's
    # E2B-like ones are MaxText's gemma4_small, which does not scan); transformers' RoPE; tied, logits capped at 30.
    "gemma4": lambda head_dim: dict(num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"],
                                    sliding_window=4, num_attention_heads=64 // head_dim,
                                    num_key_value_heads=32 // head_dim, head_dim=head_dim, global_head_dim=2 * head_dim,
                                    num_global_key_value_heads=16 // head_dim, attention_k_eq_v=True,
                                    intermediate_size=128, hidden_size_per_layer_input=0, vocab_size=256,
                                    rms_norm_eps=1e-6, final_logit_softcapping=30.0, tie_word_embeddings=True),
    # Two whole cycles of three gated-DeltaNet layers and full attention (Qwen3-Next: and two linear layers past
    # them, which MaxText scans apart); MoE everywhere, the shared expert as wide as a routed one.
    "qwen3-next": lambda head_dim: _maxtext_hybrid_qwen(head_dim, num_hidden_layers=10),
    "qwen3.5-moe": lambda head_dim: _maxtext_hybrid_qwen(head_dim, num_hidden_layers=8),
    # Gemma 4 as the E2B is (MaxText's gemma4_small decoder, unscanned): two cycles of four sliding layers and a
    # global one, per-layer inputs, the last four layers reading their keys and values from earlier layers with
    # double-wide MLPs; untied without a logit cap (MaxText caps a tied head's logits only).
    "gemma4-e2b": lambda head_dim: dict(
        num_hidden_layers=10, layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 2, sliding_window=4,
        num_attention_heads=64 // head_dim, num_key_value_heads=32 // head_dim, head_dim=head_dim,
        global_head_dim=2 * head_dim, intermediate_size=128, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=256, num_kv_shared_layers=4, use_double_wide_mlp=True, vocab_size=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False, final_logit_softcapping=None),
    # Gemma 4 as the 26B is: the MoE block beside the dense MLP, two whole cycles (MaxText scans the sliding layers
    # over cycles x positions), one global KV head whose keys are its values; untied without a logit cap.
    "gemma4-moe": lambda head_dim: dict(
        num_hidden_layers=12, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 2, sliding_window=4,
        num_attention_heads=64 // head_dim, num_key_value_heads=32 // head_dim, head_dim=head_dim,
        global_head_dim=2 * head_dim, num_global_key_value_heads=1, attention_k_eq_v=True, intermediate_size=128,
        hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
        moe_intermediate_size=32, vocab_size=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
        final_logit_softcapping=None),
    # DeepSeek-V4 as MaxText scans it: two hash-routed layers (sliding-window, compressed sparse), then two cycles of
    # a heavily compressed layer (at 128, MaxText's scanned blocks' compression: too long for the test's 12 tokens to
    # fill a window) and a compressed sparse one (at 4: 3 entries, the indexer keeping 1); a window of 4 tokens, so
    # the compressed entries count; 4 hyper-connection streams, 8 experts, a quarter of each head rotated.
    "deepseek-v4": lambda head_dim: _maxtext_deepseek_v4(
        head_dim, ["sliding_attention", "compressed_sparse_attention"] + ["heavily_compressed_attention",
                                                                          "compressed_sparse_attention"] * 2,
        hash_layers=2, hca_rate=128),
    # Its heavily compressed layers at 8, which the 12 tokens fill (unscanned only: MaxText scans them at 128).
    "deepseek-v4-hca": lambda head_dim: _maxtext_deepseek_v4(
        head_dim, ["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                   "heavily_compressed_attention"], hash_layers=1, hca_rate=8),
}


def _maxtext_deepseek_v4(head_dim: int, layer_types: list[str], hash_layers: int, hca_rate: int) -> dict[str, Any]:
    return dict(num_hidden_layers=len(layer_types), layer_types=layer_types,
                mlp_layer_types=["hash_moe"] * hash_layers + ["moe"] * (len(layer_types) - hash_layers),
                compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": hca_rate},
                sliding_window=4, num_attention_heads=64 // head_dim, num_key_value_heads=1, head_dim=head_dim,
                partial_rotary_factor=0.25, q_lora_rank=32, o_groups=2, o_lora_rank=16, index_n_heads=4,
                index_head_dim=16, index_topk=1, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                n_shared_experts=1, vocab_size=256, rms_norm_eps=1e-6)


#: Test variants at the MaxText sizes only: another config of a registry family (its mapping), each covering a part
#: of the family's MaxText mapping the family's own MaxText config leaves out.
MAXTEXT_VARIANTS = {"gemma4-e2b": "gemma4", "gemma4-moe": "gemma4", "deepseek-v4-hca": "deepseek-v4"}


def recent_tiny_config(family: str, maxtext_head_dim: int | None = None) -> Any:
    """The tiny transformers config of ``family`` (a key of :data:`SETTINGS`), at the training sizes, or with
    ``maxtext_head_dim`` at the MaxText sizes (:data:`MAXTEXT_SETTINGS`; a :data:`MAXTEXT_VARIANTS` name too)."""
    from transformers import AutoConfig

    from deepspeed_ext.checkpoint.families import get_family
    if maxtext_head_dim is None:
        if family in MAXTEXT_VARIANTS:
            raise ValueError(f"test variant {family!r} has MaxText sizes only")
        settings = {**COMMON, **SETTINGS[family]()}
    else:
        if family not in MAXTEXT_SETTINGS:
            raise ValueError(f"family {family!r} has no MaxText sizes (no MaxText mapping)")
        settings = {**COMMON, **MAXTEXT_SETTINGS[family](maxtext_head_dim)}
    return AutoConfig.for_model(get_family(MAXTEXT_VARIANTS.get(family, family)).model_type, **settings)
