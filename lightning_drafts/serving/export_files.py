"""Export files for every family: writing an export atomically, reading it back, reporting its defects.

The most reported failure of draft trainers is an export that trains well and serves badly (wrong
captured-layer ids, a missing or never-trained LM head, a ``d2t`` read differently, RoPE settings
lost). Each family writes its layout with :func:`write_export`, checks it with these helpers and raises
one ``ValueError`` that lists every defect, each naming the config field or tensor at fault and the fix.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from lightning_drafts.core.digest import tensor_fingerprint
from lightning_drafts.core.disk_full import DiskFull, is_disk_full
from lightning_drafts.core.output_lock import exclusive_output, private_output

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
CARD_FILE = "README.md"  # the model card (serving.model_card); no validator reads it


@dataclass(frozen=True)
class ExportSummary:
    """What a validated export tells a serving engine (and the evaluator).

    Attributes:
        architecture: ``config.json`` ``architectures[0]``.
        target_layer_ids: the captured target layers the draft reads, as decoder-layer **outputs**,
            0-based (HF ``hidden_states[id + 1]``), whatever convention each engine field uses.
        layer_id_convention: the convention the exporter recorded for its own ids.
        details: family-specific facts (draft vocabulary size, RoPE, ...).
    """

    architecture: str
    target_layer_ids: tuple[int, ...]
    layer_id_convention: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ExportFiles:
    """An export directory opened lazily: the parsed config and the names / shapes / dtypes of its tensors."""

    directory: Path
    config: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]

    def tensor(self, name: str) -> Tensor:
        with safe_open(str(self.directory / WEIGHTS_FILE), framework="pt") as weights:
            return weights.get_tensor(name)


# What an export of this project (or a sharded copy of one) consists of: what `overwrite` may replace.
SHARD_PATTERN = re.compile(r"model-\d+-of-\d+\.safetensors|model\.safetensors\.index\.json")


def is_export_file(name: str) -> bool:
    return name in (CONFIG_FILE, WEIGHTS_FILE, CARD_FILE) or SHARD_PATTERN.fullmatch(name) is not None


def check_destination(output_dir: str | Path, overwrite: bool) -> list[str]:
    """The names already in ``output_dir``; a file there, or a non-empty directory without ``overwrite``,
    is refused."""
    output = Path(output_dir)
    if output.exists() and not output.is_dir():
        raise ValueError(f"{output} is a file; export into a directory")
    present = sorted(p.name for p in output.iterdir()) if output.exists() else []
    if present and not overwrite:
        raise ValueError(
            f"{output} is not empty ({', '.join(present[:5])}{' ...' if len(present) > 5 else ''}); choose an "
            "empty directory, or pass --overwrite (overwrite=True) to replace the export files there"
        )
    return present


@contextmanager
def staged_export(output_dir: str | Path, overwrite: bool = True) -> Iterator[Path]:
    """A temporary directory beside ``output_dir`` to write an export into; when the block ends without
    an error, its files are moved into ``output_dir``; otherwise nothing there changes.

    A non-empty ``output_dir`` is refused unless ``overwrite``, which then removes the export files there
    (config, weights, weight shards, model card: :func:`is_export_file`) and nothing else. A ``ValueError``
    raised inside names ``output_dir``, not the temporary directory. Another process writing ``output_dir``
    at the same time is refused (:func:`~lightning_drafts.core.output_lock.exclusive_output`).
    """
    output = Path(output_dir)
    with exclusive_output(output):
        present = check_destination(output, overwrite)
        output.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
        try:
            try:
                with private_output(staging):
                    yield staging
            except (ValueError, DiskFull) as error:
                raise type(error)(str(error).replace(str(staging), str(output))) from error
            except (SafetensorError, OSError) as error:
                if not is_disk_full(error):
                    raise
                shutil.rmtree(staging, ignore_errors=True)  # what was written of it, so the figure is true
                raise DiskFull(
                    f"no space left on the disk of {output}: {shutil.disk_usage(output.parent).free:,} bytes free "
                    "there (nothing of the export was kept); free space there or export to another disk"
                ) from error
            if not output.exists():
                os.chmod(staging, 0o755)
                staging.rename(output)
                return
            for name in present:
                if is_export_file(name):  # e.g. the shards of an earlier, larger export
                    (output / name).unlink()
            for path in staging.iterdir():
                os.replace(path, output / path.name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def write_export(
    output_dir: str | Path,
    config: Mapping[str, Any],
    tensors: Mapping[str, Tensor],
) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into ``output_dir``, all or nothing: staged
    (:func:`staged_export`) and read back before they land (``lightning-drafts export`` validates an export
    before it lands). Files are readable by others (0644), as a model directory shared with an engine must
    be."""
    with staged_export(output_dir) as staging:
        weights = {name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors.items()}
        save_file(weights, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        (staging / CONFIG_FILE).write_text(json.dumps(dict(config), indent=2) + "\n")
        for name in (WEIGHTS_FILE, CONFIG_FILE):
            os.chmod(staging / name, 0o644)
        with safe_open(str(staging / WEIGHTS_FILE), framework="pt") as written:
            lost = sorted(set(weights) - set(written.keys()))
        if lost:
            raise ValueError(f"the export to {output_dir} lost weights {lost[:5]}; check free disk space")
    return Path(output_dir)


def read_export(directory: str | Path) -> ExportFiles:
    """Open ``directory``; a missing or unreadable ``config.json`` / ``model.safetensors`` raises ``ValueError``."""
    directory = Path(directory)
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise ValueError(f"{path} is missing: an export directory holds {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_path} is not valid JSON ({error}); re-run the export") from error
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} must hold a JSON object, got {type(config).__name__}")
    try:
        with safe_open(str(weights_path), framework="pt") as weights:
            shapes, dtypes = {}, {}
            for name in weights.keys():
                piece = weights.get_slice(name)
                shapes[name] = tuple(piece.get_shape())
                dtypes[name] = _torch_dtype(piece.get_dtype())
    except Exception as error:  # safetensors raises its own error types for truncated / foreign files
        raise ValueError(
            f"{weights_path} is not a readable safetensors file ({error}); re-run the export"
        ) from error
    return ExportFiles(directory, config, shapes, dtypes)


def open_export(directory: str | Path, architectures: Collection[str], kind: str) -> tuple[ExportFiles, str]:
    """:func:`read_export` of a ``kind`` export (e.g. "a DFlash") and its ``architectures[0]``, which must be
    one of ``architectures``: any other layout is refused outright, before its fields are checked."""
    files = read_export(directory)
    architecture = architecture_of(files.config, files.directory)
    if architecture not in architectures:
        raise ValueError(
            f"{files.directory / CONFIG_FILE}: architectures[0] = {architecture!r} is not {kind} layout "
            f"({sorted(architectures)})"
        )
    missing = missing_remote_code(files.config, files.directory)
    if missing:
        raise ValueError(
            f"{files.directory / CONFIG_FILE}: auto_map names code files the export does not contain "
            f"({missing}); transformers' AutoModel with trust_remote_code would fail to load it: ship the "
            "files or drop auto_map"
        )
    return files, architecture


def missing_remote_code(config: Mapping[str, Any], directory: Path) -> list[str]:
    """The ``<module>.py`` files ``config["auto_map"]`` points at that ``directory`` lacks.

    transformers resolves ``"module.Class"`` to ``<directory>/module.py``; a ``"repo--module.Class"``
    reference lives in another repository and is not looked for here."""
    auto_map = config.get("auto_map") or {}
    references = []
    for value in auto_map.values() if isinstance(auto_map, Mapping) else [auto_map]:
        references += value if isinstance(value, list) else [value]
    files = {
        reference.rsplit(".", 1)[0] + ".py"
        for reference in references
        if isinstance(reference, str) and "--" not in reference
    }
    return sorted(name for name in files if not (directory / name).is_file())


def architecture_of(config: dict[str, Any], directory: Path) -> str:
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        raise ValueError(
            f"{directory / CONFIG_FILE}: 'architectures' must be a non-empty list naming the draft class "
            f"(e.g. ['LlamaForCausalLMEagle3']), got {architectures!r}"
        )
    return architectures[0]


class DefectList:
    """Collects export defects so one ``ValueError`` reports all of them at once."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.defects: list[str] = []

    def add(self, name: str, problem: str) -> None:
        self.defects.append(f"{name}: {problem}")

    def raise_if_any(self) -> None:
        if self.defects:
            lines = "\n  - ".join(self.defects)
            raise ValueError(f"the export in {self.directory} would not serve correctly:\n  - {lines}")


def initial_fingerprints(module: torch.nn.Module, names: tuple[str, ...]) -> dict[str, str]:
    """Fingerprints of ``module``'s tensors ``names`` as they are now (call right after construction):
    recording the digest of a freshly initialised LM head lets the validator prove that the exported one
    is not that initialisation (never trained, or replaced by a fresh init on save / load)."""
    state = module.state_dict()
    # Tensors built on the meta device (deferred FSDP init) have no values to fingerprint.
    return {
        name: tensor_fingerprint(state[name]) for name in names if name in state and not state[name].is_meta
    }


def _torch_dtype(name: str) -> torch.dtype:
    mapping = {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
    }
    if name not in mapping:
        raise ValueError(f"tensor dtype {name!r} is not one a draft export uses")
    return mapping[name]


def check_tensor_layout(
    files: ExportFiles, expected: Mapping[str, Tensor], architecture: str, defects: DefectList
) -> None:
    """The written tensors are exactly those ``expected`` (built from config.json), with their shapes, in
    the one dtype config.json declares."""
    check_tensor_shapes(files, expected, architecture, defects)
    dtypes = {dtype for dtype in files.dtypes.values() if dtype.is_floating_point}
    declared = files.config.get("torch_dtype")
    if len(dtypes) > 1:
        defects.add("model.safetensors", f"mixes dtypes {sorted(map(str, dtypes))}; write one dtype")
    elif declared is not None and dtypes and f"torch.{declared}" != str(next(iter(dtypes))):
        defects.add(
            "torch_dtype",
            f"is {declared!r} but the weights are {next(iter(dtypes))}; readers cast by the config",
        )


def check_tensor_shapes(
    files: ExportFiles, expected: Mapping[str, Tensor], architecture: str, defects: DefectList
) -> None:
    """The written tensors are exactly those ``expected`` (built from config.json), with their shapes."""
    for name in sorted(set(expected) - set(files.shapes)):
        defects.add(
            name, "missing from model.safetensors; a reader would leave it at a random init (re-export)"
        )
    for name in sorted(set(files.shapes) - set(expected)):
        defects.add(name, f"is not a tensor of the {architecture} layout; readers reject or ignore it")
    for name in sorted(set(expected) & set(files.shapes)):
        if tuple(expected[name].shape) != files.shapes[name]:
            defects.add(
                name,
                f"has shape {files.shapes[name]} but config.json implies {tuple(expected[name].shape)}; the "
                "config and the weights disagree",
            )


def check_built_weights(
    files: ExportFiles,
    build: Callable[[], torch.nn.Module],
    architecture: str,
    defects: DefectList,
    still_initial: Callable[[str, Tensor], str | None] = lambda name, tensor: None,
    not_shipped: Collection[str] = (),
) -> None:
    """The weights of a draft a reader builds from ``files.config`` (``build()``, run on the meta device):
    :func:`check_tensor_layout` against its tensors less ``not_shipped`` (those the server takes from the
    target), then, when the layout is right, :func:`check_trained_tensors`."""
    try:
        with torch.device("meta"):
            expected = build().state_dict()
    except (ValueError, TypeError, KeyError) as error:  # e.g. an unknown hidden_act or rope_type
        defects.add(CONFIG_FILE, f"does not describe a buildable {architecture} ({error})")
    else:
        shipped = {name: tensor for name, tensor in expected.items() if name not in not_shipped}
        check_tensor_layout(files, shipped, architecture, defects)
    defects.raise_if_any()
    check_trained_tensors(files, defects, still_initial)


def check_target_sizes(
    config: Mapping[str, Any], defects: DefectList, expected: Mapping[str, Any], why: str
) -> None:
    """Each field of ``expected`` present in ``config`` equals the target's value there (``why``: what
    a mismatch means)."""
    for name, value in expected.items():
        if name in config and config[name] != value:
            defects.add(name, f"is {config[name]} but the target has {value}; {why}")


def check_trained_tensors(
    files: ExportFiles,
    defects: DefectList,
    still_initial: Callable[[str, Tensor], str | None] = lambda name, tensor: None,
) -> None:
    """Every floating tensor is finite; no matrix is constant; not every RMSNorm gain is still 1.0; and
    ``still_initial(name, tensor)`` (a family's own parts that start at a known value: zeros, an
    identity kernel) returns why a tensor is still at that value, or None."""
    norms_at_init = []
    for name, dtype in sorted(files.dtypes.items()):
        if not dtype.is_floating_point:
            continue
        tensor = files.tensor(name)
        if not bool(torch.isfinite(tensor).all()):
            defects.add(name, "holds NaN or inf values")
        elif name.endswith("norm.weight"):
            norms_at_init.append(bool((tensor == 1).all()))
        elif (reason := still_initial(name, tensor)) is not None:
            defects.add(name, reason)
        elif tensor.dim() >= 2 and tensor.numel() and is_constant(tensor):
            defects.add(name, "is constant (e.g. all zeros): it was never trained or not saved")
    if norms_at_init and all(norms_at_init):
        defects.add(
            "*norm.weight",
            f"all {len(norms_at_init)} RMSNorm gains are still exactly 1.0, their initialisation: the draft was "
            "never trained, or the export wrote fresh weights",
        )


def is_constant(tensor: Tensor) -> bool:
    return bool((tensor == tensor.reshape(-1)[0]).all())
