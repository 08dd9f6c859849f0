"""A short CPU run of every objective on a random tiny target: does the loss fall, does val/accept_len rise?

The data is learnable on purpose: documents follow a fixed random permutation of the vocabulary (the
next token is ``perm[token]`` nine times in ten, else uniform), packed several to a row, the first two
tokens of each document unsupervised. The targets are tiny random models (Qwen3 for the block drafts,
Llama for EAGLE-3, DeepSeek-V3 for MLA-EAGLE-3), so EAGLE-3 learns the target's own distribution and the
block drafts the data's tokens. Each run: seed 0, AdamW, validation before training and at the end on
held-out rows. Prints a markdown table: the train loss (mean of the first / last ``--window`` steps),
val/loss and val/accept_len before and after, and val/accept_len_skip_holes (block drafts) at the end.

Losses of different objectives are on different scales, and D-PACE's weights grow with the draft's
confidence, so only each objective's own before / after comparison means anything.

    .venv/bin/python benchmarks/objectives.py
    .venv/bin/python benchmarks/objectives.py --runs dflash:dpace eagle3:lambda --steps 200
"""

from __future__ import annotations

import argparse
import time

import lightning as L
import torch

from lightning_drafts import DFlash2Module, DFlashModule, Eagle3Module, MLAEagle3Module
from lightning_drafts.dflash.objectives import LOSS_TYPES
from lightning_drafts.eagle3.step_objective import LK_LOSS_TYPES

VOCAB = 96
MASK_TOKEN = VOCAB - 1
COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 8}
COMMON |= {"num_attention_heads": 4, "max_position_embeddings": 256, "tie_word_embeddings": False}
TARGETS = {
    "qwen3": {"model_type": "qwen3", "num_key_value_heads": 2, "head_dim": 8, **COMMON},
    "llama": {"model_type": "llama", "num_key_value_heads": 2, **COMMON},
    "deepseek_v3": {
        "model_type": "deepseek_v3",
        **COMMON,
        "num_key_value_heads": 4,
        "moe_intermediate_size": 16,
        "first_k_dense_replace": 1,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "q_lora_rank": 16,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,
    },
}
BLOCK = {"mask_token_id": MASK_TOKEN, "num_draft_layers": 2, "block_size": 8, "num_anchors": 8}
BLOCK |= {"loss_decay_gamma": 4.0}
FAMILIES = {
    "dflash": ("loss_type", LOSS_TYPES, lambda **kw: DFlashModule(TARGETS["qwen3"], **BLOCK, **kw)),
    "dflash2": (
        "loss_type",
        LOSS_TYPES,
        lambda **kw: DFlash2Module(TARGETS["qwen3"], selector_rank=16, selector_top_k=8, **BLOCK, **kw),
    ),
    "eagle3": (
        "lk_loss_type",
        LK_LOSS_TYPES,
        lambda **kw: Eagle3Module(TARGETS["llama"], ttt_length=4, **kw),
    ),
    "mla_eagle3": (
        "lk_loss_type",
        LK_LOSS_TYPES,
        lambda **kw: MLAEagle3Module(TARGETS["deepseek_v3"], ttt_length=4, **kw),
    ),
}


def markov_rows(count: int, seed: int, width: int = 96) -> list[dict[str, torch.Tensor]]:
    """``count`` packed rows of Markov documents (12 to 40 tokens) with document-local positions."""
    generator = torch.Generator().manual_seed(seed)
    successor = torch.randperm(MASK_TOKEN, generator=torch.Generator().manual_seed(1234))
    rows = []
    for _ in range(count):
        lengths = []
        while sum(lengths) < width - 40:
            lengths.append(int(torch.randint(12, 41, (), generator=generator)))
        ids, positions, supervised = [], [], []
        for length in lengths:
            token = int(torch.randint(MASK_TOKEN, (), generator=generator))
            for offset in range(length):
                ids.append(token)
                positions.append(offset)
                supervised.append(offset >= 2)
                noisy = torch.rand((), generator=generator) < 0.1
                token = (
                    int(torch.randint(MASK_TOKEN, (), generator=generator))
                    if noisy
                    else int(successor[token])
                )
        pad = width - len(ids)
        lengths[-1] += pad  # trailing padding folds into the row's last document
        rows.append(
            {
                "input_ids": torch.tensor(ids + [0] * pad),
                "attention_mask": torch.tensor([1] * len(ids) + [0] * pad),
                "loss_mask": torch.tensor(supervised + [False] * pad).long(),
                "position_ids": torch.tensor(
                    positions + list(range(positions[-1] + 1, positions[-1] + 1 + pad))
                ),
                "seq_lens": torch.tensor(lengths + [0] * (8 - len(lengths))),
            }
        )
    return rows


class Record(L.Callback):
    """The per-step train loss and the metrics of every validation."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.validations: list[dict[str, float]] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: dict, batch: dict, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.validations.append(
                {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
            )


def run(family: str, value: str | None, steps: int, learning_rate: float) -> tuple[Record, float]:
    option, _, build = FAMILIES[family]
    L.seed_everything(0, verbose=False)
    module = build(**{option: value}, learning_rate=learning_rate, warmup_ratio=0.05)
    train = torch.utils.data.DataLoader(markov_rows(64, seed=1), batch_size=2, shuffle=True)
    val = torch.utils.data.DataLoader(markov_rows(8, seed=2), batch_size=2)
    record = Record()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        check_val_every_n_epoch=None,
        val_check_interval=steps,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record],
    )
    start = time.perf_counter()
    trainer.validate(module, val, verbose=False)
    trainer.fit(module, train, val)
    return record, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", nargs="*", help="family:value pairs (value 'null' = None); default: all")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--window", type=int, default=10)
    args = parser.parse_args()
    if args.runs:
        runs = [(f, None if v == "null" else v) for f, v in (r.split(":", 1) for r in args.runs)]
    else:
        runs = [(family, value) for family, (_, values, _) in FAMILIES.items() for value in values]
    print(
        f"{args.steps} steps, learning rate {args.learning_rate}, micro-batches of 2 packed rows; train loss = "
        f"mean of the first / last {args.window} steps; validation on 8 held-out rows\n"
    )
    print(
        "| draft | objective | train loss first | train loss last | val/loss before | val/loss after "
        "| val/accept_len before | val/accept_len after | val/accept_len_skip_holes after | s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for family, value in runs:
        record, seconds = run(family, value, args.steps, args.learning_rate)
        first = sum(record.losses[: args.window]) / args.window
        last = sum(record.losses[-args.window :]) / args.window
        before, after = record.validations[0], record.validations[-1]
        skip = after.get("val/accept_len_skip_holes")
        print(
            f"| {family} | {value} | {first:.3f} | {last:.3f} | {before['val/loss']:.3f} | {after['val/loss']:.3f} "
            f"| {before['val/accept_len']:.3f} | {after['val/accept_len']:.3f} "
            f"| {'' if skip is None else f'{skip:.3f}'} | {seconds:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
