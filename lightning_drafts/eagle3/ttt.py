"""The EAGLE-3 training-time test (TTT): attention layout, unroll, supervision masks and loss.

Shared by the dense and the MLA draft; only the q/k/v projections differ between them.

Frames (docs/concepts/eagle3.md#frames): the batch arrives in the *dataset* frame. The *trainer* frame shifts
the token ids, the loss mask and the teacher left by one (zero-filled tail); TTT step ``k`` shifts them ``k``
more. So at step ``k`` trainer slot ``i`` reads token ``x[i+1+k]`` and is taught ``z[i+1+k]`` (the target's
distribution of ``x[i+2+k]``). The draft's hidden state, the positions (RoPE at ``position_ids + k``)
and ``doc_remaining`` are never shifted.

Packing (docs/concepts/eagle3.md#packing): a slot learns at step ``k`` only while ``k < doc_remaining[i]``,
i.e. while ``x[i+1+k]`` is still in the slot's own document. Tokens past that point are replaced by id 0 (what
the reference feeds its zero-filled tail), so no document ever reads another document's token; the
diagonal TTT keys link a slot only to itself, and Block 1 uses the block-causal mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_drafts.attention.backends import attention_with_lse
from lightning_drafts.attention.kv_heads import query_groups
from lightning_drafts.core.batch import PackedBatch
from lightning_drafts.core.draft_output import DraftOutput
from lightning_drafts.core.row_top import row_max
from lightning_drafts.eagle3.step_objective import StepObjective


@dataclass
class TTTCache:
    """The keys and values of every TTT step so far (``[B, heads, T, d]`` each, with the draft's own
    key/value heads: fewer than the query heads under grouped-query attention)."""

    keys: list[Tensor] = field(default_factory=list)
    values: list[Tensor] = field(default_factory=list)


@dataclass(frozen=True)
class TeacherSignal:
    """What the frozen target gives one micro-batch, in the dataset frame (unshifted).

    The LM head runs only where the loss mask is set: the objective reads the teacher nowhere else, and
    prompt and padding slots would otherwise cost a full-vocabulary projection each.

    Attributes:
        aux_hidden_states: ``[B, T, 3 * H_t]``, the captured layer outputs concatenated in
            ``target_layer_ids`` order.
        logits: ``[N, V_d]`` target logits restricted to the draft vocabulary (column ``c`` = draft id
            ``c``), in the target dtype, for the ``N`` loss-mask positions in row-major order.
        row: long ``[B, T]``, the ``logits`` row of each loss-mask position (-1 elsewhere).
        in_draft_vocab: bool ``[B, T]``, ``t2d[argmax over the full vocabulary]`` at loss-mask positions
            (False elsewhere): a position whose greedy target token the draft cannot predict leaves the
            loss (but stays a chain miss).
    """

    aux_hidden_states: Tensor
    logits: Tensor
    row: Tensor
    in_draft_vocab: Tensor


class TTTDraft(Protocol):
    """The three operations of an EAGLE-3 draft the unroll needs."""

    def project_hidden_states(self, aux_hidden_states: Tensor) -> Tensor: ...

    def step(
        self,
        input_ids: Tensor,
        hidden: Tensor,
        positions: Tensor,
        cache: TTTCache,
        mask: Any,
        queries: Tensor | None = None,
    ) -> Tensor: ...

    def compute_logits(self, hidden: Tensor) -> Tensor: ...


# --- attention ------------------------------------------------------------------------------------


def ttt_attention(
    query: Tensor, key: Tensor, value: Tensor, cache: TTTCache, mask: Any, scale: float
) -> Tensor:
    """EAGLE-3 attention at TTT step ``k = len(cache.keys)`` (docs/concepts/eagle3.md#attention-across-steps),
    ``[B, heads, T, d_v]``.

    Block 1: the step-0 keys of the whole row under ``mask`` (block-causal; a dense bool tensor on CPU,
    a flex ``BlockMask`` on GPU). Diagonals: for steps ``1..k``, the same slot's key only, never masked;
    the current step's key is appended first, so step ``k`` sees its own key. Both parts merge exactly
    through the log-sum-exp of Block 1, with the softmax in fp32.
    """
    cache.keys.append(key)
    cache.values.append(value)
    block, block_lse = attention_with_lse(query, cache.keys[0], cache.values[0], mask, scale)
    if len(cache.keys) == 1:
        return block
    # Grouped-query heads stay grouped: query head h reads key/value head h // groups (transformers'
    # repeat_kv order) by broadcasting over a group axis, so no repeated copy of a step's keys is made.
    heads = (key.shape[1], query_groups(query, key))
    grouped = query.float().unflatten(1, heads)
    # Scores stacked on a leading axis and the values weighted one step at a time: stacking the values on
    # a trailing axis of size k copied every one of them at every step (and kept the copy for backward).
    diagonal = torch.stack([(grouped * k.float()[:, :, None]).sum(-1).flatten(1, 2) for k in cache.keys[1:]])
    diagonal = diagonal * scale
    total = torch.logaddexp(block_lse, torch.logsumexp(diagonal, dim=0))
    out = (torch.exp(block_lse - total)[..., None].to(block.dtype) * block).unflatten(1, heads)
    for weight, diagonal_value in zip(
        torch.exp(diagonal - total).to(value.dtype), cache.values[1:], strict=True
    ):
        out = out + weight.unflatten(1, heads)[..., None] * diagonal_value[:, :, None]
    return out.flatten(1, 2)


# --- frames and masks -----------------------------------------------------------------------------


def shift_left(x: Tensor, steps: int) -> Tensor:
    """``out[:, i] = x[:, i + steps]``, zero (False) past the end of the row."""
    if steps == 0:
        return x
    out = torch.zeros_like(x)
    if steps < x.shape[1]:
        out[:, : x.shape[1] - steps] = x[:, steps:]
    return out


def step_masks(
    trainer_loss_mask: Tensor,
    trainer_in_vocab: Tensor,
    doc_remaining: Tensor | None,
    step: int,
) -> tuple[Tensor, Tensor]:
    """``(chain_valid C_k, supervised S_k)``, bool ``[B, T]``, at TTT ``step``
    (docs/concepts/eagle3.md#frames, docs/concepts/eagle3.md#packing).

    Both masks take the *trainer-frame* loss mask and in-vocabulary bits (already shifted by one).
    ``C_k = m[i+1+k] ∧ (k < doc_remaining[i])``; ``S_k = C_k ∧ t2d[argmax z[i+1+k]]``. ``doc_remaining``
    ``None`` turns the packing gate off (used only to show what the gate removes).
    """
    chain_valid = shift_left(trainer_loss_mask, step)
    if doc_remaining is not None:
        chain_valid = chain_valid & (doc_remaining > step)
    return chain_valid, chain_valid & shift_left(trainer_in_vocab, step)


def step_input_ids(packed: PackedBatch, step: int) -> Tensor:
    """Token ``x[i+1+k]`` per slot, or id 0 once that token lies outside the slot's document."""
    ids = shift_left(packed.input_ids, 1 + step)
    return torch.where(packed.doc_remaining > step, ids, torch.zeros_like(ids))


# --- unroll and objective -------------------------------------------------------------------------


@dataclass(frozen=True)
class TTTSupervision:
    """Every step's masks at once, bool ``[K, B, T]`` each: ``chain_valid`` is ``C_k`` and ``supervised``
    is ``S_k`` of :func:`step_masks` (what the objective reads, and what decides which slots a step runs)."""

    chain_valid: Tensor
    supervised: Tensor

    @cached_property
    def live(self) -> Tensor:
        """Bool ``[K, B * T]``: the slots step ``k`` runs, those supervised at ``k`` or a later step (a slot's
        later states need its earlier ones): the suffix OR of ``supervised`` over steps."""
        flat = self.supervised.reshape(self.supervised.shape[0], -1)
        return flat.flip(0).cumsum(0).flip(0) > 0

    @cached_property
    def sizes(self) -> SupervisionSizes:
        """How many slots each step runs and supervises, and the chains: one read of the device for the
        whole unroll, which then sizes its index lists without reading it again."""
        steps = self.supervised.shape[0]
        chains = self.chain_valid.any(0).sum().reshape(1)
        counts = torch.cat([self.live.sum(1), self.supervised.reshape(steps, -1).sum(1), chains]).tolist()
        return SupervisionSizes(live=counts[:steps], supervised=counts[steps : 2 * steps], chains=counts[-1])


@dataclass(frozen=True)
class SupervisionSizes:
    """Per step, the slots live (run) and supervised, and the chains of :class:`TTTSupervision`."""

    live: list[int]
    supervised: list[int]
    chains: int


def ttt_supervision(packed: PackedBatch, teacher: TeacherSignal, steps: int) -> TTTSupervision:
    """:func:`step_masks` for steps ``0..steps - 1``, with the packing gate on."""
    trainer_loss_mask = shift_left(packed.loss_mask, 1)
    trainer_in_vocab = shift_left(teacher.in_draft_vocab, 1)
    masks = [step_masks(trainer_loss_mask, trainer_in_vocab, packed.doc_remaining, k) for k in range(steps)]
    return TTTSupervision(
        chain_valid=torch.stack([chain_valid for chain_valid, _ in masks]),
        supervised=torch.stack([supervised for _, supervised in masks]),
    )


@dataclass(frozen=True)
class StepState:
    """The draft's hidden state after one TTT step at the slots that step computed.

    Attributes:
        hidden: ``[N, H]``, one row per computed slot.
        slots: long ``[N]``, the flat slot ``b * T + t`` of each row, ascending; ``None`` when the step
            computed every slot (row ``b * T + t`` is slot ``(b, t)``).
    """

    hidden: Tensor
    slots: Tensor | None = None

    def at(self, flat_slots: Tensor) -> Tensor:
        """The hidden state at ``flat_slots`` (each one a computed slot), ``[n, H]``."""
        if self.slots is None:
            return self.hidden[flat_slots]
        return self.hidden[torch.searchsorted(self.slots, flat_slots)]


def ttt_unroll(
    draft: TTTDraft, packed: PackedBatch, aux_hidden_states: Tensor, mask: Any, ttt_length: int
) -> list[StepState]:
    """The draft's hidden state after every TTT step at every slot (``ttt_length`` states of ``B * T``).

    Gradients flow through the whole unroll (the carried state and the cached keys are never detached).
    :func:`~lightning_drafts.eagle3.live_slots.ttt_unroll_live` computes the same states at the slots
    the objective reads only.
    """
    hidden = draft.project_hidden_states(aux_hidden_states)
    cache = TTTCache()
    states = []
    for step in range(ttt_length):
        hidden = draft.step(step_input_ids(packed, step), hidden, packed.position_ids + step, cache, mask)
        states.append(StepState(hidden.reshape(-1, hidden.shape[-1])))
    return states


def step_weights(ttt_length: int, gamma: float) -> list[float]:
    """``gamma^k / Σ_j gamma^j``: the loss scale does not depend on ``ttt_length``
    (docs/concepts/eagle3.md#loss)."""
    raw = [gamma**k for k in range(ttt_length)]
    return [w / sum(raw) for w in raw]


def eagle3_objective(
    compute_logits: Callable[[Tensor], Tensor],
    states: list[StepState],
    packed: PackedBatch,
    teacher: TeacherSignal,
    supervision: TTTSupervision,
    gamma: float,
    objective: StepObjective | None = None,
) -> DraftOutput:
    """The decayed, valid-count-normalised step losses and the ``[M, K]`` prediction chains.

    ``L_k`` is ``objective``'s loss over the slots supervised at step ``k`` (default: their mean soft CE;
    LK options in :mod:`lightning_drafts.eagle3.step_objective`; 0 when none, still weighted);
    ``loss = Σ_k gamma^k L_k / Σ_k gamma^k``. Logits are computed only on supervised rows, so a draft
    vocabulary of any size never costs ``[B, T, V_d]`` per step; ``states`` need to hold only the slots
    ``supervision.supervised`` marks at their step.

    Chains (docs/concepts/eagle3.md#simulated-acceptance-length): one per trainer slot valid at some step,
    row-major over ``(b, i)``; ``valid[:, k] = C_k`` (no ``t2d`` term), ``correct[:, k] = (draft argmax ==
    teacher argmax) ∧ S_k``; ``valid_tokens = Σ_k Σ S_k``.
    """
    objective = StepObjective() if objective is None else objective
    steps, width = len(states), packed.shape[1]
    valid = supervision.chain_valid.permute(1, 2, 0).contiguous()
    correct = torch.zeros_like(valid)
    # Every supervised (step, row, slot) of the unroll in one index, sized by the supervision's one read.
    sizes = supervision.sizes.supervised
    index = torch.nonzero_static(supervision.supervised, size=sum(sizes))
    rows, slots = index[:, 1].contiguous(), index[:, 2].contiguous()
    per_step = zip(states, step_weights(steps, gamma), rows.split(sizes), slots.split(sizes), strict=True)
    # Starting from a zero tied to the graph keeps a micro-batch with nothing supervised differentiable,
    # so every rank runs backward and DDP / FSDP never wait on a skipped step.
    loss = states[-1].hidden.float().sum() * 0.0
    teacher_argmax = row_max(teacher.logits)[1]
    # One step at a time, so only one step's [rows, V_d] logits and teacher rows are alive outside autograd.
    for k, (state, weight, step_rows, step_slots) in enumerate(per_step):
        student = compute_logits(state.at(step_rows * width + step_slots))
        teacher_rows = teacher.row[step_rows, step_slots + 1 + k]
        target = teacher.logits[teacher_rows]
        loss = loss + weight * objective.step_loss(student, target)
        correct[step_rows, step_slots, k] = row_max(student.detach())[1] == teacher_argmax[teacher_rows]
    supervised_total = torch.tensor(sum(sizes), device=valid.device)
    chains = torch.nonzero_static(valid.any(-1).reshape(-1), size=supervision.sizes.chains).squeeze(1)
    correct = correct.reshape(-1, steps).index_select(0, chains)
    hits = correct.sum()
    return DraftOutput(
        loss=loss,
        correct=correct,
        valid=valid.reshape(-1, steps).index_select(0, chains),
        valid_tokens=supervised_total,
        metrics={"accuracy": hits.float() / supervised_total.clamp(min=1).float()},
        sums={
            "accuracy": (hits.float(), supervised_total.float()),
            # Supervised positions whose greedy target token the draft vocabulary holds.
            "draft_vocab_coverage": (
                teacher.in_draft_vocab.sum().float(),
                packed.loss_mask.sum().float(),
            ),
        },
    )
