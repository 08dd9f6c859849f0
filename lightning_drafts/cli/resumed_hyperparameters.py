"""A resumed fit trains the run it continues: the command line may not change what that run is.

``fit --ckpt_path FILE`` rebuilds the model from the checkpoint's hyperparameters, so a changed
``--model.init_args.*`` value was dropped without a word (and recorded in ``config.yaml`` as the
checkpoint's); ``--ckpt_path last`` built it from the command line instead, so a changed draft shape
failed in ``load_state_dict`` and a changed learning rate was overwritten by the restored optimiser and
schedule state. Now every model hyperparameter the command line gives is compared with the checkpoint's:

* one that defines the run (the draft's shapes, the target, the objective, the optimiser and its
  schedule: whatever is not listed below) is refused when it differs, naming the field, both values and
  the fix, since the restored weights, optimiser moments and schedule position belong to the checkpoint's;
* one that says only how the step is computed (:data:`RUNTIME_FIELDS`: where and how the target runs,
  activation checkpointing, the attention backend, chunking) is applied and recorded in ``config.yaml``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

# Fields a resumed fit may change: the same computation, placed or chunked differently.
RUNTIME_FIELDS = frozenset(
    {
        "shard_target",
        "activation_checkpointing",
        "target_decoder",
        # A cache of another storage dtype is refused by its manifest (features_manifest.check_resumable).
        "remote",
        "draft_attn_backend",
        "target_attn_backend",
        "logits_chunk_blocks",
    }
)
# Linked from the data module when the model is built (cli.fit), not read from the command line.
LINKED_FIELDS = frozenset({"tokenizer_vocab_size", "pad_token_id"})
OPTIMISER_FIELDS = frozenset({"learning_rate", "betas", "weight_decay", "warmup_ratio", "min_lr_ratio"})
# LightningCLI's bookkeeping entries in a checkpoint's hyperparameters.
_BOOKKEEPING = frozenset({"_class_path", "_instantiator"})


def changed_fields(given: Mapping[str, Any], saved: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``field -> (given, saved)`` for every hyperparameter both name whose values differ."""
    return {
        name: (given[name], saved[name])
        for name in sorted(given.keys() & saved.keys())
        if name not in _BOOKKEEPING | LINKED_FIELDS and _comparable(given[name]) != _comparable(saved[name])
    }


def refuse_changed_run(given: Mapping[str, Any], saved: Mapping[str, Any], ckpt_path: str) -> dict[str, Any]:
    """Refuse a command line that changes the checkpoint's run; returns the runtime fields it changes
    (``field -> given value``), which the resumed fit applies."""
    changed = changed_fields(given, saved)
    for name, (new, old) in changed.items():
        if name in RUNTIME_FIELDS:
            continue
        what = (
            "its optimiser state and learning-rate schedule are restored from the checkpoint"
            if name in OPTIMISER_FIELDS
            else "it changes the draft's shapes, its target or its objective"
        )
        raise ValueError(
            f"model.init_args.{name} = {new!r} differs from {old!r} in the checkpoint {ckpt_path} that --ckpt_path "
            f"resumes ({what}); resume with {name}: {old!r}, or start a new fit without --ckpt_path"
        )
    return {name: new for name, (new, _) in changed.items()}


def _comparable(value: Any) -> str:
    if hasattr(value, "as_dict"):  # a jsonargparse Namespace
        value = value.as_dict()
    return json.dumps(value, sort_keys=True, default=str)
