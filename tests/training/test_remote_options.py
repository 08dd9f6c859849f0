"""The ``remote`` model argument: one block of options, checked field by field, recorded as plain data, and
a checkpoint written when the options were flat arguments (``target_workers``, ...) still loads with them."""

from __future__ import annotations

import pytest
import torch

from lightning_drafts import Eagle3Module
from tests.support.builders import TINY_TARGETS

# The flat names and the option each became, written out here (not read from the code under test).
RETIRED = {
    "target_workers": ("workers", 2),
    "target_address": ("address", "head:6379"),
    "target_prefetch": ("prefetch", 7),
    "target_max_mb_in_flight": ("max_mb_in_flight", 64.0),
    "target_worker_gpus": ("worker_gpus", 1.0),
    "target_unit_timeout_s": ("unit_timeout_s", 30.0),
    "target_cache_dir": ("cache_dir", "features/x"),
    "target_cache_dtype": ("cache_dtype", "float16"),
}


def build(**kwargs) -> Eagle3Module:
    return Eagle3Module(
        dict(TINY_TARGETS["llama"]), ttt_length=2, draft_vocab_size=64, token_frequencies=None, **kwargs
    )


def test_the_options_reach_the_feed_and_the_checkpoint_records_them_as_plain_data(tmp_path):
    options = {"workers": 2, "prefetch": 1, "cache_dir": str(tmp_path / "cache"), "cache_dtype": "float32"}
    module = build(remote=options)
    config = module.remote_features.config
    assert (config.workers, config.prefetch, config.cache_dir, config.cache_dtype) == (
        2,
        1,
        options["cache_dir"],
        "float32",
    )
    # Untouched options keep their defaults.
    assert (config.address, config.max_mb_in_flight, config.unit_timeout_s) == (None, 256.0, None)
    # The workers run the decoder: the trainer keeps none.
    assert module.target.decoder_released
    assert module.hparams["remote"] == options
    path = tmp_path / "hparams.pt"
    torch.save({"hyper_parameters": dict(module.hparams)}, path)
    assert torch.load(path, weights_only=True)["hyper_parameters"]["remote"] == options


def test_a_module_without_the_block_runs_the_target_here():
    module = build()
    assert module.remote_features.config.workers == 0 and module.remote_features.remote is None
    assert not getattr(module.target, "decoder_released", False) and len(module.target.decoder_layers) > 0


def test_a_checkpoint_of_the_flat_options_loads_with_each_one(tmp_path):
    module = build(**{name: value for name, (_, value) in RETIRED.items()})
    config = module.remote_features.config
    for name, (option, value) in RETIRED.items():
        assert getattr(config, option) == value, name
        assert name not in module.hparams, name
    assert module.hparams["remote"] == {option: value for option, value in RETIRED.values()}


def test_an_argument_that_never_existed_is_refused_as_python_refuses_it():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'target_worker'$"):
        build(target_worker=1)


@pytest.mark.parametrize(
    ("options", "refused"),
    [
        ({"workers": -1}, "remote.workers = -1; it must be an integer >= 0"),
        (
            {"address": "head:6379"},
            "remote.address = 'head:6379' names the Ray cluster of the target workers, but",
        ),
        (
            {"cache_dir": "x"},
            "remote.cache_dir = 'x' caches what target workers send, but remote.workers = 0",
        ),
        ({"workers": 1, "prefetch": -2}, "remote.prefetch = -2; it must be an integer >= 0"),
        ({"workers": 1, "max_mb_in_flight": 0}, "remote.max_mb_in_flight"),
        ({"workers": 1, "worker_gpus": -1}, "remote.worker_gpus"),
        ({"workers": 1, "unit_timeout_s": 0}, "remote.unit_timeout_s"),
        ({"workers": 1, "cache_dtype": "int8"}, "dtype 'int8' cannot store features"),
        ({"workers": 1, "worker": 2}, "remote has no option 'worker'; its options are ['workers', "),
    ],
)
def test_each_option_out_of_range_is_refused_naming_it(options, refused):
    with pytest.raises(ValueError) as raised:
        build(remote=options)
    assert str(raised.value).startswith(refused), str(raised.value)
