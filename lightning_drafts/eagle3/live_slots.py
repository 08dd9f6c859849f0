"""TTT steps computed at the *live* slots only: those with a supervised prediction left.

Why it is exact (docs/concepts/eagle3.md#attention-across-steps): a slot's output at step ``k`` (its attention
query, ``o_proj``, MLP and the carried hidden state) feeds only that slot: its own logits at step ``k`` and
its own later steps, through the carried state and its diagonal keys. The only thing other slots read are the
step-0 keys and values (Block 1). So a slot whose steps ``k..K-1`` supervise nothing (a prompt slot more than
``K`` tokens before an answer, a document's tail, padding) changes no loss term, no gradient and no statistic
from step ``k`` on, and need not run. Step 0 still computes keys and values at every slot; its queries,
like every later step, run at the live slots.

The live set of step ``k`` is ``S_k ∨ S_{k+1} ∨ … ∨ S_{K-1}``; it only shrinks with ``k``. Each step
gathers its live slots from the previous step's (the carried state and the cached diagonal keys), once,
and runs the draft on them as one row of ``N_k`` queries against the micro-batch's step-0 keys laid out
as one row of ``B * T`` (:mod:`lightning_drafts.attention.query_subset`). Nothing is scattered back: the
objective reads each step's state at its supervised slots (:class:`~lightning_drafts.eagle3.ttt.StepState`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_drafts.core.batch import PackedBatch
from lightning_drafts.eagle3.ttt import StepState, TTTCache, TTTDraft, TTTSupervision, step_input_ids


def live_slots(supervision: TTTSupervision) -> list[Tensor]:
    """The flat slots (``b * T + t``, ascending) live at each step of ``supervision``
    (:attr:`TTTSupervision.live`): ``K`` long tensors, each a subset of the one before, indexed at the sizes
    the supervision read once (:attr:`TTTSupervision.sizes`), so nothing else is read back from the device."""
    sizes = supervision.sizes.live
    # Row-major, so each step's slots come out ascending; a column of the [n, 2] index is strided: copied
    # contiguous, as nonzero's own tuple hands it out.
    return list(torch.nonzero_static(supervision.live, size=sum(sizes))[:, 1].contiguous().split(sizes))


def ttt_unroll_live(
    draft: TTTDraft,
    packed: PackedBatch,
    aux_hidden_states: Tensor,
    live_mask: Callable[[Tensor], Any],
    live: list[Tensor],
) -> list[StepState]:
    """The draft's state after every TTT step ``k`` at the slots ``live[k]`` only, with Block 1 under
    ``live_mask(slots)``: those queries against the ``B * T`` step-0 keys. The values are those of
    :func:`~lightning_drafts.eagle3.ttt.ttt_unroll` at the same slots, up to float round-off.
    """
    hidden = draft.project_hidden_states(aux_hidden_states)
    cache = TTTCache()
    slots = live[0]
    if slots.numel() == 0:
        # Nothing supervised at all: one slot still runs, so the zero loss stays tied to every weight and
        # every rank runs the same backward.
        slots = torch.zeros(1, dtype=torch.long, device=slots.device)
    ids = step_input_ids(packed, 0)
    hidden = draft.step(ids, hidden, packed.position_ids, cache, live_mask(slots), queries=slots)
    states = [StepState(hidden[0], slots)]
    positions = packed.position_ids.reshape(-1)
    for step, slots in enumerate(live[1:], start=1):
        if slots.numel() == 0:
            # The remaining steps supervise nothing anywhere: their states are empty (still tied to the
            # graph, for the objective's zero).
            states += [StepState(states[-1].hidden[:0], slots)] * (len(live) - step)
            break
        previous = states[-1]
        pick = torch.searchsorted(previous.slots, slots)
        # The diagonal keys of earlier steps follow their slots into the smaller set.
        cache.keys[1:] = [key[:, :, pick] for key in cache.keys[1:]]
        cache.values[1:] = [value[:, :, pick] for value in cache.values[1:]]
        ids = step_input_ids(packed, step).reshape(-1)[slots]
        hidden = draft.step(
            ids[None], previous.hidden[pick][None], positions[slots][None] + step, cache, live_mask(slots)
        )
        states.append(StepState(hidden[0], slots))
    return states


def one_row(x: Tensor) -> Tensor:
    """``[B, heads, T, d]`` -> ``[1, heads, B * T, d]``, column ``b * T + t``."""
    batch, heads, width, dim = x.shape
    return x.transpose(0, 1).reshape(1, heads, batch * width, dim)


def at_slots(x: Tensor, slots: Tensor) -> Tensor:
    """``[B, T, ...]`` -> ``[1, N, ...]``: the entries at the flat ``slots``."""
    return x.reshape(-1, *x.shape[2:])[slots][None]
