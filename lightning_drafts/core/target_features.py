"""Target features carried by a batch: what a draft reads from its frozen target, captured beforehand.

A batch from a features directory carries, beside the contract keys, the target's signal for its rows:

| key | meaning |
|---|---|
| ``target_layer_ids`` | ``[k]`` long: the decoder layers captured, in the order of ``target_hidden_states`` |
| ``target_hidden_states`` | ``[B, T, k * H]``: those layers' outputs, concatenated (zero on padding) |
| ``target_last_hidden_state`` | ``[B, T, H]``: the final-norm output, where ``target_last_hidden_mask`` is set |
| ``target_last_hidden_mask`` | ``[B, T]`` bool: the positions whose final-norm output was stored |

A draft declares what it reads with a :class:`FeatureRequest`; the final-norm output is needed at one of
:data:`FINAL_POSITIONS`, a rule over the batch's masks (:func:`final_position_mask`), so a capture stores
it only where the draft's teacher reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

FEATURE_KEYS = (
    "target_layer_ids",
    "target_hidden_states",
    "target_last_hidden_state",
    "target_last_hidden_mask",
)
# Where a draft reads the target's final-norm output: nowhere, at supervised tokens (EAGLE-3's teacher),
# before supervised tokens of the same document (DSpark's teacher of the next token), or everywhere.
FINAL_POSITIONS = ("none", "supervised", "next_supervised", "all")


@dataclass(frozen=True)
class FeatureRequest:
    """What a draft reads from its target: the outputs of decoder layers ``layer_ids`` (in that order)
    at every token, and the final-norm output at ``final_positions`` (one of :data:`FINAL_POSITIONS`)."""

    layer_ids: tuple[int, ...]
    final_positions: str

    def __post_init__(self) -> None:
        if self.final_positions not in FINAL_POSITIONS:
            raise ValueError(f"final_positions {self.final_positions!r} is not one of {FINAL_POSITIONS}")

    def served_by(self, layer_ids: tuple[int, ...], final_positions: str) -> str | None:
        """Why features holding ``layer_ids`` and the final state at ``final_positions`` cannot serve this
        request (``None`` when they can)."""
        missing = [i for i in self.layer_ids if i not in layer_ids]
        if missing:
            return (
                f"layer_ids: the draft reads target layers {list(self.layer_ids)} but the features hold "
                f"{list(layer_ids)} (missing {missing})"
            )
        if self.final_positions != "none" and final_positions not in (self.final_positions, "all"):
            return (
                f"final_positions: the draft reads the target's final hidden state at "
                f"{self.final_positions!r} positions but the features hold it at {final_positions!r}"
            )
        return None


@dataclass(frozen=True)
class TargetFeatures:
    """The validated feature keys of a batch (see the module docstring)."""

    layer_ids: tuple[int, ...]
    hidden_states: Tensor
    last_hidden_state: Tensor | None
    last_hidden_mask: Tensor | None

    def to_dict(self) -> dict[str, Tensor]:
        out = {
            "target_layer_ids": torch.tensor(self.layer_ids, dtype=torch.long),
            "target_hidden_states": self.hidden_states,
        }
        if self.last_hidden_state is not None:
            out["target_last_hidden_state"] = self.last_hidden_state
            out["target_last_hidden_mask"] = self.last_hidden_mask
        return out


def read_target_features(batch: Mapping[str, Tensor], shape: tuple[int, int]) -> TargetFeatures | None:
    """The batch's target features, checked against its ``[B, T]`` shape; ``None`` when it has none.
    Every violation raises ``ValueError`` naming the key."""
    present = [key for key in FEATURE_KEYS if batch.get(key) is not None]
    if not present:
        return None
    for key in FEATURE_KEYS[:2]:
        if key not in present:
            raise ValueError(
                f"the batch has target features ({present}) but no {key!r}; pass all of {FEATURE_KEYS[:2]}"
            )
    if ("target_last_hidden_state" in present) != ("target_last_hidden_mask" in present):
        raise ValueError(
            "batch['target_last_hidden_state'] and batch['target_last_hidden_mask'] come together; one is missing"
        )
    layer_ids = batch["target_layer_ids"]
    if not isinstance(layer_ids, Tensor) or layer_ids.dim() != 1 or layer_ids.dtype.is_floating_point:
        raise ValueError(f"batch['target_layer_ids'] must be a 1-D integer tensor, got {layer_ids!r}")
    ids = tuple(int(i) for i in layer_ids.tolist())
    hidden = _float_tensor(batch, "target_hidden_states", 3, shape)
    if ids and hidden.shape[-1] % len(ids):
        raise ValueError(
            f"batch['target_hidden_states'] has {hidden.shape[-1]} features, not a multiple of its "
            f"{len(ids)} layers {list(ids)}"
        )
    last = mask = None
    if "target_last_hidden_state" in present:
        last = _float_tensor(batch, "target_last_hidden_state", 3, shape)
        mask = batch["target_last_hidden_mask"]
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != shape:
            got = (mask.dtype, tuple(mask.shape)) if isinstance(mask, Tensor) else type(mask).__name__
            raise ValueError(f"batch['target_last_hidden_mask'] must be a bool tensor {shape}, got {got}")
    return TargetFeatures(ids, hidden, last, mask)


def final_position_mask(
    loss_mask: Tensor, attention_mask: Tensor, doc_remaining: Tensor, rule: str
) -> Tensor:
    """Bool ``[B, T]``: the positions where ``rule`` (one of :data:`FINAL_POSITIONS`) needs the target's
    final-norm output. ``"next_supervised"``: the next token is supervised and in the same document."""
    if rule == "none":
        return torch.zeros_like(attention_mask, dtype=torch.bool)
    if rule == "supervised":
        return loss_mask.bool()
    if rule == "all":
        return attention_mask.bool()
    if rule == "next_supervised":
        mask = torch.zeros_like(attention_mask, dtype=torch.bool)
        mask[:, :-1] = loss_mask[:, 1:].bool() & (doc_remaining[:, :-1] > 0)
        return mask
    raise ValueError(f"final_positions {rule!r} is not one of {FINAL_POSITIONS}")


def _float_tensor(batch: Mapping[str, Tensor], key: str, dims: int, shape: tuple[int, int]) -> Tensor:
    value = batch[key]
    if not isinstance(value, Tensor) or not value.dtype.is_floating_point:
        got = value.dtype if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(f"batch[{key!r}] must be a floating-point tensor, got {got}")
    if value.dim() != dims or tuple(value.shape[:2]) != shape:
        raise ValueError(
            f"batch[{key!r}] has shape {tuple(value.shape)}, expected [{shape[0]}, {shape[1]}, ...]"
        )
    return value
