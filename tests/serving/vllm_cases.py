"""What the vLLM tests serve: tiny targets vLLM's CPU build can load, and drafts trained briefly on the
target's own greedy text, so that rounds accept some tokens and reject others (a draft that accepts
nothing, or everything, would make the comparison with the built-in decode trivial).

The targets are random and saved with ``save_pretrained``; vLLM's CPU attention needs a head size of at
least 32, which the conformance suite's tiny targets (head size 8) do not have. The shipped trained tiny
targets (``lightning_drafts.shipped``, heads of 32) can replace them here once they land: ``save_target``
is the one place that makes a target directory.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_drafts import DFlash2Module, DFlashModule, DSparkModule, Eagle3Module
from lightning_drafts.serving.decode import greedy_generate
from lightning_drafts.training.module import DraftModule
from lightning_drafts.training.target import FrozenTarget
from tests.builders import packed_row, random_docs, stack_rows

VOCAB = 96
MASK = VOCAB - 1  # reserved: never in a prompt or a training document
EOS = 1
BLOCK = 4
PROMPT_LENGTHS = [5, 9, 13, 7, 16, 11]
MAX_NEW_TOKENS = 32
TRAIN_STEPS = 40

# head_dim 32 (Llama: hidden / heads) is the smallest head size vLLM's CPU attention runs.
TARGETS = {
    "llama": {"model_type": "llama"},
    "qwen3": {"model_type": "qwen3", "head_dim": 32},
}
SHARED = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "eos_token_id": EOS,
}


def save_target(kind: str, directory: Path) -> Path:
    """A random tiny ``kind`` target in ``directory``, its LM head scaled up so greedy choices are far from
    ties (two engines' float32 kernels then agree on every token)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**SHARED, **TARGETS[kind]}))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(10)
    model.save_pretrained(directory)
    return directory


def prompts(seed: int) -> list[torch.Tensor]:
    return random_docs(PROMPT_LENGTHS, vocab=MASK, seed=seed)


def self_distillation_batch(target: FrozenTarget) -> dict[str, torch.Tensor]:
    """Prompts followed by the target's own greedy continuation, two documents packed per row."""
    documents = [torch.cat([p, torch.tensor(greedy_generate(target, p, 40))]) for p in prompts(seed=1)]
    width = max(len(a) + len(b) for a, b in zip(documents[::2], documents[1::2], strict=True))
    return stack_rows(
        [packed_row([a, b], width) for a, b in zip(documents[::2], documents[1::2], strict=True)]
    )


def build_draft(family: str, target_dir: Path) -> DraftModule:
    """A fresh draft of ``family`` against the saved target (seeded)."""
    torch.manual_seed(0)
    target = str(target_dir)
    common = {"target_attn_backend": "sdpa", "draft_attn_backend": "sdpa"}
    if family == "eagle3":
        # A draft vocabulary smaller than the target's, so vLLM reads d2t; the last layer is among the ids.
        return Eagle3Module(target, ttt_length=3, draft_vocab_size=64, target_layer_ids=[0, 2, 3], **common)
    block = {"mask_token_id": MASK, "block_size": BLOCK, "num_anchors": 16, "num_draft_layers": 2, **common}
    if family == "dflash":
        return DFlashModule(target, target_layer_ids=[1, 3], **block)
    if family == "dflash2":
        return DFlash2Module(
            target, target_layer_ids=[1, 3], conv_group_size=16, selector_rank=8, selector_top_k=4, **block
        )
    if family == "dspark":
        return DSparkModule(target, target_layer_ids=[1, 2], markov_rank=8, **block)
    raise ValueError(f"no vLLM case for family {family!r}")


def trained_export(
    family: str,
    target_dir: Path,
    directory: Path,
    steps: int = TRAIN_STEPS,
    context_key_gains: str = "shared",
) -> Path:
    """``family``'s draft trained ``steps`` AdamW steps on the target's greedy text, exported to ``directory``.

    ``context_key_gains`` (block drafts): ``"shared"`` gives every draft layer the first layer's ``k_norm``
    gain, the one vLLM's CPU build applies to every layer's context keys, so both engines draft alike;
    ``"distinct"`` sets the later layers' gains far from the first's, where the two part (README: "Served
    by a real engine").
    """
    module = build_draft(family, target_dir)
    batch = self_distillation_batch(module.target)
    if isinstance(module, Eagle3Module):
        module.build_vocab_mapping(torch.bincount(batch["input_ids"].flatten(), minlength=VOCAB))
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(steps):
        optimizer.zero_grad()
        module.compute_loss(batch).loss.backward()
        optimizer.step()
    if not isinstance(module, Eagle3Module):
        set_context_key_gains(module.draft.layers, context_key_gains)
    return module.export(directory)


def set_context_key_gains(layers: torch.nn.ModuleList, mode: str) -> None:
    first = layers[0].self_attn.k_norm.weight
    with torch.no_grad():
        for layer in layers[1:]:
            gain = layer.self_attn.k_norm.weight
            if mode == "shared":
                gain.copy_(first)
            elif mode == "distinct":
                gain.copy_(2 * first.flip(0))
            else:
                raise ValueError(f"context_key_gains={mode!r}; use 'shared' or 'distinct'")
