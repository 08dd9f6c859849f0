"""The block draft network: Qwen3-style layers whose keys and values span target context + block.

Target features of the listed layers are fused once (``fc`` then ``hidden_norm``) and every layer
projects them with its own ``k_proj`` / ``v_proj`` ("KV injection", docs/concepts/dflash.md#kv-injection).
Queries are the block slots only. The draft has no embedding and no LM head of its own: the caller embeds
block tokens with the target's frozen embedding and reads logits with the target's frozen LM head.

Everything runs on the flat layout of :mod:`lightning_drafts.attention.block_masks` (all blocks of the
micro-batch back to back, batch dimension 1). Module and parameter names follow the published
checkpoints (``layers.N.self_attn.q_proj``, ``fc``, ``hidden_norm``, ``norm``, and for DFlash2's
in-block convolution ``layers.N.attention_conv`` / ``mlp_conv``). DFlash uses :class:`BlockDraft` as is;
DFlash2 and DSpark subclass it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

from lightning_drafts.attention.backends import mask_for_queries, masked_attention
from lightning_drafts.blockdraft.conv import GroupedDynamicConv

# Rotary fields a Qwen3 reader would misread (docs/concepts/dflash.md#draft-config: a leaked
# partial_rotary_factor makes a server build a quarter-width rotary table).
FOREIGN_ROPE_FIELDS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")
ATTENTION_OVERRIDES = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The spread z-lab, SpecForge and NeMo share: the middle layer for one, else 1 .. L-3 evenly."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise ValueError(
            f"a target with {num_target_layers} layers is too shallow for the default DFlash layer spread "
            "(1 .. num_layers - 3); pass target_layer_ids explicitly"
        )
    span = (num_target_layers - 4) / (num_draft_layers - 1)
    return [round(1 + i * span) for i in range(num_draft_layers)]


def draft_config(
    text_config: Any,
    num_draft_layers: int,
    sliding_window: int | None = None,
    overrides: dict[str, int] | None = None,
) -> Qwen3Config:
    """A Qwen3 config for the draft, derived from the target's decoder config
    (docs/concepts/dflash.md#draft-config).

    The hidden size always equals the target's (the draft reads the target's embedding and LM head);
    ``overrides`` may change only attention heads, KV heads, head dim and the MLP width.
    """
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(ATTENTION_OVERRIDES))
    if unknown:
        raise ValueError(
            f"draft_overrides keys {unknown} are not overridable; allowed: {list(ATTENTION_OVERRIDES)}"
        )
    hidden, heads = text_config.hidden_size, text_config.num_attention_heads
    rope = dict(getattr(text_config, "rope_parameters", None) or {})
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", getattr(text_config, "rope_theta", 10000.0))
    for name in FOREIGN_ROPE_FIELDS:
        rope.pop(name, None)
    layer_type = "full_attention" if sliding_window is None else "sliding_attention"
    fields = {
        "vocab_size": text_config.vocab_size,
        "hidden_size": hidden,
        "intermediate_size": text_config.intermediate_size,
        "num_hidden_layers": num_draft_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(text_config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(text_config, "head_dim", None) or hidden // heads,
        "hidden_act": getattr(text_config, "hidden_act", "silu"),
        "max_position_embeddings": text_config.max_position_embeddings,
        "rms_norm_eps": getattr(text_config, "rms_norm_eps", 1e-6),
        "initializer_range": getattr(text_config, "initializer_range", 0.02),
        "rope_parameters": rope,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "layer_types": [layer_type] * num_draft_layers,
        "sliding_window": sliding_window,
        "use_sliding_window": sliding_window is not None,
        "max_window_layers": num_draft_layers,
        **overrides,
    }
    if fields["num_attention_heads"] % fields["num_key_value_heads"]:
        raise ValueError(
            f"num_attention_heads = {fields['num_attention_heads']} is not a multiple of num_key_value_heads = "
            f"{fields['num_key_value_heads']}; fix draft_overrides"
        )
    return Qwen3Config(**fields)


class DraftRotaryEmbedding(nn.Module):
    """RoPE whose ``inv_freq`` stays fp32 through every dtype cast.

    A bf16-rounded ``inv_freq`` dephases with position against the fp32 tables serving engines use
    and erodes acceptance (docs/concepts/dflash.md#precision), so after any ``.to()`` / ``.half()`` the fp32
    reference is restored.
    """

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        rope_type = config.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            base, dim = config.rope_parameters["rope_theta"], config.head_dim
            inv_freq, self.attention_scaling = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), 1.0
        elif rope_type in ROPE_INIT_FUNCTIONS:
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
        else:
            raise ValueError(
                f"rope_type {rope_type!r} is not supported; known: {sorted(ROPE_INIT_FUNCTIONS)}"
            )
        self.reference_inv_freq = inv_freq.float()
        self.register_buffer("inv_freq", self.reference_inv_freq.clone(), persistent=False)

    def _apply(self, fn: Any, recurse: bool = True) -> DraftRotaryEmbedding:
        super()._apply(fn, recurse)
        self.inv_freq = self.reference_inv_freq.to(self.inv_freq.device)
        return self

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """fp32 ``cos`` / ``sin`` of shape ``[*positions.shape, head_dim]``."""
        if self.inv_freq.dtype != torch.float32:
            # FSDP1's mixed precision casts buffers in place (``buffer.data = ...``), past ``_apply``.
            self.inv_freq = self.reference_inv_freq.to(self.inv_freq.device)
        freqs = positions.float()[..., None] * self.inv_freq
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [1, heads, L, hd]`` by fp32 ``cos`` / ``sin [L, hd]`` (Qwen3's rotate-half pairing)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos.to(x.dtype) + rotated * sin.to(x.dtype)).to(x.dtype)


@dataclass(frozen=True)
class SlotRows:
    """Flat slot indices (``m * bs + t``, ascending) of a layer computed in part: ``attend``, the slots that
    query; ``feed``, the slots the MLP runs on."""

    attend: Tensor
    feed: Tensor


def _with_earlier_slots(needed: Tensor, reach: int) -> Tensor:
    """Bool ``[M, bs]``: ``needed`` and the ``reach`` slots before each needed slot in its block."""
    out = needed.clone()
    for back in range(1, min(reach, needed.shape[1] - 1) + 1):
        out[:, :-back] |= needed[:, back:]
    return out


def _spread(rows: Tensor, index: Tensor | None, like: Tensor) -> Tensor:
    """``rows [n, H]`` at the flat slots ``index`` of a zero tensor shaped ``like [M, bs, H]`` (differentiable);
    ``rows`` as ``like``'s shape when ``index`` is None (every slot). In ``rows``' dtype either way: under
    autocast the attention and MLP outputs are bf16 while ``like`` (a float32 norm's output) is not."""
    if index is None:
        return rows.view_as(like)
    flat = rows.new_zeros(like.shape[0] * like.shape[1], rows.shape[-1])
    return flat.index_copy(0, index, rows).view_as(like)


class BlockAttention(nn.Module):
    """Non-causal GQA over ``[context | blocks]`` keys for block-slot queries; structure comes from the mask."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        blocks: Tensor,
        context: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | object,
        queries: Tensor | None = None,
    ) -> Tensor:
        """``blocks [Q, H]`` slots, ``context [R, H]`` fused target features -> ``[Q, H]``; with ``queries``
        (ascending slot indices, ``mask`` already restricted to them) only those slots query: ``[n, H]``.
        Keys and values are every context key and slot either way."""
        q_len = blocks.shape[0]
        both = torch.cat([context, blocks], dim=0)
        q_cos, q_sin = cos[-q_len:], sin[-q_len:]
        if queries is not None:
            blocks, q_cos, q_sin = (t.index_select(0, queries) for t in (blocks, q_cos, q_sin))
        query = self.q_norm(self.q_proj(blocks).unflatten(-1, (self.heads, self.head_dim)))
        key = self.k_norm(self.k_proj(both).unflatten(-1, (self.kv_heads, self.head_dim)))
        value = self.v_proj(both).unflatten(-1, (self.kv_heads, self.head_dim))
        query = apply_rotary(query.transpose(0, 1)[None], q_cos, q_sin)
        key = apply_rotary(key.transpose(0, 1)[None], cos, sin)
        value = value.transpose(0, 1)[None]
        # Grouped-query heads as they are: the attention repeats them only for the kernels that need it.
        out = masked_attention(query, key, value, mask, scale=self.head_dim**-0.5)
        return self.o_proj(out[0].transpose(0, 1).flatten(1))


class BlockDecoderLayer(nn.Module):
    """Pre-norm Qwen3 layer; with ``conv`` = (taps, group size) each sublayer is wrapped in DFlash2's
    in-block convolution (pre-conv feeds queries and block keys; the context K/V is unaffected)."""

    def __init__(self, config: Qwen3Config, conv: tuple[int, int] | None = None) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.input_layernorm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.self_attn = BlockAttention(config)
        self.post_attention_layernorm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)
        if conv is not None:
            self.attention_conv = GroupedDynamicConv(hidden, *conv)
            self.mlp_conv = GroupedDynamicConv(hidden, *conv)
        self.has_conv = conv is not None

    def forward(
        self,
        hidden: Tensor,
        context: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | object,
        rows: SlotRows | None = None,
    ) -> Tensor:
        """``hidden [M, bs, H]`` block slots; ``context [R, H]``. With ``rows`` (``mask`` restricted to
        ``rows.attend``) the output is exact at the slots :meth:`rows_for` was given and not computed
        elsewhere."""
        x = self.input_layernorm(hidden)
        if self.has_conv:
            x, post = self.attention_conv.prepare(x)
        attend = None if rows is None else rows.attend
        attended = _spread(self.self_attn(x.flatten(0, 1), context, cos, sin, mask, attend), attend, x)
        hidden = hidden + (self.attention_conv.finish(attended, post) if self.has_conv else attended)
        x = self.post_attention_layernorm(hidden)
        if self.has_conv:
            x, post = self.mlp_conv.prepare(x)
        if rows is None:
            fed = self.mlp(x)
        else:
            fed = _spread(self.mlp(x.flatten(0, 1).index_select(0, rows.feed)), rows.feed, x)
        return hidden + (self.mlp_conv.finish(fed, post) if self.has_conv else fed)

    def rows_for(self, needed: Tensor) -> SlotRows:
        """The slots whose queries and MLP inputs the layer's output at bool ``needed [M, bs]`` reads.

        Without the convolution, those slots themselves. With ``T`` taps, each convolution reads ``T - 1``
        earlier slots of the block: the output reads MLP outputs ``T - 1`` back, which read states
        ``T - 1`` further back through the MLP's pre-convolution, whose attention outputs read ``T - 1``
        more through the attention's post-convolution.
        """
        reach = self.mlp_conv.kernel_size - 1 if self.has_conv else 0
        feed = _with_earlier_slots(needed, reach)
        attend = _with_earlier_slots(needed, 3 * reach)
        return SlotRows(attend.reshape(-1).nonzero().squeeze(1), feed.reshape(-1).nonzero().squeeze(1))


class BlockDraft(nn.Module):
    """The block draft: ``fc`` + ``hidden_norm`` over target features, decoder layers, final ``norm``.

    Args:
        config: the draft's Qwen3 config (see :func:`draft_config`).
        num_target_features: how many target layers are concatenated (``len(target_layer_ids)``).
        conv: DFlash2's ``(conv_kernel_size, conv_group_size)``, or None for DFlash.
    """

    def __init__(
        self, config: Qwen3Config, num_target_features: int, conv: tuple[int, int] | None = None
    ) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(num_target_features * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(BlockDecoderLayer(config, conv) for _ in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = DraftRotaryEmbedding(config)
        self._init_linears(config.initializer_range)

    def _init_linears(self, std: float) -> None:
        # The HF initialisation (normal(0, initializer_range)); identity-initialised parts reset after it.
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
        for module in self.modules():
            if isinstance(module, GroupedDynamicConv):
                module.reset_parameters()

    def forward(
        self,
        features: Tensor,
        context_positions: Tensor,
        block_embeddings: Tensor,
        block_positions: Tensor,
        mask: Tensor | object,
        needed: Tensor | None = None,
    ) -> Tensor:
        """Final-norm hidden states ``[M, bs, H]`` of the block slots.

        ``features [R, L * H]`` captured target features of the context keys, ``context_positions [R]``,
        ``block_embeddings [M, bs, H]``, ``block_positions [M, bs]`` (document-local RoPE positions),
        ``mask``: the block mask of the layout (dense bool, tiled or flex ``BlockMask``).

        ``needed``: bool ``[M, bs]``, the slots whose states the caller reads (None: every slot). Every
        slot still feeds the others as a key and value in every layer, but the last layer's queries, output
        projection and MLP run only where a needed state depends on them (:meth:`BlockDecoderLayer.rows_for`):
        the states are exact at the needed slots and not computed at the others (finite, meaningless).
        """
        context = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        cos, sin = self.rotary_emb(torch.cat([context_positions, block_positions.flatten()]))
        hidden = block_embeddings.to(self.fc.weight.dtype)
        *layers, last = self.layers
        for layer in layers:
            hidden = layer(hidden, context, cos, sin, mask)
        rows = None if needed is None else last.rows_for(needed)
        if rows is None or rows.attend.numel() == 0:
            # Nothing needed (a batch with no supervised slot): the whole layer keeps every parameter in the graph.
            hidden = last(hidden, context, cos, sin, mask)
        else:
            hidden = last(hidden, context, cos, sin, mask_for_queries(mask, rows.attend), rows)
        return self.norm(hidden)
