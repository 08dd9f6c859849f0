"""Read an EAGLE-3 export back: the draft as a serving engine builds it, or the whole training module.

:func:`load_exported_draft` reads the draft the way a serving engine does (shapes and RoPE from
``config.json``, weights from ``model.safetensors``), for ``lightning-drafts evaluate``;
:func:`load_eagle3` rebuilds the module the export came from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from lightning_drafts.eagle3.draft_base import Eagle3Draft
from lightning_drafts.eagle3.export_check import draft_from_config
from lightning_drafts.eagle3.module import Eagle3Base, Eagle3Module, MLAEagle3Module
from lightning_drafts.serving.export_files import CONFIG_FILE, WEIGHTS_FILE

DRAFT_CLASSES = {cls.exported_as: cls for cls in (Eagle3Module, MLAEagle3Module)}


def load_exported_draft(directory: str | Path) -> tuple[Eagle3Draft, dict[str, Any]]:
    """The draft network and ``config.json`` of an export, read as a serving engine reads them.

    Shapes and RoPE come from ``config.json`` (not from the target), the weights (``d2t`` included) from
    ``model.safetensors``, loaded strictly in the dtype they were saved in. Run the validator first.
    """
    directory = Path(directory)
    config = json.loads((directory / CONFIG_FILE).read_text())
    state = load_file(str(directory / WEIGHTS_FILE))
    draft = draft_from_config(config).to(state["fc.weight"].dtype)
    draft.load_state_dict(state, strict=True)
    return draft.eval().requires_grad_(False), config


def load_eagle3(directory: str | Path, target: Any = None, **overrides: Any) -> Eagle3Base:
    """Rebuild the module an export came from, with its weights and vocabulary mapping.

    ``target`` defaults to the one recorded at export (a hub id, path or config dict); pass it when the
    export was made from a ``PreTrainedModel`` instance. ``overrides`` go to the module constructor.
    """
    directory = Path(directory)
    config = json.loads((directory / CONFIG_FILE).read_text())
    record = config.get("lightning_drafts")
    if not record or record.get("draft_class") not in DRAFT_CLASSES:
        raise ValueError(
            f"{directory / CONFIG_FILE} has no lightning_drafts record of an EAGLE-3 draft; it was not written "
            "by export_draft"
        )
    target = record.get("target") if target is None else target
    if target is None:
        raise ValueError(
            f"{directory} does not record its target; pass target= (hub id, path, config or model)"
        )
    arguments = {
        "target_layer_ids": record["target_layer_ids"],
        "ttt_length": record["ttt_length"],
        "draft_vocab_size": record["draft_vocab_size"],
        "loss_decay_gamma": record["loss_decay_gamma"],
        "target_seed": record.get("target_seed", 0),
        # The dense config says whether the draft had biases (exports before draft_biases had them wherever
        # the target did); the MLA config has neither field.
        "draft_biases": bool(config.get("attention_bias") or config.get("mlp_bias")),
        **overrides,
    }
    module = DRAFT_CLASSES[record["draft_class"]](target=target, **arguments)
    _check_same_target(module, config, directory)
    module.draft.load_state_dict(load_file(str(directory / WEIGHTS_FILE)), strict=True)
    module.vocab_mapping_built.fill_(True)
    # The original init, not the one just overwritten, is what a re-export must be checked against.
    module.init_fingerprints = dict(record.get("init_fingerprints") or {})
    return module


def _check_same_target(module: Eagle3Base, config: dict[str, Any], directory: Path) -> None:
    expected = {
        "vocab_size": module.target.vocab_size,
        "target_hidden_size": module.target.text_config.hidden_size,
    }
    wrong = {key: (config.get(key), value) for key, value in expected.items() if config.get(key) != value}
    if wrong:
        details = ", ".join(
            f"{key}: export {saved} vs target {actual}" for key, (saved, actual) in wrong.items()
        )
        raise ValueError(f"{directory} was trained against a different target ({details})")
