"""The validation split holds documents out by their content: copies of a document never straddle it,
it is the same for the same seed, and its share is the fraction asked for."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from lightning_drafts.datamodules import PackedChatDataModule, load_embedded_tokenizer


def chat(i: int) -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"question number {i}"},
            {"role": "assistant", "content": f"answer number {i}"},
        ]
    }


@pytest.fixture(scope="module")
def chats_with_copies(tmp_path_factory):
    # 100 distinct conversations; every fifth is there four times (a corpus that repeats greetings).
    rows = [chat(i) for i in range(100) for _ in range(4 if i % 5 == 0 else 1)]
    path = tmp_path_factory.mktemp("copies") / "chats.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path), len(rows)


def split(path: str, cache_dir, seed: int = 0, fraction: float = 0.2) -> tuple[Counter, Counter]:
    data = PackedChatDataModule(
        data_files=path,
        tokenizer=load_embedded_tokenizer(),
        cache_dir=str(cache_dir),
        max_tokens=64,
        val_fraction=fraction,
        seed=seed,
        setup_summary=False,
    )
    data.setup("fit")

    def contents(documents) -> Counter:
        return Counter(tuple(documents.tokens(i)[0].tolist()) for i in range(len(documents)))

    return contents(data.train_documents), contents(data.val_documents)


def test_copies_of_a_document_land_on_one_side_and_the_share_is_the_fraction(chats_with_copies, tmp_path):
    path, rows = chats_with_copies
    train, val = split(path, tmp_path)
    assert sum(train.values()) + sum(val.values()) == rows == 160
    assert not set(train) & set(val)
    # Whole contents are held out while they fit in round(0.2 * 160) = 32 documents: the greedy fill
    # stops short of 32 by less than the largest group (4 copies).
    assert 32 - 4 < sum(val.values()) <= 32
    assert sum(val[c] for c in val if val[c] == 4) >= 4  # some repeated conversation is held out whole


def test_the_split_is_set_by_the_seed(chats_with_copies, tmp_path):
    path, _ = chats_with_copies
    first = split(path, tmp_path, seed=0)
    assert split(path, tmp_path / "again", seed=0) == first
    assert split(path, tmp_path, seed=1)[1] != first[1]


def test_a_corpus_of_one_content_holds_out_nothing_and_says_why(tmp_path, caplog):
    path = tmp_path / "same.jsonl"
    path.write_text("\n".join(json.dumps(chat(7)) for _ in range(30)))
    with caplog.at_level("WARNING", logger="lightning_drafts.datamodules"):
        train, val = split(str(path), tmp_path, fraction=0.1)
    assert sum(train.values()) == 30 and not val
    (said,) = [r.getMessage() for r in caplog.records if "held out no document" in r.getMessage()]
    assert said.startswith("val_fraction=0.1 held out no document: all 30 documents have one content"), said
