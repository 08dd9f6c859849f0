"""The tiny random targets (configs built offline, 96-token vocabulary, 256 positions) that the test suite and
the CPU benchmarks build drafts on: one per architecture family a draft reads (Llama, Qwen3, DeepSeek-V3 MLA)."""

from __future__ import annotations

VOCAB = 96

TINY_TARGETS = {
    "llama": {
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    },
    "qwen3": {
        "model_type": "qwen3",
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    },
    "deepseek_v3": {
        "model_type": "deepseek_v3",
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 8,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "q_lora_rank": 16,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    },
}
