"""``PackedChatDataModule``: chat rows to packed, contract-valid micro-batches for draft training."""

from __future__ import annotations

import hashlib
import logging
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from datasets.fingerprint import Hasher
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from lightning_drafts.datamodules.chat_format import Conversation, MalformedRow, read_conversation
from lightning_drafts.datamodules.content_split import split_by_content
from lightning_drafts.datamodules.data_files import load_data_files
from lightning_drafts.datamodules.documents import LONG_DOCUMENT_POLICIES, Documents
from lightning_drafts.datamodules.embedded import (
    embedded_corpus_dataset,
    embedded_corpus_fingerprint,
    load_embedded_tokenizer,
)
from lightning_drafts.datamodules.feature_store import FeatureStore, SourceFeatures, union_by_start
from lightning_drafts.datamodules.loader import LoaderState, PackedEpochDataset, PlanOrder, ResumableLoader
from lightning_drafts.datamodules.packing import resolve_packing
from lightning_drafts.datamodules.reserved_ids import reserved_id_problem
from lightning_drafts.datamodules.row_locations import RowLocations
from lightning_drafts.datamodules.setup_summary import log_setup_summary
from lightning_drafts.datamodules.templates import resolve_chat_template
from lightning_drafts.datamodules.tokenize import (
    SHAPE_COUNTS,
    ChatOptions,
    TokenizedCorpus,
    default_cache_dir,
    tokenize_rows,
    tokenizer_fingerprint,
)
from lightning_drafts.datamodules.tokenizer_files import load_tokenizer
from lightning_drafts.gguf import is_gguf, load_gguf_tokenizer

logger = logging.getLogger("lightning_drafts.datamodules")


class PackedChatDataModule(LightningDataModule):
    """Tokenised, assistant-masked chat data packed into rows of ``max_tokens``.

    The packing modes: docs/concepts/packing.md#the-data-module-packedchatdatamodule.

    Args:
        data_files: JSON / JSONL / Parquet file(s) or glob(s) of OpenAI ``messages`` or ShareGPT
            ``conversations`` rows, a ``datasets`` hub id (online only), or None for the embedded
            chitchat corpus.
        tokenizer: a path, a hub id, ``shipped:<name>`` (the tokenizer of a shipped tiny target, e.g.
            ``shipped:tiny-llama``), a tokenizer object, or None for the embedded Mistral v1 tokenizer.
        chat_template: None for the tokenizer's own template, a built-in name (``"mistral"``,
            ``"chatml"``) or a Jinja template string.
        chat_template_kwargs: the template's switches, as a serving request passes them (e.g.
            ``{"enable_thinking": False}`` for Qwen3); they reach every rendering.
        supervise_reasoning: supervise the reasoning the target writes (``reasoning_content`` or a
            ``<think>`` block, tags included); False trains on the answers and tool calls alone.
        drop_media: drop the image / audio parts of a message's content, counted in the summary, instead
            of refusing their rows (a text draft cannot learn from them).
        max_tokens: row width of packed rows, and the length limit of a document.
        batch_size: rows per micro-batch (documents per micro-batch for ``"microbatch"`` and padded).
        packing: ``"buffer"`` (or True), ``"microbatch"``, or False for one padded document per row.
        seed: seeds the per-epoch shuffle and the validation split's hash.
        shuffle_buffer: documents per best-fit-decreasing window (``"buffer"`` packing).
        num_workers: DataLoader workers (collation is cheap; 0 is usually enough).
        val_fraction: share of the documents held out for validation (ignored when ``val_data_files``),
            chosen by a hash of each document's content and ``seed`` (``datamodules/content_split.py``):
            copies of one document always land on the same side, so validation never scores a
            document the draft trained on, and the split is the same on every run.
        val_data_files: a separate validation source, in the same forms as ``data_files``.
        long_documents: ``"truncate"`` (keep the first ``max_tokens`` tokens) or ``"drop"``.
        num_proc: processes for the one-time tokenisation.
        cache_dir: where tokenised data is cached (default: the ``datasets`` cache).
        max_documents: use only the first N rows of each source (quick runs and tests).
        world_size, rank: override the Trainer's data-parallel size and rank (tests, custom launchers).
        strict: refuse the data at its first malformed row (named by file and line) instead of counting
            and skipping malformed rows.
        setup_summary: print the setup summary (counts per split, one sample with its supervised tokens
            marked) once, on rank 0; warnings about the data print either way.
        features_dir: a directory written by ``lightning-drafts capture`` for these documents: every
            micro-batch then also carries its documents' captured target features (packed exactly as the
            tokens, in any packing mode), and the draft trains without running the target's decoder. The
            directory must have been captured with this tokenizer, chat template and documents (checked at
            setup, naming what differs); the draft checks the target and layers at fit start.

    After construction, ``vocab_size`` (``len(tokenizer)``) and ``pad_token_id`` are set, so
    ``LightningCLI.link_arguments`` can pass them to a model. After ``setup``, ``stats`` holds the counts
    of each split and ``train_documents`` / ``val_documents`` the documents themselves.
    """

    def __init__(
        self,
        data_files: str | list[str] | None = None,
        tokenizer: str | PreTrainedTokenizerBase | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        supervise_reasoning: bool = True,
        drop_media: bool = False,
        max_tokens: int = 2048,
        batch_size: int = 1,
        packing: bool | str = "buffer",
        seed: int = 0,
        shuffle_buffer: int = 10_000,
        num_workers: int = 0,
        val_fraction: float = 0.0,
        val_data_files: str | list[str] | None = None,
        long_documents: str = "truncate",
        num_proc: int | None = None,
        cache_dir: str | None = None,
        max_documents: int | None = None,
        world_size: int | None = None,
        rank: int | None = None,
        strict: bool = False,
        setup_summary: bool = True,
        features_dir: str | None = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("max_tokens", max_tokens),
            ("batch_size", batch_size),
            ("shuffle_buffer", shuffle_buffer),
        ):
            if int(value) < 1:
                raise ValueError(f"{name}={value} must be a positive integer")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must be in [0, 1)")
        if val_fraction > 0 and val_data_files is not None:
            raise ValueError(
                f"both val_fraction={val_fraction} and val_data_files={val_data_files!r} were given; use one"
            )
        if long_documents not in LONG_DOCUMENT_POLICIES:
            raise ValueError(f"long_documents={long_documents!r} must be one of {LONG_DOCUMENT_POLICIES}")
        if max_documents is not None and max_documents < 1:
            raise ValueError(f"max_documents={max_documents} must be a positive integer or None")
        if (world_size is None) != (rank is None):
            raise ValueError(f"pass world_size and rank together (got world_size={world_size}, rank={rank})")
        if world_size is not None and not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")

        self.data_files = data_files
        self.val_data_files = val_data_files
        self.max_tokens = int(max_tokens)
        self.batch_size = int(batch_size)
        self.packing = resolve_packing(packing)
        self.seed = int(seed)
        self.shuffle_buffer = int(shuffle_buffer)
        self.num_workers = int(num_workers)
        self.val_fraction = float(val_fraction)
        self.long_documents = long_documents
        self.num_proc = num_proc
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.max_documents = max_documents
        self.world_size = world_size
        self.rank = rank
        self.strict = bool(strict)
        self.setup_summary = bool(setup_summary)
        self.features_dir = features_dir
        self.chat_options = ChatOptions(
            template_kwargs=dict(chat_template_kwargs or {}),
            supervise_reasoning=bool(supervise_reasoning),
            drop_media=bool(drop_media),
        )
        # The manifest of features_dir once set up (the draft checks it against itself at fit start).
        self.features_manifest: dict[str, Any] | None = None
        self._features: FeatureStore | None = None
        # The latest train and validation datasets made (use_features gives them the features too).
        self._made: dict[str, PackedEpochDataset] = {}
        # Where the first malformed rows of each reason were found, named ("file:line: problem"), for
        # the setup summary.
        self.first_malformed: dict[str, list[str]] = {}

        self.tokenizer = _load_tokenizer(tokenizer)
        self.chat_template = resolve_chat_template(chat_template, self.tokenizer)
        self.vocab_size = len(self.tokenizer)
        self.pad_token_id = _pad_token_id(self.tokenizer)

        self.stats: dict[str, dict[str, Any]] = {}
        self.train_documents: Documents | None = None
        self.val_documents: Documents | None = None
        self._loader_state = LoaderState(self._attached_trainer)

    # ------------------------------------------------------------------ data preparation

    def prepare_data(self) -> None:
        # Runs once per node before setup on every rank, so the ranks load the tokenised cache instead of
        # all tokenising at once.
        self._tokenized(self.data_files)
        if self.val_data_files is not None:
            self._tokenized(self.val_data_files)

    def setup(self, stage: str | None = None) -> None:
        if self.train_documents is not None:
            return
        corpus = self._tokenized(self.data_files)
        documents, malformed, shapes = corpus.documents, corpus.malformed, corpus.shapes
        val_documents, val_malformed, val_shapes = None, Counter(), {}
        if self.val_data_files is not None:
            val_corpus = self._tokenized(self.val_data_files)
            val_documents, val_malformed, val_shapes = (
                val_corpus.documents,
                val_corpus.malformed,
                val_corpus.shapes,
            )
        elif self.val_fraction > 0:
            train_index, val_index = split_by_content(documents, self.val_fraction, self.seed)
            if len(val_index) == 0:
                logger.warning(
                    "val_fraction=%s held out no document: all %d documents have one content (copies of one "
                    "another), and copies stay on one side of the split, so holding them out would leave none to "
                    "train on; add other documents, or give val_data_files",
                    self.val_fraction,
                    len(documents),
                )
            val_documents = documents.select(val_index)
            documents = documents.select(train_index)
            val_shapes = {name: counts[val_index] for name, counts in shapes.items()}
            shapes = {name: counts[train_index] for name, counts in shapes.items()}

        self.train_documents, self.stats["train"] = self._fit(documents, malformed, shapes)
        if val_documents is not None:
            self.val_documents, self.stats["val"] = self._fit(val_documents, val_malformed, val_shapes)
        counts = self.stats["train"]
        if counts["supervised_tokens"] == 0 and counts["answers_truncated_away"] == counts["documents"] > 0:
            raise ValueError(
                f"no training document keeps a supervised token: every prompt fills max_tokens={self.max_tokens} "
                "(the chat template's prefix and the user turns come first), so truncation cut every answer; "
                "raise max_tokens"
            )
        if len(self.train_documents) == 0:
            raise ValueError(
                f"no trainable document in {self.data_files or 'the embedded corpus'} (counts: {self.stats['train']}); "
                "check the data format, the chat template and long_documents"
            )
        if self.features_dir is not None:
            store = FeatureStore(self.features_dir)
            store.check_data(self.features_identity(), self.feature_sources())
            self._features, self.features_manifest = store, store.manifest
        if self._is_global_zero():
            self._log_summary()

    def features_identity(self) -> dict[str, str]:
        """What a features directory must have been captured with, besides the documents themselves."""
        return {
            "tokenizer": tokenizer_fingerprint(self.tokenizer),
            "chat_template": hashlib.sha256(self.chat_template.encode()).hexdigest()[:32],
        }

    def feature_sources(self) -> dict[str, Documents | None]:
        """The documents of each data source, as a capture stores them: one tokenised corpus each, its
        splits merged back (so the validation split's seed and fraction never invalidate a capture)."""
        self.setup("fit")
        separate_val = self.val_data_files is not None
        return {
            "data_files": union_by_start(
                [self.train_documents, None if separate_val else self.val_documents]
            ),
            "val_data_files": self.val_documents if separate_val else None,
        }

    def captured_sources(self) -> dict[str, Documents]:
        """The sources a features directory of this data holds (those with documents)."""
        return {name: docs for name, docs in self.feature_sources().items() if docs is not None}

    def capture_record(self) -> dict[str, Any]:
        """What a features directory records of the data its documents were made with."""
        return {
            **self.features_identity(),
            "data": {
                "data_files": self.data_files,
                "val_data_files": self.val_data_files,
                "max_tokens": self.max_tokens,
                "long_documents": self.long_documents,
                "max_documents": self.max_documents,
            },
        }

    def source_of(self, split: str) -> str:
        """The source (``data_files`` / ``val_data_files``) whose documents the ``split`` loader yields."""
        return "val_data_files" if split == "val" and self.val_data_files is not None else "data_files"

    def use_features(self, features_dir: str) -> dict[str, Any]:
        """From now on, every micro-batch carries its documents' features from ``features_dir`` (the loaders
        made already included); checked as ``features_dir`` is at setup. Returns its manifest."""
        self.setup("fit")
        store = FeatureStore(features_dir)
        store.check_data(self.features_identity(), self.feature_sources())
        self.features_dir, self._features, self.features_manifest = features_dir, store, store.manifest
        for split, dataset in self._made.items():
            dataset.features = self._split_features(split)
        return store.manifest

    def _split_features(self, split: str) -> SourceFeatures | None:
        if self._features is None:
            return None
        return self._features.source(self.source_of(split))

    def reserved_id_problem(self, token_id: int) -> str | None:
        """Why ``token_id`` cannot be a reserved id (a block draft's mask token), or ``None``
        (:func:`~lightning_drafts.datamodules.reserved_ids.reserved_id_problem` over this tokenizer and, after
        :meth:`setup`, these documents)."""
        return reserved_id_problem(self.tokenizer, token_id, self._occurrences)

    def _occurrences(self, token_id: int) -> int:
        # Train and validation documents may be views of one token array: count each array once.
        arrays = {id(d.input_ids): d.input_ids for d in (self.train_documents, self.val_documents) if d}
        return sum(int(np.count_nonzero(ids == token_id)) for ids in arrays.values())

    def conversations(self) -> Iterator[tuple[int, list[dict[str, Any]] | MalformedRow]]:
        """Every row of ``data_files`` (the first ``max_documents``), in file order, as ``(row index,
        normalised messages)``, or ``(row index, MalformedRow)`` for a row that is not a conversation
        (:meth:`conversation_rows` with the row's tool definitions)."""
        for index, row in self.conversation_rows():
            yield index, row if isinstance(row, MalformedRow) else row.messages

    def conversation_rows(self) -> Iterator[tuple[int, Conversation | MalformedRow]]:
        """Every row of ``data_files`` (the first ``max_documents``), in file order, as ``(row index,
        Conversation)`` (its messages and tool definitions), or ``(row index, MalformedRow)`` for a row
        that is not a conversation.

        What ``lightning-drafts regenerate`` rewrites: all rows, before the validation split (a row
        unreadable as JSON is named in the setup summary's reader counts, as for ``fit``, and not
        yielded)."""
        if self.data_files is None:
            rows = embedded_corpus_dataset()
        else:
            rows, _, read, _ = load_data_files(
                self.data_files, self.cache_dir, self.strict, self.chat_options.drop_media
            )
            if read is not None:
                for reason, where in read.first_seen.items():
                    self._name_malformed(reason, where)
        count = len(rows) if self.max_documents is None else min(self.max_documents, len(rows))
        for index in range(count):
            try:
                yield (
                    index,
                    read_conversation(
                        rows[index], require_answers=False, drop_media=self.chat_options.drop_media
                    ),
                )
            except MalformedRow as malformed:
                yield index, malformed

    def _tokenized(self, files: str | list[str] | None) -> TokenizedCorpus:
        rejected = Counter()
        if files is None:
            rows, fingerprint = embedded_corpus_dataset(), embedded_corpus_fingerprint()
            locations = RowLocations(name="the embedded corpus")
        else:
            rows, fingerprint, read, locations = load_data_files(
                files, self.cache_dir, self.strict, self.chat_options.drop_media
            )
            if read is not None:
                rejected = read.malformed
                for reason, where in read.first_seen.items():
                    self._name_malformed(reason, where)
        if self.max_documents is not None and self.max_documents < len(rows):
            rows = rows.select(range(self.max_documents))
            fingerprint = Hasher.hash([fingerprint, "first", self.max_documents])
        tokenized = tokenize_rows(
            rows,
            self.tokenizer,
            self.chat_template,
            source_fingerprint=fingerprint,
            options=self.chat_options,
            num_proc=self.num_proc,
            cache_dir=self.cache_dir,
        )
        corpus = TokenizedCorpus.from_dataset(tokenized)
        named = locations.describe(example.index for example in corpus.examples)
        described = [
            (example.reason, f"{named[example.index]}: {example.reason}" + _field_note(example.field))
            for example in corpus.examples
        ]
        if self.strict and described:
            raise ValueError(
                f"{described[0][1]} (strict mode stops at the first malformed row; malformed rows in all: "
                f"{dict(corpus.malformed)}; drop strict to skip them)"
            )
        for reason, text in described:
            self._name_malformed(reason, text)
        return TokenizedCorpus(corpus.documents, corpus.malformed + rejected, shapes=corpus.shapes)

    def _name_malformed(self, reason: str, where: str) -> None:
        # A source is read by prepare_data and again by setup: each row is named once.
        named = self.first_malformed.setdefault(reason, [])
        if where not in named:
            named.append(where)

    def _fit(
        self, documents: Documents, malformed: Counter, shapes: dict[str, np.ndarray]
    ) -> tuple[Documents, dict[str, Any]]:
        fitted, truncated, dropped = documents.fit_to_width(self.max_tokens, self.long_documents)
        supervised = fitted.supervised_per_document()
        return fitted, {
            "documents": len(fitted),
            "tokens": fitted.num_tokens,
            "supervised_tokens": int(supervised.sum()),
            # Answers that truncation at max_tokens cut off whole (their prompt alone fills the width).
            "answers_truncated_away": int(((supervised == 0) & (fitted.lengths == self.max_tokens)).sum()),
            "truncated": truncated,
            "dropped": dropped,
            "malformed": int(sum(malformed.values())),
            "malformed_reasons": dict(malformed),
            # Counted on the documents before truncation.
            **{name: int(shapes[name].sum()) if name in shapes else 0 for name in SHAPE_COUNTS},
        }

    def _log_summary(self) -> None:
        log_setup_summary(
            logger,
            self.stats,
            self.first_malformed,
            self.tokenizer,
            self.train_documents,
            settings={
                "max_tokens": self.max_tokens,
                "long_documents": self.long_documents,
                "packing": self.packing,
            },
            verbose=self.setup_summary,
        )

    # ------------------------------------------------------------------ loaders

    def train_dataloader(self) -> ResumableLoader:
        return self._train_loader(features=True)

    def token_dataloader(self) -> ResumableLoader:
        """The train loader without target features: what a pass over the tokens alone reads (counting
        the supervised tokens of a draft vocabulary), which then costs no feature read."""
        return self._train_loader(features=False)

    def _train_loader(self, features: bool) -> ResumableLoader:
        self.setup("fit")
        world_size, rank = self._world()
        dataset = self._dataset(
            self.train_documents, shuffle=True, world_size=world_size, rank=rank, split="train"
        )
        if not features:
            dataset.features = None
        else:
            self._made["train"] = dataset
        return ResumableLoader(dataset, self._loader_state, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader | list:
        self.setup("fit")
        if self.val_documents is None or len(self.val_documents) == 0:
            return []
        world_size, rank = self._world()
        dataset = self._made["val"] = self._dataset(
            self.val_documents, shuffle=False, world_size=world_size, rank=rank, split="val"
        )
        return DataLoader(dataset, batch_size=None, sampler=PlanOrder(dataset), num_workers=self.num_workers)

    def _dataset(
        self, documents: Documents, *, shuffle: bool, world_size: int, rank: int, split: str
    ) -> PackedEpochDataset:
        return PackedEpochDataset(
            documents,
            mode=self.packing,
            max_tokens=self.max_tokens,
            batch_size=self.batch_size,
            pad_token_id=self.pad_token_id,
            seed=self.seed,
            shuffle=shuffle,
            shuffle_buffer=self.shuffle_buffer,
            world_size=world_size,
            rank=rank,
            features=self._split_features(split),
        )

    def _world(self) -> tuple[int, int]:
        if self.world_size is not None:
            return self.world_size, self.rank
        if self.trainer is not None:
            return int(self.trainer.world_size), int(self.trainer.global_rank)
        return 1, 0

    def _attached_trainer(self) -> Any:
        # A bound method rather than a lambda, so the DataModule stays picklable (ddp_spawn).
        return self.trainer

    def _is_global_zero(self) -> bool:
        return self._world()[1] == 0

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """The train loader's epoch and position; Lightning stores it in every checkpoint."""
        return self._loader_state.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the train loader at a saved position: the next pass continues that epoch."""
        self._loader_state.load_state_dict(state_dict)


def _load_tokenizer(tokenizer: str | os.PathLike | PreTrainedTokenizerBase | None) -> PreTrainedTokenizerBase:
    if tokenizer is None:
        return load_embedded_tokenizer()
    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return tokenizer
    if is_gguf(tokenizer):
        return load_gguf_tokenizer(tokenizer)
    if isinstance(tokenizer, (str, os.PathLike)):
        return load_tokenizer(str(tokenizer))
    raise ValueError(
        f"tokenizer={tokenizer!r} must be a path, a hub id, a transformers tokenizer, or None for the embedded one"
    )


def _pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    # A missing pad token falls back to EOS rather than adding a token: a new id would not exist in the
    # target's embedding table. Pad slots are masked everywhere, so their id never matters.
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    raise ValueError(
        f"tokenizer {tokenizer.name_or_path!r} has neither a pad nor an EOS token; set tokenizer.pad_token first"
    )


def _field_note(field: str) -> str:
    return f" (field {field})" if field else ""
