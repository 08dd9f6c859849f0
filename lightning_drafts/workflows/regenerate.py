"""Train on the target's own answers: rewrite every assistant turn of a data module's conversations with
the frozen target's generation, turn by turn.

A draft trained on dataset answers learns tokens its target would not have written, and accepts fewer
when served; regenerating the answers with the target (as SpecForge, NeMo and the EAGLE authors advise)
removes that gap. The output is OpenAI ``messages`` JSON Lines that
:class:`~lightning_drafts.datamodules.PackedChatDataModule` reads, plus ``<output>.meta.json``.

Work is cut into **batches of consecutive source rows** (``batch_size`` rows each, fixed by row index),
so what a batch generates never depends on where a run started, which worker ran it or what ran before:

* a killed run resumes at the first batch it had not written (``resume=True``), and the file equals an
  uninterrupted run's;
* worker ``i`` of ``n`` takes batches ``i, i + n, ...`` into its own shard file, and
  :func:`merge_shards` orders the rows by source row: the same file as one worker.

AnswerSampling (``temperature > 0``) is seeded per conversation turn (``seed``, row, turn), for the same reason.
A row that cannot be answered (not a conversation, an empty user turn, a first prompt longer than
``max_prompt_tokens``, too long to leave ``max_new_tokens`` in the target's context, or already at
``max_conversation_tokens``) is not written; it is counted by reason and named in the metadata, never
dropped silently. A conversation that meets one of the last three at a later turn is written up to its
last generated turn and counted (``ended_early``) by reason.

**Agents.** Regenerate runs no tools, and a recorded tool result answers the recorded call, not the one the
target might make. So an assistant turn that calls tools is kept as recorded, with the tool results after
it, and the assistant turns that answer in text are regenerated from the conversation so far, rendered with
the row's tool definitions (``tools``) as serving renders them; the row is written with its ``tools``.
Kept call turns are counted (``tool_call_turns_kept``: their tokens are the data's, not the target's).
``tool_calls="skip"`` leaves such conversations out instead, counted.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from lightning_drafts.core.output_lock import exclusive_output
from lightning_drafts.datamodules.chat_format import Conversation, MalformedRow, conversation_row
from lightning_drafts.datamodules.tokenize import render_prompt
from lightning_drafts.serving.generate import AnswerSampling, Engine, Request
from lightning_drafts.serving.progress import Progress, announce

THINKING_MODES = (None, "on", "off", "both")
TOOL_CALL_POLICIES = ("keep", "skip")


@dataclass
class Counts:
    conversations: int = 0
    rows_written: int = 0
    assistant_turns: int = 0
    generated_tokens: int = 0
    # Turns that reached max_new_tokens before the target ended them: the template closes them with an
    # end-of-turn token the target did not choose there (the data match then counts it as a miss).
    turns_cut_at_max_new_tokens: int = 0
    skipped: Counter = field(default_factory=Counter)
    skipped_rows: list[dict[str, Any]] = field(default_factory=list)
    # Conversations written with their turns up to the one that could not be generated, by reason.
    ended_early: Counter = field(default_factory=Counter)
    # Assistant turns calling tools, and tool results, written as recorded (tool_calls="keep").
    tool_call_turns_kept: int = 0
    tool_results_kept: int = 0

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Counts:
        """The counts a metadata file recorded."""
        return cls(
            **{
                **data,
                "skipped": Counter(data["skipped"]),
                "skipped_rows": list(data["skipped_rows"]),
                "ended_early": Counter(data.get("ended_early", {})),  # absent before it was counted
            }
        )

    def add(self, other: Counts) -> None:
        """Add ``other``'s counts (another worker's) to these, every field."""
        for name in (f.name for f in fields(self)):
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass(frozen=True)
class RegenerateOptions:
    """Everything that decides the output file (recorded in the metadata; a resume must match it)."""

    sampling: AnswerSampling = AnswerSampling()
    thinking: str | None = None
    batch_size: int = 8
    max_prompt_tokens: int = 4096
    # The target's context (its max_position_embeddings): a turn must fit its prompt and max_new_tokens in
    # it, as a serving engine refuses a prompt that does not (None: no bound).
    context_tokens: int | None = None
    # Training truncates each document at the data module's max_tokens: a turn whose prompt already holds
    # that many tokens would never be trained on, so the conversation ends before it (None: no bound).
    max_conversation_tokens: int | None = None
    # Conversations with tool calls: "keep" their calls and results as recorded and regenerate the text
    # answers, or "skip" them (counted).
    tool_calls: str = "keep"

    def __post_init__(self) -> None:
        if self.thinking not in THINKING_MODES:
            raise ValueError(f"thinking = {self.thinking!r}; choose one of {THINKING_MODES}")
        if self.tool_calls not in TOOL_CALL_POLICIES:
            raise ValueError(f"tool_calls = {self.tool_calls!r}; choose one of {TOOL_CALL_POLICIES}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size = {self.batch_size}; it must be >= 1")
        if self.max_conversation_tokens is not None and self.max_conversation_tokens < 1:
            raise ValueError(
                f"max_conversation_tokens = {self.max_conversation_tokens}; it must be >= 1 (None: no bound)"
            )
        if self.context_tokens is not None and self.context_tokens <= self.sampling.max_new_tokens:
            raise ValueError(
                f"context_tokens = {self.context_tokens} leaves no room for a prompt with max_new_tokens = "
                f"{self.sampling.max_new_tokens}; lower max_new_tokens"
            )

    def stop_reason(self, prompt_tokens: int) -> str | None:
        """Why a turn whose prompt has ``prompt_tokens`` tokens is not generated, or None: the prompt is
        longer than ``max_prompt_tokens`` or than what leaves ``max_new_tokens`` in the target's context
        (the tighter bound named), or it already holds ``max_conversation_tokens`` (named first)."""
        if self.max_conversation_tokens is not None and prompt_tokens >= self.max_conversation_tokens:
            return f"prompt reached max_conversation_tokens={self.max_conversation_tokens}"
        limit = self.max_prompt_tokens
        reason = f"prompt longer than max_prompt_tokens={self.max_prompt_tokens}"
        if self.context_tokens is not None and self.context_tokens - self.sampling.max_new_tokens < limit:
            limit = self.context_tokens - self.sampling.max_new_tokens
            reason = (
                f"prompt + max_new_tokens={self.sampling.max_new_tokens} longer than the target's context "
                f"({self.context_tokens} tokens)"
            )
        return reason if prompt_tokens > limit else None


def regenerate(
    datamodule: Any,
    engine: Engine,
    output: str | Path,
    options: RegenerateOptions = RegenerateOptions(),
    provenance: dict[str, Any] | None = None,
    resume: bool = False,
    overwrite: bool = False,
    worker: tuple[int, int] = (0, 1),
    progress: bool = True,
) -> dict[str, Any]:
    """Rewrite the assistant turns of ``datamodule.conversation_rows()`` with ``engine`` into ``output``.

    ``worker = (i, n)``: this worker's share (batches ``i, i + n, ...``), written to ``output`` itself;
    give each worker its own ``output`` (:func:`shard_path`) and :func:`merge_shards` them. Returns the
    metadata written beside the output (``<output>.meta.json``)."""
    index, workers = worker
    if not 0 <= index < workers:
        raise ValueError(f"worker = {worker}; it must be (i, n) with 0 <= i < n")
    output = Path(output)
    with exclusive_output(output):
        meta_path = metadata_path(output)
        rows = list(datamodule.conversation_rows())
        settings = {
            **asdict(options),
            "worker": [index, workers],
            "data": _data_fingerprint(datamodule, rows),
            **(provenance or {}),
        }
        done, counts = _start(output, meta_path, settings, resume, overwrite)
        if not done:
            # The metadata comes before the output's first row: a run killed while its first batch
            # decodes leaves an empty output that a resume can vouch for.
            _write_metadata(meta_path, settings, counts, next_batch=0, finished=False)
        tokenizer, template = datamodule.tokenizer, datamodule.chat_template
        if options.thinking in ("on", "both") and "enable_thinking" not in template:
            raise ValueError(
                f"thinking = {options.thinking!r}, but the chat template has no enable_thinking switch; "
                "leave thinking unset for this tokenizer"
            )
        batches = [
            rows[start : start + options.batch_size] for start in range(0, len(rows), options.batch_size)
        ]
        mine = [(n, b) for n, b in enumerate(batches) if n % workers == index and n >= done]
        if done:
            announce(
                f"resuming {output} at batch {done} of {len(batches)}: {counts.rows_written} rows were written "
                f"by the run that stopped, {sum(len(b) for _, b in mine)} conversations to go"
            )
        with (
            Progress(sum(len(b) for _, b in mine), "regenerate", "conversation", progress) as shown,
            output.open("a", encoding="utf-8") as out,
        ):
            for number, batch in mine:
                before = counts.generated_tokens
                written = _regenerate_batch(
                    batch,
                    engine,
                    options,
                    tokenizer,
                    template,
                    datamodule.chat_options.template_kwargs,
                    counts,
                )
                for row in written:
                    out.write(json.dumps(row, ensure_ascii=False) + "\n")
                out.flush()
                os.fsync(out.fileno())
                _write_metadata(meta_path, settings, counts, next_batch=number + 1, finished=False)
                shown.update(len(batch), counts.generated_tokens - before)
        if counts.skipped:
            warnings.warn(
                f"{sum(counts.skipped.values())} conversation(s) were not regenerated ({dict(counts.skipped)}); "
                f"{meta_path} names them",
                stacklevel=2,
            )
        return _write_metadata(meta_path, settings, counts, next_batch=len(batches), finished=True)


def _regenerate_batch(
    batch: list[tuple[int, Any]],
    engine: Engine,
    options: RegenerateOptions,
    tokenizer: Any,
    template: str,
    template_kwargs: dict[str, Any],
    counts: Counts,
) -> list[dict[str, Any]]:
    """The regenerated rows of one batch, in source-row order (turn ``k`` of every conversation is
    generated together: multi-turn conversations continue from their own regenerated turns)."""
    modes = {"both": [True, False], "on": [True], "off": [False], None: [None]}[options.thinking]
    jobs = []  # (source row, thinking, remaining messages, regenerated so far, source conversation)
    for row, conversation in batch:
        counts.conversations += 1
        if isinstance(conversation, MalformedRow):
            problem = conversation.reason
        else:
            problem = _unanswerable(conversation.messages, options.tool_calls)
        if problem is not None:
            counts.skipped[problem] += 1
            counts.skipped_rows.append({"row": row, "reason": problem})
            continue
        jobs += [(row, mode, list(conversation.messages), [], conversation) for mode in modes]
    finished, turn = [], 0
    encode = tokenizer.backend_tokenizer.encode
    while jobs:
        requests, waiting, still = [], [], []
        for job in jobs:
            row, mode, remaining, so_far, source = job
            while remaining and not _generated(remaining[0]):
                kept = remaining.pop(0)
                counts.tool_call_turns_kept += kept["role"] == "assistant"
                counts.tool_results_kept += kept["role"] == "tool"
                so_far.append(kept)
            if not remaining:
                finished.append(job)
                continue
            kwargs = template_kwargs if mode is None else {**template_kwargs, "enable_thinking": mode}
            prompt = encode(
                render_prompt(so_far, template, tokenizer, tools=source.tools, **kwargs),
                add_special_tokens=False,
            ).ids
            stop = options.stop_reason(len(prompt))
            if stop is not None:
                if any(m["role"] == "assistant" for m in so_far):
                    # What was generated (or kept) is kept: the conversation ends at its last assistant turn.
                    while so_far[-1]["role"] != "assistant":
                        so_far.pop()
                    counts.ended_early[stop] += 1
                    finished.append(job)
                else:
                    counts.skipped[stop] += 1
                    counts.skipped_rows.append({"row": row, "reason": stop, "turn": len(so_far)})
                continue
            requests.append(Request(prompt, _seed(options.sampling.seed, row, turn, mode)))
            waiting.append(job)
        if requests:
            for job, tokens in zip(waiting, engine(requests, options.sampling), strict=True):
                row, mode, remaining, so_far, _ = job
                remaining.pop(0)
                so_far.append({"role": "assistant", "content": tokenizer.decode(tokens)})
                counts.assistant_turns += 1
                counts.generated_tokens += len(tokens)
                counts.turns_cut_at_max_new_tokens += len(tokens) >= options.sampling.max_new_tokens
                still.append(job)
        jobs, turn = still, turn + 1
    rows = []
    for row, mode, _, messages, source in sorted(finished, key=lambda job: (job[0], job[1] is False)):
        record = conversation_row(Conversation(messages, source.tools, key=source.key))
        record["source_row"] = row
        if mode is not None:
            record["thinking"] = mode
        rows.append(record)
    counts.rows_written += len(rows)
    return rows


def _generated(message: dict[str, Any]) -> bool:
    """Whether ``message`` is a turn the target writes anew: an assistant turn that answers in text (a
    turn calling tools is kept, as the recorded results answer its calls)."""
    return message["role"] == "assistant" and not message.get("tool_calls")


# Why a conversation with tool calls or results is left out under tool_calls="skip".
TOOL_TURNS = "tool calls (tool_calls='skip')"


def _unanswerable(messages: list[dict[str, Any]], tool_calls: str) -> str | None:
    for message in messages:
        if message["role"] == "user" and not message["content"].strip():
            return "empty user turn"
        if tool_calls == "skip" and (message["role"] == "tool" or message.get("tool_calls")):
            return TOOL_TURNS
    return None


def _seed(seed: int, row: int, turn: int, mode: bool | None) -> int:
    digest = hashlib.sha256(f"{seed}/{row}/{turn}/{mode}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % (2**63)


def metadata_path(output: str | Path) -> Path:
    """Where the metadata of ``output`` lives (beside it, so the JSON Lines hold only conversations)."""
    return Path(f"{output}.meta.json")


def shard_path(output: str | Path, worker: int, workers: int) -> Path:
    """Worker ``worker`` of ``workers``'s file for ``output``."""
    output = Path(output)
    return output.with_name(f"{output.stem}.worker{worker}of{workers}{output.suffix}")


def merge_shards(output: str | Path, workers: int, overwrite: bool = False) -> dict[str, Any]:
    """One file from the ``workers`` shards of ``output`` (:func:`shard_path`), rows in source-row order:
    the file one worker would have written. Every shard must be finished."""
    output = Path(output)
    with exclusive_output(output):
        if output.exists() and not overwrite:
            raise FileExistsError(f"{output} exists; pass overwrite=True (--overwrite) to replace it")
        rows, counts, settings = [], Counts(), None
        for worker in range(workers):
            path = shard_path(output, worker, workers)
            meta = json.loads(metadata_path(path).read_text()) if metadata_path(path).exists() else None
            if meta is None or not meta["finished"]:
                raise ValueError(
                    f"worker {worker} of {workers} has not finished ({path}); run or resume it first"
                )
            rows += [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
            counts.add(Counts.from_json(meta["counts"]))
            settings = {**meta["settings"], "worker": [0, 1]}
        rows.sort(key=lambda row: (row["source_row"], row.get("thinking") is False))
        counts.skipped_rows.sort(key=lambda item: item["row"])
        with output.open("w", encoding="utf-8") as out:
            for row in rows:
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
        return _write_metadata(metadata_path(output), settings, counts, next_batch=None, finished=True)


def _start(
    output: Path, meta_path: Path, settings: dict[str, Any], resume: bool, overwrite: bool
) -> tuple[int, Counts]:
    """The first batch number to run and the counts so far; refuses an existing output unless resuming
    (same settings) or overwriting."""
    if resume and overwrite:
        raise ValueError("pass resume or overwrite, not both")
    if not output.exists():
        if resume:
            raise FileNotFoundError(f"{output} does not exist: nothing to resume; drop --resume")
        meta_path.unlink(missing_ok=True)
        return 0, Counts()
    if overwrite:
        output.unlink()
        meta_path.unlink(missing_ok=True)
        return 0, Counts()
    if not resume:
        raise FileExistsError(f"{output} exists; pass --resume to continue it or --overwrite to start again")
    if not meta_path.exists():
        raise ValueError(
            f"{output} has no {meta_path.name}: it was not written by regenerate; cannot resume it"
        )
    meta = json.loads(meta_path.read_text())
    changed = {k: (meta["settings"].get(k), v) for k, v in settings.items() if meta["settings"].get(k) != v}
    if changed:
        raise ValueError(
            f"cannot resume {output}: these settings differ from the run that wrote it (was, now): {changed}; "
            "resume with the same settings or pass --overwrite"
        )
    if meta["next_batch"] is None:
        raise ValueError(f"{output} was merged from worker shards; there is nothing to resume")
    # Keep only what the metadata vouches for: a kill between the rows and the metadata, or mid-line,
    # leaves rows of a batch the metadata does not count; that batch runs again.
    lines = output.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = lines[: meta["counts"]["rows_written"]]
    output.write_text("".join(kept), encoding="utf-8")
    return int(meta["next_batch"]), Counts.from_json(meta["counts"])


def _data_fingerprint(datamodule: Any, rows: list[tuple[int, Any]]) -> str:
    digest = hashlib.sha256()
    for row, conversation in rows:
        if isinstance(conversation, MalformedRow):
            digest.update(json.dumps([row, conversation.reason], sort_keys=True).encode())
            continue
        digest.update(json.dumps([row, conversation.messages], sort_keys=True).encode())
        if conversation.tools is not None:
            digest.update(json.dumps(conversation.tools, sort_keys=True).encode())
    digest.update(datamodule.chat_template.encode())
    if datamodule.chat_options.template_kwargs:  # they reach every prompt's rendering
        digest.update(json.dumps(datamodule.chat_options.template_kwargs, sort_keys=True).encode())
    return digest.hexdigest()[:16]


def _write_metadata(
    path: Path, settings: dict[str, Any], counts: Counts, next_batch: int | None, finished: bool
) -> dict[str, Any]:
    meta = {
        "settings": settings,
        "counts": {
            **asdict(counts),
            "skipped": dict(counts.skipped),
            "ended_early": dict(counts.ended_early),
        },
        "next_batch": next_batch,
        "finished": finished,
    }
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    os.replace(temporary, path)
    return meta
