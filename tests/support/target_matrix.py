"""The target architectures drafts are trained for, as tiny random configs of their own transformers classes
(built offline), and the frozen target's CPU attention paths: which cells run, and why the others are
refused. The matrix test (tests/training/test_target_matrix.py) and the docs table
(docs/reference/target-matrix.md) both read it."""

from __future__ import annotations

from tests.support.builders import TINY_TARGETS, VOCAB

LAYERS = 3
WINDOW = 4  # sliding window and chunk, in tokens: shorter than every test document, so they matter

_BASE = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
_ALTERNATING = ["sliding_attention", "full_attention", "sliding_attention"]
# Qwen3-Next's and Qwen3.5's Gated DeltaNet layers around a full-attention one.
_GATED_DELTANET = {
    "layer_types": ["linear_attention", "full_attention", "linear_attention"],
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
}

# architecture -> (what it stands for, config). Every one is its own transformers config class.
ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "llama": ("Llama 3", {**_BASE, "model_type": "llama"}),
    "qwen3": ("Qwen3", {**_BASE, "model_type": "qwen3"}),
    "deepseek_v3": ("DeepSeek-V3 (MLA, MoE)", {**TINY_TARGETS["deepseek_v3"], "num_hidden_layers": LAYERS}),
    "gpt_oss": (
        "gpt-oss (sliding window, attention sinks, MoE)",
        {
            **_BASE,
            "model_type": "gpt_oss",
            # gpt-oss's YaRN table stretches 4,096 positions by 32.
            "max_position_embeddings": 131072,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": WINDOW,
            "layer_types": _ALTERNATING,
        },
    ),
    "qwen3_moe": (
        "Qwen3-MoE",
        {
            **_BASE,
            "model_type": "qwen3_moe",
            "moe_intermediate_size": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
    ),
    "qwen3_next": (
        "Qwen3-Next (Gated DeltaNet linear attention, MoE)",
        {
            **_BASE,
            "model_type": "qwen3_next",
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            **_GATED_DELTANET,
        },
    ),
    "gemma3": (
        "Gemma 3 (sliding window)",
        {
            **_BASE,
            "model_type": "gemma3_text",
            "sliding_window": WINDOW,
            "layer_types": _ALTERNATING,
            "query_pre_attn_scalar": 8,
        },
    ),
    "glm4_moe": (
        "GLM-4.5 (MoE)",
        {
            **_BASE,
            "model_type": "glm4_moe",
            "moe_intermediate_size": 16,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
    "llama4": (
        "Llama 4 (chunked attention, MoE)",
        {
            **_BASE,
            "model_type": "llama4_text",
            "intermediate_size_mlp": 64,
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 1,
            "attention_chunk_size": WINDOW,
            "layer_types": ["chunked_attention", "full_attention", "chunked_attention"],
            "no_rope_layers": [1, 0, 1],
        },
    ),
    "mistral": (
        "Mistral (sliding window on every layer)",
        {**_BASE, "model_type": "mistral", "sliding_window": WINDOW},
    ),
    "gemma2": (
        "Gemma 2 (sliding window, logit soft-capping)",
        {
            **_BASE,
            "model_type": "gemma2",
            "sliding_window": WINDOW,
            "layer_types": _ALTERNATING,
            "query_pre_attn_scalar": 8,
            # Caps near the tiny model's own score and logit sizes, so that a cap left out shows.
            "attn_logit_softcapping": 0.05,
            "final_logit_softcapping": 0.5,
        },
    ),
    "qwen3_5": (
        "Qwen3.5 (Gated DeltaNet linear attention)",
        {
            **_BASE,
            "model_type": "qwen3_5_text",
            **_GATED_DELTANET,
        },
    ),
    "kimi_linear": (
        "Kimi Linear (Kimi Delta Attention, MLA, MoE)",
        {
            **_BASE,
            "model_type": "kimi_linear",
            "num_key_value_heads": 4,
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
            "mlp_layer_types": ["dense", "sparse", "sparse"],
            "moe_intermediate_size": 16,
            "num_experts": 4,
            "num_experts_per_token": 2,
            "num_shared_experts": 1,
            "kv_lora_rank": 16,
            "q_lora_rank": None,
            "qk_rope_head_dim": 4,
            "qk_nope_head_dim": 4,
            "qk_head_dim": 8,
            "v_head_dim": 8,
            "linear_head_dim": 8,
            "linear_num_heads": 4,
            "linear_conv_kernel_dim": 4,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
    "deepseek_v4": (
        "DeepSeek-V4 (compressed and sparse attention, hyper-connections, MoE)",
        {
            **_BASE,
            "model_type": "deepseek_v4",
            "num_key_value_heads": 1,
            "head_dim": 16,
            "q_lora_rank": 16,
            "qk_rope_head_dim": 4,
            "moe_intermediate_size": 16,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "layer_types": [
                "heavily_compressed_attention",
                "compressed_sparse_attention",
                "heavily_compressed_attention",
            ],
            "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
            "mlp_layer_types": ["hash_moe", "moe", "moe"],
            "o_groups": 2,
            "o_lora_rank": 16,
            "index_n_heads": 2,
            "index_head_dim": 8,
            "index_topk": 4,
            "sliding_window": WINDOW,
        },
    ),
    "qwen3_vl": (
        "Qwen3-VL on text (a vision-language model's language model)",
        {
            "model_type": "qwen3_vl",
            "text_config": {
                **{key: value for key, value in _BASE.items() if key != "tie_word_embeddings"},
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "mrope_section": [1, 1, 2],
                },
            },
            "vision_config": {
                "depth": 1,
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_heads": 2,
                "out_hidden_size": 32,
                "deepstack_visual_indexes": [0],
            },
            "tie_word_embeddings": False,
        },
    ),
}

# The frozen target's attention paths on the CPU: attn_backend -> what it runs.
PATHS = {
    "sdpa": "each document alone: fused flash kernel per document (a windowed or chunked layer's mask "
    "document-sized)",
    "eager": "transformers' eager attention, one per-document mask per layer type",
    "flex": "flex attention (eager on the CPU), one per-document block mask per layer type",
    # A target with linear-attention layers runs one decoder forward per document on every path, through the
    # model's own attention: its recurrent state and convolution take no document bounds.
}

# (architecture, path) -> the refusal's message, matched whole (each names the layer kind and the path that can).
REFUSED: dict[tuple[str, str], str] = {
    (
        "gpt_oss",
        "sdpa",
    ): "transformers runs GptOssForCausalLM without 'sdpa' attention, which attn_backend='sdpa' "
    "needs; run the target with attn_backend='eager'",
    ("gpt_oss", "flex"): "the target's attention sinks do not run in flex attention on the CPU "
    "(attn_backend='flex'); run it with attn_backend='eager' on the CPU",
    (
        "qwen3_next",
        "flex",
    ): "transformers runs Qwen3NextForCausalLM without 'flex_attention' attention, which "
    "attn_backend='flex' needs; run the target with attn_backend='sdpa'",
    (
        "gemma2",
        "sdpa",
    ): "transformers runs Gemma2ForCausalLM without 'sdpa' attention, which attn_backend='sdpa' "
    "needs; run the target with attn_backend='eager'",
    (
        "qwen3_5",
        "flex",
    ): "transformers runs Qwen3_5ForCausalLM without 'flex_attention' attention, which "
    "attn_backend='flex' needs; run the target with attn_backend='sdpa'",
    (
        "kimi_linear",
        "flex",
    ): "transformers runs KimiLinearForCausalLM without 'flex_attention' attention, which "
    "attn_backend='flex' needs; run the target with attn_backend='sdpa'",
    (
        "deepseek_v4",
        "sdpa",
    ): "transformers runs DeepseekV4ForCausalLM without 'sdpa' attention, which attn_backend='sdpa' "
    "needs; run the target with attn_backend='eager'",
    (
        "deepseek_v4",
        "eager",
    ): "decoder layer 0 of the target outputs (1, 64, 4, 32), not one hidden state per token "
    "[batch, tokens, hidden] (several residual streams, as DeepSeek-V4's hyper-connections and Gemma 3n's "
    "AltUp keep): no draft here reads such a layer's features",
    (
        "deepseek_v4",
        "flex",
    ): "transformers runs DeepseekV4ForCausalLM without 'flex_attention' attention, which "
    "attn_backend='flex' needs; run the target with attn_backend='eager'",
    (
        "qwen3_vl",
        "flex",
    ): "transformers runs Qwen3VLForConditionalGeneration without 'flex_attention' attention, which "
    "attn_backend='flex' needs; run the target with attn_backend='sdpa'",
}

# Draft module class -> the only architectures it trains on (every other class trains on all of them), and the
# refusal the others get.
FAMILY_ONLY = {"MLAEagle3Module": ("deepseek_v3", "kimi_linear")}
FAMILY_REFUSAL = {"MLAEagle3Module": "lacks the MLA fields"}

CELLS = [(architecture, path) for architecture in ARCHITECTURES for path in PATHS]
TESTED = [cell for cell in CELLS if cell not in REFUSED]


def config(architecture: str) -> dict:
    return dict(ARCHITECTURES[architecture][1])


def first_path(architecture: str) -> str | None:
    """The first path that runs ``architecture`` (the one a draft is trained through in the matrix), or
    ``None`` where every path refuses it."""
    return next((path for path in PATHS if (architecture, path) not in REFUSED), None)


def family_trains(module_name: str, architecture: str) -> bool:
    return architecture in FAMILY_ONLY.get(module_name, ARCHITECTURES)


def matrix_table(module_names: list[str]) -> str:
    """The matrix as the docs show it (docs/reference/target-matrix.md): one row per architecture, one column
    per path (``tested``, or the refusal), and the draft classes that train a step on it."""
    header = [
        "architecture",
        "model_type",
        *(f"`{path}`" for path in PATHS),
        "draft classes trained a step (first tested path)",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for architecture, (title, fields) in ARCHITECTURES.items():
        cells = [
            f"refused: {REFUSED[architecture, path]}" if (architecture, path) in REFUSED else "tested"
            for path in PATHS
        ]
        trained = (
            ", ".join(name for name in module_names if family_trains(name, architecture))
            if first_path(architecture)
            else "none: no path runs it"
        )
        lines.append(f"| {title} | `{fields['model_type']}` | " + " | ".join(cells) + f" | {trained} |")
    return "\n".join(lines)
