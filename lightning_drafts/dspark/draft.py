"""The DSpark draft network (docs/concepts/dspark.md#draft-network): the DFlash backbone plus its own
embedding / LM head copies, the Markov head and the confidence head.

The backbone is DFlash's, unchanged and imported (``fc`` + ``hidden_norm`` over the concatenated target
features, computed once and shared by every layer; Qwen3 layers whose keys and values span
``[context ; block]``; final ``norm``; fp32 RoPE tables). DSpark differs from DFlash only in owning
frozen copies of the target's embedding and LM head (NeMo's checkpoint layout holds them) and in the
two heads on top. State-dict keys have no prefix and match NeMo's ``Qwen3DSparkModel``:
``embed_tokens.weight``, ``layers.N.*``, ``norm.weight``, ``fc.weight``, ``hidden_norm.weight``,
``lm_head.weight``, ``markov_head.*``, ``confidence_head.proj.*``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.nn.utils import skip_init
from transformers import Qwen3Config

from lightning_drafts.blockdraft.draft import BlockDraft
from lightning_drafts.dspark.confidence_head import ConfidenceHead
from lightning_drafts.dspark.markov_head import MarkovHead
from lightning_drafts.dspark.rules import CONFIDENCE_HEAD_WITH_MARKOV


class DSparkDraft(BlockDraft):
    """The DSpark draft.

    Args:
        config: the draft's Qwen3 config (:func:`lightning_drafts.blockdraft.draft.draft_config`).
        num_target_features: ``len(target_layer_ids)``.
        markov_rank: rank r of the Markov head; 0 = no head (DFlash-like logits).
        markov_head_type: ``"vanilla"``, ``"gated"`` or ``"rnn"``.
        confidence_head: build the confidence head.
        confidence_head_with_markov: feed the Markov latent of the previous token to the confidence
            head besides the slot's hidden state (needs ``markov_rank > 0``).
    """

    def __init__(
        self,
        config: Qwen3Config,
        num_target_features: int,
        markov_rank: int = 256,
        markov_head_type: str = "vanilla",
        confidence_head: bool = True,
        confidence_head_with_markov: bool = True,
    ) -> None:
        super().__init__(config, num_target_features)
        vocab, hidden, std = config.vocab_size, config.hidden_size, config.initializer_range
        CONFIDENCE_HEAD_WITH_MARKOV.check(
            confidence_head_with_markov, confidence_head=confidence_head, markov_rank=markov_rank
        )
        # Filled by copy_target_weights (or an export reload), so never randomly initialised: at a real
        # vocabulary that would cost seconds and draw RNG for nothing.
        self.embed_tokens = skip_init(nn.Embedding, vocab, hidden)
        self.lm_head = skip_init(nn.Linear, hidden, vocab, bias=False)
        self.markov_head = (
            MarkovHead(vocab, hidden, markov_rank, markov_head_type, std) if markov_rank else None
        )
        with_markov = confidence_head_with_markov and self.markov_head is not None
        self.confidence_head = (
            ConfidenceHead(hidden + (markov_rank if with_markov else 0), std) if confidence_head else None
        )
        self.confidence_with_markov = with_markov
        self._cast_head: Tensor | None = None

    @contextmanager
    def head_cast_once(self) -> Iterator[None]:
        """Inside: a frozen LM head is cast to the autocast dtype once, and every :meth:`vocabulary_logits`
        call (one per logits chunk) reads that copy. Autocast caches the casts of trainable weights only,
        so it would otherwise cast the ``[V, H]`` head again at every chunk (Qwen3-4B: 389M values)."""
        weight = self.lm_head.weight
        device = weight.device.type
        if weight.requires_grad or not torch.is_autocast_enabled(device):
            yield
            return
        self._cast_head = weight.to(torch.get_autocast_dtype(device))
        try:
            yield
        finally:
            self._cast_head = None

    def copy_target_weights(self, embedding: Tensor, lm_head: Tensor, freeze: bool = True) -> None:
        """Copy the target's input embedding and LM head (``[V, H]`` each); ``freeze`` keeps them fixed."""
        for name, module, weight in (
            ("input embedding", self.embed_tokens, embedding),
            ("LM head", self.lm_head, lm_head),
        ):
            if tuple(weight.shape) != tuple(module.weight.shape):
                raise ValueError(
                    f"the target's {name} is {tuple(weight.shape)} but the draft expects "
                    f"{tuple(module.weight.shape)} (vocab_size, hidden_size); build the draft from this target"
                )
            module.weight.data.copy_(weight.detach())
            module.weight.requires_grad_(not freeze)

    def forward(
        self,
        features: Tensor,
        context_positions: Tensor,
        block_tokens: Tensor,
        block_positions: Tensor,
        mask: Tensor | object,
        needed: Tensor | None = None,
    ) -> Tensor:
        """As :meth:`BlockDraft.forward`, but the block slots come as token ids ``[M, bs]``, embedded here
        with the draft's own copy: under FSDP2 the root's weights are unsharded only inside its forward."""
        embeddings = self.embed_tokens(block_tokens)
        return super().forward(features, context_positions, embeddings, block_positions, mask, needed)

    def head_parameters(self) -> list[Tensor]:
        """The trainable weights :meth:`heads` reads (LM head copy when unfrozen, Markov and confidence heads)."""
        heads = (self.lm_head, self.markov_head, self.confidence_head)
        return [p for head in heads if head is not None for p in head.parameters() if p.requires_grad]

    def heads(self, hidden: Tensor, previous: Tensor) -> tuple[Tensor, Tensor | None]:
        """Markov-corrected logits ``[M, K, V]`` (model dtype) and fp32 confidence logits ``[M, K]`` (or None).

        ``hidden [M, K, H]``: post-norm slot states; ``previous [M, K]``: the token before each slot's
        target (teacher-forced: the anchor for slot 0, the gold token at ``anchor + k`` for slot k).
        """
        latents, confidence = self.slot_heads(hidden, previous)
        return self.vocabulary_logits(hidden, latents), confidence

    def slot_heads(self, hidden: Tensor, previous: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """The heads' work of each slot apart from the vocabulary: the Markov latents ``[M, K, r]`` that
        :meth:`vocabulary_logits` projects (None without a Markov head) and the fp32 confidence logits
        ``[M, K]`` (or None). The ``rnn`` head's latents run over the block's slots in order."""
        embedded = latents = None
        if self.markov_head is not None:
            embedded = self.markov_head.embed(previous)
            latents = self.markov_head.latents(embedded, hidden)
        confidence = None
        if self.confidence_head is not None:
            confidence = self.confidence_head(hidden, embedded if self.confidence_with_markov else None)
        return latents, confidence

    def vocabulary_logits(
        self,
        hidden: Tensor,
        latents: Tensor | None,
        previous: Tensor | None = None,
        distinct_previous: int | None = None,
    ) -> Tensor:
        """Markov-corrected logits ``[..., V]`` (model dtype) of slot states ``hidden [..., H]`` and their
        Markov latents ``[..., r]`` (:meth:`slot_heads`), each position on its own; ``previous`` (the tokens
        the latents come from) lets a vanilla head project each distinct token's bias once
        (:meth:`MarkovHead.add_bias`; ``distinct_previous``, their number of distinct tokens when known)."""
        weight = self._cast_head if self._cast_head is not None else self.lm_head.weight
        logits = torch.nn.functional.linear(hidden.to(weight.dtype), weight)
        if latents is None:
            return logits
        return self.markov_head.add_bias(logits, latents, previous, distinct_previous)
