"""The EAGLE-3 draft skeleton shared by the dense and the MLA draft (docs/concepts/eagle3.md#dense-draft,
docs/concepts/eagle3.md#mla-draft).

``fc`` fuses the three captured target layers; one decoder layer (``midlayer``) reads the concatenation
of the normalised token embedding and the normalised carried hidden state (width ``2H``) and adds its
attention output to the **carried hidden state** (not the embedding); ``norm`` + ``lm_head`` give logits
over the draft vocabulary. Only the attention's q/k/v projections differ between the two drafts.

Parameter names follow the EAGLE-3 serving layout (``fc``, ``midlayer.*``, ``norm``, ``lm_head``,
``embed_tokens``, ``d2t``, ``t2d``), so ``state_dict()`` is what vLLM and SGLang load.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers.activations import ACT2FN

from lightning_drafts.eagle3.live_slots import at_slots, one_row
from lightning_drafts.eagle3.rope import resolve_rope_theta, rope_scaling_of
from lightning_drafts.eagle3.ttt import TTTCache, ttt_attention


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back (what the HF targets and the serving kernels do)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = ACT2FN[hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class TTTAttention(nn.Module):
    """Attention over the TTT cache; subclasses supply the projections, RoPE and ``o_proj``."""

    scale: float
    o_proj: nn.Linear

    def project_query(self, fused: Tensor, positions: Tensor) -> Tensor:
        """``q`` as ``[B, heads, T, d]`` with RoPE applied at ``positions``."""
        raise NotImplementedError(f"{type(self).__name__} must implement project_query")

    def project_key_value(self, fused: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """``k, v`` as ``[B, kv_heads, T, d]`` with RoPE applied to ``k`` at ``positions``: the draft's own
        key/value heads, a divisor of the query heads (grouped-query attention), never repeated out."""
        raise NotImplementedError(f"{type(self).__name__} must implement project_key_value")

    def forward(
        self, fused: Tensor, positions: Tensor, cache: TTTCache, mask: Any, queries: Tensor | None = None
    ) -> Tensor:
        """``[B, T, H]`` attention outputs, or ``[1, N, H]`` at the flat slots ``queries`` only: then the keys
        and values of every slot enter the cache as one row of ``B * T`` (the layout ``mask`` indexes)."""
        key, value = self.project_key_value(fused, positions)
        if queries is None:
            query = self.project_query(fused, positions)
        else:
            key, value = one_row(key), one_row(value)
            query = self.project_query(at_slots(fused, queries), at_slots(positions, queries))
        out = ttt_attention(query, key, value, cache, mask, self.scale)
        batch, _, width, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(batch, width, -1))


class Eagle3DecoderLayer(nn.Module):
    """The draft's single decoder layer (``midlayer``)."""

    def __init__(self, hidden_size: int, eps: float, self_attn: TTTAttention, mlp: GatedMLP) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.hidden_norm = RMSNorm(hidden_size, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = mlp

    def forward(
        self,
        embeds: Tensor,
        hidden: Tensor,
        positions: Tensor,
        cache: TTTCache,
        mask: Any,
        queries: Tensor | None = None,
    ) -> Tensor:
        fused = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        if queries is not None:
            hidden = at_slots(hidden, queries)
        hidden = hidden + self.self_attn(fused, positions, cache, mask, queries)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def shared_fields(text_config: Any, vocab_size: int, draft_vocab_size: int) -> dict[str, Any]:
    """The config fields both drafts clone from the target's text config the same way: sizes, the MLP
    width, RMSNorm eps, RoPE base and scaling, the initialisation std."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": text_config.hidden_size,
        "target_hidden_size": text_config.hidden_size,
        "draft_vocab_size": draft_vocab_size,
        "intermediate_size": text_config.intermediate_size,
        "rms_norm_eps": getattr(text_config, "rms_norm_eps", 1e-6),
        "rope_theta": resolve_rope_theta(text_config),
        "rope_scaling": rope_scaling_of(text_config),
        "initializer_range": getattr(text_config, "initializer_range", 0.02),
    }


class Eagle3Draft(nn.Module):
    """An EAGLE-3 draft: frozen embedding copy, ``fc``, one ``midlayer``, ``norm``, ``lm_head``, d2t/t2d.

    Args:
        config: the draft's config (:class:`~lightning_drafts.eagle3.llama_draft.LlamaDraftConfig` or
            :class:`~lightning_drafts.eagle3.mla_draft.MLADraftConfig`), of which the skeleton reads the
            :func:`shared_fields`: the target vocabulary ``V`` (embedding rows, ``t2d`` length), the draft
            width ``H``, each captured layer's width, ``V_d`` (the LM-head rows), RMSNorm eps and the
            initialisation std.
        midlayer: the decoder layer (it decides dense vs MLA attention).
    """

    # The TTT unroll starts here instead of at `forward` (see DraftModule.configure_model).
    fsdp_entry_method = "project_hidden_states"

    def __init__(self, config: Any, midlayer: Eagle3DecoderLayer) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = midlayer
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        # Identity until a mapping is set: draft id i predicts target id i.
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(config.vocab_size) < config.draft_vocab_size)
        self._initialize(config.initializer_range)

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.out_features

    @property
    def selected_token_ids(self) -> Tensor:
        """Long ``[V_d]``: the target id each LM-head row predicts."""
        return self.d2t + torch.arange(self.draft_vocab_size, device=self.d2t.device)

    def set_vocab_mapping(self, selected_token_ids: Tensor) -> None:
        """Write ``d2t`` / ``t2d`` for the draft vocabulary ``selected_token_ids`` (long ``[V_d]``)."""
        if selected_token_ids.shape != self.d2t.shape:
            raise ValueError(
                f"the vocabulary mapping has {selected_token_ids.numel()} ids but the draft's LM head has "
                f"{self.draft_vocab_size} rows; build it with draft_vocab_size={self.draft_vocab_size}"
            )
        selected = selected_token_ids.to(self.d2t.device).long()
        self.d2t.copy_(selected - torch.arange(self.draft_vocab_size, device=selected.device))
        self.t2d.zero_()
        self.t2d[selected] = True

    @torch.no_grad()
    def copy_embeddings(self, weight: Tensor) -> None:
        """Copy the target's input embeddings (cast to the draft dtype); they stay frozen."""
        self.embed_tokens.weight.copy_(weight.to(self.embed_tokens.weight.dtype))

    @torch.no_grad()
    def copy_lm_head(self, weight: Tensor) -> None:
        """Set the LM head to the rows of the target's ``weight`` (``[V, H]``) that the draft vocabulary
        predicts (cast to the draft dtype)."""
        rows = weight.index_select(0, self.selected_token_ids.to(weight.device))
        self.lm_head.weight.copy_(rows.to(self.lm_head.weight.device, self.lm_head.weight.dtype))

    def project_hidden_states(self, aux_hidden_states: Tensor) -> Tensor:
        return self.fc(aux_hidden_states.to(self.fc.weight.dtype))

    def step(
        self,
        input_ids: Tensor,
        hidden: Tensor,
        positions: Tensor,
        cache: TTTCache,
        mask: Any,
        queries: Tensor | None = None,
    ) -> Tensor:
        """One TTT step: the next raw (pre-final-norm) hidden state, ``[B, T, H]``, or ``[1, N, H]`` at the
        flat slots ``queries`` only (see :meth:`TTTAttention.forward`)."""
        return self.midlayer(self.embed_tokens(input_ids), hidden, positions, cache, mask, queries)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.norm(hidden))

    def _initialize(self, std: float) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
