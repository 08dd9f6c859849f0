"""Capture: resumable (a stopped capture finishes with the same shards as an uninterrupted one, no
document twice or missing), refused when the disk is short (with the figure), and a manifest that does
not match the module is refused naming the field; another draft vocabulary needs no new capture."""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from lightning_drafts import DFlashModule, Eagle3Module
from lightning_drafts.core.output_lock import OutputInUse
from lightning_drafts.datamodules.feature_store import MANIFEST, FeatureStore
from tests.families.family_case import ROOT
from tests.families.test_conformance import run
from tests.features.feature_cases import capture, corpus, first_batch, without_features
from tests.support.builders import TINY_TARGETS
from tests.support.hang_guard import HANG_GUARD_S
from tests.support.lock_holder import held_by_another_process

pytestmark = pytest.mark.usefixtures("one_thread")

LLAMA = TINY_TARGETS["llama"]
LAYERS = [1, 3, 4]
# Three layers of 32 float32 features: 384 bytes a token, so shards of about 15 tokens.
SMALL_SHARDS = 384 * 15


def eagle3(**options) -> Eagle3Module:
    torch.manual_seed(0)
    return Eagle3Module(LLAMA, target_layer_ids=LAYERS, ttt_length=2, target_attn_backend="sdpa", **options)


def shard_tensors(directory) -> dict[str, dict[str, torch.Tensor]]:
    return {path.name: load_file(str(path)) for path in sorted(directory.glob("*.safetensors"))}


def test_a_stopped_capture_resumes_to_the_shards_of_an_uninterrupted_one(tmp_path):
    module, docs = eagle3(), corpus()
    whole = capture(module, tmp_path / "whole", docs, shard_bytes=SMALL_SHARDS)
    shards = whole.manifest["sources"]["data_files"]["shards"]
    assert len(shards) >= 3

    stopped = tmp_path / "stopped"
    with pytest.raises(ValueError, match="incomplete"):
        capture(module, stopped, docs, shard_bytes=SMALL_SHARDS, max_shards=1)
    assert len(list(stopped.glob("*.safetensors"))) == 1
    # A shard cut off mid-write (a killed process) never carries a shard's name, and is written again.
    (stopped / (shards[1]["file"] + ".partial")).write_bytes(b"cut off")
    resumed = capture(module, stopped, docs, shard_bytes=SMALL_SHARDS)

    expected, actual = shard_tensors(tmp_path / "whole"), shard_tensors(stopped)
    assert expected.keys() == actual.keys() == {shard["file"] for shard in shards}
    for name, tensors in expected.items():
        assert tensors.keys() == actual[name].keys()
        for key, value in tensors.items():
            assert torch.equal(actual[name][key], value), f"{name}: {key}"
    # Every document exactly once, in corpus order.
    starts = np.concatenate([tensors["doc_starts"].numpy() for tensors in actual.values()])
    assert np.array_equal(starts, docs.starts)
    drop = ("capture_seconds", "directory")
    assert {k: v for k, v in resumed.manifest.items() if k not in drop} == {
        k: v for k, v in whole.manifest.items() if k not in drop
    }


def test_a_cut_or_missing_shard_is_named_with_the_fix_that_rewrites_it(tmp_path):
    module, docs = eagle3(), corpus()
    whole = capture(module, tmp_path / "whole", docs, shard_bytes=SMALL_SHARDS)
    names = [shard["file"] for shard in whole.manifest["sources"]["data_files"]["shards"]]
    damaged = tmp_path / "damaged"
    capture(module, damaged, docs, shard_bytes=SMALL_SHARDS)
    cut = damaged / names[1]
    cut.write_bytes(cut.read_bytes()[:1000])  # a copy that stopped
    fix = "; delete it and run the same `lightning-drafts capture` again: it rewrites the shards that are not there"
    with pytest.raises(ValueError) as refused:
        FeatureStore(damaged).source("data_files")
    message = str(refused.value)
    assert message.startswith(f"feature shard {cut} is 1,000 bytes, unreadable (") and message.endswith(fix)
    assert "\n" not in message
    cut.unlink()
    with pytest.raises(ValueError, match=f"^feature shard {cut} is missing \\(.*{re.escape(fix)}$"):
        FeatureStore(damaged).source("data_files")
    # The fix it names works: the capture writes the shard again, equal to the uninterrupted one's.
    capture(module, damaged, docs, shard_bytes=SMALL_SHARDS)
    assert shard_tensors(damaged).keys() == shard_tensors(tmp_path / "whole").keys()
    for key, value in load_file(str(tmp_path / "whole" / names[1])).items():
        assert torch.equal(load_file(str(cut))[key], value), key


def test_a_resumed_capture_says_where_and_its_shards_are_readable_by_others(tmp_path, caplog):
    module, docs = eagle3(), corpus()
    with pytest.raises(ValueError, match="incomplete"):
        capture(module, tmp_path, docs, shard_bytes=SMALL_SHARDS, max_shards=1)
    with caplog.at_level(logging.INFO):
        store = capture(module, tmp_path, docs, shard_bytes=SMALL_SHARDS)
    total = len(store.manifest["sources"]["data_files"]["shards"])
    assert f"resuming the capture in {tmp_path}: 1 of {total} shards are there, {total - 1} to write" in [
        r.getMessage() for r in caplog.records
    ]
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir() if not p.name.startswith(".")}
    assert set(modes.values()) == {0o644} and MANIFEST in modes and len(modes) == total + 1, modes


def test_a_capture_into_a_directory_another_capture_writes_is_refused(tmp_path):
    with held_by_another_process(tmp_path / "features") as holder:
        with pytest.raises(
            OutputInUse, match=rf"features is being written by another run \(process {holder.pid} "
        ):
            capture(eagle3(), tmp_path / "features", corpus(), shard_bytes=SMALL_SHARDS)
    assert not (tmp_path / "features").exists()


def test_resuming_with_another_setting_is_refused_naming_it(tmp_path):
    module, docs = eagle3(), corpus()
    with pytest.raises(ValueError, match="incomplete"):
        capture(module, tmp_path, docs, shard_bytes=SMALL_SHARDS, max_shards=1)
    with pytest.raises(ValueError, match="its 'dtype' is 'float32', this one's 'bfloat16'"):
        capture(module, tmp_path, docs, shard_bytes=SMALL_SHARDS, dtype="bfloat16")


def test_a_capture_that_would_not_fit_the_disk_is_refused_with_the_figure(tmp_path):
    with pytest.raises(ValueError, match=r"needs about 0\.000 GiB \([\d,]+ bytes\) more .* only .* is free"):
        capture(eagle3(), tmp_path, corpus(), keep_free_bytes=1 << 62)
    assert not list(tmp_path.glob("*.safetensors"))


def test_the_disk_estimate_is_tokens_times_layers_times_hidden_times_bytes(tmp_path):
    docs = corpus()
    store = capture(eagle3(), tmp_path, docs, dtype="bfloat16")
    supervised = int(docs.supervised_per_document().sum())
    on_disk = sum(
        t.numel() * t.element_size()
        for s in shard_tensors(tmp_path).values()
        for k, t in s.items()
        if k in ("hidden_states", "last_hidden_state")
    )
    assert on_disk == docs.num_tokens * 3 * 32 * 2 + supervised * 32 * 2
    assert store.manifest["sources"]["data_files"]["final_rows"] == supervised


def test_float8_storage_holds_a_byte_a_feature_plus_a_scale_per_token_and_layer(tmp_path):
    docs = corpus()
    capture(eagle3(), tmp_path, docs, dtype="float8_e4m3fn")
    (tensors,) = shard_tensors(tmp_path).values()
    assert tensors["hidden_states"].dtype == torch.float8_e4m3fn
    assert tensors["hidden_scales"].shape == (docs.num_tokens, 3)
    assert tensors["last_hidden_state"].dtype == torch.bfloat16  # the teacher keeps bfloat16
    with pytest.raises(ValueError, match=r"dtype 'int8' cannot store features; use one of \['bfloat16'"):
        capture(eagle3(), tmp_path / "int8", docs, dtype="int8")


@pytest.mark.parametrize(
    ("options", "field"),
    [
        (
            {"target_layer_ids": [1, 3, 5]},
            r"layer_ids: the draft reads target layers \[1, 3, 5\] .* \(missing \[5\]\)",
        ),
        ({"target_seed": 1}, r"target\.weights is"),
        ({"target_dtype": "bfloat16"}, r"target\.dtype is 'float32' there but 'bfloat16' here"),
        ({"target": {**LLAMA, "hidden_size": 48}}, r"target\.config_hash is"),
    ],
    ids=["layer_ids", "weights", "dtype", "config"],
)
def test_a_manifest_that_does_not_match_the_module_is_refused_naming_the_field(tmp_path, options, field):
    store = capture(eagle3(), tmp_path, corpus())
    options = dict(options)
    target = options.pop("target", LLAMA)
    torch.manual_seed(0)
    other = Eagle3Module(target, ttt_length=2, **{"target_layer_ids": LAYERS, **options})
    with pytest.raises(ValueError, match=field):
        other.check_features(store.manifest)
    eagle3().check_features(store.manifest)  # the capturing configuration itself passes


def test_features_without_the_teacher_are_refused_for_a_draft_that_reads_it(tmp_path):
    torch.manual_seed(0)
    dflash = DFlashModule(LLAMA, mask_token_id=95, target_layer_ids=LAYERS, num_draft_layers=1, block_size=4)
    store = capture(dflash, tmp_path, corpus())
    assert store.manifest["final_positions"] == "none"
    with pytest.raises(
        ValueError, match="final_positions: the draft reads .* 'supervised' .* hold it at 'none'"
    ):
        eagle3().check_features(store.manifest)
    # A batch without the teacher refuses at the step too, naming what is missing.
    batch = first_batch(corpus(), "microbatch", store)
    with pytest.raises(ValueError, match="final hidden state at fewer positions"):
        eagle3().compute_loss(batch)


def test_another_draft_vocabulary_trains_from_the_same_capture(tmp_path):
    """The teacher is stored as the target's final hidden state, so the frozen LM head recomputes it for
    any draft vocabulary: a compressed-vocabulary draft trains from a full-vocabulary draft's capture."""
    docs = corpus()
    store = capture(eagle3(), tmp_path, docs)
    counts = torch.arange(LLAMA["vocab_size"], dtype=torch.long)
    small = eagle3(draft_vocab_size=40, token_frequencies=counts)
    small.check_features(store.manifest)
    batch = first_batch(docs, "microbatch", store)
    online, _ = run(small, without_features(batch), {})
    offline, _ = run(small, batch, {})
    torch.testing.assert_close(offline.loss, online.loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(offline.correct, online.correct)


def test_an_incomplete_or_foreign_directory_is_refused_by_the_store(tmp_path):
    with pytest.raises(ValueError, match="has no features.json; run `lightning-drafts capture` first"):
        FeatureStore(tmp_path)
    (tmp_path / MANIFEST).write_text(json.dumps({"format": "other", "version": 1}))
    with pytest.raises(ValueError, match="is not a version-1 lightning-drafts-features manifest"):
        FeatureStore(tmp_path)


def test_a_two_process_torchrun_capture_equals_the_single_process_capture(tmp_path):
    """`torchrun --nproc_per_node 2 -m lightning_drafts capture ...` (gloo on CPU): each rank writes its
    own half of the shards, and together they are byte for byte the one-process capture's."""
    config = ROOT / "configs" / "quickstart" / "dflash.yaml"
    options = [
        "capture",
        f"--config={config}",
        "--shard-bytes=200000",
        "--data.init_args.max_documents=60",
        f"--data.init_args.cache_dir={tmp_path / 'cache'}",
        "--data.init_args.setup_summary=false",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    torchrun = [
        str(Path(sys.executable).with_name("torchrun")),
        "--standalone",
        "--nproc_per_node=2",
        "-m",
    ]
    runs = {}
    for name, launcher in (("one", [sys.executable, "-m"]), ("two", torchrun)):
        command = [*launcher, "lightning_drafts", *options, f"--output={tmp_path / name}"]
        runs[name] = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S
        )
        assert runs[name].returncode == 0, runs[name].stderr[-3000:]
    one, two = shard_tensors(tmp_path / "one"), shard_tensors(tmp_path / "two")
    assert one.keys() == two.keys() and len(one) >= 4
    for name, tensors in one.items():
        for key, value in tensors.items():
            assert torch.equal(two[name][key], value), f"{name}: {key}"
    half = len(one) // 2
    assert runs["two"].stdout.count(f"captured {half} shard(s)") == 2, runs["two"].stdout
    assert FeatureStore(tmp_path / "two").manifest["complete"]
