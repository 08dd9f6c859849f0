"""Host reads of a training step (what makes a CUDA host wait for the device), counted on a CPU by
``benchmarks/host_syncs.py``: the counter itself against operators known to read, then the property
every family's step keeps: its reads do not grow with the micro-batch (documents, anchors, blocks,
logits chunks), and the throughput callback makes none."""

from __future__ import annotations

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from benchmarks.host_syncs import DRAFTS, HostSyncs, step_reads
from lightning_drafts.callbacks import ThroughputCallback
from tests.support.builders import TINY_TARGETS
from tests.support.probe_draft import NextTokenProbe
from tests.training.test_module import loader, trainer


def test_the_counter_sees_each_kind_of_host_read_and_not_reads_of_a_host_copy():
    values = torch.tensor([0.0, 2.0, 0.0, 3.0])
    with HostSyncs() as syncs:
        float(values.sum())
        values.nonzero()
        values[values > 1]
        values.tolist()
        torch.unique(values)
        on_host = values.cpu()
        int(on_host[1:].sum())
        on_host.tolist()
        values * 2
    kinds = sorted(kind for kind, _ in syncs.reads.elements())
    assert kinds == ["boolean index", "cpu", "nonzero", "scalar read", "tolist", "unique"]
    # Operators on the device: sum, nonzero, gt, index, unique, mul (and the scalar read's own).
    assert syncs.kernels >= 6


@pytest.mark.parametrize("draft", DRAFTS)
def test_a_step_reads_the_device_as_often_whatever_the_micro_batch_holds(draft):
    """1,024 and 4,096 tokens: 4x the documents, anchors, blocks and logits chunks, the same reads at the
    same lines: none per document, block, chunk or layer."""
    small, large = (step_reads(draft, width) for width in (1024, 4096))
    assert small.total > 0
    assert large.reads == small.reads


class _CountedThroughput(ThroughputCallback):
    """The callback with its hooks' host reads counted."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs = HostSyncs()

    def on_train_batch_start(self, *args) -> None:
        with self.syncs:
            super().on_train_batch_start(*args)

    def on_train_batch_end(self, *args) -> None:
        with self.syncs:
            super().on_train_batch_end(*args)


def test_the_throughput_callback_never_reads_the_device_during_a_step(tmp_path):
    callback = _CountedThroughput()
    fit = trainer(tmp_path, max_steps=4, logger=False, callbacks=[callback])
    fit.fit(NextTokenProbe(TINY_TARGETS["llama"]), loader())
    assert callback.syncs.kernels > 0
    assert not callback.syncs.reads
    # 12 real tokens per row, one row per step.
    assert callback.tokens_seen == 48


def test_the_throughput_window_must_hold_a_micro_batch():
    with pytest.raises(ValueError, match="window must be at least 1 micro-batch, got 0"):
        ThroughputCallback(window=0)


class _SquaresClock(ThroughputCallback):
    """Its clock reads 0, 1, 4, 9, ... seconds at its successive calls."""

    def __init__(self) -> None:
        super().__init__(window=3)
        self.calls = 0

    def _clock(self) -> float:
        self.calls += 1
        return float((self.calls - 1) ** 2)


def test_the_rates_are_the_window_s_tokens_over_its_time_restarted_by_a_validation(tmp_path):
    """Clock calls: batch 0 starts (0), batches 0 and 1 end (1, 4), a validation, batch 2 starts (9),
    batches 2 and 3 end (16, 25), a validation, batch 4 starts (36), batches 4 and 5 end (49, 64). Each row
    holds 12 real tokens in 2 documents."""
    callback = _SquaresClock()
    fit = trainer(tmp_path, max_steps=6, val_check_interval=2, limit_val_batches=1, callbacks=[callback])
    fit.fit(NextTokenProbe(TINY_TARGETS["llama"]), loader(), loader())
    events = EventAccumulator(str(tmp_path / "tb" / "version_0"))
    events.Reload()
    seconds = [1 - 0, 4 - 0, 16 - 9, 25 - 9, 49 - 36, 64 - 36]
    batches = [1, 2, 1, 2, 1, 2]
    expected_tokens = [12 * n / s for n, s in zip(batches, seconds, strict=True)]
    expected_samples = [2 * n / s for n, s in zip(batches, seconds, strict=True)]
    tokens = [e.value for e in events.Scalars("train/real_tokens_per_s")]
    samples = [e.value for e in events.Scalars("train/samples_per_s")]
    # TensorBoard stores float32: within its rounding of values near 1-12.
    assert tokens == pytest.approx(expected_tokens, rel=1e-6)
    assert samples == pytest.approx(expected_samples, rel=1e-6)


def test_the_window_drops_micro_batches_older_than_its_length(tmp_path):
    """Window 3, no validation: from the fourth micro-batch on, the rate spans the last three only."""
    callback = _SquaresClock()
    fit = trainer(tmp_path, max_steps=6, limit_val_batches=0, callbacks=[callback])
    fit.fit(NextTokenProbe(TINY_TARGETS["llama"]), loader())
    events = EventAccumulator(str(tmp_path / "tb" / "version_0"))
    events.Reload()
    ends = [1, 4, 9, 16, 25, 36]
    starts = [0, 0, 0, 1, 4, 9]
    batches = [1, 2, 3, 3, 3, 3]
    expected = [12 * n / (end - start) for n, end, start in zip(batches, ends, starts, strict=True)]
    assert [e.value for e in events.Scalars("train/real_tokens_per_s")] == pytest.approx(expected, rel=1e-6)
