"""Which target features a DSpark draft reads, and how they are captured
(docs/concepts/dspark.md#target-features).

Feature ids follow the HF ``output_hidden_states`` offset-1 convention NeMo uses: ``-1`` is the
embedding output (``hidden_states[0]``), ``0 <= i < L - 1`` the output of decoder layer i
(``hidden_states[i + 1]``), and ``L - 1`` the **final-norm** output (``hidden_states[L]``, what the LM
head reads), not the raw last-layer output. Features are concatenated in the given, strictly
increasing order; the order is part of the checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_drafts.core.batch import PackedBatch
from lightning_drafts.dspark.rules import EMBEDDING_FEATURE, TARGET_LAYER_IDS
from lightning_drafts.training.target import FrozenTarget, TargetOutput


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """NeMo's ``build_target_layer_ids``: ``round(1 + i * (L - 2) / (n - 1))`` for ``n`` = draft layers
    (Python's half-to-even rounding), deduplicated and sorted; ``n`` clamped to ``[1, L - 1]``; one
    layer -> ``[L - 1]``. E.g. L = 28, n = 5 -> ``[1, 8, 14, 20, 27]``."""
    count = max(1, min(num_draft_layers, num_target_layers - 1))
    if count == 1:
        return [num_target_layers - 1]
    span = (num_target_layers - 2) / (count - 1)
    return sorted({round(1 + i * span) for i in range(count)})


def check_target_layer_ids(layer_ids: Sequence[int], num_target_layers: int) -> list[int]:
    """Non-empty, strictly increasing ids in ``{-1} ∪ [0, L - 1]`` (:data:`~lightning_drafts.dspark.rules.
    TARGET_LAYER_IDS`). Ids ``-1`` and ``L - 1`` train fine but standard SGLang captures auxiliary
    features only for ``[0, L - 2]``, so they warn."""
    ids = TARGET_LAYER_IDS.check(list(layer_ids), num_layers=num_target_layers)
    last = num_target_layers - 1
    unservable = [i for i in ids if i in (EMBEDDING_FEATURE, last)]
    if unservable:
        rank_zero_warn(
            f"target_layer_ids {ids} include {unservable}: standard SGLang captures auxiliary features only for "
            f"ids in [0, {last - 1}], so this draft may not be servable there; pick ids in that range to serve it"
        )
    return ids


def hooked_layer_ids(layer_ids: Sequence[int], num_target_layers: int) -> tuple[int, ...]:
    """The decoder layers whose outputs the feature ids ``layer_ids`` read (the embedding ``-1`` and the
    final-norm ``L - 1`` come from the embedding table and the final state instead)."""
    return tuple(i for i in layer_ids if 0 <= i < num_target_layers - 1)


@torch.no_grad()
def context_features(
    output: TargetOutput, target: FrozenTarget, packed: PackedBatch, layer_ids: Sequence[int]
) -> Tensor:
    """The concatenated features ``[B, T, F * H]`` from the target's ``output`` over
    :func:`hooked_layer_ids` (live or captured), the final state and the embedding table."""
    last = target.num_layers - 1
    hooked = hooked_layer_ids(layer_ids, target.num_layers)
    by_id = dict(zip(hooked, output.hidden_states, strict=True))
    if last in layer_ids:
        by_id[last] = output.final_states((slice(None), slice(None)), needed=packed.attention_mask)
    if EMBEDDING_FEATURE in layer_ids:
        by_id[EMBEDDING_FEATURE] = target.input_embeddings(packed.input_ids)
    return torch.cat([by_id[i] for i in layer_ids], dim=-1)
