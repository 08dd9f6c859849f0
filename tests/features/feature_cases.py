"""Documents and captures shared by the features tests: chat-like documents (a prompt, a hole) held as
a :class:`Documents` corpus, captured through the same code path as ``lightning-drafts capture``."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
import torch

from lightning_drafts.datamodules.documents import Documents
from lightning_drafts.datamodules.feature_store import FeatureStore
from lightning_drafts.datamodules.loader import PackedEpochDataset
from lightning_drafts.training.module import DraftModule
from lightning_drafts.workflows.capture import capture_documents
from tests.support.block_draft_cases import documents

LENGTHS = [9, 6, 3, 11, 7, 10, 8]
WIDTH = 24
DATA = {"tokenizer": "tests", "chat_template": "tests", "data": {}}


def corpus(lengths: list[int] = LENGTHS, seed: int = 0) -> Documents:
    """Documents whose first two tokens (the prompt) and sixth token (a user turn) are unsupervised."""
    docs = documents(lengths, seed=seed)
    masks = []
    for doc in docs:
        mask = np.ones(len(doc), dtype=np.int64)
        mask[:2] = 0
        mask[6:7] = 0
        masks.append(mask)
    lengths_ = np.array([len(d) for d in docs], dtype=np.int64)
    return Documents(
        input_ids=np.concatenate([d.numpy() for d in docs]),
        loss_mask=np.concatenate(masks),
        starts=np.cumsum(lengths_) - lengths_,
        lengths=lengths_,
    )


def capture(module: DraftModule, directory: Path, docs: Documents, **options) -> FeatureStore:
    """``docs`` captured as the ``data_files`` source (float32 unless ``dtype`` says otherwise)."""
    options = {"dtype": "float32", "rows_per_batch": 3, **options}
    capture_documents(
        module, {"data_files": docs}, directory, max_tokens=WIDTH, pad_token_id=0, data=DATA, **options
    )
    return FeatureStore(directory)


def first_batch(docs: Documents, mode: str, store: FeatureStore | None) -> dict[str, torch.Tensor]:
    """The first micro-batch of every document in order (``mode`` packing), with the store's features."""
    dataset = PackedEpochDataset(
        docs,
        mode=mode,
        max_tokens=WIDTH,
        batch_size=len(docs),
        pad_token_id=0,
        seed=0,
        shuffle=False,
        shuffle_buffer=len(docs),
        world_size=1,
        rank=0,
        features=None if store is None else store.source("data_files"),
    )
    return next(iter(dataset))


def without_features(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value for key, value in batch.items() if not key.startswith("target_")}


def refuse_target_forward(module: DraftModule):
    """A hook that fails the test if the target's decoder runs (remove it with ``.remove()``)."""

    def hook(*_):
        raise AssertionError("the target's decoder ran although the batch carries its features")

    return module.target.model.get_decoder().register_forward_pre_hook(hook)


class RefuseTargetForward(L.Callback):
    """Fails a fit in which the target's decoder runs (a fit from features must not run it)."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: DraftModule) -> None:
        self.hook = refuse_target_forward(pl_module)

    def on_fit_end(self, trainer: L.Trainer, pl_module: DraftModule) -> None:
        self.hook.remove()
