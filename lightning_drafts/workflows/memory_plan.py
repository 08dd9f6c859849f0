"""Peak memory per rank, tokens per optimizer step and model FLOPs of a fit config, without loading a weight.

The config's module is built on the meta device (its target from a ``config.json``), so parameter counts
are the code's own; activations come from the per-family formulas of
:mod:`~lightning_drafts.workflows.activation_bytes`. The derivation and its check against measured CPU
steps: docs/guides/memory-plan.md.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_drafts.training.sharding import repeated_layers
from lightning_drafts.workflows.activation_bytes import (
    F32,
    BlockSettings,
    MLAWidths,
    Shapes,
    Workload,
    block_count,
    block_draft_bytes,
    eagle3_bytes,
)

GB = 1e9
SHARDED = {"ModelParallelStrategy": "fsdp2", "FSDPStrategy": "fsdp1"}


class _AllOnMeta(TorchFunctionMode):
    """Every tensor on the meta device, whatever device the code names (``skip_init``'s ``to_empty``, a
    ``.cpu()`` copy of a rope table): a module of billions of parameters builds in seconds and no memory."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (Tensor.cpu, Tensor.cuda) and args[0].is_meta:
            return args[0]
        if func is Tensor.to:
            args = tuple(a for a in args if not isinstance(a, (str, torch.device)))
            kwargs.pop("device", None)
        elif "device" in kwargs:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


@dataclass(frozen=True)
class RunSettings:
    """What the trainer section decides: ranks, sharding and precision, and the micro-batches per step."""

    devices: int
    strategy: str  # "single", "ddp", "fsdp1" or "fsdp2"
    precision: str
    accumulate: int
    cpu: bool

    @property
    def activation_bytes(self) -> int:
        return 2 if self.precision.startswith(("bf16", "16")) else 4

    @classmethod
    def of(cls, trainer: dict[str, Any]) -> RunSettings:
        strategy = trainer.get("strategy")
        name = strategy.get("class_path", "").rsplit(".", 1)[-1] if isinstance(strategy, dict) else strategy
        devices = trainer.get("devices", 1)
        devices = devices if isinstance(devices, int) else 1
        kind = SHARDED.get(name, "ddp" if devices > 1 else "single")
        return cls(
            devices=devices,
            strategy=kind,
            precision=str(trainer.get("precision", "32-true")),
            accumulate=int(trainer.get("accumulate_grad_batches", 1)),
            cpu=trainer.get("accelerator") == "cpu",
        )


@dataclass
class Plan:
    """The estimate: ``memory`` (bytes per rank, by item), its peak, and the step's tokens and FLOPs."""

    family: str
    settings: RunSettings
    work: Workload
    memory: dict[str, float]
    activations: dict[str, float]
    tokens_per_step: int
    flops: dict[str, float]
    notes: list[str] = field(default_factory=list)

    @property
    def resident(self) -> float:
        """What stays on the rank between steps: weights, optimizer state."""
        return sum(v for k, v in self.memory.items() if not k.startswith("during the step"))

    @property
    def step_bytes(self) -> float:
        """What one micro-batch adds at its peak: the activations at the end of the forward pass, or in
        backward the gradients (unsharded under FSDP) beside what the activations have not yet freed."""
        return max(sum(self.activations.values()), self.memory.get("during the step: gradients", 0.0))

    @property
    def peak(self) -> float:
        return (
            self.resident
            + sum(
                v
                for k, v in self.memory.items()
                if k.startswith("during the step: ") and k != "during the step: gradients"
            )
            + self.step_bytes
        )

    @property
    def total_flops(self) -> float:
        return sum(self.flops.values())


def read_config(path: str | Path) -> dict[str, Any]:
    """A fit config's ``trainer``, ``model`` and ``data`` sections."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"config {path} does not exist; give a fit config, e.g. configs/recipes/*.yaml"
        )
    config = yaml.safe_load(path.read_text()) or {}
    if "model" not in config or "class_path" not in (config.get("model") or {}):
        raise ValueError(f"{path} has no model.class_path; give a lightning-drafts fit config")
    return config


def target_config(target: str, config_json: str | Path | None) -> dict[str, Any]:
    """The target's ``config.json`` fields: ``config_json`` when given, else ``AutoConfig`` of the target
    (a local folder, ``shipped:<name>`` or the Hugging Face cache)."""
    if config_json is not None:
        path = Path(config_json)
        if not path.is_file():
            raise FileNotFoundError(f"--target-config {path} does not exist; give the target's config.json")
        return json.loads(path.read_text())
    from transformers import AutoConfig

    from lightning_drafts.training.target import resolve_shipped

    try:
        # Never a download: a plan reads what is here.
        return AutoConfig.from_pretrained(resolve_shipped(target), local_files_only=True).to_dict()
    except OSError as error:
        raise FileNotFoundError(
            f"the target {target!r} has no config.json here (not a folder, not in the Hugging Face cache); "
            "pass its config.json with --target-config (benchmarks/recipe_targets/ holds the recipe targets')"
        ) from error


def build_on_meta(model: dict[str, Any], target_fields: dict[str, Any]) -> nn.Module:
    """The config's LightningModule with every tensor on the meta device."""
    module_name, class_name = model["class_path"].rsplit(".", 1)
    cls = getattr(importlib.import_module(module_name), class_name)
    args = dict(model.get("init_args") or {})
    args["target"] = {k: v for k, v in target_fields.items() if k not in ("quantization_config", "auto_map")}
    args.pop("remote", None)
    with torch.device("meta"), _AllOnMeta():
        return cls(**args)


def _count(parameters: Any) -> int:
    return sum(p.numel() for p in parameters)


def plan_config(
    config: dict[str, Any],
    target_fields: dict[str, Any],
    devices: int | None = None,
    precision: str | None = None,
    rows: int | None = None,
    width: int | None = None,
    document_tokens: int = 1024,
    supervised: float = 0.6,
    coverage: float = 1.0,
    cpu: bool | None = None,
) -> Plan:
    """The estimate for one fit config; the keyword arguments override its trainer and data settings."""
    trainer = dict(config.get("trainer") or {})
    if devices is not None:
        trainer["devices"] = devices
    if precision is not None:
        trainer["precision"] = precision
    if cpu is not None:
        trainer["accelerator"] = "cpu" if cpu else "gpu"
    settings = RunSettings.of(trainer)
    data = (config.get("data") or {}).get("init_args") or {}
    work = Workload(
        rows=rows or int(data.get("batch_size", 1)),
        width=width or int(data.get("max_tokens", 2048)),
        document_tokens=min(document_tokens, width or int(data.get("max_tokens", 2048))),
        supervised=supervised,
        coverage=coverage,
    )
    module = build_on_meta(config["model"], target_fields)
    family = type(module).__name__.removesuffix("Module")
    memory, shapes, notes = _weights(module, settings)
    e = settings.activation_bytes
    ttt_length = module.hparams.get("ttt_length")
    if ttt_length:
        activations = eagle3_bytes(shapes, work, ttt_length, e, settings.cpu, _mla_widths(module))
    else:
        checkpointing = bool(module.hparams.get("activation_checkpointing"))
        activations = block_draft_bytes(shapes, work, _block_settings(module), e, settings.cpu, checkpointing)
        if checkpointing:
            notes.append(
                "activation checkpointing: each draft layer keeps its input; one is rebuilt at a time"
            )
    tokens = work.tokens * settings.devices * settings.accumulate
    return Plan(
        family=family,
        settings=settings,
        work=work,
        memory=memory,
        activations=activations,
        tokens_per_step=tokens,
        flops=_flops(module, shapes, work, settings),
        notes=notes,
    )


def _weights(module: nn.Module, settings: RunSettings) -> tuple[dict[str, float], Shapes, list[str]]:
    target = module.target
    text = target.text_config
    target_bytes = next(target.parameters()).dtype.itemsize
    target_params = _count(target.parameters())
    draft_roots = [child for name, child in module.named_children() if name != "target"]
    trainable = _count(p for root in draft_roots for p in root.parameters() if p.requires_grad)
    frozen = _count(p for root in draft_roots for p in root.parameters() if not p.requires_grad)
    layers = [layer for root in draft_roots for layer in repeated_layers(root)]
    layer_params = max((_count(layer.parameters()) for layer in layers), default=0)
    ranks = settings.devices if settings.strategy in ("fsdp1", "fsdp2") else 1
    shard_target = settings.strategy == "fsdp1" or (
        settings.strategy == "fsdp2" and module.hparams.get("shard_target")
    )
    decoder = _count(target.decoder_layers.parameters()) if shard_target else 0
    target_layer = max((_count(layer.parameters()) for layer in target.decoder_layers), default=0)
    memory = {
        "target weights": (target_params - decoder + decoder / settings.devices) * target_bytes,
        # fp32 masters (a *-mixed precision keeps them fp32), their gradients, AdamW's two moments.
        "draft weights (fp32)": trainable * F32 / ranks,
        # FSDP2 keeps them whole on every rank, outside the draft's groups; FSDP1 shards them in its units.
        "draft frozen copies (fp32)": frozen * F32 / (ranks if settings.strategy == "fsdp1" else 1),
        "AdamW moments (fp32)": 2 * trainable * F32 / ranks,
    }
    notes = []
    if shard_target:
        # One target layer gathered, the next prefetched.
        memory["during the step: gathered target layers"] = 2 * target_layer * target_bytes
    if ranks > 1:
        # FSDP2: the draft root's trainable weights outside its layers stay whole from its forward to its
        # backward, plus a layer running and one prefetched. FSDP1: one flat unit, frozen copies included.
        if settings.strategy == "fsdp2":
            root = trainable - len(layers) * layer_params
        else:
            root = trainable + frozen
        gathered = root + (2 * layer_params if settings.strategy == "fsdp2" else 0)
        width = 2 if settings.strategy == "fsdp1" and settings.activation_bytes == 2 else F32
        memory["during the step: gathered draft"] = gathered * width
        memory["during the step: gradients"] = gathered * width + trainable * F32 / ranks
        notes.append(f"{settings.strategy.upper()} over {settings.devices} ranks")
    else:
        memory["during the step: gradients"] = trainable * F32
    vocab = getattr(module, "draft_vocab_size", None) or getattr(
        getattr(module, "draft", None), "draft_vocab_size", None
    )
    draft_config = getattr(module.draft, "config", text)
    heads = getattr(draft_config, "num_attention_heads", text.num_attention_heads)
    head_dim = getattr(draft_config, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(draft_config, "num_key_value_heads", None) or heads
    shapes = Shapes(
        hidden=text.hidden_size,
        intermediate=getattr(draft_config, "intermediate_size", text.intermediate_size),
        query_width=heads * head_dim,
        kv_width=kv_heads * head_dim,
        vocab=vocab or target.vocab_size,
        target_vocab=target.vocab_size,
        captured=len(getattr(module, "target_layer_ids", None) or (0, 0, 0)),
        draft_layers=max(len(layers), 1),
    )
    return memory, shapes, notes


def _mla_widths(module: nn.Module) -> MLAWidths | None:
    config = getattr(module.draft, "config", None)
    if config is None or not hasattr(config, "kv_lora_rank"):
        return None
    names = [f.name for f in fields(MLAWidths) if f.name != "heads"]
    return MLAWidths(heads=config.num_attention_heads, **{name: getattr(config, name) for name in names})


def _block_settings(module: nn.Module) -> BlockSettings:
    conv = getattr(module, "_conv", None)
    return BlockSettings(
        block_size=module.block_size,
        anchors_per_document=module.num_anchors,
        partial_blocks=type(module).__name__.startswith("DSpark"),
        logits_chunk_blocks=module.logits_chunk_blocks,
        conv_convolutions=2 if conv is not None else 0,
        markov_rank=int(module.hparams.get("markov_rank") or 0),
        differentiable_outputs=2 if conv is not None else 1,
    )


def _flops(module: nn.Module, shapes: Shapes, work: Workload, settings: RunSettings) -> dict[str, float]:
    """Model FLOPs of one optimizer step: 2 x multiply-adds of the matmuls, forward only for the frozen
    target, forward and backward (3x) for the draft; attention as 2 x 2 x queries x visible keys x width."""
    scale = settings.devices * settings.accumulate
    target = module.target
    text = target.text_config
    tokens = work.tokens
    active = _active_target_params(target, text)
    target_flops = 2 * active * tokens
    # Causal attention over documents: each token sees half its document on average.
    target_attention = (
        2 * 2 * tokens * (work.document_tokens / 2) * shapes.query_width * text.num_hidden_layers
    )
    draft_roots = [child for name, child in module.named_children() if name != "target"]
    matrix = _count(p for root in draft_roots for p in root.parameters() if p.requires_grad and p.dim() == 2)
    if module.hparams.get("ttt_length"):
        supervised = tokens * work.supervised
        slots = module.hparams["ttt_length"] * supervised
        draft = 3 * 2 * matrix * slots
        attention = 3 * 2 * 2 * slots * (work.document_tokens / 2) * shapes.query_width
        head = 0.0
    else:
        blocks = block_count(work, _block_settings(module))
        slots = blocks * module.block_size
        layer_matrix = matrix - shapes.hidden * shapes.hidden * shapes.captured
        draft = 3 * 2 * (layer_matrix * slots + shapes.hidden * shapes.hidden * shapes.captured * tokens)
        # Each block sees its document's context up to the anchor (half the document) and itself.
        attention = 3 * 2 * 2 * slots * (work.document_tokens / 2 + module.block_size) * shapes.query_width
        attention *= shapes.draft_layers
        # The frozen LM head over every chain position: forward and the gradient to its input.
        head = 2 * 2 * shapes.hidden * shapes.target_vocab * blocks * (module.block_size - 1)
    return {
        "target forward (matmuls)": scale * target_flops,
        "target attention": scale * target_attention,
        "draft forward + backward (matmuls)": scale * (draft + head),
        "draft attention": scale * attention,
    }


def _active_target_params(target: nn.Module, text: Any) -> float:
    """Parameters a token multiplies through: a mixture of experts counts its routed share only."""
    total = _count(p for p in target.parameters() if p.dim() >= 2) - _count(
        target.input_embeddings.parameters()
    )
    experts = (
        getattr(text, "num_local_experts", None)
        or getattr(text, "num_experts", None)
        or getattr(text, "n_routed_experts", None)
    )
    chosen = getattr(text, "num_experts_per_tok", None) or getattr(text, "experts_per_token", None)
    if not experts or not chosen:
        return total
    routed = _count(
        p for name, p in target.named_parameters() if ".experts." in f".{name}." and "shared" not in name
    )
    return total - routed + routed * chosen / experts
