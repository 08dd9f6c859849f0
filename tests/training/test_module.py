"""DraftModule: trains in a Trainer, logs to TensorBoard, checkpoints hold only the draft, resume works."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_drafts.callbacks import ThroughputCallback
from tests.support.builders import TINY_TARGETS, packed_row, random_docs, stack_rows
from tests.support.probe_draft import NextTokenProbe


def batches(count: int = 4, distinct: bool = True) -> list[dict]:
    return [
        stack_rows([packed_row(random_docs([5, 7], seed=i if distinct else 0), 16)]) for i in range(count)
    ]


def squeeze(batch: dict) -> dict:
    return {k: v[0] for k, v in batch.items()}


def loader(distinct: bool = True):
    return torch.utils.data.DataLoader([squeeze(b) for b in batches(distinct=distinct)], batch_size=1)


def trainer(tmp_path, **kwargs) -> L.Trainer:
    kwargs.setdefault("logger", L.pytorch.loggers.TensorBoardLogger(tmp_path, name="tb", version=0))
    kwargs.setdefault("max_steps", 6)
    return L.Trainer(
        accelerator="cpu",
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **kwargs,
    )


def test_training_logs_loss_and_acceptance_to_tensorboard(tmp_path):
    torch.manual_seed(0)
    module = NextTokenProbe(TINY_TARGETS["llama"])
    # One batch repeated, so the loss curve shows learning rather than batch-to-batch variation.
    fit = trainer(tmp_path, limit_val_batches=2, callbacks=[ThroughputCallback()])
    fit.fit(module, loader(distinct=False), loader())
    events = EventAccumulator(str(tmp_path / "tb" / "version_0"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "train/loss",
        "train/accept_len",
        "train/acc_pos0",
        "train/valid_tokens",
        "val/loss",
        "val/accept_len",
    } <= tags
    losses = [e.value for e in events.Scalars("train/loss")]
    assert len(losses) == 6 and all(b < a for a, b in zip(losses, losses[1:], strict=False))
    assert all(1.0 <= e.value <= 2.0 for e in events.Scalars("train/accept_len"))
    assert "val/acceptance_by_position" in events.Tags()["histograms"]
    # Each row holds 12 real tokens in 16 slots.
    assert all(e.value == 0.25 for e in events.Scalars("train/padding_fraction"))
    assert all(e.value > 0 for e in events.Scalars("train/real_tokens_per_s"))
    assert [(e.step, e.value) for e in events.Scalars("train/tokens_seen")] == [
        (s, 12.0 * (s + 1)) for s in range(6)
    ]


def test_tokens_seen_counts_on_after_a_resume(tmp_path):
    module = NextTokenProbe(TINY_TARGETS["llama"])
    fit = trainer(tmp_path, logger=False, max_steps=3, callbacks=[ThroughputCallback()])
    fit.fit(module, loader())
    path = tmp_path / "draft.ckpt"
    fit.save_checkpoint(path)
    again = trainer(tmp_path, max_steps=5, callbacks=[ThroughputCallback()])
    again.fit(NextTokenProbe(TINY_TARGETS["llama"]), loader(), ckpt_path=path)
    events = EventAccumulator(str(tmp_path / "tb" / "version_0"))
    events.Reload()
    # 12 real tokens per row, one row per step: steps 3 and 4 of the resumed run end at 48 and 60.
    assert [(e.step, e.value) for e in events.Scalars("train/tokens_seen")] == [(3, 48.0), (4, 60.0)]


def test_checkpoint_holds_only_the_draft_and_resumes(tmp_path):
    module = NextTokenProbe(TINY_TARGETS["llama"])
    fit = trainer(tmp_path, logger=False, max_steps=3)
    fit.fit(module, loader())
    path = tmp_path / "draft.ckpt"
    fit.save_checkpoint(path)
    state = torch.load(path, weights_only=False)["state_dict"]
    assert set(state) == {"head.weight", "head.bias"}

    resumed = NextTokenProbe(TINY_TARGETS["llama"])
    again = trainer(tmp_path, logger=False, max_steps=5)
    again.fit(resumed, loader(), ckpt_path=path)
    assert again.global_step == 5
    loaded = NextTokenProbe.load_from_checkpoint(path, target=TINY_TARGETS["llama"])
    torch.testing.assert_close(loaded.head.weight, module.head.weight)


def test_a_checkpoint_missing_draft_weights_is_refused(tmp_path):
    module = NextTokenProbe(TINY_TARGETS["llama"])
    fit = trainer(tmp_path, logger=False, max_steps=1)
    fit.fit(module, loader())
    path = tmp_path / "draft.ckpt"
    fit.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    del checkpoint["state_dict"]["head.bias"]
    torch.save(checkpoint, path)
    with pytest.raises(ValueError, match="head.bias"):
        NextTokenProbe.load_from_checkpoint(path, target=TINY_TARGETS["llama"])


def test_tokenizer_vocabulary_fills_a_config_target_and_must_fit_a_given_one():
    config = {k: v for k, v in TINY_TARGETS["llama"].items() if k != "vocab_size"}
    assert NextTokenProbe(config, tokenizer_vocab_size=50).target.vocab_size == 50
    with pytest.raises(ValueError, match="tokenizer has 200 tokens"):
        NextTokenProbe(TINY_TARGETS["llama"], tokenizer_vocab_size=200)


class RatioProbe(NextTokenProbe):
    """Reports, per micro-batch, ``hits = 1`` out of ``count = 1 + batch index`` supervised slots."""

    def __init__(self, target: dict, register: bool = True) -> None:
        super().__init__(target)
        self.seen = 0
        if register:
            self.register_ratio_metrics(["hit_rate"])

    def compute_loss(self, batch, anchors=None):
        output = super().compute_loss(batch)
        self.seen += 1
        hits, count = torch.tensor(1.0), torch.tensor(float(self.seen))
        output.sums = {"hit_rate": (hits, count)}
        output.metrics["hit_rate"] = hits / count
        return output


def test_registered_ratios_are_logged_as_ratios_of_sums_over_the_epoch(tmp_path):
    module = RatioProbe(TINY_TARGETS["llama"])
    (logged,) = trainer(tmp_path, logger=False).validate(module, loader())
    # Four batches: 1/1, 1/2, 1/3, 1/4. The ratio of sums is 4/10; the mean of the ratios would be 0.52.
    assert logged["val/hit_rate"] == pytest.approx(4 / 10)


def test_sums_for_an_unregistered_ratio_are_refused(tmp_path):
    module = RatioProbe(TINY_TARGETS["llama"], register=False)
    with pytest.raises(ValueError, match="'hit_rate'.*register_ratio_metrics"):
        trainer(tmp_path, logger=False).validate(module, loader())


def test_shard_target_without_fsdp2_is_refused(tmp_path):
    module = NextTokenProbe(TINY_TARGETS["llama"], shard_target=True)
    with pytest.raises(ValueError, match="shard_target=True needs ModelParallelStrategy"):
        trainer(tmp_path, logger=False, max_steps=1).fit(module, loader())


def test_a_precision_that_recasts_the_target_away_from_target_dtype_is_refused(tmp_path):
    module = NextTokenProbe(TINY_TARGETS["llama"], target_dtype="float32")
    with pytest.raises(ValueError, match="target_dtype = torch.float32 but the trainer's precision cast"):
        trainer(tmp_path, logger=False, max_steps=1, precision="bf16-true").fit(module, loader())
    kept = NextTokenProbe(TINY_TARGETS["llama"], target_dtype="bfloat16")
    trainer(tmp_path, logger=False, max_steps=1, precision="bf16-true").fit(kept, loader())
    assert next(kept.target.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"learning_rate": -1}, "learning_rate = -1; it must be a number > 0"),
        ({"learning_rate": 0.0}, "learning_rate = 0.0; it must be a number > 0"),
        ({"warmup_ratio": 2}, "warmup_ratio = 2; it must be a number >= 0 and <= 1"),
        ({"min_lr_ratio": -0.1}, "min_lr_ratio = -0.1; it must be a number >= 0 and <= 1"),
        ({"weight_decay": float("nan")}, "weight_decay = nan; it must be a number >= 0"),
        ({"betas": (0.9, 1.0)}, r"betas\[1\] = 1.0; it must be a number >= 0 and < 1"),
        ({"betas": (0.9,)}, r"betas = \(0.9,\); it must be two numbers"),
    ],
)
def test_optimiser_settings_out_of_range_are_refused_at_construction(options, message):
    with pytest.raises(ValueError, match=message):
        NextTokenProbe(TINY_TARGETS["llama"], **options)
