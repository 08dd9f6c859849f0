"""Read a DSpark export back: the draft network of a NeMo-layout export, or an export's weights into a
module (either layout)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from lightning_drafts.dspark.draft import DSparkDraft
from lightning_drafts.dspark.layout import TARGET_COPIES, draft_from_config, read_config
from lightning_drafts.serving.export_files import WEIGHTS_FILE


def load_exported_draft(path: str | Path) -> tuple[DSparkDraft, dict[str, Any]]:
    """Rebuild the draft network of a ``nemo``-layout export (weights loaded strictly) with its config.

    A SpecForge-layout export has no embedding / LM head; load it with ``DSparkModule.load_exported``,
    whose module holds the target's.
    """
    path = Path(path)
    config, layout, fields = read_config(path)
    if layout != "nemo":
        raise ValueError(
            f"{path} is a SpecForge-layout export without the embedding / LM head; build a DSparkModule on its "
            "target and call load_exported(path)"
        )
    draft = draft_from_config(config, fields["target_layer_ids"], fields)
    state = load_file(str(path / WEIGHTS_FILE))
    draft.to(next(iter(state.values())).dtype).load_state_dict(state, strict=True)
    return draft, config


def load_into_module(draft: DSparkDraft, path: Path, fields: dict[str, Any]) -> None:
    """Load an export's weights into ``draft`` after checking it was made with these DSpark ``fields``."""
    _, layout, exported = read_config(path)
    if exported != fields:
        raise ValueError(
            f"{path} holds a DSpark draft with {exported}, but this module has {fields}; build the "
            "module with matching block_size, mask_token_id, target_layer_ids and Markov / confidence heads"
        )
    state = load_file(str(path / WEIGHTS_FILE))
    reference = draft.state_dict()
    # The SpecForge layout leaves the embedding / LM head out: the module's copies of the target's stay.
    expected = set(reference) - (set(TARGET_COPIES) if layout == "specforge" else set())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - set(reference))
    if missing or unexpected:
        raise ValueError(
            f"{path} does not fit this draft: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    draft.load_state_dict({k: v.to(reference[k].dtype) for k, v in state.items()}, strict=False)
