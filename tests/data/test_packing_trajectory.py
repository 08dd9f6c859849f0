"""`packing="microbatch"` follows the padded run's training trajectory step by step (SpecForge semantics).

The same documents form each micro-batch in both runs; only their layout differs (packed rows vs one
padded row per document). EAGLE-3's loss is a masked mean over the micro-batch, so exact packing gives
the same loss at every step, and the same gradients give the same weights for the next step.

The runs step with SGD: its update is proportional to the gradient, so round-off differences between
the layouts stay round-off. Adam's first steps move every element by about the learning rate whatever
the gradient's size, so a near-zero gradient element whose sign differs by round-off would move the
two runs' weights apart by twice the learning rate, and the losses with them.
"""

from __future__ import annotations

import lightning as L
import torch

from lightning_drafts import Eagle3Module
from lightning_drafts.datamodules import PackedChatDataModule

TARGET = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


class SGDEagle3(Eagle3Module):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            [p for p in self.parameters() if p.requires_grad], lr=self.hparams.learning_rate
        )


class RecordLosses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.real_tokens: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))
        self.real_tokens.append(int(batch["attention_mask"].sum()))


def train(packing, tmp_path) -> RecordLosses:
    data = PackedChatDataModule(
        max_tokens=384,
        batch_size=3,
        packing=packing,
        seed=3,
        max_documents=60,
        cache_dir=str(tmp_path / "cache"),
    )
    torch.manual_seed(0)
    model = SGDEagle3(
        target={**TARGET, "vocab_size": data.vocab_size},
        ttt_length=3,
        draft_vocab_size=512,
        learning_rate=1.0,
    )
    record = RecordLosses()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record],
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule=data)
    return record


def test_microbatch_packing_gives_the_padded_losses_step_by_step(tmp_path):
    padded = train(False, tmp_path)
    packed = train("microbatch", tmp_path)
    assert packed.real_tokens == padded.real_tokens  # the same documents in every step
    assert len(packed.losses) == 4
    torch.testing.assert_close(torch.tensor(packed.losses), torch.tensor(padded.losses), rtol=1e-5, atol=1e-6)
    assert packed.losses[-1] < packed.losses[0] - 1e-3  # the weights did move between steps
