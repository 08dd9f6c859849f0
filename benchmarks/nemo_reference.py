"""NVIDIA NeMo Automodel 0.7.0's draft trainers, loaded as an independent reference, and the weight mapping
that puts one set of draft weights into both implementations.

The wheel is unpacked (never installed) by ``.ci/reference-env``; its root is
``$LIGHTNING_DRAFTS_REFERENCE_ROOT``, else :func:`reference_root` runs ``.ci/reference-env`` (which downloads
it once into ``<repo>/.reference``). NeMo's package ``__init__`` files import vLLM, SGLang and its own import
hooks, so :func:`load` reads NeMo's packages as empty namespaces (their ``__init__`` files are never run, but
for the few whose names the draft files import) and then imports the draft files themselves, which need only
torch and transformers. Nothing of NeMo is copied into this project.

Used by ``benchmarks/vs_reference.py`` and by the oracle tests of ``tests/reference/``:

* :func:`load` imports one NeMo module (``load("speculative.eagle.core")``);
* :func:`eagle3_reference`, :func:`dflash_reference`, :func:`dspark_reference` build NeMo's side of a
  project module (NeMo's draft holding its weights, NeMo's target wrapper and trainer) as a
  :class:`Reference` whose ``step(packed, anchors)`` runs one NeMo training step on the same batch;
* :func:`load_into` and :func:`gradient_pairs` are the weight mapping, both ways (``*_RENAMES``).

::

    reference = eagle3_reference(module)
    metrics = reference.step(validate_batch(batch, vocab_size=module.target.vocab_size), None)
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
ENV_VAR = "LIGHTNING_DRAFTS_REFERENCE_ROOT"
PACKAGE = "nemo_automodel"
# Packages whose __init__ must run: the draft files import names that only these define. Every other NeMo
# package is an empty namespace (its __init__ imports vLLM / SGLang or installs NeMo's own import hooks).
INIT_RUN = frozenset({"nemo_automodel.components.models.common"})


class ReferenceUnavailable(RuntimeError):
    """The reference wheel could not be had; the message says why and what to run."""


@functools.cache
def reference_root() -> Path:
    """The unpacked wheel's root (the folder holding ``nemo_automodel/``): ``$LIGHTNING_DRAFTS_REFERENCE_ROOT``,
    else the last line ``.ci/reference-env`` prints (it downloads and unpacks the wheel once)."""
    given = os.environ.get(ENV_VAR)
    if given:
        root = Path(given)
    else:
        built = subprocess.run(
            ["bash", str(ROOT / ".ci" / "reference-env")],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHON": sys.executable},
        )
        if built.returncode != 0:
            raise ReferenceUnavailable(
                f"{ENV_VAR} is unset and `bash .ci/reference-env` failed (it downloads nemo-automodel==0.7.0 "
                f"with pip; run it yourself and export {ENV_VAR} to its last line):\n{built.stderr[-4000:]}"
            )
        root = Path(built.stdout.strip().splitlines()[-1])
    if not (root / PACKAGE / "components" / "speculative").is_dir():
        raise ReferenceUnavailable(
            f"{ENV_VAR}={root} holds no {PACKAGE}/components/speculative; run `bash .ci/reference-env` and "
            f"export {ENV_VAR} to the folder it prints last"
        )
    return root


class _NamespaceLoader(importlib.abc.Loader):
    """Makes a package an empty module whose ``__path__`` is its folder, without running its ``__init__``."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        return None


class _ReferenceFinder(importlib.abc.MetaPathFinder):
    """Finds ``nemo_automodel.*`` in the unpacked wheel only: packages as namespaces (but :data:`INIT_RUN`),
    modules from their files."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None):
        if name != PACKAGE and not name.startswith(PACKAGE + "."):
            return None
        location = self.root.joinpath(*name.split("."))
        if location.is_dir():
            init = location / "__init__.py"
            if name in INIT_RUN and init.is_file():
                return importlib.util.spec_from_file_location(
                    name, init, submodule_search_locations=[str(location)]
                )
            spec = importlib.machinery.ModuleSpec(name, _NamespaceLoader(), is_package=True)
            spec.submodule_search_locations = [str(location)]
            return spec
        source = location.with_suffix(".py")
        if source.is_file():
            return importlib.util.spec_from_file_location(name, source)
        return None


@functools.cache
def _install_finder() -> None:
    installed = sys.modules.get(PACKAGE)
    root = reference_root()
    if installed is not None and not str(getattr(installed, "__path__", [""])[0]).startswith(str(root)):
        raise ReferenceUnavailable(
            f"{PACKAGE} is already imported from {installed.__path__}; the reference must come from {root} "
            "(uninstall nemo-automodel from this environment)"
        )
    sys.meta_path.insert(0, _ReferenceFinder(root))


def load(module: str) -> ModuleType:
    """``nemo_automodel.components.<module>`` from the reference wheel (e.g. ``"speculative.dflash.core"``)."""
    _install_finder()
    return importlib.import_module(f"{PACKAGE}.components.{module}")


# --- the weight mapping -----------------------------------------------------------------------------------
# The project's draft state dicts follow the serving layouts; NeMo's follow its own module trees. The names
# map with a handful of prefix renames per family (project prefix -> NeMo prefix, first match wins).

EAGLE3_RENAMES = (
    ("midlayer.", "model.layers.0."),
    ("fc.", "model.fc."),
    ("norm.", "model.norm."),
    ("embed_tokens.", "model.embed_tokens."),
)


def renamed(name: str, renames: Sequence[tuple[str, str]]) -> str:
    """``name`` with the first matching project prefix replaced by NeMo's."""
    for ours, theirs in renames:
        if name.startswith(ours):
            return theirs + name[len(ours) :]
    return name


def nemo_parameters(
    parameters: Mapping[str, torch.Tensor], renames: Sequence[tuple[str, str]]
) -> dict[str, torch.Tensor]:
    """The project's draft ``parameters`` under NeMo's names (cloned, so the two never share storage)."""
    return {renamed(name, renames): tensor.detach().clone() for name, tensor in parameters.items()}


def load_into(module: torch.nn.Module, draft: torch.nn.Module, renames: Sequence[tuple[str, str]]) -> None:
    """Copy the project ``draft``'s parameters into NeMo's ``module``; the two parameter sets must match
    name for name and shape for shape (a name the mapping misses fails here, naming it, instead of leaving
    a random weight). Buffers (vocabulary maps, rotary tables) are each side's own business."""
    mapped = nemo_parameters(dict(draft.named_parameters()), renames)
    theirs = dict(module.named_parameters())
    if set(mapped) != set(theirs):
        raise ValueError(
            f"the weight mapping does not cover both drafts: NeMo's {type(module).__name__} has no "
            f"{sorted(set(mapped) - set(theirs))} and the project's draft no {sorted(set(theirs) - set(mapped))} "
            "(after renaming); add a rename"
        )
    with torch.no_grad():
        for name, tensor in mapped.items():
            if theirs[name].shape != tensor.shape:
                raise ValueError(
                    f"{name}: NeMo's shape {tuple(theirs[name].shape)}, ours {tuple(tensor.shape)}"
                )
            theirs[name].copy_(tensor)


def gradient_pairs(
    draft: torch.nn.Module, module: torch.nn.Module, renames: Sequence[tuple[str, str]]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{project name: (our gradient, NeMo's gradient)}`` for every trainable project parameter (a zero
    tensor where the loss never reached a parameter). A parameter trainable on one side only fails."""
    theirs = dict(module.named_parameters())
    pairs = {}
    for name, ours in draft.named_parameters():
        other = theirs[renamed(name, renames)]
        if ours.requires_grad != other.requires_grad:
            raise ValueError(
                f"{name} is {'' if ours.requires_grad else 'not '}trained here but "
                f"{'' if other.requires_grad else 'not '}in NeMo's draft"
            )
        if ours.requires_grad:
            pairs[name] = tuple(p.grad if p.grad is not None else torch.zeros_like(p) for p in (ours, other))
    return pairs


# --- NeMo's side of each family, built from a project module -----------------------------------------------
# Each builder takes a project module (its target, its hyperparameters, its draft's weights) and returns a
# Reference: NeMo's draft holding the same weights, and ``step(packed, anchors)`` running NeMo's own target
# wrapper and trainer on the same batch. NeMo samples anchors inside its trainers; the explicit ``anchors``
# (the project's ``[B, N]`` layout, -1 = none) reach it through the one method each trainer samples with
# (DFlash, DFlash2) or by taking every valid anchor (DSpark, whose draft samples them).


@dataclass
class Reference:
    """NeMo's draft (weights copied from the project's), the renames between the two, and one training
    step of NeMo's trainer: ``step(packed, anchors=None, prefix_lengths=None) -> NeMo's metrics dataclass``
    (its loss not yet backpropagated). A batch whose rows each hold one document runs NeMo's unpacked path,
    any other its packing path."""

    draft: torch.nn.Module
    renames: Sequence[tuple[str, str]]
    step: Callable[..., Any]


def packs(packed: Any) -> bool:
    """Whether some row of ``packed`` holds more than one document."""
    return bool(((packed.seq_lens > 0).sum(dim=1) > 1).any())


def _packing(packed: Any) -> dict[str, torch.Tensor]:
    """NeMo's packing inputs: the contract's document layout when the batch packs, nothing when padded."""
    if not packs(packed):
        return {}
    return {
        "position_ids": packed.position_ids,
        "seq_lens": packed.seq_lens,
        "doc_remaining": packed.doc_remaining,
    }


def eagle3_reference(module: Any, lk_loss_type: str | None = None) -> Reference:
    """EAGLE-3 (dense ``LlamaEagle3DraftModel`` or MLA ``DeepseekV3Eagle3DraftModel``) under NeMo's
    ``Eagle3TrainerModule``, with the draft config NeMo's recipe derives from the target."""
    core, target_module = load("speculative.eagle.core"), load("speculative.eagle.target")
    hf = module.target.model
    config = hf.config.to_dict()
    config.update(
        draft_vocab_size=module.draft.draft_vocab_size,
        target_hidden_size=hf.config.hidden_size,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    if module.target.config.model_type == "deepseek_v3":
        draft_class = load("speculative.eagle.draft_deepseek").DeepseekV3Eagle3DraftModel
    else:
        draft_class = load("speculative.eagle.draft_llama").LlamaEagle3DraftModel
    # NeMo's norms default to bf16; its recipe casts the draft to the compute dtype.
    draft = draft_class(type(hf.config).from_dict(config)).float()
    load_into(draft, module.draft, EAGLE3_RENAMES)
    selected = module.draft.selected_token_ids.clone()
    draft.set_vocab_mapping(selected)
    draft.freeze_embeddings()
    mask = torch.zeros(module.target.vocab_size, dtype=torch.bool)
    mask[selected] = True
    trainer = core.Eagle3TrainerModule(
        draft,
        selected_token_ids=selected,
        selected_token_mask=mask,
        ttt_steps=module.hparams.ttt_length,
        lk_loss_type=lk_loss_type,
        lk_kl_scale=module.hparams.lk_kl_scale,
        lk_kl_decay=module.hparams.lk_kl_decay,
    )
    wrapper = target_module.HFEagle3TargetModel(hf, aux_layer_ids=list(module.target_layer_ids))

    def step(
        packed: Any, anchors: torch.Tensor | None = None, prefix_lengths: torch.Tensor | None = None
    ) -> Any:
        batch = wrapper.generate_batch(
            packed.input_ids, packed.attention_mask, packed.loss_mask.long(), **_packing(packed)
        )
        return trainer(**batch.to_trainer_inputs())

    return Reference(draft, EAGLE3_RENAMES, step)


def _nemo_anchors(anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The project's ``[B, N]`` anchors (-1 = none) as NeMo's ``(anchors, keep_mask)`` (0 where not kept)."""
    keep = anchors >= 0
    return anchors.clamp(min=0), keep


def dflash_reference(module: Any) -> Reference:
    """DFlash or DFlash2 under NeMo's ``DFlashTrainerModule`` / ``DFlash2TrainerModule`` (objective
    ``dflash``, or ``variable_prefix`` with the ``prefix_lengths`` ``[B, N]`` given to ``step``), with the draft config
    NeMo's recipe derives from the target."""
    dflash_core, target_module = load("speculative.dflash.core"), load("speculative.dflash.target")
    draft_qwen3 = load("speculative.dflash.draft_qwen3")
    dflash2 = hasattr(module, "selector_top_k")
    hf = module.target.model
    extra = {
        "target_layer_ids": list(module.target_layer_ids),
        "block_size": module.block_size,
        "mask_token_id": module.mask_token_id,
    }
    if dflash2:
        extra.update(selector_rank=module._selector_rank, selector_top_k=module.selector_top_k)
    config = draft_qwen3.build_qwen3_dflash_draft_config(
        hf.config,
        num_draft_layers=len(module.draft.layers),
        num_target_layers=hf.config.num_hidden_layers,
        block_size=module.block_size,
        dflash_config=extra,
        attention_backend="sdpa",
    )
    if module.sliding_window is not None:
        config.layer_types = ["sliding_attention"] * config.num_hidden_layers
        config.sliding_window = module.sliding_window
    if dflash2:
        draft = load("speculative.dflash.draft_qwen3_dflash2").Qwen3DFlash2DraftModel(config).float()
        base = load("speculative.dflash.dflash2_core").DFlash2TrainerModule
        options = {"selector_loss_weight": module.selector_loss_weight}
    else:
        draft = draft_qwen3.Qwen3DFlashDraftModel(config).float()
        base = dflash_core.DFlashTrainerModule
        loss_type = "variable_prefix" if module.variable_prefix else "dflash"
        options = {"loss_type": loss_type, "prefix_weight_base": module.prefix_weight_base}
    load_into(draft, module.draft, ())
    given: dict[str, torch.Tensor] = {}

    class GivenAnchors(base):
        """NeMo's trainer with the anchors (and prefix lengths) it would sample replaced by given ones."""

        def _sample_anchor_positions(self, seq_len, loss_mask, device, doc_remaining=None):
            return _nemo_anchors(given["anchors"])

        def _sample_prefix_lengths(self, bsz, n_blocks, device):
            return given["prefix_lengths"]

    trainer = GivenAnchors(
        draft,
        hf.get_output_embeddings(),
        hf.get_input_embeddings(),
        mask_token_id=module.mask_token_id,
        block_size=module.block_size,
        attention_backend="sdpa",
        num_anchors=module.num_anchors,
        loss_decay_gamma=module.loss_decay_gamma,
        sliding_window=module.sliding_window,
        **options,
    )
    wrapper = target_module.HFDFlashTargetModel(hf, target_layer_ids=list(module.target_layer_ids))

    def step(packed: Any, anchors: torch.Tensor, prefix_lengths: torch.Tensor | None = None) -> Any:
        given.update(anchors=anchors, prefix_lengths=prefix_lengths)
        packing = _packing(packed)
        batch = wrapper.generate_batch(
            packed.input_ids, packed.attention_mask, packed.loss_mask.long(), **packing
        )
        return trainer(batch.input_ids, batch.hidden_states, batch.loss_mask, **packing)

    return Reference(draft, (), step)


class _Args(dict):
    """The attribute-and-``in`` view of recipe arguments that NeMo's DSpark config builder reads."""

    __getattr__ = dict.__getitem__


def dspark_reference(
    module: Any, width: int | None = None, num_anchors: int | None = None, seed: int = 0
) -> Reference:
    """DSpark under NeMo's ``DSparkTrainerModule``, the draft config from NeMo's ``build_draft_config``.

    NeMo's draft samples its anchors. Allowed as many as a row has candidate positions (``width - 1`` for
    batches ``width`` tokens wide), it keeps every valid one, so ``step(packed, None)`` trains on a fixed
    set, which :func:`dspark_anchors` gives in the project's layout. With a smaller budget ``num_anchors``
    per row, each step draws from the global RNG seeded with ``seed``, which is the draw
    ``dspark_anchors(packed, num_anchors, seed)`` gives."""
    if (width is None) == (num_anchors is None):
        raise ValueError("pass the batch width (every valid anchor) or num_anchors (a seeded draw), not both")
    config_module, target_module = load("speculative.dspark.config"), load("speculative.dspark.target")
    core, draft_qwen3 = load("speculative.dspark.core"), load("speculative.dspark.draft_qwen3")
    hf = module.target.model
    hp = module.hparams
    args = _Args(
        num_draft_layers=len(module.draft.layers),
        target_layer_ids=list(module.target_layer_ids),
        confidence_head_alpha=hp.confidence_head_alpha,
        confidence_head_with_markov=hp.confidence_head_with_markov,
        markov_rank=hp.markov_rank,
        markov_head_type=hp.markov_head_type,
        block_size=module.block_size,
        mask_token_id=module.mask_token_id,
        num_anchors=width - 1 if num_anchors is None else num_anchors,
    )
    config = config_module.build_draft_config(hf.config, args)
    config._attn_implementation = "sdpa"  # flex attention runs forward only on CPU
    draft = draft_qwen3.Qwen3DSparkModel(config).float()
    load_into(draft, module.draft, ())
    draft.set_embedding_head_trainable(not hp.freeze_embeddings)
    trainer = core.DSparkTrainerModule(
        draft,
        loss_decay_gamma=module.loss_decay_gamma,
        ce_loss_alpha=hp.ce_loss_alpha,
        l1_loss_alpha=hp.l1_loss_alpha,
        confidence_head_alpha=hp.confidence_head_alpha,
    )
    wrapper = target_module.HFDSparkTargetModel(hf, target_layer_ids=list(module.target_layer_ids))

    def step(
        packed: Any, anchors: torch.Tensor | None = None, prefix_lengths: torch.Tensor | None = None
    ) -> Any:
        packing = _packing(packed)
        batch = wrapper.generate_batch(
            packed.input_ids, packed.attention_mask, packed.loss_mask.long(), **packing
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return trainer(
                batch.input_ids,
                batch.target_hidden_states,
                batch.loss_mask,
                target_last_hidden_states=batch.target_last_hidden_states,
                **packing,
            )

    return Reference(draft, (), step)


def dspark_anchors(packed: Any, num_anchors: int | None = None, seed: int = 0) -> torch.Tensor:
    """The anchors NeMo's DSpark draft trains on for ``packed`` (its own sampler), in the project's ``[B, N]``
    layout (-1 = none): every valid one by default, else the draw of a ``dspark_reference(module,
    num_anchors=num_anchors, seed=seed)`` step."""
    common = load("speculative.dspark.common")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        anchors, keep = common.sample_anchor_positions(
            seq_len=packed.input_ids.shape[1],
            loss_mask=packed.loss_mask.long(),
            num_anchors=packed.input_ids.shape[1] - 1 if num_anchors is None else num_anchors,
            device=packed.input_ids.device,
            doc_remaining=packed.doc_remaining if packs(packed) else None,
        )
    width = int(keep.sum(dim=1).max())
    return torch.where(keep, anchors, -1)[:, :width]
