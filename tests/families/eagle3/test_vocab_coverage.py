"""A draft vocabulary that covers little of the target's greedy next tokens is reported once, early,
with the coverage figure; one that covers them is not."""

from __future__ import annotations

import warnings

import lightning as L

from lightning_drafts import Eagle3Module, PackedChatDataModule
from lightning_drafts.core.batch import validate_batch
from lightning_drafts.eagle3.vocab_coverage import MICRO_BATCHES, CoverageCheck

MESSAGE = "of the target's greedy next tokens"


class Batches(L.Callback):
    def __init__(self) -> None:
        self.seen: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen.append({key: value.clone() for key, value in batch.items()})


def test_a_small_draft_vocabulary_warns_once_with_its_coverage_of_greedy_tokens(tmp_path):
    data = PackedChatDataModule(
        tokenizer="shipped:tiny-llama", max_tokens=64, max_documents=60, cache_dir=str(tmp_path / "cache")
    )
    module = Eagle3Module(
        "shipped:tiny-llama", ttt_length=1, draft_vocab_size=24, tokenizer_vocab_size=data.vocab_size
    )
    batches = Batches()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=MICRO_BATCHES + 4,
        logger=False,
        callbacks=[batches],
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, data)
    reported = [str(w.message) for w in caught if MESSAGE in str(w.message)]
    assert len(reported) == 1, reported

    # The figure, recomputed from the target's greedy tokens over the same first micro-batches.
    covered = supervised = 0
    for batch in batches.seen[:MICRO_BATCHES]:
        packed = validate_batch(batch)
        greedy = module.target.greedy_tokens(module.target(packed).last_hidden_state)[packed.loss_mask]
        covered += int(module.draft.t2d[greedy].sum())
        supervised += int(packed.loss_mask.sum())
    assert f"covers {covered / supervised:.0%} {MESSAGE}" in reported[0]
    assert f"({supervised:,} supervised positions)" in reported[0] and "raise draft_vocab_size" in reported[0]


def test_the_coverage_is_judged_once_on_its_window():
    check = CoverageCheck(draft_vocab_size=8, vocab_size=100, micro_batches=2)
    assert check.add(3, 10) is None
    warning = check.add(0.8, 10)
    assert "covers 19% of the target's greedy next tokens on the first 2 training micro-batches" in warning
    assert check.add(0, 10) is None and check.judge() is None
    fine = CoverageCheck(draft_vocab_size=8, vocab_size=100, micro_batches=1)
    assert fine.add(95, 100) is None and fine.judged
    # A run shorter than the window is judged on what it saw, once.
    short = CoverageCheck(draft_vocab_size=8, vocab_size=100)
    short.add(1, 10)
    assert "covers 10%" in short.judge() and short.judge() is None
