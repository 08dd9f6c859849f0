"""The rules of the DSpark hyperparameters an export carries: :class:`~lightning_drafts.dspark.module.
DSparkModule` and the draft check their arguments with them and ``validate_dspark_export`` checks the
exported fields with them.

Feature ids follow NeMo's HF ``output_hidden_states`` offset-1 convention: ``-1`` = embedding output,
``0 .. L - 2`` = decoder-layer outputs (``hidden_states[id + 1]``), ``L - 1`` = the final-norm output.
"""

from __future__ import annotations

from typing import Any

from lightning_drafts.core.checks import is_int
from lightning_drafts.core.rules import FieldRule, int_rule

EMBEDDING_FEATURE = -1
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")

BLOCK_SIZE = int_rule(
    "block_size", 1, hint="K proposals per block: slot k proposes the token at anchor + k + 1"
)
MARKOV_RANK = int_rule("markov_rank", 0, hint="the Markov head's rank r; 0 disables the head")


def feature_ids_problem(ids: Any, num_layers: Any) -> str | None:
    """A non-empty, strictly increasing list of feature ids, each inside ``[-1, L - 1]`` for a target of
    ``num_layers`` decoder layers (unchecked where ``num_layers`` is not an int)."""
    if not isinstance(ids, (list, tuple)) or not ids:
        return (
            f"{ids!r}; it must be the non-empty, strictly increasing list of target feature ids the draft's "
            "fc reads (-1 = embedding output, L-1 = final-norm output, else decoder-layer outputs)"
        )
    not_ids = [i for i in ids if not is_int(i)]
    if not_ids:
        return f"{list(ids)}; it must hold int feature ids (offending: {not_ids})"
    if is_int(num_layers):
        last = num_layers - 1
        outside = [i for i in ids if not EMBEDDING_FEATURE <= i <= last]
        if outside:
            return (
                f"{list(ids)}; it names features outside the target's {num_layers} decoder layers (offending: "
                f"{outside}; valid: -1 = embedding output, 0..{last - 1} = decoder-layer outputs, {last} = "
                "final-norm output)"
            )
    if any(a >= b for a, b in zip(ids, ids[1:], strict=False)):
        return f"{list(ids)}; it must be strictly increasing, the order fc is trained with"
    return None


def head_type_problem(value: Any) -> str | None:
    return None if value in MARKOV_HEAD_TYPES else f"{value!r}; it must be one of {list(MARKOV_HEAD_TYPES)}"


def confidence_with_markov_problem(value: Any, confidence_head: Any, markov_rank: Any) -> str | None:
    """A confidence head that reads the Markov latent needs a Markov head."""
    if confidence_head and value and markov_rank == 0:
        return (
            "true but markov_rank is 0: the confidence head would read a Markov latent that does not exist; "
            "set markov_rank > 0 or confidence_head_with_markov false"
        )
    return None


TARGET_LAYER_IDS = FieldRule("target_layer_ids", feature_ids_problem)
MARKOV_HEAD_TYPE = FieldRule("markov_head_type", head_type_problem)
CONFIDENCE_HEAD_WITH_MARKOV = FieldRule("confidence_head_with_markov", confidence_with_markov_problem)
