"""The DeepSeek-V3 MLA EAGLE-3 draft (docs/concepts/eagle3.md#mla-draft), configured from the target's text
config.

Multi-head latent attention: optional low-rank q (``q_a_proj`` → RMSNorm → ``q_b_proj``), a shared
low-rank kv latent plus one rope key shared by every head (``kv_a_proj_with_mqa``), per-head nope keys and
values from ``kv_b_proj``; DeepSeek's interleaved RoPE on the rope part, with fp32 frequencies that stay
fp32 after casts. The MLP is the target's *dense* FFN width with SiLU; MoE fields are not replicated.
The attention itself is the shared TTT attention (Block 1 under the block-causal mask + diagonals), so
the MLA draft runs the same dense-mask path on CPU and flex ``BlockMask`` on GPU as the dense draft.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_drafts.eagle3.draft_base import (
    Eagle3DecoderLayer,
    Eagle3Draft,
    GatedMLP,
    RMSNorm,
    TTTAttention,
    shared_fields,
)
from lightning_drafts.eagle3.rope import FrequencyTable, deepseek_rope_table, interleaved_rope

MLA_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass(frozen=True)
class MLADraftConfig:
    """The MLA draft's shape, cloned from a DeepSeek-V3 target (``num_hidden_layers`` is always 1)."""

    vocab_size: int
    hidden_size: int
    target_hidden_size: int
    draft_vocab_size: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict | None
    initializer_range: float

    @classmethod
    def from_target(cls, text_config: Any, vocab_size: int, draft_vocab_size: int) -> MLADraftConfig:
        missing = [name for name in MLA_FIELDS if getattr(text_config, name, None) is None]
        if missing:
            raise ValueError(
                f"the target config ({type(text_config).__name__}) lacks the MLA fields {missing}; "
                "MLAEagle3Module needs a DeepSeek-V3-style target (use Eagle3Module for dense targets)"
            )
        return cls(
            **shared_fields(text_config, vocab_size, draft_vocab_size),
            num_attention_heads=text_config.num_attention_heads,
            q_lora_rank=getattr(text_config, "q_lora_rank", None),
            kv_lora_rank=text_config.kv_lora_rank,
            qk_nope_head_dim=text_config.qk_nope_head_dim,
            qk_rope_head_dim=text_config.qk_rope_head_dim,
            v_head_dim=text_config.v_head_dim,
            max_position_embeddings=getattr(text_config, "max_position_embeddings", None) or 4096,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class MLADraftAttention(TTTAttention):
    """Multi-head latent attention over the fused ``2H`` input (no GQA, no biases)."""

    def __init__(self, config: MLADraftConfig) -> None:
        super().__init__()
        width, heads = 2 * config.hidden_size, config.num_attention_heads
        self.num_heads, self.nope_dim, self.rope_dim = heads, config.qk_nope_head_dim, config.qk_rope_head_dim
        self.kv_lora_rank, self.v_head_dim = config.kv_lora_rank, config.v_head_dim
        qk_dim = self.nope_dim + self.rope_dim
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(width, heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(width, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(width, config.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, heads * (self.nope_dim + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_head_dim, config.hidden_size, bias=False)
        self.rope = deepseek_rope_table(
            self.rope_dim, config.rope_theta, config.max_position_embeddings, config.rope_scaling
        )
        # No YaRN mscale on the softmax scale: the reference draft learns around it
        # (docs/concepts/eagle3.md#mla-attention-and-rope).
        self.scale = qk_dim**-0.5

    def project_query(self, fused: Tensor, positions: Tensor) -> Tensor:
        batch, width, _ = fused.shape
        query = self._query(fused).view(batch, width, self.num_heads, -1).transpose(1, 2)
        query_nope, query_rope = query.split([self.nope_dim, self.rope_dim], dim=-1)
        return torch.cat([query_nope, interleaved_rope(query_rope, self.rope.angles(positions))], dim=-1)

    def project_key_value(self, fused: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        batch, width, _ = fused.shape
        latent, key_rope = self.kv_a_proj_with_mqa(fused).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        per_head = self.kv_b_proj(self.kv_a_layernorm(latent)).view(batch, width, self.num_heads, -1)
        key_nope, value = per_head.transpose(1, 2).split([self.nope_dim, self.v_head_dim], dim=-1)
        key_rope = interleaved_rope(key_rope[:, None], self.rope.angles(positions))
        key = torch.cat([key_nope, key_rope.expand(-1, self.num_heads, -1, -1)], dim=-1)
        return key, value.contiguous()

    def _query(self, fused: Tensor) -> Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(fused)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(fused)))


class MLAEagle3Draft(Eagle3Draft):
    """The DeepSeek MLA EAGLE-3 draft (same skeleton and key names as the dense draft, MLA attention)."""

    def __init__(self, config: MLADraftConfig) -> None:
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, "silu")
        attention = MLADraftAttention(config)
        super().__init__(config, Eagle3DecoderLayer(config.hidden_size, config.rms_norm_eps, attention, mlp))

    @property
    def rope(self) -> FrequencyTable:
        return self.midlayer.self_attn.rope


def build_mla_draft(text_config: Any, vocab_size: int, draft_vocab_size: int) -> MLAEagle3Draft:
    """The MLA draft for a DeepSeek-V3-style target whose text config is ``text_config``."""
    return MLAEagle3Draft(MLADraftConfig.from_target(text_config, vocab_size, draft_vocab_size))
