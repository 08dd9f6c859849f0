"""PackedChatDataModule on the embedded corpus and tokenizer: masks, counts, loaders, resume, ranks."""

from __future__ import annotations

import json
import logging
import re
from collections import Counter

import datasets
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from lightning_drafts.core.batch import validate_batch
from lightning_drafts.datamodules import PackedChatDataModule, load_embedded_tokenizer
from lightning_drafts.datamodules.chat_format import normalize_conversation
from lightning_drafts.datamodules.packing import plan_epoch
from lightning_drafts.datamodules.templates import MISTRAL_TEMPLATE, strip_generation_tags
from lightning_drafts.datamodules.tokenize import render_with_assistant_spans, tokenize_batch

datasets.disable_progress_bars()

SMALL = dict(max_documents=80, max_tokens=256, batch_size=2)


@pytest.fixture(scope="module")
def tokenizer():
    return load_embedded_tokenizer()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("chat-cache"))


@pytest.fixture
def make(tokenizer, cache_dir):
    def build(**overrides) -> PackedChatDataModule:
        module = PackedChatDataModule(
            **{"tokenizer": tokenizer, "cache_dir": cache_dir, **SMALL, **overrides}
        )
        module.setup("fit")
        return module

    return build


def doc_key(ids, mask) -> tuple:
    return tuple(int(t) for t in ids), tuple(int(m) for m in mask)


def documents_in_batch(batch: dict[str, torch.Tensor]) -> list[tuple]:
    found = []
    for row in range(batch["input_ids"].shape[0]):
        begin = 0
        for length in batch["seq_lens"][row].tolist():
            if length:
                span = slice(begin, begin + length)
                real = batch["attention_mask"][row, span].bool()
                found.append(
                    doc_key(batch["input_ids"][row, span][real], batch["loss_mask"][row, span][real])
                )
                begin += length
    return found


def all_documents(documents) -> Counter:
    return Counter(doc_key(*documents.tokens(i)) for i in range(len(documents)))


def epoch(module: PackedChatDataModule) -> list[dict[str, torch.Tensor]]:
    return list(module.train_dataloader())


# ---------------------------------------------------------------------------- assistant masks


def word_tokenizer(words: str) -> PreTrainedTokenizerFast:
    vocab = {word: i for i, word in enumerate(["<unk>", *words.split()])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")


WORD_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{ 'assistant : ' }}{% generation %}{{ m.content + ' <eos>' }}{% endgeneration %}{{ ' ' }}"
    "{%- else -%}{{ m.role + ' : ' + m.content + ' ' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'assistant : ' }}{%- endif -%}"
)
CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi there"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "bye"},
    {"role": "assistant", "content": "ok see you"},
]
# Written out by hand from WORD_TEMPLATE: only the replies and their end-of-turn token are supervised.
WORD_TOKENS = (
    "system : be brief user : hi there assistant : hello <eos> user : bye assistant : ok see you <eos>"
)
#            system :  be brief user :  hi there assistant : hello <eos> user : bye assistant : ok see you <eos>
WORD_MASK = [0,     0, 0, 0,    0,   0, 0, 0,    0,        0, 1,    1,    0,   0, 0,   0,        0, 1, 1,  1,  1]  # fmt: skip


@pytest.mark.parametrize("tags", [True, False], ids=["generation-tags", "prefix-rendering"])
def test_multiturn_mask_matches_hand_written_expectation(tags):
    tok = word_tokenizer("system : be brief user hi there assistant hello <eos> bye ok see you")
    template = WORD_TEMPLATE if tags else strip_generation_tags(WORD_TEMPLATE)
    out = tokenize_batch({"messages": [CONVERSATION]}, tok, template)
    assert out["malformed"] == [""]
    assert tok.convert_ids_to_tokens(out["input_ids"][0].tolist()) == WORD_TOKENS.split()
    assert out["loss_mask"][0].tolist() == WORD_MASK


@pytest.mark.parametrize("tags", [True, False], ids=["generation-tags", "prefix-rendering"])
def test_mistral_template_supervises_each_reply_and_its_eos(tokenizer, tags):
    template = MISTRAL_TEMPLATE if tags else strip_generation_tags(MISTRAL_TEMPLATE)
    conversation = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "It is 4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6, of course."},
    ]
    out = tokenize_batch({"messages": [conversation]}, tokenizer, template)
    ids, mask = out["input_ids"][0], out["loss_mask"][0].astype(bool)
    runs = np.split(np.arange(len(ids)), np.flatnonzero(np.diff(mask.astype(int))) + 1)
    supervised = [tokenizer.decode(ids[run]) for run in runs if mask[run[0]]]
    assert supervised == ["It is 4.</s>", "6, of course.</s>"]
    # SentencePiece's dummy prefix makes the token after <s> "▁[", hence the space after <s>.
    assert (
        tokenizer.decode(ids[~mask])
        == "<s> [INST] Answer briefly.\n\nWhat is 2+2? [/INST] [INST] And 3+3? [/INST]"
    )
    # The reply "6, ..." starts with a lone "▁" token (digits have no "▁6" piece); the model emits it, so
    # it is supervised.
    last_reply = [run for run in runs if mask[run[0]]][-1]
    assert tokenizer.convert_ids_to_tokens(ids[last_reply].tolist()) == [
        "▁",
        "6",
        ",",
        "▁of",
        "▁course",
        ".",
        "</s>",
    ]


def test_sharegpt_rows_match_openai_rows(tokenizer):
    sharegpt = [
        {"from": "system", "value": "Answer briefly."},
        {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello!"},
    ]
    openai = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ]
    assert normalize_conversation({"conversations": sharegpt}) == openai
    a = tokenize_batch({"conversations": [sharegpt]}, tokenizer, MISTRAL_TEMPLATE)
    b = tokenize_batch({"messages": [openai]}, tokenizer, MISTRAL_TEMPLATE)
    assert a["input_ids"][0].tolist() == b["input_ids"][0].tolist()
    assert a["loss_mask"][0].tolist() == b["loss_mask"][0].tolist()


def test_template_without_consistent_prefixes_is_reported(tokenizer):
    # A template that prints the turn count up front changes earlier text as turns are added, so
    # prefix rendering cannot locate the replies.
    template = "{{ messages | length }}{% for m in messages %} {{ m.content }}{% endfor %}"
    row = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    out = tokenize_batch({"messages": [row["messages"]]}, tokenizer, template)
    assert "inconsistently" in out["malformed"][0]
    assert len(out["input_ids"][0]) == 0
    text, spans = render_with_assistant_spans(row["messages"], MISTRAL_TEMPLATE, tokenizer)
    assert [text[a:b] for a, b in spans] == [" b</s>"]


# ---------------------------------------------------------------------------- data module


def test_malformed_rows_are_counted_and_reported(tmp_path, tokenizer, cache_dir, caplog):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    rows = [
        good,
        {"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]},
        {"messages": []},
        {"messages": [{"role": "user", "content": "anyone?"}]},
        {"conversations": [{"from": "human", "value": "hey"}, {"from": "gpt", "value": "hey you"}]},
        {"conversations": [{"from": "narrator", "value": "once"}, {"from": "gpt", "value": "upon"}]},
        {"conversations": [{"from": "human", "value": "anyone?"}]},
        good,
    ]
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    with caplog.at_level(logging.INFO, logger="lightning_drafts.datamodules"):
        module = PackedChatDataModule(
            data_files=str(path), tokenizer=tokenizer, cache_dir=cache_dir, max_tokens=64
        )
        module.setup()
    stats = module.stats["train"]
    assert stats["documents"] == 3
    assert stats["malformed"] == 5
    assert stats["malformed_reasons"] == {
        "unknown role 'robot'": 1,
        "empty conversation": 1,
        "no assistant turn": 2,
        "unknown role 'narrator'": 1,
    }
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("5 malformed rows" in message for message in warnings)
    for batch in epoch(module):
        validate_batch(batch, module.vocab_size)


def test_parquet_files_load_and_bad_sources_fail_clearly(tmp_path, tokenizer, cache_dir):
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(3)
    ]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "chats.parquet"))
    module = PackedChatDataModule(
        data_files=str(tmp_path / "chats.parquet"), tokenizer=tokenizer, cache_dir=cache_dir
    )
    module.setup()
    assert module.stats["train"]["documents"] == 3
    (tmp_path / "chats.txt").write_text("hello")
    for bad, message in (
        (tmp_path / "chats.txt", "is not .json"),
        (tmp_path / "missing.jsonl", "does not exist"),
    ):
        with pytest.raises(ValueError, match=message):
            PackedChatDataModule(data_files=str(bad), tokenizer=tokenizer, cache_dir=cache_dir).setup()


def test_setup_logs_a_marked_sample_and_the_counts(make, caplog):
    with caplog.at_level(logging.INFO, logger="lightning_drafts.datamodules"):
        module = make(seed=1)
    text = caplog.text
    stats = module.stats["train"]
    assert (
        f"{stats['documents']} documents, {stats['tokens']} tokens, {stats['supervised_tokens']} supervised"
        in text
    )
    assert "⟦" in text and "⟧" in text and "[INST]" in text
    assert 0 < stats["supervised_tokens"] < stats["tokens"]


def test_public_attributes_describe_the_embedded_tokenizer(tokenizer):
    module = PackedChatDataModule(tokenizer=tokenizer)
    assert (module.vocab_size, module.pad_token_id) == (32_000, 0)
    assert tokenizer.convert_ids_to_tokens(0) == "<unk>"
    with pytest.raises(ValueError, match="chat_template='llama9'"):
        PackedChatDataModule(tokenizer=tokenizer, chat_template="llama9")


def test_tokenisation_is_cached_across_runs(tokenizer, tmp_path):
    def build(cache, **kwargs):
        module = PackedChatDataModule(tokenizer=tokenizer, cache_dir=str(cache), max_documents=40, **kwargs)
        module.setup()
        return module

    parallel = build(tmp_path / "a", num_proc=2)
    files = {p: p.stat().st_mtime_ns for p in (tmp_path / "a").glob("chat-tokens-*.arrow")}
    assert len(files) == 2  # one cache shard per process
    again = build(tmp_path / "a", max_tokens=128)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "a").glob("chat-tokens-*.arrow")} == files
    serial = build(tmp_path / "b")
    assert all_documents(parallel.train_documents) == all_documents(serial.train_documents)
    assert again.stats["train"]["documents"] == serial.stats["train"]["documents"] == 40


@pytest.mark.parametrize("packing", ["buffer", "microbatch", False])
def test_every_batch_is_valid_and_every_document_used_once(make, packing):
    module = make(packing=packing, val_fraction=0.1)
    seen = Counter()
    for batch in epoch(module):
        validate_batch(batch, module.vocab_size)
        assert all(t.dtype == torch.long for t in batch.values())
        seen.update(documents_in_batch(batch))
    assert seen == all_documents(module.train_documents)
    val = [
        d for b in module.val_dataloader() for d in documents_in_batch(validate_batch(b, 32_000).to_dict())
    ]
    assert Counter(val) == all_documents(module.val_documents)
    assert not set(val) & set(seen)


def test_packed_and_padded_epochs_carry_the_same_real_tokens(make):
    totals = {}
    for packing in ("buffer", "microbatch", False):
        batches = epoch(make(packing=packing))
        slots = sum(b["input_ids"].numel() for b in batches)
        totals[packing] = (
            sum(int(b["attention_mask"].sum()) for b in batches),
            sum(int(b["loss_mask"].sum()) for b in batches),
        )
        assert slots >= totals[packing][0]
    assert totals["buffer"] == totals["microbatch"] == totals[False]


def test_same_seed_same_batches_new_epoch_new_order(make):
    first, second = make(seed=7), make(seed=7)
    a, b = epoch(first), epoch(second)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b, strict=True))
    next_epoch = epoch(first)
    assert [documents_in_batch(x) for x in next_epoch] != [documents_in_batch(x) for x in a]
    assert Counter(d for x in next_epoch for d in documents_in_batch(x)) == all_documents(
        first.train_documents
    )
    assert first.state_dict()["epoch"] == 1


@pytest.mark.parametrize("packing", ["buffer", False])
def test_resume_mid_epoch_continues_exactly(make, packing):
    reference = make(packing=packing)
    epoch(reference)
    uninterrupted = epoch(reference)  # epoch 1
    interrupted = make(packing=packing)
    epoch(interrupted)
    loader = iter(interrupted.train_dataloader())
    head = [next(loader) for _ in range(3)]
    state = interrupted.state_dict()
    assert (state["epoch"], state["position"]) == (1, 3)

    resumed = make(packing=packing)
    resumed.load_state_dict(state)
    rest = epoch(resumed)
    assert len(head) + len(rest) == len(uninterrupted)
    for got, want in zip(head + rest, uninterrupted, strict=True):
        assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(
            got["seq_lens"], want["seq_lens"]
        )
    mismatched = make(packing=packing, batch_size=3)
    mismatched.load_state_dict(state)
    with pytest.raises(ValueError, match="cannot resume the train loader mid-epoch"):
        epoch(mismatched)


def resumed_segment(make, state: dict | None, world_size: int, batches: int | None) -> tuple[Counter, dict]:
    """Documents the ranks of one run segment use (resumed from ``state``, stopped after ``batches``
    micro-batches per rank, or at the epoch's end), and the state a checkpoint then records (rank 0's)."""
    seen, states = Counter(), []
    for rank in range(world_size):
        module = make(world_size=world_size, rank=rank)
        if state is not None:
            module.load_state_dict(state)
        loader = iter(module.train_dataloader())
        taken = list(loader) if batches is None else [next(loader) for _ in range(batches)]
        seen.update(d for batch in taken for d in documents_in_batch(batch))
        states.append(module.state_dict())
    assert all(s["consumed"] == states[0]["consumed"] for s in states), states
    return seen, states[0]


@pytest.mark.parametrize("world_sizes", [(1, 1, 1, 1), (2, 1, 2, 1)])
def test_a_second_and_a_third_mid_epoch_resume_still_use_every_document_once(make, world_sizes):
    # Interrupted three times mid-epoch (each resume continues from the previous resume's checkpoint), on
    # one rank throughout and on a world size changing at each resume. A single resume cannot show a
    # checkpoint of a resumed run recording its position relative to where it resumed.
    state, seen = None, Counter()
    for world_size, batches in zip(world_sizes, (3, 2, 2, None), strict=True):
        documents, state = resumed_segment(make, state, world_size, batches)
        seen += documents
        assert state["epoch"] == 0
    expected = all_documents(make().train_documents)
    assert seen == expected, f"missing {expected - seen}, repeated {seen - expected}"


def test_workers_yield_the_same_batches_in_order(make):
    single = epoch(make(seed=2))
    module = make(seed=2, num_workers=2)
    assert [b["input_ids"].tolist() for b in epoch(module)] == [b["input_ids"].tolist() for b in single]
    resumed = make(seed=2, num_workers=2)
    # A position alone (as older releases saved it) resumes at the world size it was saved on.
    state = {key: value for key, value in module.state_dict().items() if key != "consumed"}
    resumed.load_state_dict({**state, "epoch": 0, "position": 3})
    assert [b["input_ids"].tolist() for b in epoch(resumed)] == [b["input_ids"].tolist() for b in single[3:]]


def test_resume_through_lightning_checkpoint(make, tmp_path):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Recorder(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))
            self.seen: list[int] = []

        def training_step(self, batch, batch_idx):
            self.seen.append(hash(batch["input_ids"].numpy().tobytes()))
            return self.weight.sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(ckpt_path=None, callbacks=()):
        model = Recorder()
        trainer = pl.Trainer(
            max_epochs=2,
            logger=False,
            callbacks=list(callbacks),
            enable_checkpointing=bool(callbacks),
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, datamodule=make(max_documents=30), ckpt_path=ckpt_path)
        return model.seen

    full = fit(callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1)])
    checkpoint = sorted(tmp_path.glob("*step=5.ckpt"))[0]
    assert torch.load(checkpoint, weights_only=False)["PackedChatDataModule"]["position"] == 5
    assert full[:5] + fit(ckpt_path=str(checkpoint)) == full

    # A checkpoint written at the end of epoch 0 resumes into all of epoch 1 (not into the finished epoch 0,
    # which would leave epoch 1 with no batch at all).
    epoch_end = ModelCheckpoint(
        dirpath=tmp_path / "epoch-end", save_on_train_epoch_end=True, filename="{epoch}", save_top_k=-1
    )
    assert fit(callbacks=[epoch_end]) == full
    saved = torch.load(tmp_path / "epoch-end" / "epoch=0.ckpt", weights_only=False)["PackedChatDataModule"]
    resumed = fit(ckpt_path=str(tmp_path / "epoch-end" / "epoch=0.ckpt"))
    assert saved["epoch"] == 0 and full[: saved["position"]] + resumed == full


def test_a_third_resume_through_lightning_checkpoints_still_uses_every_document_once(make, tmp_path):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    class DocumentRecorder(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))
            self.seen: Counter = Counter()

        def training_step(self, batch, batch_idx):
            self.seen.update(documents_in_batch(batch))
            return self.weight.sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    # Each segment resumes from the checkpoint the previous one wrote at its last step (the Trainer's own
    # count of batches is the saved position here), and the last one runs to the epoch's end.
    seen, checkpoint = Counter(), None
    for segment, stop in enumerate((4, 7, 9, -1)):
        model = DocumentRecorder()
        saved = tmp_path / str(segment)
        trainer = pl.Trainer(
            max_epochs=1,
            max_steps=stop,
            logger=False,
            callbacks=[ModelCheckpoint(dirpath=saved, every_n_train_steps=1, save_top_k=-1)],
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, datamodule=make(), ckpt_path=checkpoint)
        seen += model.seen
        if stop > 0:
            (checkpoint,) = [str(p) for p in saved.glob(f"*step={stop}.ckpt")]
    expected = all_documents(make().train_documents)
    assert seen == expected, f"missing {expected - seen}, repeated {seen - expected}"


@pytest.mark.parametrize("packing", ["buffer", "microbatch", False])
def test_ranks_are_disjoint_and_cover_every_document(make, packing):
    ranks = [make(packing=packing, world_size=2, rank=rank) for rank in (0, 1)]
    batches = [epoch(module) for module in ranks]
    assert len(batches[0]) == len(batches[1])
    seen = [Counter(d for b in rank_batches for d in documents_in_batch(b)) for rank_batches in batches]
    assert not set(seen[0]) & set(seen[1])
    assert seen[0] + seen[1] == all_documents(ranks[0].train_documents)


def test_long_document_options_are_counted(make):
    whole = make(max_tokens=100_000).train_documents
    too_long = int((whole.lengths > 256).sum())
    assert too_long > 0
    truncated = make(long_documents="truncate")
    dropped = make(long_documents="drop")
    assert (truncated.stats["train"]["truncated"], truncated.stats["train"]["dropped"]) == (too_long, 0)
    assert (dropped.stats["train"]["truncated"], dropped.stats["train"]["dropped"]) == (0, too_long)
    assert (
        len(truncated.train_documents) == len(whole) and len(dropped.train_documents) == len(whole) - too_long
    )
    kept = Counter(d for b in epoch(truncated) for d in documents_in_batch(b))
    prefixes = Counter(
        doc_key(ids[:256], mask[:256]) for ids, mask in (whole.tokens(i) for i in range(len(whole)))
    )
    assert kept == prefixes
    assert max(len(ids) for ids, _ in (d for b in epoch(dropped) for d in documents_in_batch(b))) <= 256


def test_buffer_packing_efficiency_on_the_embedded_corpus():
    # The shipped tiny Llama's tokenizer and the default cache: the shipped-target and quickstart tests
    # tokenise the same corpus with it there (the cache key is source, tokenizer and template; the row
    # width is applied after), so the suite tokenises it once. Any tokenizer gives real document lengths.
    module = PackedChatDataModule(tokenizer="shipped:tiny-llama", max_tokens=2048, batch_size=8)
    module.setup()
    documents = module.train_documents
    assert len(documents) > 4_000
    plan = plan_epoch(documents.lengths, mode="buffer", max_tokens=2048, batch_size=8, seed=0, epoch=0)
    rows = len(plan.row_bounds) - 1
    assert documents.num_tokens / (rows * 2048) >= 0.99


def test_reserved_id_problem_names_special_tokens_and_counts_occurrences():
    data = PackedChatDataModule(
        tokenizer="shipped:tiny-qwen3", max_tokens=128, max_documents=50, val_fraction=0.1
    )
    data.setup("fit")
    assert data.reserved_id_problem(2) == "the tokenizer's eos token '<|im_end|>'"
    assert data.reserved_id_problem(0) == "the tokenizer's pad token '<|endoftext|>'"
    assert data.reserved_id_problem(3) is None  # <|mask|>: text never produces it
    start = data.tokenizer.convert_tokens_to_ids("<|im_start|>")
    expected = sum(
        int((data_split.tokens(i)[0] == start).sum())
        for data_split in (data.train_documents, data.val_documents)
        for i in range(len(data_split))
    )
    # Spans are truncated views of the token array, which still holds every token.
    problem = data.reserved_id_problem(start)
    counted = re.fullmatch(r"token '<\|im_start\|>', which occurs ([\d,]+) times in the data", problem)
    assert counted and int(counted.group(1).replace(",", "")) >= expected > 0
