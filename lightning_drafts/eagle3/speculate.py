"""EAGLE-3 chain and tree drafting from an exported draft, as vLLM / SGLang run it (the evaluate plug-in).

Everything comes from the export: the draft network from ``config.json`` + ``model.safetensors``
(:func:`~lightning_drafts.eagle3.reload.load_exported_draft`), the captured layers from vLLM's
``eagle_aux_hidden_state_layer_ids`` (layer *inputs*, so ``id - 1`` names the layer output; the
validator has checked it against SGLang's field and the training record), and draft-to-target ids from
the exported ``d2t`` offsets, ``target = draft + d2t[draft]``.

One proposal of ``num_steps`` tokens from a verified prefix ``x_0 .. x_{L-1}`` (the last token has no
target features yet), in the training frame of docs/concepts/eagle3.md#frames and
docs/concepts/eagle3.md#attention-across-steps:

* depth 1 (TTT step 0): every context slot ``i = 0 .. L-2`` reads ``fc(target features of x_<=i)`` and
  the token ``x_{i+1}`` at RoPE position ``i``, attending causally to the context; the last slot predicts
  the first draft token. Its keys are the context keys every later depth sees (Block 1);
* depth ``k + 1`` (TTT step ``k``): only the last slot continues, with the draft's own hidden state from
  the previous depth, the previous draft token, RoPE position ``L - 2 + k``, and the context keys plus its
  own keys from depths ``2 .. k + 1`` (the TTT diagonal), exactly what an engine's draft KV cache holds.

A tree (:meth:`Eagle3Speculator.propose_tree`, SGLang's top-k trees) runs the same steps with one batch
row per current leaf: a leaf's row carries its own ancestors' diagonal keys, so each node attends to the
context and to its ancestors.

No KV cache across rounds: the context is re-encoded each round, which gives the same keys an engine
would have cached for the verified tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_drafts.eagle3.draft_base import Eagle3Draft
from lightning_drafts.eagle3.export_check import served_layer_ids
from lightning_drafts.eagle3.module import Eagle3Base
from lightning_drafts.eagle3.reload import load_eagle3, load_exported_draft
from lightning_drafts.eagle3.ttt import TTTCache
from lightning_drafts.serving.draft_tree import DraftTree, TreeShape, grow_tree
from lightning_drafts.serving.family import VerifiedPrefix
from lightning_drafts.training.target import FrozenTarget


class Eagle3Speculator:
    """Greedy chain drafting of ``num_steps`` tokens with an EAGLE-3 / MLA-EAGLE-3 draft, or tree drafting
    (:meth:`propose_tree`, SGLang's top-k trees: :mod:`lightning_drafts.serving.draft_tree`).

    Args:
        draft: the draft network (as loaded from the export).
        target_layer_ids: decoder-layer outputs the draft's ``fc`` reads, in ``fc``'s chunk order.
        num_steps: chain depth (tokens per proposal).
    """

    def __init__(
        self, draft: Eagle3Draft, target_layer_ids: list[int] | tuple[int, ...], num_steps: int
    ) -> None:
        self.draft = draft
        self.target_layer_ids = tuple(target_layer_ids)
        self.num_steps = num_steps

    def propose(self, prefix: VerifiedPrefix) -> Tensor:
        return self.chain(prefix)[0]

    @torch.no_grad()
    def chain(self, prefix: VerifiedPrefix, forced: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(target ids [num_steps], draft logits [num_steps, V_d])`` of one chain from ``prefix``.

        ``forced`` (target ids ``[num_steps - 1]``) feeds given tokens to depths ``2..num_steps`` instead
        of the draft's own picks: the teacher forcing of training, to compare the two paths exactly.
        """
        state = _DraftState.from_context(self.draft, prefix)
        one_row = torch.zeros(1, dtype=torch.long, device=state.hidden.device)
        logits = [state.logits()]
        tokens = [self._target_token(logits[-1].argmax(-1))]
        for depth in range(1, self.num_steps):
            token = tokens[-1] if forced is None else forced[depth - 1 : depth].to(one_row.device)
            logits.append(state.advance(token, one_row))
            tokens.append(self._target_token(logits[-1].argmax(-1)))
        return torch.cat(tokens).to(prefix.tokens.device), torch.cat(logits)

    @torch.no_grad()
    def propose_tree(self, prefix: VerifiedPrefix, shape: TreeShape) -> DraftTree:
        """The tree of ``shape`` from ``prefix``: the chain's context pass, then one draft step per depth
        for all current leaves at once, one batch row each. A leaf's row holds its own ancestors' keys in
        the TTT diagonal (:meth:`_DraftState.advance` reorders the rows), so every node attends to the
        context and to its ancestors, as in an engine's tree-shaped draft KV cache."""
        state = _DraftState.from_context(self.draft, prefix)

        def advance(tokens: Tensor, rows: Tensor) -> Tensor:
            return state.advance(tokens, rows).float().log_softmax(-1)

        first = state.logits()[0].float().log_softmax(-1)
        tree = grow_tree(first, advance, shape, self._target_token)
        device = prefix.tokens.device
        return DraftTree(tree.tokens.to(device), tree.parents.to(device), tree.scores)

    def _target_token(self, draft_id: Tensor) -> Tensor:
        # The engines' reading of d2t: offsets, target id = draft id + d2t[draft id].
        return draft_id + self.draft.d2t[draft_id]


@dataclass
class _DraftState:
    """The draft between depths: one batch row per leaf, its last hidden state ``[rows, 1, H]`` and its
    TTT keys (Block 1: the context's, shared by every row; diagonals: the row's own earlier depths)."""

    draft: Eagle3Draft
    hidden: Tensor
    cache: TTTCache
    position: Tensor
    last_row: Tensor
    depth: int = 0

    @classmethod
    def from_context(cls, draft: Eagle3Draft, prefix: VerifiedPrefix) -> _DraftState:
        """Depth 1: every context slot at once, causal; the last slot's state predicts the first token."""
        context = prefix.tokens.numel() - 1
        device = draft.fc.weight.device
        aux = torch.cat(prefix.hidden_states, dim=-1)[None].to(device)
        positions = torch.arange(context, device=device)[None]
        causal = torch.ones(context, context, dtype=torch.bool, device=device).tril()[None, None]
        cache = TTTCache()
        inputs = prefix.tokens[1:][None].to(device)
        hidden = draft.step(inputs, draft.project_hidden_states(aux), positions, cache, causal)
        # Later depths see every context key (Block 1) and their own chain through the diagonal.
        return cls(draft, hidden[:, -1:], cache, positions[:, -1:], causal[..., -1:, :])

    def logits(self) -> Tensor:
        """``[rows, V_d]`` draft logits of the current rows."""
        return self.draft.compute_logits(self.hidden[:, -1])

    def advance(self, tokens: Tensor, rows: Tensor) -> Tensor:
        """One depth further: row ``i`` continues row ``rows[i]`` with token ``tokens[i]``; the new rows'
        ``[len(rows), V_d]`` logits."""
        self.depth += 1
        self.hidden = self.hidden.index_select(0, rows)
        # Block 1 is the context's for every row: a view, not a copy per row.
        self.cache.keys = [_rows_of(self.cache.keys[0][:1], rows.numel())] + [
            k.index_select(0, rows) for k in self.cache.keys[1:]
        ]
        self.cache.values = [_rows_of(self.cache.values[0][:1], rows.numel())] + [
            v.index_select(0, rows) for v in self.cache.values[1:]
        ]
        self.hidden = self.draft.step(
            tokens.view(-1, 1), self.hidden, self.position + self.depth, self.cache, self.last_row
        )
        return self.logits()


def _rows_of(row: Tensor, count: int) -> Tensor:
    return row.expand(count, *row.shape[1:])


def load_speculator(directory: Path, target: FrozenTarget, num_steps: int) -> Eagle3Speculator:
    """The speculator of an (already validated) export, on the target's device."""
    draft, config = load_exported_draft(directory)
    draft.to(target.lm_head.weight.device)
    return Eagle3Speculator(draft, served_layer_ids(config), num_steps)


def load_training_module(directory: Path, target: FrozenTarget, num_steps: int) -> Eagle3Base:
    """The module the export came from, sharing ``target``'s model, unrolled ``num_steps`` TTT steps."""
    return load_eagle3(
        directory,
        target=target.model,
        ttt_length=num_steps,
        target_attn_backend=target.requested_backend,
    )


def default_num_steps(config: dict[str, Any]) -> int:
    """The ``ttt_length`` the draft was trained with (the depth its estimate covers)."""
    return int((config.get("lightning_drafts") or {}).get("ttt_length") or 3)
