"""How a draft module is placed under the sharded strategies: activation checkpointing of the draft layers,
FSDP2 units (``ModelParallelStrategy``), the frozen target under FSDP1 (``FSDPStrategy``), and norm clipping
there. ``DraftModule``'s ``configure_model``, ``on_fit_start`` and ``configure_gradient_clipping`` call these.

``torch.distributed``'s FSDP modules are imported where they are used: a torch built without distributed
support still trains on one device.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import FSDPStrategy, Strategy

from lightning_drafts.training.target import FrozenTarget


def repeated_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The elements of every ``ModuleList`` under ``module``: a draft's decoder layers, its FSDP units."""
    return [layer for child in module.modules() if isinstance(child, torch.nn.ModuleList) for layer in child]


def checkpoint_layers(draft_roots: list[torch.nn.Module]) -> None:
    """Recompute each draft decoder layer's activations in backward (any strategy)."""
    from torch.distributed._composable import checkpoint

    for layer in (layer for root in draft_roots for layer in repeated_layers(root)):
        checkpoint(layer)


def shard_fsdp2(
    draft_roots: list[torch.nn.Module], target: FrozenTarget, data_parallel: Any, shard_target: bool
) -> None:
    """FSDP2 units: each draft layer, then each draft root with trainable weights; with ``shard_target``,
    each of the target's decoder layers too (the target is replicated otherwise)."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    for root in draft_roots:
        for layer in repeated_layers(root):
            fully_shard(layer, mesh=data_parallel)
        if any(p.requires_grad for p in root.parameters()):
            # Frozen copies (EAGLE-3's and DSpark's input embedding, a frozen LM head) stay whole on every
            # rank, outside the root's group: in it, each micro-batch would all-gather them in float32
            # (Llama-3.1-8B's embedding: 2.1 GB per rank) for weights that never change.
            frozen = {p for p in root.parameters() if not p.requires_grad}
            fully_shard(root, mesh=data_parallel, ignored_params=frozen or None)
            # FSDP2 unshards a root's weights when its `forward` runs and keeps them until backward,
            # so methods called after it (heads, TTT steps) see whole weights. A draft whose step
            # starts with another method (EAGLE-3) names it. Registering every TTT method instead
            # gave gradients up to 8% off DDP's in the 2-process test.
            entry = getattr(root, "fsdp_entry_method", None)
            if entry is not None:
                register_fsdp_forward_method(root, entry)
    if shard_target:
        # Decoder layers only, each its own FSDP root told to reshard after forward (a root keeps
        # its weights otherwise, expecting a backward the frozen target never has). The embedding,
        # final norm and LM head stay whole: drafts and the varlen path call them outside any
        # forward, and frozen weights need no gradient reduction.
        for layer in target.decoder_layers:
            fully_shard(layer, mesh=data_parallel, reshard_after_forward=True)


def keep_target_out_of_fsdp1_units(strategy: Strategy, target: FrozenTarget) -> None:
    """Under ``FSDPStrategy`` (FSDP1), the target's embedding, final norm and LM head are FSDP-ignored
    modules: whole on every rank's device as under DDP or FSDP2, in no flat parameter. In the root unit's
    flat parameter beside the draft, every full-state-dict save would unshard them and copy them to rank
    0's CPU (~2 GB of Llama-3.1-8B's embedding and LM head in bf16) before the checkpoint dropped them.
    FSDP does not move ignored modules, so they are moved to the rank's device here."""
    if not isinstance(strategy, FSDPStrategy):
        return
    # FSDP takes one of the two arguments, and ignored states of one kind; a user's own are kept. Ignored
    # as parameters unless the user gave modules (an ignored module takes its whole subtree with it).
    key = "ignored_modules" if strategy.kwargs.get("ignored_modules") is not None else "ignored_states"
    ignored = list(strategy.kwargs.get(key) or ())
    as_modules = any(isinstance(item, torch.nn.Module) for item in ignored)
    for module in target.outside_decoder():
        module.to(strategy.root_device)
        for item in [module] if as_modules else module.parameters(recurse=False):
            if not any(item is other for other in ignored):  # a tied LM head is the embedding
                ignored.append(item)
    strategy.kwargs[key] = ignored


def check_fsdp1_units(strategy: Strategy, target: FrozenTarget) -> None:
    """Under ``FSDPStrategy`` (FSDP1) the target's decoder layers must be FSDP units of their own: the
    module's state dict leaves the target out (:meth:`FrozenTarget.state_dict`), which FSDP1 allows for
    whole units only (it refuses, at the first save, a unit whose parameters are missing; the rest of the
    target is FSDP-ignored, :func:`keep_target_out_of_fsdp1_units`)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if not isinstance(strategy, FSDPStrategy) or getattr(target, "decoder_released", False):
        return
    layers = target.decoder_layers
    if not all(isinstance(layer, FullyShardedDataParallel) for layer in layers):
        raise ValueError(
            f"FSDPStrategy did not wrap the target's decoder layers ({type(layers[0]).__name__}) as FSDP "
            "units; name their class in the strategy's auto_wrap_policy (e.g. "
            "[transformers.models.llama.modeling_llama.LlamaDecoderLayer])"
        )


def clip_fsdp1_by_norm(strategy: Strategy, clip_val: float | None, algorithm: str | None) -> bool:
    """Clip by norm under ``FSDPStrategy`` (FSDP1) through the root FSDP module's own ``clip_grad_norm_``,
    which reduces the norm over every rank's shards: Lightning's ``FSDPPrecision`` refuses norm clipping
    (it has no handle on the root), and ``torch.nn.utils.clip_grad_norm_`` over one rank's shards would clip
    by a partial norm. Returns whether it clipped (otherwise the caller clips as Lightning does)."""
    by_norm = algorithm is None or algorithm == "norm"
    if clip_val and by_norm and isinstance(strategy, FSDPStrategy):
        strategy.model.clip_grad_norm_(clip_val)
        return True
    return False
