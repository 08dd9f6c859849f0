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
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
            "linear_conv_kernel_dim": 4,
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
}

# Draft module class -> the only architectures it trains on (every other class trains on all of them), and the
# refusal the others get.
FAMILY_ONLY = {"MLAEagle3Module": ("deepseek_v3",)}
FAMILY_REFUSAL = {"MLAEagle3Module": "lacks the MLA fields"}

CELLS = [(architecture, path) for architecture in ARCHITECTURES for path in PATHS]
TESTED = [cell for cell in CELLS if cell not in REFUSED]


def config(architecture: str) -> dict:
    return dict(ARCHITECTURES[architecture][1])


def first_path(architecture: str) -> str:
    """The first path that runs ``architecture`` (the one a draft is trained through in the matrix)."""
    return next(path for path in PATHS if (architecture, path) not in REFUSED)


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
        trained = ", ".join(name for name in module_names if family_trains(name, architecture))
        lines.append(f"| {title} | `{fields['model_type']}` | " + " | ".join(cells) + f" | {trained} |")
    return "\n".join(lines)
