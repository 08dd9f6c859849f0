"""A checkpoint target loaded without its decoder (``target_decoder=False``): no decoder layer is built, the
embedding, final norm and LM head are the checkpoint's, and the target describes itself as the full one."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from lightning_drafts.core.batch import validate_batch
from lightning_drafts.training.decoderless import load_without_decoder
from lightning_drafts.training.target import FrozenTarget
from tests.support.builders import packed_row, random_docs, stack_rows


def saved(config: dict, directory) -> str:
    FrozenTarget(config).model.save_pretrained(directory)
    return str(directory)


def test_no_decoder_layer_is_built_and_the_rest_is_the_checkpoint(target_config, tmp_path):
    path = saved(target_config, tmp_path / "target")
    full, bare = FrozenTarget(path), FrozenTarget(path, decoder=False)

    assert len(bare.decoder_layers) == 0
    assert not [name for name, _ in bare.model.named_parameters() if ".layers." in name]
    assert bare.num_layers == full.num_layers == target_config["num_hidden_layers"]
    assert bare.identity() == full.identity()
    kept = {name: value for name, value in full.model.state_dict().items() if ".layers." not in name}
    assert kept.keys() == bare.model.state_dict().keys()
    for name, value in kept.items():
        assert torch.equal(value, bare.model.state_dict()[name]), name
    hidden = torch.randn(5, target_config["hidden_size"])
    assert torch.equal(bare.logits(hidden), full.logits(hidden))

    batch = stack_rows([packed_row(random_docs([4, 5]), 12)])
    with pytest.raises(ValueError, match="the target's decoder was released"):
        bare(validate_batch(batch, vocab_size=bare.vocab_size), (1,))


def test_a_checkpoint_without_the_lm_head_is_refused_naming_the_tensor(target_config, tmp_path):
    path = saved(target_config, tmp_path / "target")
    weights = tmp_path / "target" / "model.safetensors"
    tensors = load_file(weights)
    del tensors["lm_head.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"has no \['lm_head.weight'\]"):
        load_without_decoder(path, dtype="auto")
