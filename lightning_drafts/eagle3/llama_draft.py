"""The dense Llama-style EAGLE-3 draft (docs/concepts/eagle3.md#dense-draft), configured from the target's
text config.

Used for Llama, Qwen3, Phi-3 and other dense targets: grouped-query attention with the target's head
layout and RoPE, q/k/v projections of width ``2H`` (embedding ‖ hidden), SwiGLU MLP.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torch import Tensor, nn

from lightning_drafts.eagle3.draft_base import (
    Eagle3DecoderLayer,
    Eagle3Draft,
    GatedMLP,
    TTTAttention,
    shared_fields,
)
from lightning_drafts.eagle3.rope import FrequencyTable, llama_rope_table, rotate_half_rope


@dataclass(frozen=True)
class LlamaDraftConfig:
    """The dense draft's shape, cloned from the target (``num_hidden_layers`` is always 1)."""

    vocab_size: int
    hidden_size: int
    target_hidden_size: int
    draft_vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    hidden_act: str
    rms_norm_eps: float
    attention_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict | None
    initializer_range: float

    @classmethod
    def from_target(
        cls, text_config: Any, vocab_size: int, draft_vocab_size: int, biases: bool | None = None
    ) -> LlamaDraftConfig:
        """``biases``: ``None`` or ``True`` take the target's ``attention_bias`` / ``mlp_bias``; ``False``
        gives the draft none."""
        heads = text_config.num_attention_heads
        return cls(
            **shared_fields(text_config, vocab_size, draft_vocab_size),
            num_attention_heads=heads,
            num_key_value_heads=getattr(text_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(text_config, "head_dim", None) or text_config.hidden_size // heads,
            hidden_act=getattr(text_config, "hidden_act", "silu"),
            attention_bias=biases is not False and bool(getattr(text_config, "attention_bias", False)),
            mlp_bias=biases is not False and bool(getattr(text_config, "mlp_bias", False)),
            max_position_embeddings=getattr(text_config, "max_position_embeddings", 4096),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class LlamaDraftAttention(TTTAttention):
    """GQA attention over the fused ``2H`` input, with the target's rotate-half RoPE."""

    def __init__(self, config: LlamaDraftConfig, rope: FrequencyTable) -> None:
        super().__init__()
        width, head_dim = 2 * config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            head_dim,
        )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        bias = config.attention_bias
        self.q_proj = nn.Linear(width, self.num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(width, self.num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(width, self.num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * head_dim, config.hidden_size, bias=bias)
        self.rope = rope
        self.scale = head_dim**-0.5

    def project_query(self, fused: Tensor, positions: Tensor) -> Tensor:
        batch, width, _ = fused.shape
        query = self.q_proj(fused).view(batch, width, self.num_heads, self.head_dim).transpose(1, 2)
        return rotate_half_rope(query, self.rope.angles(positions), self.rope.attention_scaling)

    def project_key_value(self, fused: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        batch, width, _ = fused.shape
        key = self.k_proj(fused).view(batch, width, self.num_kv_heads, self.head_dim).transpose(1, 2)
        value = self.v_proj(fused).view(batch, width, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return rotate_half_rope(key, self.rope.angles(positions), self.rope.attention_scaling), value


class LlamaEagle3Draft(Eagle3Draft):
    """The dense EAGLE-3 draft; ``state_dict()`` keys are the ``LlamaForCausalLMEagle3`` layout."""

    def __init__(self, config: LlamaDraftConfig, rope: FrequencyTable) -> None:
        attention = LlamaDraftAttention(config, rope)
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias=config.mlp_bias)
        super().__init__(config, Eagle3DecoderLayer(config.hidden_size, config.rms_norm_eps, attention, mlp))


def build_llama_draft(
    text_config: Any, vocab_size: int, draft_vocab_size: int, biases: bool | None = None
) -> LlamaEagle3Draft:
    """The dense draft for a target whose text config is ``text_config`` (``biases``: see
    :meth:`LlamaDraftConfig.from_target`)."""
    config = LlamaDraftConfig.from_target(text_config, vocab_size, draft_vocab_size, biases)
    return LlamaEagle3Draft(config, llama_rope_table(text_config))
