"""A target worker is refused when any one field of its identity differs from the trainer's, its weights
included, not only its dtype: each field is changed alone on a real worker's identity (built in this
process, without Ray) and must be named in the refusal. Two runs on equal workers cannot show this."""

from __future__ import annotations

import pytest

from lightning_drafts import Eagle3Module
from lightning_drafts.training.remote.target_worker import TargetWorker
from lightning_drafts.training.remote.worker_identity import fingerprint_mismatch, identity_mismatch
from tests.support.builders import TINY_TARGETS

# Every field a trainer's features depend on, written out here (not read from the code under test): the
# target's config, dtype, sizes, embedding / LM-head digest and GGUF file digest; the captured layers and
# final-state positions; the attention backend; the torch version.
IDENTITY_FIELDS = (
    "config_hash",
    "dtype",
    "hidden_size",
    "num_layers",
    "vocab_size",
    "weights",
    "file_sha256",
    "layer_ids",
    "final_positions",
    "attn_backend",
    "torch",
)


@pytest.fixture(scope="module")
def trainer_and_worker() -> tuple[Eagle3Module, dict]:
    # A config dict: random target weights drawn from the target seed.
    module = Eagle3Module(
        dict(TINY_TARGETS["llama"]), ttt_length=2, draft_vocab_size=64, token_frequencies=None
    )
    worker = TargetWorker(**module.remote_features.build().worker_args)
    return module, worker.identity()


def test_a_worker_of_the_trainers_own_target_is_accepted(trainer_and_worker):
    module, identity = trainer_and_worker
    expected = module.remote_features.identity()
    assert set(expected) <= set(IDENTITY_FIELDS), set(expected) - set(IDENTITY_FIELDS)
    assert identity_mismatch(0, identity, expected) is None
    assert fingerprint_mismatch(1, identity, identity) is None


@pytest.mark.parametrize("field", IDENTITY_FIELDS)
def test_a_worker_differing_in_one_field_is_refused_naming_it(trainer_and_worker, field):
    module, identity = trainer_and_worker
    expected = module.remote_features.identity()
    other = {**identity, field: f"another {field}"}
    refused = identity_mismatch(2, other, expected)
    assert refused is not None and refused.startswith(
        f"target worker 2 serves another target: {field} is 'another {field}' there but "
        f"{expected.get(field)!r} in the trainer"
    ), refused
    # The same field missing on the worker but recorded by the trainer is a difference too.
    if field in expected:
        missing = {k: v for k, v in identity.items() if k != field}
        assert f": {field} is None there" in (identity_mismatch(0, missing, expected) or ""), field


def test_a_worker_holding_another_random_target_of_the_same_config_is_refused_by_its_weights(
    trainer_and_worker,
):
    module, _ = trainer_and_worker
    args = {**module.remote_features.build().worker_args, "seed": 1}
    identity = TargetWorker(**args).identity()
    refused = identity_mismatch(0, identity, module.remote_features.identity())
    assert refused is not None and ": weights is " in refused, refused


def test_workers_with_other_decoder_weights_are_refused_naming_both_fingerprints(trainer_and_worker):
    _, identity = trainer_and_worker
    other = {**identity, "decoder_fingerprint": "f" * 32}
    refused = fingerprint_mismatch(1, other, identity)
    assert refused is not None and "f" * 32 in refused and identity["decoder_fingerprint"] in refused
