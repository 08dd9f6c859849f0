"""The probe family's export: its layout, its validator, its speculator and its reload."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from lightning_drafts.core.batch import validate_batch
from lightning_drafts.serving.export_files import (
    WEIGHTS_FILE,
    DefectList,
    ExportSummary,
    architecture_of,
    check_tensor_layout,
    check_trained_tensors,
    read_export,
    write_export,
)
from lightning_drafts.serving.family import VerifiedPrefix
from lightning_drafts.training.target import FrozenTarget

if TYPE_CHECKING:
    from tests.families.probe.module import ProbeDraft

ARCHITECTURE = "LightningDraftsNextTokenProbe"
CONVENTION = "decoder-layer outputs, 0-based (HF hidden_states[id + 1])"


def write_probe_export(module: ProbeDraft, output_dir: str | Path) -> Path:
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "next_token_probe",
        "hidden_size": module.target.text_config.hidden_size,
        "vocab_size": module.target.vocab_size,
        "target_layer_ids": list(module.target_layer_ids),
        "torch_dtype": str(module.head.weight.dtype).removeprefix("torch."),
        "lightning_drafts": {**module.target_record(), "layer_id_convention": CONVENTION},
    }
    tensors = {"head.weight": module.head.weight, "head.bias": module.head.bias}
    return write_export(output_dir, config, tensors)


def validate_probe_export(directory: Path, target: FrozenTarget | None = None) -> ExportSummary:
    """Every defect of a probe export in one ``ValueError``, each naming its field or tensor."""
    files = read_export(directory)
    config, defects = files.config, DefectList(directory)
    architecture = architecture_of(config, directory)
    if architecture != ARCHITECTURE:
        defects.add("architectures", f"is [{architecture!r}], not [{ARCHITECTURE!r}]")
    hidden, vocab, layers = (config.get(k) for k in ("hidden_size", "vocab_size", "target_layer_ids"))
    for name, value in (("hidden_size", hidden), ("vocab_size", vocab)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            defects.add(name, f"is {value!r}; it must be a positive int")
    if not isinstance(layers, list) or len(layers) != 1 or not isinstance(layers[0], int):
        defects.add("target_layer_ids", f"is {layers!r}; the probe reads exactly one layer")
        layers = None
    if target is not None:
        if hidden != target.text_config.hidden_size:
            defects.add("hidden_size", f"is {hidden} but the target has {target.text_config.hidden_size}")
        if vocab != target.vocab_size:
            defects.add("vocab_size", f"is {vocab} but the target has {target.vocab_size}")
        if layers is not None and not 0 <= layers[0] < target.num_layers:
            defects.add("target_layer_ids", f"{layers} is outside the target's {target.num_layers} layers")
    if not (config.get("lightning_drafts") or {}).get("layer_id_convention"):
        defects.add("lightning_drafts.layer_id_convention", "is missing; the layer ids are ambiguous")
    if isinstance(hidden, int) and isinstance(vocab, int):
        expected = {
            "head.weight": torch.empty(vocab, hidden, device="meta"),
            "head.bias": torch.empty(vocab, device="meta"),
        }
        check_tensor_layout(files, expected, ARCHITECTURE, defects)
    check_trained_tensors(files, defects)
    defects.raise_if_any()
    return ExportSummary(architecture, tuple(layers), CONVENTION, {"vocab_size": vocab})


class ProbeSpeculator:
    """One proposal per round: the head's pick at the last verified token."""

    num_steps = 1

    def __init__(self, head: nn.Linear, target_layer_ids: tuple[int, ...]) -> None:
        self.head = head
        self.target_layer_ids = target_layer_ids

    @torch.no_grad()
    def propose(self, prefix: VerifiedPrefix) -> Tensor:
        # The last verified token has no target features yet; the probe needs them, so it runs the target.
        captured = prefix.target(validate_batch({"input_ids": prefix.tokens[None]}), self.target_layer_ids)
        return self.head(captured.hidden_states[0][0, -1]).argmax(-1, keepdim=True)


def _head(directory: Path, target: FrozenTarget) -> nn.Linear:
    weights = load_file(str(directory / WEIGHTS_FILE))
    head = nn.Linear(weights["head.weight"].shape[1], weights["head.weight"].shape[0])
    head.load_state_dict({"weight": weights["head.weight"], "bias": weights["head.bias"]})
    return head.to(target.lm_head.weight.device).eval().requires_grad_(False)


def load_probe_speculator(directory: Path, target: FrozenTarget, num_steps: int) -> ProbeSpeculator:
    if num_steps != 1:
        raise ValueError(f"num_steps = {num_steps}: the probe proposes exactly one token per round")
    layers = read_export(directory).config["target_layer_ids"]
    return ProbeSpeculator(_head(directory, target), tuple(layers))


def load_probe_module(directory: Path, target: FrozenTarget, num_steps: int) -> ProbeDraft:
    from tests.families.probe.module import ProbeDraft

    module = ProbeDraft(target.model)
    module.head.load_state_dict(_head(directory, target).state_dict())
    return module


def default_num_steps(config: dict[str, Any]) -> int:
    return 1
