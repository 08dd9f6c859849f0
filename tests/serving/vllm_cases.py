"""What the vLLM tests serve: the shipped tiny targets, and drafts trained briefly on the target's own greedy
text, so that rounds accept some tokens and reject others (a draft that accepts nothing, or everything,
would make the comparison with the built-in decode trivial).

The shipped targets have heads of 32, the smallest head size vLLM's CPU attention runs (the conformance
suite's random targets, heads of 8, cannot be served by it). They are named by their ``shipped:`` spec, so
``evaluate --engine vllm`` resolves the spec to the directory vLLM loads, as a user's config would.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_drafts import DFlash2Module, DFlashModule, DSparkModule, Eagle3Module
from lightning_drafts.serving.decode import greedy_generate
from lightning_drafts.shipped import MASK_TOKEN_ID, SPECIAL_TOKENS, resolve_shipped
from lightning_drafts.training.module import DraftModule
from tests.support.builders import packed_row, stack_rows

TARGETS = {"llama": "shipped:tiny-llama", "qwen3": "shipped:tiny-qwen3"}
# The tied variants (``<kind>-tied``) are written by :func:`tied_target` into a test's directory.
TIED_SUFFIX = "-tied"
VOCAB = 2048
BLOCK = 4
PROMPT_LENGTHS = [5, 9, 13, 7, 16, 11]
MAX_NEW_TOKENS = 32
# Enough for rounds that accept several drafted tokens and rounds that accept none (block drafts learn the
# target's text more slowly than EAGLE-3).
TRAIN_STEPS = {"eagle3": 40, "dflash": 80}


def prompts(seed: int) -> list[torch.Tensor]:
    """Random prompts of ordinary tokens (no special id: the mask token stays out of every document)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(len(SPECIAL_TOKENS), VOCAB, (n,), generator=generator) for n in PROMPT_LENGTHS]


def self_distillation_batch(module: DraftModule) -> dict[str, torch.Tensor]:
    """Prompts followed by the target's own greedy continuation, two documents packed per row."""
    documents = [torch.cat([p, torch.tensor(greedy_generate(module.target, p, 40))]) for p in prompts(seed=1)]
    pairs = list(zip(documents[::2], documents[1::2], strict=True))
    width = max(len(a) + len(b) for a, b in pairs)
    return stack_rows([packed_row([a, b], width) for a, b in pairs])


def tied_target(kind: str, directory: Path) -> str:
    """A directory holding the shipped target of ``kind`` with its LM head tied to its input embedding
    (``tie_word_embeddings``; the embedding takes the head's trained rows, so greedy text stays the
    trained target's), its tokenizer beside it: what vLLM loads for a tied target such as SmolLM2."""
    path = directory / f"{kind}{TIED_SUFFIX}"
    if not (path / "config.json").is_file():
        source = resolve_shipped(TARGETS[kind])
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        with torch.no_grad():
            model.get_input_embeddings().weight.copy_(model.get_output_embeddings().weight)
        model.config.tie_word_embeddings = True
        model.tie_weights()
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        model.save_pretrained(path)
        AutoTokenizer.from_pretrained(source).save_pretrained(path)
    reloaded = AutoModelForCausalLM.from_pretrained(path)
    assert reloaded.config.tie_word_embeddings
    assert reloaded.get_output_embeddings().weight is reloaded.get_input_embeddings().weight
    return str(path)


def build_draft(family: str, target: str) -> DraftModule:
    """A fresh draft of ``family`` against ``target`` (seeded)."""
    torch.manual_seed(0)
    common = {"target_attn_backend": "sdpa", "draft_attn_backend": "sdpa"}
    if family == "eagle3":
        # A draft vocabulary smaller than the target's, so vLLM reads d2t; the last layer is among the ids.
        return Eagle3Module(target, ttt_length=3, draft_vocab_size=256, target_layer_ids=[1, 3, 7], **common)
    block = {
        "mask_token_id": MASK_TOKEN_ID,
        "block_size": BLOCK,
        "num_anchors": 16,
        "num_draft_layers": 2,
        **common,
    }
    if family == "dflash":
        return DFlashModule(target, target_layer_ids=[1, 4, 7], **block)
    if family == "dflash2":
        return DFlash2Module(
            target, target_layer_ids=[1, 4, 7], conv_group_size=16, selector_rank=8, selector_top_k=4, **block
        )
    if family == "dspark":
        return DSparkModule(target, target_layer_ids=[1, 4], markov_rank=8, **block)
    raise ValueError(f"no vLLM case for family {family!r}")


@functools.cache
def trained_module(family: str, target: str, steps: int) -> DraftModule:
    """``family``'s draft trained ``steps`` AdamW steps on the target's greedy text (once per session)."""
    module = build_draft(family, target)
    batch = self_distillation_batch(module)
    if isinstance(module, Eagle3Module):
        module.build_vocab_mapping(torch.bincount(batch["input_ids"].flatten(), minlength=VOCAB))
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(steps):
        optimizer.zero_grad()
        module.compute_loss(batch).loss.backward()
        optimizer.step()
    return module


def trained_export(
    family: str,
    target: str,
    directory: Path,
    steps: int | None = None,
    context_key_gains: str = "shared",
) -> Path:
    """:func:`trained_module` (``steps``: ``TRAIN_STEPS`` of the family, else DFlash's) exported to ``directory``.

    ``context_key_gains`` (block drafts): ``"shared"`` gives every draft layer the first layer's ``k_norm``
    gain, the one vLLM's CPU build applies to every layer's context keys, so both engines draft alike;
    ``"distinct"`` sets the later layers' gains far from the first's, where the two part (README: "The
    DFlash gap").
    """
    steps = TRAIN_STEPS.get(family, TRAIN_STEPS["dflash"]) if steps is None else steps
    module = copy.deepcopy(trained_module(family, target, steps))
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
