"""The DSpark Markov head: a low-rank bigram logit bias from the previous token
(docs/concepts/dspark.md#markov-and-confidence-heads).

The block drafter predicts every slot of a block in one parallel pass, so slot k cannot see what was
drafted at slot k - 1 ("suffix decay"). The Markov head re-introduces that dependency cheaply: a
token-id lookup ``e = W1[prev]`` (rank r) projected back to the vocabulary, ``bias = W2 e``, added to
the backbone's logits. It is position-agnostic (ids only), so packing needs nothing from it.

Types: ``vanilla`` (the rank-r bigram table, the default), ``gated`` (a sigmoid gate from the slot's
hidden state and ``e`` scales ``e``) and ``rnn`` (a gated recurrent state over the block's slots).
Training is teacher-forced: ``prev`` of slot k is the gold token at ``anchor + k``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_drafts.core.checks import check_int
from lightning_drafts.core.row_blocks import add_gathered_rows
from lightning_drafts.core.sized_unique import sorted_unique
from lightning_drafts.dspark.rules import MARKOV_HEAD_TYPE


class MarkovHead(nn.Module):
    """Previous-token logit bias. Parameter names follow NeMo / SpecForge checkpoints (``markov_w1``,
    ``markov_w2``, ``gate_proj``, ``joint_proj``).

    Args:
        vocab_size: V, rows of ``markov_w1`` and outputs of ``markov_w2``.
        hidden_size: H, the backbone width (the gated / rnn heads read the slot's hidden state).
        rank: r >= 1.
        head_type: ``"vanilla"``, ``"gated"`` or ``"rnn"``.
        init_std: std of the normal initialisation (biases start at 0), the HF ``initializer_range``.
    """

    def __init__(
        self, vocab_size: int, hidden_size: int, rank: int, head_type: str = "vanilla", init_std: float = 0.02
    ) -> None:
        super().__init__()
        MARKOV_HEAD_TYPE.check(head_type)
        check_int("markov_rank", rank, 1, hint="a head has a rank; markov_rank=0 builds none")
        self.head_type, self.rank = head_type, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif head_type == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=init_std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def embed(self, previous: Tensor) -> Tensor:
        """``[..., r]`` latent of each previous token (also the confidence head's Markov feature)."""
        return self.markov_w1(previous.long())

    def forward(self, embedded: Tensor, hidden: Tensor) -> Tensor:
        """The ``[M, K, V]`` logit bias of every slot from ``embedded [M, K, r]`` (see :meth:`embed`) and
        the post-norm slot states ``hidden [M, K, H]``."""
        return self.bias(self.latents(embedded, hidden))

    def latents(self, embedded: Tensor, hidden: Tensor) -> Tensor:
        """The ``[M, K, r]`` latents :meth:`bias` projects: the slot's own work, apart from the vocabulary."""
        embedded = embedded.to(self.markov_w2.weight.dtype)
        if self.head_type == "vanilla":
            return embedded
        hidden = hidden.to(embedded.dtype)
        if self.head_type == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden, embedded], dim=-1))) * embedded
        return self._recurrent_latents(embedded, hidden)

    def bias(self, latents: Tensor) -> Tensor:
        """The ``[..., V]`` logit bias of latents ``[..., r]`` (:meth:`latents`)."""
        return self.markov_w2(latents)

    def add_bias(
        self, logits: Tensor, latents: Tensor, previous: Tensor | None = None, distinct: int | None = None
    ) -> Tensor:
        """``logits + bias(latents)`` (``[..., V]``, in the logits' dtype), written into ``logits`` itself: pass
        logits nothing else reads (a projection's fresh output).

        ``previous``: the tokens ``latents`` were embedded from (:meth:`embed`). A vanilla head's bias is then
        a row of its bigram table, the same for every slot after the same token, so each distinct token's row
        is projected once and added to the slots that read it, a block of rows at a time
        (:func:`~lightning_drafts.core.row_blocks.add_gathered_rows`; the benchmark's packed DSpark step: 2,183
        supervised slots in two chunks, after 542 distinct tokens; the rank-r product over the vocabulary is
        the head's whole cost). Otherwise flat ``[n, V]`` logits of the head's dtype take one fused
        product-and-add, so no ``[n, V]`` bias or copy is made and swept. ``distinct``: how many distinct
        tokens ``previous`` holds, when the caller knows it (the unique then needs no read of the device)."""
        weight = self.markov_w2.weight
        if previous is not None and self.head_type == "vanilla":
            tokens = previous.reshape(-1)
            if distinct is None:
                values, inverse = torch.unique(tokens, return_inverse=True)
            else:
                values, inverse = sorted_unique(tokens, distinct)
            rows = self.bias(self.embed(values).to(weight.dtype))
            # The slots' gradients sum into a row in the head's dtype, not in bf16 logits'.
            return add_gathered_rows(logits, rows, inverse)
        if logits.dim() == 2 and logits.dtype == latents.dtype == weight.dtype:
            return logits.addmm_(latents, weight.t())
        return logits + self.bias(latents).to(logits.dtype)

    def _recurrent_latents(self, embedded: Tensor, hidden: Tensor) -> Tensor:
        # The state starts at zero in every block and runs over its K slots; the bias of slot k is read
        # from the state before slot k's update, as in NeMo's training unroll.
        state = embedded.new_zeros(embedded.shape[0], self.rank)
        latents = []
        for k in range(embedded.shape[1]):
            gate, candidate, out = self.joint_proj(
                torch.cat([state, embedded[:, k], hidden[:, k]], dim=-1)
            ).chunk(3, dim=-1)
            gate = torch.sigmoid(gate)
            state = gate * state + (1 - gate) * torch.tanh(candidate)
            latents.append(torch.tanh(out))
        return torch.stack(latents, dim=1)
