"""A block draft's mask id must be one text never produces: a special or added token of the tokenizer
(not eos / bos / pad / unk) the data does not use, or an id past the tokenizer's tokens."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_drafts.datamodules import PackedChatDataModule
from lightning_drafts.training.hyperparameters import check_mask_token_against_data


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> PackedChatDataModule:
    cache = tmp_path_factory.mktemp("cache")
    module = PackedChatDataModule(
        tokenizer="shipped:tiny-qwen3",
        max_tokens=256,
        max_documents=20,
        cache_dir=str(cache),
        setup_summary=False,
    )
    module.setup("fit")
    return module


def test_an_ordinary_text_token_the_data_lacks_is_refused_naming_its_text(data):
    tokenizer = data.tokenizer
    used = np.bincount(data.train_documents.input_ids, minlength=len(tokenizer))
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    unused_text = next(i for i in range(len(tokenizer)) if used[i] == 0 and i not in special)
    text = tokenizer.convert_ids_to_tokens(unused_text)
    with pytest.raises(ValueError) as refused:
        check_mask_token_against_data(unused_text, data)
    message = str(refused.value)
    assert f"mask_token_id = {unused_text} is token {text!r}: an ordinary text token" in message
    assert "occurs" not in message.split(";")[0]
    assert "3 '<|mask|>'" in message and "past its 2,048 tokens" in message


def test_a_reserved_token_or_an_id_past_the_tokenizer_is_accepted(data):
    for token_id in (3, len(data.tokenizer), len(data.tokenizer) + 100):
        check_mask_token_against_data(token_id, data)


@pytest.mark.parametrize(
    ("token_id", "match"),
    [
        (2, r"the tokenizer's eos token '<\|im_end\|>'"),
        (1, r"token '<\|im_start\|>', which occurs [\d,]+ times in the data;"),
    ],
)
def test_an_end_token_or_an_added_token_the_data_uses_is_refused(data, token_id, match):
    with pytest.raises(ValueError, match=match):
        check_mask_token_against_data(token_id, data)
