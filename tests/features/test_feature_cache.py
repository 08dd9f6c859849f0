"""The features cache (``remote.cache_dir``) on its own: documents received unit by unit, in training
order and packing, some never (asked for afterwards, packed otherwise), across a restart, make the
directory ``lightning-drafts capture`` writes (bfloat16: every tensor equal; float8: the values equal, the
scales within one float32 step, see below); a directory of another capture is refused naming the field.
With real Ray workers: tests/training/test_remote_target.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from lightning_drafts.core.output_lock import OutputInUse
from lightning_drafts.datamodules.feature_store import dequantize_rows
from lightning_drafts.datamodules.loader import PackedEpochDataset
from lightning_drafts.training.remote.feature_cache import FeatureCache
from tests.features.feature_cases import DATA, WIDTH, capture, corpus
from tests.features.test_capture import eagle3
from tests.support.lock_holder import held_by_another_process

pytestmark = pytest.mark.usefixtures("one_thread")

# Three layers of 32 features: 96 bytes a token in float8, so shards of about 15 tokens or fewer.
SMALL_SHARDS = 96 * 15


def units(docs, mode: str, batch_size: int) -> PackedEpochDataset:
    return PackedEpochDataset(
        docs,
        mode=mode,
        max_tokens=WIDTH,
        batch_size=batch_size,
        pad_token_id=0,
        seed=0,
        shuffle=True,
        shuffle_buffer=len(docs),
        world_size=1,
        rank=0,
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_features_received_unit_by_unit_make_the_directory_a_capture_writes(tmp_path, dtype):
    module, docs = eagle3(), corpus()
    captured = capture(module, tmp_path / "captured", docs, dtype=dtype, shard_bytes=SMALL_SHARDS)
    assert len(captured.manifest["sources"]["data_files"]["shards"]) >= 3

    def cache() -> FeatureCache:
        return FeatureCache(
            tmp_path / "cached", module.capture_identity(), {"data_files": docs}, DATA, dtype, SMALL_SHARDS
        )

    # Training's units (buffer packing, shuffled), the last one never received.
    training = units(docs, "buffer", 2)
    first = cache()
    for index in range(len(training) - 1):
        batch = training[index]
        first.receive("data_files", docs, training.placement(index), module.features_for(batch))
    missing = first.missing()["data_files"]
    assert 0 < len(missing) < len(docs)
    # A restarted run finds what was received; the rest arrives packed otherwise, one document a row.
    second = cache()
    assert second.missing()["data_files"].starts.tolist() == missing.starts.tolist()
    rest = units(missing, "microbatch", 1)
    for index in range(len(rest)):
        second.receive("data_files", missing, rest.placement(index), module.features_for(rest[index]))
    assert second.missing() == {}
    second.finish()

    written = json.loads((tmp_path / "cached" / "features.json").read_text())
    expected = {k: v for k, v in captured.manifest.items() if k != "directory"}
    assert written["complete"] and written["dtype"] == dtype
    assert {k: v for k, v in written.items() if k != "capture_seconds"} == {
        k: v for k, v in expected.items() if k != "capture_seconds"
    }
    assert sorted(p.name for p in (tmp_path / "cached").iterdir()) == sorted(
        p.name for p in (tmp_path / "captured").iterdir()
    )
    for path in (tmp_path / "captured").glob("*.safetensors"):
        mine, theirs = load_file(tmp_path / "cached" / path.name), load_file(path)
        assert mine.keys() == theirs.keys()
        for key, value in theirs.items():
            assert mine[key].dtype == value.dtype, f"{path.name}: {key}"
            if key == "hidden_scales":
                # A document's float32 features from rows packed otherwise round otherwise in the last
                # bits (a matmul of another shape); a float8 scale keeps that, within one float32 step.
                torch.testing.assert_close(mine[key], value, rtol=3e-7, atol=0)
            else:
                assert torch.equal(mine[key], value), f"{path.name}: {key}"
        if "hidden_scales" in theirs:
            assert torch.equal(
                dequantize_rows(mine["hidden_states"], mine["hidden_scales"]),
                dequantize_rows(theirs["hidden_states"], theirs["hidden_scales"]),
            ), path.name
    # Complete: a later run finds it so and receives nothing more.
    assert cache().complete


def test_a_directory_of_another_capture_is_refused_naming_the_field(tmp_path):
    module, docs = eagle3(), corpus()
    capture(module, tmp_path / "features", docs, dtype="bfloat16")
    with pytest.raises(
        ValueError, match=r"records another capture: its 'dtype' is 'bfloat16', this one's 'float16'"
    ):
        FeatureCache(
            tmp_path / "features",
            module.capture_identity(),
            {"data_files": docs},
            DATA,
            "float16",
            SMALL_SHARDS,
        )


def test_a_cache_another_run_is_filling_is_refused_and_left_alone(tmp_path):
    module, docs = eagle3(), corpus()
    with held_by_another_process(tmp_path / "cached") as holder:
        with pytest.raises(
            OutputInUse, match=rf"cached is being written by another run \(process {holder.pid} "
        ):
            FeatureCache(
                tmp_path / "cached",
                module.capture_identity(),
                {"data_files": docs},
                DATA,
                "bfloat16",
                SMALL_SHARDS,
            )
    assert not (tmp_path / "cached").exists()
    # Once the other run is gone, the cache is this run's.
    FeatureCache(
        tmp_path / "cached", module.capture_identity(), {"data_files": docs}, DATA, "bfloat16", SMALL_SHARDS
    )
    assert (tmp_path / "cached" / "received").is_dir()
