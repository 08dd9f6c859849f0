"""Steps whose micro-batch supervises nothing: no loss point of 0, a token-weighted epoch loss, and a
progress bar that keeps the last real loss."""

from __future__ import annotations

import json

import lightning as L
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_drafts import Eagle3Module, PackedChatDataModule


def answered(answer: str) -> dict:
    return {"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": answer}]}


# A prompt longer than max_tokens: truncation cuts the whole answer, so the document supervises nothing.
UNANSWERED = {
    "messages": [
        {"role": "user", "content": " ".join(["word"] * 200)},
        {"role": "assistant", "content": "too late"},
    ]
}


class StepRecord(L.Callback):
    """Each training step's own loss and supervised-prediction count, as the module computed them."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        output = outputs["draft_output"]
        self.steps.append((float(output.loss), int(output.valid_tokens)))


def test_steps_without_supervised_tokens_log_no_loss_and_the_epoch_loss_weighs_tokens(tmp_path):
    data_file = tmp_path / "chats.jsonl"
    # Answers of different lengths, so a token-weighted mean differs from a mean over steps.
    answers = [answered("ok"), answered("hello you"), answered("hello to you and welcome to the show")]
    rows = [answers[0], UNANSWERED, answers[1], UNANSWERED, answers[2], UNANSWERED]
    data_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = PackedChatDataModule(
        data_files=str(data_file),
        tokenizer="shipped:tiny-llama",
        max_tokens=48,
        packing=False,
        batch_size=1,
        cache_dir=str(tmp_path / "cache"),
    )
    module = Eagle3Module("shipped:tiny-llama", ttt_length=2, tokenizer_vocab_size=data.vocab_size)
    record = StepRecord()
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        log_every_n_steps=1,
        logger=L.pytorch.loggers.TensorBoardLogger(tmp_path, name="tb", version=0),
        callbacks=[record],
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(module, data)

    assert len(record.steps) == 6
    supervised = [(step, loss, tokens) for step, (loss, tokens) in enumerate(record.steps) if tokens]
    assert len(supervised) == 3, record.steps
    events = EventAccumulator(str(tmp_path / "tb" / "version_0"))
    events.Reload()
    logged = {event.step: event.value for event in events.Scalars("train/loss")}
    # One point per step that supervised something, at that step, with that step's loss; none at 0.
    assert sorted(logged) == [step for step, _, _ in supervised]
    for step, loss, _ in supervised:
        assert logged[step] == pytest.approx(loss, rel=1e-5)
    (epoch,) = events.Scalars("train/loss_epoch")
    weighted = sum(loss * tokens for _, loss, tokens in supervised) / sum(t for _, _, t in supervised)
    assert epoch.value == pytest.approx(weighted, rel=1e-5)
    # The progress bar holds the last real loss, not the 0 of the final, unsupervised steps.
    last_supervised_loss = supervised[-1][1]
    assert trainer.progress_bar_metrics["train/loss"] == pytest.approx(last_supervised_loss, rel=1e-5)
