"""The features loader: DataLoader workers give the same batches as the main process, and a source's
reader survives pickling (a spawned worker opens its own memory maps)."""

from __future__ import annotations

import pickle

import torch

from lightning_drafts import DFlashModule
from lightning_drafts.datamodules.loader import PackedEpochDataset
from tests.features.feature_cases import WIDTH, capture, corpus
from tests.support.builders import TINY_TARGETS


def test_workers_and_a_pickled_reader_give_the_main_process_batches(tmp_path):
    torch.manual_seed(0)
    module = DFlashModule(
        TINY_TARGETS["llama"], mask_token_id=95, target_layer_ids=[1, 4], num_draft_layers=1, block_size=4
    )
    docs = corpus()
    source = capture(module, tmp_path, docs).source("data_files")

    def batches(features, workers: int) -> list[dict[str, torch.Tensor]]:
        dataset = PackedEpochDataset(
            docs, mode="buffer", max_tokens=WIDTH, batch_size=1, pad_token_id=0, seed=0, shuffle=True,
            shuffle_buffer=4, world_size=1, rank=0, features=features,
        )  # fmt: skip
        return list(torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers))

    expected = batches(source, 0)
    assert len(expected) >= 2 and all("target_hidden_states" in b for b in expected)
    for actual in (batches(source, 2), batches(pickle.loads(pickle.dumps(source)), 0)):
        assert len(actual) == len(expected)
        for a, b in zip(actual, expected, strict=True):
            assert a.keys() == b.keys()
            for key in b:
                assert torch.equal(a[key], b[key]), key
