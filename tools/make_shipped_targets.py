"""Remake the tiny trained targets in ``lightning_drafts/shipped/`` (seeded; about 20 minutes on 2 CPU cores).

    python tools/make_shipped_targets.py --threads 1   # all three, into lightning_drafts/shipped/
    python tools/make_shipped_targets.py --only tiny-llama --steps 200 --output /tmp/targets

1. A 2,048-id byte-level BPE tokenizer (``tokenizers``) is trained on every utterance of the embedded
   chitchat corpus, with four special tokens (pad, ``<|im_start|>``, ``<|im_end|>`` = EOS, and a mask
   token that text never produces) and the built-in ChatML template.
2. Each target is a plain causal LM trained from a seeded random init on the corpus's conversations,
   rendered with that template and joined by the pad token: random 256-token windows, AdamW, cosine
   schedule. The targets are "pretrained" on the whole corpus; drafts later train on its documents.
3. Each directory gets the tokenizer and a ``training.json`` with the run's settings, its loss curve,
   and the variety of its greedy text: over 64-token greedy continuations of the quickstart's held-out
   prompts, the mean number of distinct tokens and the share of distinct bigrams. A random target
   writes one to five tokens over and over; these must write varied text for served acceptance to mean
   anything.

The result is reproducible on one machine and thread count (CPU float32 reductions depend on threads).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from lightning_drafts.datamodules import PackedChatDataModule, embedded_corpus_rows
from lightning_drafts.datamodules.templates import CHATML_TEMPLATE
from lightning_drafts.serving.prompts import prompts_from_datamodule
from lightning_drafts.shipped import PAD_TOKEN, SHIPPED_TARGETS, SPECIAL_TOKENS

VOCAB_SIZE = 2048
SHARED = {"vocab_size": VOCAB_SIZE, "hidden_size": 64, "num_hidden_layers": 8, "tie_word_embeddings": False}
SHARED |= {"max_position_embeddings": 2048, "pad_token_id": 0, "eos_token_id": 2, "bos_token_id": None}
# Head sizes of 32 because vLLM's CPU attention runs no smaller head.
SHAPES: dict[str, dict] = {
    "tiny-llama": {
        "model_type": "llama",
        "intermediate_size": 256,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
    },
    "tiny-qwen3": {
        "model_type": "qwen3",
        "intermediate_size": 256,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
    },
    # vLLM's CPU MLA kernel runs only a 576-wide latent (kv_lora_rank 512 + rope 64).
    "tiny-deepseek-v3": {
        "model_type": "deepseek_v3",
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "first_k_dense_replace": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "q_lora_rank": 32,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 64,
        "v_head_dim": 32,
    },
}
# DeepSeek-V3's MoE forward costs about three times the dense ones' per step on CPU.
STEPS = {"tiny-llama": 1000, "tiny-qwen3": 1000, "tiny-deepseek-v3": 500}
# At 3e-3 the DeepSeek-V3 target's loss went to NaN within 100 steps; 1e-3 trains it stably.
LEARNING_RATES = {"tiny-llama": 3e-3, "tiny-qwen3": 3e-3, "tiny-deepseek-v3": 1e-3}
WINDOW = 256
# The quickstart's held-out split, so the variety figures are on prompts no draft trains on.
QUICKSTART_VAL_FRACTION = 0.02


def train_tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = (m["content"] for row in embedded_corpus_rows() for m in row["messages"])
    backend.train_from_iterator(texts, trainer=trainer)
    if backend.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"the BPE trainer stopped at {backend.get_vocab_size()} ids, not {VOCAB_SIZE}")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token=PAD_TOKEN,
        additional_special_tokens=list(SPECIAL_TOKENS[1:2] + SPECIAL_TOKENS[3:]),
        chat_template=CHATML_TEMPLATE,
        model_max_length=SHARED["max_position_embeddings"],
    )
    ids = [tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS]
    if ids != list(range(len(SPECIAL_TOKENS))):
        raise RuntimeError(f"special tokens got ids {ids}, expected 0..{len(SPECIAL_TOKENS) - 1}")
    return tokenizer


def token_stream(tokenizer: PreTrainedTokenizerFast) -> torch.Tensor:
    """Every conversation rendered with the chat template, joined by the pad token, as one id stream."""
    pad = tokenizer.pad_token_id
    stream: list[int] = []
    for row in embedded_corpus_rows():
        stream += tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=False) + [pad]
    return torch.tensor(stream, dtype=torch.long)


def train_target(name: str, stream: torch.Tensor, steps: int, batch: int, seed: int) -> tuple[object, dict]:
    config = AutoConfig.for_model(**(SHARED | SHAPES[name]))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LEARNING_RATES[name],
        betas=(0.9, 0.95),
    )
    warmup = max(1, steps // 20)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    losses: list[tuple[int, float]] = []
    start = time.perf_counter()
    for step in range(steps):
        starts = torch.randint(0, stream.numel() - WINDOW - 1, (batch,), generator=generator)
        windows = torch.stack([stream[s : s + WINDOW] for s in starts.tolist()])
        loss = model(input_ids=windows, labels=windows, use_cache=False).loss
        if not torch.isfinite(loss):
            raise RuntimeError(f"{name}: the loss is {loss.item()} at step {step}; lower its learning rate")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == steps - 1:
            losses.append((step, round(loss.item(), 4)))
            print(f"{name} step {step:5d} loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)")
    model.eval()
    settings = {"steps": steps, "batch": batch, "window": WINDOW, "seed": seed, "lr": LEARNING_RATES[name]}
    settings["threads"] = torch.get_num_threads()
    return model, {"training": settings, "loss": losses, "seconds": round(time.perf_counter() - start, 1)}


@torch.no_grad()
def greedy_variety(model, prompts: list[torch.Tensor], new_tokens: int = 64) -> dict:
    """Distinct tokens per greedy continuation, and the share of its bigrams that are distinct."""
    distinct, bigram_share = [], []
    for prompt in prompts:
        ids = prompt[None]
        for _ in range(new_tokens):
            logits = model(input_ids=ids, use_cache=False).logits[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
        out = ids[0, prompt.numel() :].tolist()
        bigrams = list(zip(out, out[1:], strict=False))
        distinct.append(len(set(out)))
        bigram_share.append(len(set(bigrams)) / len(bigrams))
    return {
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "mean_distinct_tokens": round(sum(distinct) / len(distinct), 2),
        "mean_distinct_bigram_share": round(sum(bigram_share) / len(bigram_share), 3),
    }


def heldout_prompts(tokenizer: PreTrainedTokenizerFast, limit: int) -> list[torch.Tensor]:
    data = PackedChatDataModule(
        tokenizer=tokenizer, max_tokens=512, val_fraction=QUICKSTART_VAL_FRACTION, setup_summary=False
    )
    return prompts_from_datamodule(data, limit=limit)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--output", type=Path, default=Path(__file__).parents[1] / "lightning_drafts" / "shipped"
    )
    parser.add_argument("--only", choices=SHIPPED_TARGETS, action="append")
    parser.add_argument("--steps", type=int, default=None, help=f"training steps (default: {STEPS})")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts the variety is measured on")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = train_tokenizer()
    stream = token_stream(tokenizer)
    print(f"tokenizer: {len(tokenizer)} ids; corpus: {stream.numel():,} tokens")
    prompts = heldout_prompts(tokenizer, limit=args.prompts)
    for name in args.only or SHIPPED_TARGETS:
        model, record = train_target(name, stream, args.steps or STEPS[name], args.batch, args.seed)
        record["greedy_variety"] = greedy_variety(model, prompts)
        record["corpus_tokens"] = stream.numel()
        print(name, json.dumps(record["greedy_variety"]))
        directory = args.output / name
        model.generation_config.do_sample = False
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        (directory / "training.json").write_text(json.dumps(record, indent=1) + "\n")
        # safetensors writes its file owner-only; package data must be readable by every user.
        for path in directory.iterdir():
            path.chmod(0o644)


if __name__ == "__main__":
    main()
