"""The seam a draft family plugs in through: one :class:`DraftFamily` record per family folder, listed
once in :mod:`lightning_drafts.registry`.

Export, validation, ``evaluate``, the CLI and the served-acceptance callback find a family by the class of
a module or by the ``architectures[0]`` of an export, through a :class:`FamilyRegistry`; nothing else
names a family.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from lightning_drafts.serving.export_files import CONFIG_FILE, ExportSummary, architecture_of, read_export
from lightning_drafts.training.module import DraftModule
from lightning_drafts.training.target import FrozenTarget


@dataclass(frozen=True)
class VerifiedPrefix:
    """What a speculator sees at the start of a round (one sequence, no batch dimension).

    Attributes:
        tokens: long ``[L]``, the prompt and every emitted token. The last one (the previous round's
            bonus / correction token, or the prefill's first token) is verified but has no target
            features yet: the target has not run on it.
        hidden_states: one ``[L - 1, H_t]`` tensor per id in the speculator's ``target_layer_ids``, in
            that order: the target's decoder-layer **outputs** (HF ``hidden_states[id + 1]``) at
            ``tokens[:-1]``.
        last_hidden_state: ``[L - 1, H_t]``, the target's final-norm hidden state at ``tokens[:-1]``
            (what its LM head reads).
        target: the frozen target, for drafts that reuse its embedding or LM head (e.g. DFlash).
    """

    tokens: Tensor
    hidden_states: tuple[Tensor, ...]
    last_hidden_state: Tensor
    target: FrozenTarget


@runtime_checkable
class Speculator(Protocol):
    """A draft as a serving engine runs it: propose up to ``num_steps`` target tokens per round.

    Attributes:
        num_steps: the most tokens one proposal holds (EAGLE-3: chain depth; DFlash: block size - 1).
        target_layer_ids: the target decoder-layer outputs (0-based, HF ``hidden_states[id + 1]``) the
            draft reads, read from the exported config in the convention the engine uses.
    """

    num_steps: int
    target_layer_ids: tuple[int, ...]

    def propose(self, prefix: VerifiedPrefix) -> Tensor:
        """Long ``[k]`` **target** vocabulary ids continuing ``prefix.tokens``, ``0 <= k <= num_steps``."""
        ...


@dataclass(frozen=True)
class DraftFamily:
    """Everything the shared workflows need to know about one draft family.

    Attributes:
        name: a label for reports and errors.
        modules: the family's ``DraftModule`` classes (a module's family is found by its class).
        architectures: the ``config.json`` ``architectures[0]`` values its exports carry (an export's
            family is found by it); each name is written here and nowhere else in the workflows.
        validate: ``(export_dir, target or None) -> ExportSummary``; raises ``ValueError`` naming each
            defective field.
        load_speculator: ``(export_dir, target, num_steps) -> Speculator`` built from the exported files
            only (config + safetensors), on the target's device.
        load_training_module: ``(export_dir, target, num_steps) -> DraftModule`` whose ``compute_loss``
            gives the training-time estimate with chains of at least ``num_steps`` positions (the report
            keeps the first ``num_steps``), or ``None`` when the export does not record how to rebuild it.
        default_num_steps: ``config.json -> int``, the proposal length when none is asked for.
        layouts: the export layouts the family's ``module.export(dir, layout=...)`` can write (empty: one
            layout, and ``module.export(dir)`` takes none).
        vllm_methods: ``architectures[0]`` -> vLLM's speculative ``method`` serving that layout
            (``evaluate --engine vllm``); an architecture vLLM does not load is absent.
        sglang_algorithms: ``architectures[0]`` -> SGLang's ``--speculative-algorithm`` for that layout
            (the model card's serving command); an architecture SGLang does not load is absent.
    """

    name: str
    modules: tuple[type[DraftModule], ...]
    architectures: tuple[str, ...]
    validate: Callable[[Path, FrozenTarget | None], ExportSummary]
    load_speculator: Callable[[Path, FrozenTarget, int], Speculator]
    load_training_module: Callable[[Path, FrozenTarget, int], DraftModule | None]
    default_num_steps: Callable[[dict[str, Any]], int]
    layouts: tuple[str, ...] = ()
    vllm_methods: Mapping[str, str] = field(default_factory=dict)
    sglang_algorithms: Mapping[str, str] = field(default_factory=dict)

    def vllm_method(self, architecture: str) -> str:
        """vLLM's speculative method for an export of ``architecture``; refused when vLLM loads none."""
        if architecture not in self.vllm_methods:
            served = sorted(self.vllm_methods) or "none"
            raise ValueError(
                f"vLLM loads no {self.name} draft of architecture {architecture!r} (the {self.name} architectures "
                f"vLLM serves: {served}); evaluate it with the built-in engine (--engine builtin)"
            )
        return self.vllm_methods[architecture]


class FamilyRegistry:
    """The registered families, looked up by module class or export architecture."""

    def __init__(self, families: Iterable[DraftFamily]) -> None:
        self._families: list[DraftFamily] = []
        for family in families:
            self.register(family)

    @property
    def families(self) -> tuple[DraftFamily, ...]:
        return tuple(self._families)

    def register(self, family: DraftFamily) -> None:
        """Add ``family``; an architecture or module class another family already claims is refused."""
        for known in self._families:
            shared = set(known.architectures) & set(family.architectures)
            shared |= {cls.__name__ for cls in set(known.modules) & set(family.modules)}
            if shared:
                raise ValueError(f"family {family.name!r} claims {sorted(shared)}, already {known.name!r}'s")
        self._families.append(family)

    def unregister(self, family: DraftFamily) -> None:
        self._families.remove(family)

    def for_architecture(self, architecture: str) -> DraftFamily:
        for family in self._families:
            if architecture in family.architectures:
                return family
        known = sorted(a for f in self._families for a in f.architectures)
        raise ValueError(
            f"no draft family serves architecture {architecture!r} (known: {known}); register the family's "
            "DraftFamily record in lightning_drafts/registry.py"
        )

    def for_export(self, directory: str | Path) -> DraftFamily:
        """The family of the export in ``directory``, by its ``config.json`` ``architectures[0]``."""
        directory = Path(directory)
        return self.for_architecture(architecture_of(read_export(directory).config, directory))

    def module_class(self, class_path: str) -> type[DraftModule] | None:
        """The registered module class a checkpoint's ``draft_class`` names: where the class is defined
        now, or one of its ``former_class_paths``; ``None`` when no registered family has it."""
        for family in self._families:
            for cls in family.modules:
                if (
                    class_path == f"{cls.__module__}.{cls.__qualname__}"
                    or class_path in cls.former_class_paths
                ):
                    return cls
        return None

    def for_module(self, module: DraftModule) -> DraftFamily:
        for family in self._families:
            if isinstance(module, family.modules):
                return family
        raise ValueError(
            f"{type(module).__name__} belongs to no registered draft family; register its DraftFamily record "
            f"in lightning_drafts/registry.py (export writes {CONFIG_FILE} through it)"
        )
