"""The rules of the DSpark hyperparameters an export carries: :class:`~lightning_drafts.dspark.module.
DSparkModule` and the draft check their arguments with them and ``validate_dspark_export`` checks the
exported fields with them.

Feature ids follow NeMo's HF ``output_hidden_states`` offset-1 convention: ``-1`` = embedding output,
``0 .. L - 2`` = decoder-layer outputs (``hidden_states[id + 1]``), ``L - 1`` = the final-norm output.
"""

from __future__ import annotations

from typing import Any

from lightning_drafts.core.layer_ids import layer_ids_rule
from lightning_drafts.core.rules import FieldRule, int_rule

EMBEDDING_FEATURE = -1
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")

BLOCK_SIZE = int_rule(
    "block_size", 1, hint="K proposals per block: slot k proposes the token at anchor + k + 1"
)
MARKOV_RANK = int_rule("markov_rank", 0, hint="the Markov head's rank r; 0 disables the head")


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


TARGET_LAYER_IDS = layer_ids_rule(
    "the non-empty, strictly increasing list of target feature ids the draft's fc reads (-1 = embedding "
    "output, L-1 = final-norm output, else decoder-layer outputs)",
    lowest=EMBEDDING_FEATURE,
    noun="features",
    valid=lambda layers: (
        f"valid: -1 = embedding output, 0..{layers - 2} = decoder-layer outputs, {layers - 1} = final-norm output"
    ),
)
MARKOV_HEAD_TYPE = FieldRule("markov_head_type", head_type_problem)
CONFIDENCE_HEAD_WITH_MARKOV = FieldRule("confidence_head_with_markov", confidence_with_markov_problem)
