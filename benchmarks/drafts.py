"""The drafts the CPU benchmarks train, on the throughput benchmark's random target.

The target is a Llama-shaped random model whose width makes its linear layers dominate, with the embedded
tokenizer's 32,000-token vocabulary. The sizes come from the benchmarks' shared options (``--hidden-size``,
``--target-layers``, ``--max-tokens``, ``--ttt-length``, ``--draft-vocab-size``, ``--draft-layers``,
``--block-size``, ``--anchors``, ``--logits-chunk-blocks``; ``benchmarks/throughput.py`` defines them).
Used by ``throughput.py``, the ablations beside it (``skip_ablation.py``, ``thread_scaling.py``),
``vs_reference.py``, ``profile_step.py``, ``block_supervision.py`` and ``target_depth.py``.
"""

from __future__ import annotations

import argparse
import inspect
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_drafts import DFlash2Module, DFlashModule, DraftModule, Eagle3Module
from lightning_drafts.datamodules.embedded import EMBEDDED_VOCAB_SIZE
from lightning_drafts.eagle3 import count_supervised_tokens

ANCHOR_DRAFTS = ("dflash", "dflash2", "dspark")
ALL_DRAFTS = ("eagle3", *ANCHOR_DRAFTS)
# Id 0 is <unk>: SentencePiece's byte fallback never emits it, so no document holds it (it also pads,
# which only matters to serving, not to a throughput measurement).
MASK_TOKEN_ID = 0


def target_config(args: argparse.Namespace) -> dict[str, Any]:
    """A Llama-shaped target wide enough that its linear layers dominate, with the tokenizer's vocabulary."""
    hidden = args.hidden_size
    return {
        "model_type": "llama",
        "vocab_size": EMBEDDED_VOCAB_SIZE,
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_hidden_layers": args.target_layers,
        "num_attention_heads": hidden // 64,
        "num_key_value_heads": max(1, hidden // 256),
        "head_dim": 64,
        "max_position_embeddings": 4 * args.max_tokens,
        "tie_word_embeddings": False,
    }


def capture_layers(num_layers: int, count: int) -> list[int]:
    """``count`` distinct ascending layer ids spread over the target (the defaults need deeper targets)."""
    if num_layers < count:
        raise ValueError(f"--target-layers {num_layers} is fewer than the {count} captured layers needed")
    return np.linspace(0, num_layers - 1, count).round().astype(int).tolist()


def build_eagle3(
    args: argparse.Namespace,
    documents: list[dict[str, Tensor]],
    cls: type[DraftModule] = Eagle3Module,
    target: dict[str, Any] | None = None,
) -> DraftModule:
    """EAGLE-3 (or ``cls``, an EAGLE-3 variant, on ``target``) with the draft vocabulary of ``documents``."""
    counts = count_supervised_tokens(documents, EMBEDDED_VOCAB_SIZE)
    module = cls(
        target_config(args) if target is None else target,
        target_layer_ids=capture_layers(args.target_layers, 3),
        ttt_length=args.ttt_length,
        draft_vocab_size=args.draft_vocab_size,
        token_frequencies=counts,
    )
    # A random target's greedy token is uniform over 32,000 ids and would leave the draft vocabulary
    # 7 times in 8, dropping those positions from the loss; a trained target's stays inside it about as
    # often as the vocabulary covers the data (here 100%). Silencing the other LM-head rows restores that,
    # so the logits and loss work per supervised position is what real training does.
    with torch.no_grad():
        keep = torch.zeros(EMBEDDED_VOCAB_SIZE, dtype=torch.bool)
        keep[module.draft.selected_token_ids] = True
        module.target.lm_head.weight[~keep] = 0.0
    return module


def block_draft_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The block drafts' shared arguments; ``logits_chunk_blocks`` only when asked (else each default)."""
    arguments = {
        "mask_token_id": MASK_TOKEN_ID,
        "target_layer_ids": capture_layers(args.target_layers, min(args.draft_layers, args.target_layers)),
        "num_draft_layers": args.draft_layers,
        "block_size": args.block_size,
        "num_anchors": args.anchors,
    }
    if args.logits_chunk_blocks is not None:
        arguments["logits_chunk_blocks"] = args.logits_chunk_blocks or None
    return arguments


def build_block_draft(cls: type[DraftModule], args: argparse.Namespace) -> DraftModule:
    return cls(target_config(args), **block_draft_arguments(args))


def build_dspark(args: argparse.Namespace) -> DraftModule:
    """DSpark, once ``lightning_drafts`` exports it; only the arguments its constructor takes are passed."""
    try:
        from lightning_drafts import DSparkModule
    except ImportError as error:
        raise NotImplementedError(f"DSparkModule is not importable yet ({error})") from error
    accepted = inspect.signature(DSparkModule.__init__).parameters
    wanted = block_draft_arguments(args)
    return DSparkModule(target_config(args), **{k: v for k, v in wanted.items() if k in accepted})


def build_draft(name: str, args: argparse.Namespace, padded: list[dict[str, Tensor]]) -> DraftModule:
    """The draft ``name`` (one of ``ALL_DRAFTS``); EAGLE-3's draft vocabulary comes from ``padded``."""
    if name == "eagle3":
        return build_eagle3(args, padded)
    if name == "dflash":
        return build_block_draft(DFlashModule, args)
    if name == "dflash2":
        return build_block_draft(DFlash2Module, args)
    return build_dspark(args)
